//! Metric families whose series are made on first use, at most `[metrics] max_series` of them per family: past the
//! bound a new combination of labels is recorded under `_other`, and counted as dropped.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use prometheus::core::{MetricVec, MetricVecBuilder};

use super::sharded::Counter;

/// A prometheus vector of series by label values (counters, gauges, histograms alike).
pub trait Vector {
    type Series;
    fn series(&self, values: &[&str]) -> Self::Series;
    fn remove(&self, values: &[&str]);
    /// The label values of every series, in the labels' order.
    fn made(&self) -> Vec<Vec<String>>;
}

impl<T: MetricVecBuilder> Vector for MetricVec<T> {
    type Series = T::M;

    fn series(&self, values: &[&str]) -> T::M {
        self.with_label_values(values)
    }

    fn remove(&self, values: &[&str]) {
        let _ = self.remove_label_values(values);
    }

    fn made(&self) -> Vec<Vec<String>> {
        let names: Vec<String> = prometheus::core::Collector::desc(self)
            .first()
            .map(|desc| desc.variable_labels.clone())
            .unwrap_or_default();
        prometheus::core::Collector::collect(self)
            .iter()
            .flat_map(|family| family.get_metric().iter())
            .map(|metric| {
                names
                    .iter()
                    .map(|name| {
                        metric
                            .get_label()
                            .iter()
                            .find(|pair| pair.name() == name)
                            .map_or_else(String::new, |pair| pair.value().to_owned())
                    })
                    .collect()
            })
            .collect()
    }
}

/// Label value standing for every series refused past the bound.
pub const OTHER: &str = crate::config::OTHER_LABEL;

/// The bound on series per family, shared by every family of the process (changed by a reload).
#[derive(Debug)]
pub struct SeriesBound {
    max: AtomicUsize,
}

impl SeriesBound {
    pub fn new(max: usize) -> Arc<SeriesBound> {
        Arc::new(SeriesBound {
            max: AtomicUsize::new(max),
        })
    }

    pub fn set(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }

    fn get(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }
}

/// The combinations a family has made and refused, by the hash of their label values.
#[derive(Debug, Default)]
struct LabelSets {
    made: HashSet<u64>,
    /// Remembered so that asking again does not count twice; bounded like the series, past which every refusal
    /// counts.
    refused: HashSet<u64>,
}

/// One metric family (a prometheus vector) made on first use and bounded.
#[derive(Debug)]
pub struct Family<V> {
    vec: V,
    /// For each label, whether it stays as it is past the bound (a label with few values, such as a status code or
    /// a protocol) or becomes [`OTHER`] (a model, a version, a backend, a principal).
    kept: Vec<bool>,
    made: RwLock<LabelSets>,
    bound: Arc<SeriesBound>,
    /// `oipgate_metrics_series_dropped_total` for this family.
    dropped: Counter,
}

impl<V: Vector> Family<V> {
    pub fn new(vec: V, kept: &[bool], bound: Arc<SeriesBound>, dropped: Counter) -> Family<V> {
        Family {
            vec,
            kept: kept.to_vec(),
            made: RwLock::new(LabelSets::default()),
            bound,
            dropped,
        }
    }

    /// The series of `values`: made now if it is new and the family is within its bound, else the `_other` series
    /// standing for it. Routes keep what it returns, so for them this runs once per series; a series looked up per
    /// call (a named principal's) takes the shared read lock only.
    pub fn series(&self, values: &[&str]) -> V::Series {
        let key = hash(values);
        {
            let made = self.made.read().unwrap_or_else(PoisonError::into_inner);
            if made.made.contains(&key) {
                return self.vec.series(values);
            }
            // Refused before, and still no room (a reload may have raised the bound).
            if made.refused.contains(&key) && made.made.len() >= self.bound.get() {
                drop(made);
                return self.other(values);
            }
        }
        let mut made = self.made.write().unwrap_or_else(PoisonError::into_inner);
        if made.made.contains(&key) {
            return self.vec.series(values);
        }
        let max = self.bound.get();
        if made.made.len() < max {
            made.refused.remove(&key);
            made.made.insert(key);
            return self.vec.series(values);
        }
        if made.refused.len() < max {
            if made.refused.insert(key) {
                self.dropped.inc();
            }
        } else {
            self.dropped.inc();
        }
        drop(made);
        self.other(values)
    }

    /// The `_other` series standing for `values`.
    fn other(&self, values: &[&str]) -> V::Series {
        let other: Vec<&str> = values
            .iter()
            .zip(&self.kept)
            .map(|(value, kept)| if *kept { *value } else { OTHER })
            .collect();
        self.vec.series(&other)
    }

    /// Removes the series of `values`, if it was made.
    pub fn forget(&self, values: &[&str]) {
        let key = hash(values);
        let mut made = self.made.write().unwrap_or_else(PoisonError::into_inner);
        if made.made.remove(&key) {
            self.vec.remove(values);
        }
    }

    /// Removes every series whose label values `keep` refuses (they are given in the labels' order).
    pub fn retain(&self, keep: impl Fn(&[String]) -> bool) {
        for values in self.vec.made() {
            if !keep(&values) {
                let values: Vec<&str> = values.iter().map(String::as_str).collect();
                let key = hash(&values);
                let mut made = self.made.write().unwrap_or_else(PoisonError::into_inner);
                made.made.remove(&key);
                made.refused.remove(&key);
                drop(made);
                self.vec.remove(&values);
            }
        }
    }

    /// How many series it has made (not counting the `_other` ones).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.made.read().unwrap_or_else(PoisonError::into_inner).made.len()
    }
}

/// A 64-bit hash of label values, each ended by a byte no label value holds, so ("ab", "c") and ("a", "bc") differ.
fn hash(values: &[&str]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for value in values {
        hasher.update(value.as_bytes());
        hasher.update(&[0xff]);
    }
    hasher.digest()
}

#[cfg(test)]
mod tests {
    use super::super::sharded::CounterVec;
    use super::*;
    use prometheus::Opts;

    #[test]
    fn past_the_bound_new_series_go_to_other_and_count_once() {
        let bound = SeriesBound::new(2);
        let vec = CounterVec::new(Opts::new("t", "t"), &["model", "code"]).unwrap();
        let dropped = Counter::new("d", "d").unwrap();
        let family = Family::new(vec.clone(), &[false, true], bound.clone(), dropped.clone());
        family.series(&["a", "200"]).inc();
        family.series(&["b", "200"]).inc();
        family.series(&["a", "200"]).inc();
        family.series(&["c", "500"]).inc();
        family.series(&["c", "500"]).inc();
        assert_eq!(vec.with_label_values(&["a", "200"]).get(), 2);
        assert_eq!(vec.with_label_values(&[OTHER, "500"]).get(), 2);
        assert_eq!(dropped.get(), 1);
        assert_eq!(family.len(), 2);
        family.forget(&["b", "200"]);
        bound.set(3);
        family.series(&["c", "500"]).inc();
        assert_eq!(vec.with_label_values(&["c", "500"]).get(), 1);
    }
}

//! Counters, up-and-down gauges and histograms that each thread adds to in memory of its own, summed when they are
//! read: recording a request is plain loads and stores, with no locked instruction and no cache line that the door
//! threads pass between their cores, where a prometheus atomic is both on every call.
//!
//! Each thread that records takes an arena of its own (given back when the thread ends, for the next one), and a
//! metric takes the same cells in every arena. A thread is the only writer of its arena, so it adds with a load and
//! a store. Past [`ARENAS`] threads at once, the rest share arena 0 and add with atomic instructions; past
//! [`SEGMENTS`] segments of cells, a metric keeps atomics of its own. Either way the sums are exact.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use prometheus::HistogramOpts;
use prometheus::core::{
    Atomic, Describer, GenericCounter, GenericCounterVec, GenericGauge, GenericGaugeVec, Metric, MetricVec,
    MetricVecBuilder,
};
use prometheus::proto::{self, LabelPair};

/// Cells in a segment (32 KiB); one metric's cells are always in one segment.
const SEGMENT: usize = 4096;
/// Segments an arena may have (a table of 32 KiB): 8 Mi cells, where a duration histogram takes 18.
const SEGMENTS: usize = 2048;
/// Arenas: arena 0 is shared, the others each written by one thread.
const ARENAS: usize = 128;

type Segment = [AtomicU64; SEGMENT];

/// One thread's cells (arena 0: the cells every thread without an arena of its own adds to atomically).
struct Arena {
    segments: Box<[OnceLock<Box<Segment>>]>,
}

impl Arena {
    fn new() -> Arena {
        Arena {
            segments: (0..SEGMENTS).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The segment of `cell`, made when first written.
    fn segment_of(&self, cell: usize) -> &Segment {
        self.segments[cell / SEGMENT].get_or_init(|| Box::new([const { AtomicU64::new(0) }; SEGMENT]))
    }

    /// The cell's value in this arena (0 when its segment was never written).
    fn read(&self, cell: usize) -> u64 {
        self.segments[cell / SEGMENT]
            .get()
            .map_or(0, |segment| segment[cell % SEGMENT].load(Ordering::Relaxed))
    }
}

static ARENA: [OnceLock<Box<Arena>>; ARENAS] = [const { OnceLock::new() }; ARENAS];
/// How many arenas were handed out at most: a read sums over these.
static ARENAS_MADE: AtomicUsize = AtomicUsize::new(1);

fn arena(index: usize) -> &'static Arena {
    ARENA[index].get_or_init(|| Box::new(Arena::new()))
}

/// Arenas not held by a thread, and the next never held.
struct ArenaPool {
    next: usize,
    free: Vec<usize>,
}

static ARENA_POOL: Mutex<ArenaPool> = Mutex::new(ArenaPool {
    next: 1,
    free: Vec::new(),
});

/// The arena a thread holds while it lives.
struct Held {
    index: usize,
    arena: &'static Arena,
}

impl Held {
    fn take() -> Held {
        let mut pool = ARENA_POOL.lock().unwrap_or_else(PoisonError::into_inner);
        let index = match pool.free.pop() {
            Some(index) => index,
            None if pool.next < ARENAS => {
                pool.next += 1;
                ARENAS_MADE.store(pool.next, Ordering::Release);
                pool.next - 1
            }
            None => 0,
        };
        Held {
            index,
            arena: arena(index),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // The pool's lock orders this thread's last stores before the next holder's first loads.
        if self.index != 0 {
            ARENA_POOL
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .free
                .push(self.index);
        }
    }
}

thread_local! {
    static HELD: Held = Held::take();
}

/// Where this thread adds: its own arena (plain stores), or the shared one (atomic adds).
#[derive(Clone, Copy)]
struct Writer {
    arena: &'static Arena,
    shared: bool,
}

impl Writer {
    fn here() -> Writer {
        // A thread whose arena was given back already (a value dropped late in its end) adds to the shared one.
        HELD.try_with(|held| Writer {
            arena: held.arena,
            shared: held.index == 0,
        })
        .unwrap_or_else(|_| Writer {
            arena: arena(0),
            shared: true,
        })
    }
}

fn add_to(cell: &AtomicU64, delta: u64, shared: bool) {
    if shared {
        cell.fetch_add(delta, Ordering::Relaxed);
    } else {
        // The only writer of this cell: no read-modify-write needed.
        cell.store(cell.load(Ordering::Relaxed).wrapping_add(delta), Ordering::Relaxed);
    }
}

fn add_real_to(cell: &AtomicU64, delta: f64, shared: bool) {
    let plus = |bits: u64| (f64::from_bits(bits) + delta).to_bits();
    if shared {
        let _ = cell.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some(plus(bits)));
    } else {
        cell.store(plus(cell.load(Ordering::Relaxed)), Ordering::Relaxed);
    }
}

/// The cells not taken, by how many are taken together, and the next never taken.
struct CellPool {
    next: usize,
    free: Vec<(usize, Vec<usize>)>,
}

static CELL_POOL: Mutex<CellPool> = Mutex::new(CellPool {
    next: 0,
    free: Vec::new(),
});

/// A metric's cells: the same `len` cells from `start` in every arena, or, past the arenas' room, atomics of its own.
enum Cells {
    Arenas { start: usize, len: usize },
    Own(Box<[AtomicU64]>),
}

impl Cells {
    /// `len` cells, all reading 0.
    fn take(len: usize) -> Cells {
        if len > SEGMENT {
            return Cells::own(len);
        }
        let mut pool = CELL_POOL.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(start) = pool
            .free
            .iter_mut()
            .find(|(n, _)| *n == len)
            .and_then(|(_, free)| free.pop())
        {
            return Cells::Arenas { start, len };
        }
        // Never across two segments, so that a histogram's buckets and sum are one segment's.
        if pool.next % SEGMENT + len > SEGMENT {
            pool.next = pool.next.next_multiple_of(SEGMENT);
        }
        if pool.next + len > SEGMENT * SEGMENTS {
            return Cells::own(len);
        }
        let start = pool.next;
        pool.next += len;
        Cells::Arenas { start, len }
    }

    /// `len` atomics of the metric's own, for a metric that does not fit the arenas.
    fn own(len: usize) -> Cells {
        Cells::Own((0..len).map(|_| AtomicU64::new(0)).collect())
    }

    fn add(&self, index: usize, delta: u64) {
        match self {
            Cells::Arenas { start, .. } => {
                let writer = Writer::here();
                let cell = start + index;
                add_to(&writer.arena.segment_of(cell)[cell % SEGMENT], delta, writer.shared);
            }
            Cells::Own(cells) => add_to(&cells[index], delta, true),
        }
    }

    /// Adds 1 to the count at `index` and `value` to the real number in the last cell.
    fn observe(&self, index: usize, value: f64) {
        match self {
            Cells::Arenas { start, len } => {
                let writer = Writer::here();
                let segment = writer.arena.segment_of(*start);
                let first = start % SEGMENT;
                add_to(&segment[first + index], 1, writer.shared);
                add_real_to(&segment[first + len - 1], value, writer.shared);
            }
            Cells::Own(cells) => {
                add_to(&cells[index], 1, true);
                add_real_to(&cells[cells.len() - 1], value, true);
            }
        }
    }

    /// The sum of the cell at `index` over every arena.
    fn read(&self, index: usize) -> u64 {
        match self {
            Cells::Arenas { start, .. } => {
                arenas().fold(0u64, |sum, arena| sum.wrapping_add(arena.read(start + index)))
            }
            Cells::Own(cells) => cells[index].load(Ordering::Relaxed),
        }
    }

    /// The sum of the real number at `index` over every arena.
    fn read_real(&self, index: usize) -> f64 {
        match self {
            Cells::Arenas { start, .. } => arenas().map(|arena| f64::from_bits(arena.read(start + index))).sum(),
            Cells::Own(cells) => f64::from_bits(cells[index].load(Ordering::Relaxed)),
        }
    }
}

/// Every arena handed out so far.
fn arenas() -> impl Iterator<Item = &'static Arena> {
    ARENA[..ARENAS_MADE.load(Ordering::Acquire)]
        .iter()
        .filter_map(|arena| arena.get().map(|arena| &**arena))
}

impl Drop for Cells {
    fn drop(&mut self) {
        let Cells::Arenas { start, len } = *self else {
            return;
        };
        // No one holds the metric any more, so no thread writes these cells: they are zeroed for the next to take.
        let mut pool = CELL_POOL.lock().unwrap_or_else(PoisonError::into_inner);
        for arena in arenas() {
            if let Some(segment) = arena.segments[start / SEGMENT].get() {
                for cell in &segment[start % SEGMENT..start % SEGMENT + len] {
                    cell.store(0, Ordering::Relaxed);
                }
            }
        }
        match pool.free.iter_mut().find(|(n, _)| *n == len) {
            Some((_, free)) => free.push(start),
            None => pool.free.push((len, vec![start])),
        }
    }
}

impl fmt::Debug for Cells {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cells::Arenas { start, len } => write!(f, "Cells({start}..{})", start + len),
            Cells::Own(cells) => write!(f, "Cells(own {})", cells.len()),
        }
    }
}

/// A count kept per thread: a prometheus counter's value.
#[derive(Debug)]
pub struct PerThreadCount(Cells);

impl Atomic for PerThreadCount {
    type T = u64;

    fn new(value: u64) -> PerThreadCount {
        let cells = Cells::take(1);
        // A thread that only makes metrics takes no arena.
        if value != 0 {
            cells.add(0, value);
        }
        PerThreadCount(cells)
    }

    /// Sets the sum; right only while no other thread adds (a counter's reset).
    fn set(&self, value: u64) {
        self.0.add(0, value.wrapping_sub(self.get()));
    }

    fn get(&self) -> u64 {
        self.0.read(0)
    }

    fn inc_by(&self, delta: u64) {
        self.0.add(0, delta);
    }

    fn dec_by(&self, delta: u64) {
        self.0.add(0, delta.wrapping_neg());
    }
}

/// A signed level kept per thread, moved up and down (calls in flight): a prometheus gauge's value. It is a
/// [`PerThreadCount`] read as two's complement, whose wrapping sums are the signed sums.
#[derive(Debug)]
pub struct PerThreadLevel(PerThreadCount);

impl Atomic for PerThreadLevel {
    type T = i64;

    fn new(value: i64) -> PerThreadLevel {
        PerThreadLevel(PerThreadCount::new(value.cast_unsigned()))
    }

    /// Sets the sum; right only while no other thread moves it.
    fn set(&self, value: i64) {
        self.0.set(value.cast_unsigned());
    }

    fn get(&self) -> i64 {
        self.0.get().cast_signed()
    }

    fn inc_by(&self, delta: i64) {
        self.0.inc_by(delta.cast_unsigned());
    }

    fn dec_by(&self, delta: i64) {
        self.0.dec_by(delta.cast_unsigned());
    }
}

/// A counter whose threads each add to their own cell.
pub type Counter = GenericCounter<PerThreadCount>;
pub type CounterVec = GenericCounterVec<PerThreadCount>;
/// A gauge only moved up and down (never set while it is moved), each thread moving its own cell.
pub type Level = GenericGauge<PerThreadLevel>;
pub type LevelVec = GenericGaugeVec<PerThreadLevel>;

/// A histogram whose threads each count in cells of their own: a bucket's count and the sum, per thread.
#[derive(Debug, Clone)]
pub struct Histogram(Arc<HistogramCells>);

#[derive(Debug)]
struct HistogramCells {
    /// Upper bounds of the buckets, ascending, without +Inf.
    bounds: Box<[f64]>,
    /// Each bucket's own count (not cumulative), then the +Inf bucket's, then the sum.
    cells: Cells,
    labels: Vec<LabelPair>,
}

impl Histogram {
    fn new(opts: &HistogramOpts, values: &[impl AsRef<str>]) -> prometheus::Result<Histogram> {
        let desc = opts.describe()?;
        if desc.variable_labels.len() != values.len() {
            return Err(prometheus::Error::InconsistentCardinality {
                expect: desc.variable_labels.len(),
                got: values.len(),
            });
        }
        let bounds: Box<[f64]> = opts
            .buckets
            .iter()
            .copied()
            .filter(|bound| *bound != f64::INFINITY)
            .collect();
        if bounds.is_empty()
            || bounds
                .windows(2)
                .any(|pair| pair[0].partial_cmp(&pair[1]).is_none_or(|o| o.is_ge()))
        {
            return Err(prometheus::Error::Msg(format!(
                "histogram buckets must be in increasing order: {:?}",
                opts.buckets
            )));
        }
        let mut labels = desc.const_label_pairs.clone();
        for (name, value) in desc.variable_labels.iter().zip(values) {
            let mut pair = LabelPair::default();
            pair.set_name(name.clone());
            pair.set_value(value.as_ref().to_owned());
            labels.push(pair);
        }
        labels.sort_by(|a, b| a.name().cmp(b.name()));
        let cells = Cells::take(bounds.len() + 2);
        Ok(Histogram(Arc::new(HistogramCells { bounds, cells, labels })))
    }

    /// Counts `value` in its bucket (the first whose upper bound is not below it) and adds it to the sum.
    pub fn observe(&self, value: f64) {
        let histogram = &self.0;
        let bucket = histogram
            .bounds
            .iter()
            .position(|bound| value <= *bound)
            .unwrap_or(histogram.bounds.len());
        histogram.cells.observe(bucket, value);
    }

    /// How many values were observed.
    #[cfg(test)]
    fn sample_count(&self) -> u64 {
        (0..=self.0.bounds.len()).map(|bucket| self.0.cells.read(bucket)).sum()
    }
}

impl Metric for Histogram {
    fn metric(&self) -> proto::Metric {
        let histogram = &self.0;
        let mut buckets = Vec::with_capacity(histogram.bounds.len());
        let mut count = 0u64;
        for (bucket, bound) in histogram.bounds.iter().enumerate() {
            count += histogram.cells.read(bucket);
            let mut cumulative = proto::Bucket::default();
            cumulative.set_cumulative_count(count);
            cumulative.set_upper_bound(*bound);
            buckets.push(cumulative);
        }
        // The count is the buckets' total, so the two never disagree in a scrape.
        count += histogram.cells.read(histogram.bounds.len());
        let mut proto_histogram = proto::Histogram::default();
        proto_histogram.set_sample_count(count);
        proto_histogram.set_sample_sum(histogram.cells.read_real(histogram.bounds.len() + 1));
        proto_histogram.set_bucket(buckets);
        let mut metric = proto::Metric::from_label(histogram.labels.clone());
        metric.set_histogram(proto_histogram);
        metric
    }
}

/// Makes the series of a [`HistogramVec`].
#[derive(Debug, Clone, Copy)]
pub struct HistogramBuilder;

impl MetricVecBuilder for HistogramBuilder {
    type M = Histogram;
    type P = HistogramOpts;

    fn build<V: AsRef<str>>(&self, opts: &HistogramOpts, values: &[V]) -> prometheus::Result<Histogram> {
        Histogram::new(opts, values)
    }
}

pub type HistogramVec = MetricVec<HistogramBuilder>;

/// Histograms named, described and bucketed by `opts`, by `labels`.
pub fn histogram_vec(opts: HistogramOpts, labels: &[&str]) -> prometheus::Result<HistogramVec> {
    let opts = opts.variable_labels(labels.iter().map(|label| (*label).to_owned()).collect());
    MetricVec::create(proto::MetricType::HISTOGRAM, HistogramBuilder, opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{Encoder, Opts, Registry, TextEncoder};
    use std::sync::Barrier;

    fn text(registry: &Registry) -> String {
        let mut out = Vec::new();
        TextEncoder::new().encode(&registry.gather(), &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn exposition_is_prometheus_own() {
        let ours = Registry::new();
        let theirs = Registry::new();
        // Sums of these are exact in any order, so the threads' order cannot change the text.
        let buckets = vec![0.125, 0.25, 1.0, 4.0];
        let histograms = histogram_vec(
            HistogramOpts::new("h", "help h").buckets(buckets.clone()),
            &["model", "code"],
        )
        .unwrap();
        let their_histograms =
            prometheus::HistogramVec::new(HistogramOpts::new("h", "help h").buckets(buckets), &["model", "code"])
                .unwrap();
        let counters = CounterVec::new(Opts::new("c", "help c").const_label("zone", "a"), &["model"]).unwrap();
        let their_counters =
            prometheus::IntCounterVec::new(Opts::new("c", "help c").const_label("zone", "a"), &["model"]).unwrap();
        let levels = LevelVec::new(Opts::new("g", "help g"), &["backend"]).unwrap();
        let their_levels = prometheus::IntGaugeVec::new(Opts::new("g", "help g"), &["backend"]).unwrap();
        ours.register(Box::new(histograms.clone())).unwrap();
        ours.register(Box::new(counters.clone())).unwrap();
        ours.register(Box::new(levels.clone())).unwrap();
        theirs.register(Box::new(their_histograms.clone())).unwrap();
        theirs.register(Box::new(their_counters.clone())).unwrap();
        theirs.register(Box::new(their_levels.clone())).unwrap();
        // Bucket edges, below the first, past the last, and from threads of their own.
        let values = [0.0, 0.125, 0.1875, 0.25, 0.5, 1.0, 1.5, 1024.0];
        std::thread::scope(|scope| {
            for (i, value) in values.iter().enumerate() {
                let model = ["a", "b"][i % 2];
                let (histograms, counters, levels) = (&histograms, &counters, &levels);
                scope.spawn(move || {
                    histograms.with_label_values(&[model, "200"]).observe(*value);
                    counters.with_label_values(&[model]).inc_by(i as u64);
                    levels.with_label_values(&[model]).inc();
                    levels.with_label_values(&["x"]).dec();
                });
                their_histograms.with_label_values(&[model, "200"]).observe(*value);
                their_counters.with_label_values(&[model]).inc_by(i as u64);
                their_levels.with_label_values(&[model]).inc();
                their_levels.with_label_values(&["x"]).dec();
            }
        });
        assert_eq!(text(&ours), text(&theirs));
        assert!(
            text(&ours).contains(r#"h_bucket{code="200",model="a",le="1"} 3"#),
            "{}",
            text(&ours)
        );
    }

    #[test]
    fn sums_are_exact_with_more_threads_than_arenas() {
        let counter = Counter::new("c", "c").unwrap();
        let level = Level::new("l", "l").unwrap();
        let histogram = histogram_vec(HistogramOpts::new("h", "h").buckets(vec![1.0]), &[])
            .unwrap()
            .with_label_values::<&str>(&[]);
        let threads = ARENAS + 40;
        // All alive at once, so that some share arena 0.
        let together = Barrier::new(threads);
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    together.wait();
                    for _ in 0..1000 {
                        counter.inc();
                        level.inc();
                        histogram.observe(0.5);
                    }
                    level.sub(999);
                });
            }
        });
        let threads = threads as u64;
        assert_eq!(counter.get(), threads * 1000);
        assert_eq!(level.get(), threads.cast_signed());
        assert_eq!(histogram.sample_count(), threads * 1000);
        assert!((histogram.0.cells.read_real(2) - threads as f64 * 500.0).abs() < 1e-6);
    }

    #[test]
    fn a_thread_s_counts_stay_when_it_ends_and_its_arena_is_taken_again() {
        let counter = Counter::new("c", "c").unwrap();
        for _ in 0..(ARENAS * 2) {
            std::thread::scope(|scope| {
                scope.spawn(|| counter.inc_by(3));
            });
        }
        assert_eq!(counter.get(), ARENAS as u64 * 6);
        counter.reset();
        assert_eq!(counter.get(), 0);
    }

    #[test]
    fn cells_given_back_read_zero_when_taken_again() {
        for round in 0..50 {
            let counter = Counter::new("c", "c").unwrap();
            assert_eq!(counter.get(), 0, "round {round}");
            let histogram = histogram_vec(HistogramOpts::new("h", "h").buckets(vec![1.0, 2.0]), &["a"]).unwrap();
            assert_eq!(histogram.with_label_values(&["x"]).sample_count(), 0, "round {round}");
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    counter.inc_by(7);
                    histogram.with_label_values(&["x"]).observe(1.5);
                });
            });
            counter.inc();
            histogram.with_label_values(&["x"]).observe(3.0);
            assert_eq!(counter.get(), 8);
            assert_eq!(histogram.with_label_values(&["x"]).sample_count(), 2);
        }
    }

    #[test]
    fn cells_of_their_own_count_alike() {
        let cells = Cells::Own((0..3).map(|_| AtomicU64::new(0)).collect());
        cells.add(0, 5);
        cells.observe(1, 0.25);
        cells.observe(1, 0.5);
        assert_eq!((cells.read(0), cells.read(1), cells.read_real(2)), (5, 2, 0.75));
    }

    #[test]
    fn buckets_out_of_order_are_refused() {
        let refused = histogram_vec(HistogramOpts::new("h", "h").buckets(vec![1.0, 1.0]), &[]).unwrap();
        assert!(refused.get_metric_with_label_values::<&str>(&[]).is_err());
    }

    #[test]
    fn a_histogram_past_a_segment_keeps_cells_of_its_own() {
        let buckets: Vec<f64> = (1..=SEGMENT).map(|bound| bound as f64).collect();
        let histogram = histogram_vec(HistogramOpts::new("h", "h").buckets(buckets), &[])
            .unwrap()
            .with_label_values::<&str>(&[]);
        assert!(matches!(histogram.0.cells, Cells::Own(_)));
        histogram.observe(2.5);
        histogram.observe(1e9);
        assert_eq!(histogram.sample_count(), 2);
    }
}

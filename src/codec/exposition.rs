//! Prometheus' text exposition format, read strictly: the samples of the metrics asked for, with their `model`
//! label, from a backend's `/metrics` (Triton's, MLServer's, vLLM's, SGLang's). A line that is not a comment, blank or
//! a well-formed sample makes the whole text refused, so a garbled answer is a failed scrape, never a wrong load.

use std::collections::HashMap;

/// The load a backend's metrics report, summed over the metrics asked for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reported {
    /// Every sample, summed.
    pub total: f64,
    /// Samples with a `model` label, summed by it.
    pub by_model: HashMap<String, f64>,
    /// The tie-break metric's samples, summed (vLLM's KV-cache use): of two equal queues, the lower wins.
    pub tie_break: f64,
}

impl Reported {
    /// The load of `model` (the backend's name for it): its own samples when the metrics are labelled by model,
    /// else everything.
    pub fn of(&self, model: &str) -> f64 {
        if self.by_model.is_empty() {
            self.total
        } else {
            self.by_model.get(model).copied().unwrap_or(0.0)
        }
    }
}

/// Sums the samples of `metrics` in `text`, and apart those of `tie_break`; the line and why, for text that is not
/// the exposition format.
pub fn read(text: &str, metrics: &[String], tie_break: Option<&str>) -> Result<Reported, String> {
    let mut reported = Reported::default();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let sample = sample(line).map_err(|why| format!("line {}: {why}", number + 1))?;
        if !sample.value.is_finite() {
            continue;
        }
        if tie_break == Some(sample.name) {
            reported.tie_break += sample.value;
            continue;
        }
        if !metrics.iter().any(|metric| metric == sample.name) {
            continue;
        }
        reported.total += sample.value;
        if let Some(model) = sample.model {
            *reported.by_model.entry(model).or_default() += sample.value;
        }
    }
    Ok(reported)
}

/// One sample line.
#[derive(Debug, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    model: Option<String>,
    value: f64,
}

fn sample(line: &str) -> Result<Sample<'_>, String> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(line.len());
    let name = &line[..name_end];
    let valid_name = name
        .chars()
        .enumerate()
        .all(|(i, c)| c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit()));
    if name.is_empty() || !valid_name {
        return Err(format!("'{}' is not a metric name", name.escape_default()));
    }
    let mut rest = &line[name_end..];
    let mut model = None;
    if let Some(labels) = rest.strip_prefix('{') {
        let (found, after) = self::labels(labels)?;
        model = found;
        rest = after;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        number => number
            .parse::<f64>()
            .map_err(|_| format!("'{}' is not a number", number.escape_default()))?,
    };
    if let Some(timestamp) = fields.next() {
        timestamp
            .parse::<i64>()
            .map_err(|_| format!("'{}' is not a timestamp", timestamp.escape_default()))?;
    }
    if fields.next().is_some() {
        return Err("more than a value and a timestamp".to_owned());
    }
    Ok(Sample { name, model, value })
}

/// Reads `label="value",...}` (the opening brace consumed); the `model` label's value and what follows the braces.
fn labels(mut text: &str) -> Result<(Option<String>, &str), String> {
    let mut model = None;
    loop {
        text = text.trim_start();
        if let Some(after) = text.strip_prefix('}') {
            return Ok((model, after));
        }
        let equals = text.find('=').ok_or("a label without '='")?;
        let label = text[..equals].trim();
        if label.is_empty() || !label.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("'{}' is not a label name", label.escape_default()));
        }
        let quoted = text[equals + 1..].trim_start();
        let body = quoted.strip_prefix('"').ok_or("a label value not in quotes")?;
        let (value, after) = quoted_value(body)?;
        if label == "model" {
            model = Some(value);
        }
        text = after.trim_start();
        text = text.strip_prefix(',').unwrap_or(text);
    }
}

/// Reads a label value up to its closing quote, undoing `\\`, `\"` and `\n`; the value and what follows.
fn quoted_value(text: &str) -> Result<(String, &str), String> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((index, c)) = chars.next() {
        match c {
            '"' => return Ok((value, &text[index + 1..])),
            '\\' => match chars.next() {
                Some((_, '\\')) => value.push('\\'),
                Some((_, '"')) => value.push('"'),
                Some((_, 'n')) => value.push('\n'),
                _ => return Err("a bad escape in a label value".to_owned()),
            },
            c => value.push(c),
        }
    }
    Err("a label value without its closing quote".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn triton_pending_requests_by_model() {
        let text = "# HELP nv_inference_pending_request_count Instantaneous number of pending requests\n\
                    # TYPE nv_inference_pending_request_count gauge\n\
                    nv_inference_pending_request_count{model=\"slow\",version=\"1\"} 7\n\
                    nv_inference_pending_request_count{model=\"slow\",version=\"2\"} 2\n\
                    nv_inference_pending_request_count{model=\"add_sub\",version=\"1\"} 0\n\
                    nv_inference_count{model=\"slow\",version=\"1\"} 1000\n";
        let reported = read(text, &names(&["nv_inference_pending_request_count"]), None).unwrap();
        assert_eq!(reported.of("slow"), 9.0);
        assert_eq!(reported.of("add_sub"), 0.0);
        assert_eq!(reported.of("other"), 0.0);
        assert_eq!(reported.total, 9.0);
    }

    #[test]
    fn unlabelled_metrics_are_summed_for_every_model() {
        let text = "parallel_request_queue_sum 3\nbatch_request_queue_sum 2.5 1700000000000\nvllm:num_requests_waiting{model_name=\"x\"} 4\n";
        let reported = read(
            text,
            &names(&[
                "parallel_request_queue_sum",
                "batch_request_queue_sum",
                "vllm:num_requests_waiting",
            ]),
            None,
        )
        .unwrap();
        let vllm = "vllm:num_requests_waiting{model_name=\"m\"} 2\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.75\n";
        let tied = read(
            vllm,
            &names(&["vllm:num_requests_waiting"]),
            Some("vllm:kv_cache_usage_perc"),
        )
        .unwrap();
        assert_eq!((tied.of("m"), tied.tie_break), (2.0, 0.75));
        assert_eq!(reported.of("anything"), 9.5);
    }

    #[test]
    fn escapes_in_label_values_are_read() {
        let text = "q{path=\"a\\\\b\\\"c\\n\",model=\"m\"} 1\n";
        assert_eq!(read(text, &names(&["q"]), None).unwrap().of("m"), 1.0);
    }

    #[test]
    fn garbage_is_refused_with_its_line() {
        for (text, why) in [
            ("q 1\n<html>oops</html>\n", "line 2"),
            ("q{model=\"m} 1\n", "closing quote"),
            ("q{model=m} 1\n", "not in quotes"),
            ("q one\n", "not a number"),
            ("q 1 2 3\n", "more than"),
            ("9q 1\n", "not a metric name"),
        ] {
            let error = read(text, &names(&["q"]), None).unwrap_err();
            assert!(error.contains(why), "{text:?}: {error}");
        }
    }
}

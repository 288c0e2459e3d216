//! Stateful sequences (Triton's sequence batching): which requests belong to one, read from their `sequence_id`,
//! `sequence_start` and `sequence_end` parameters, and the keys that keep a sequence on one version and one endpoint.

use std::fmt;

use super::{ParamValue, Parameters};
use crate::error::{Error, Result};

/// The parameter naming a request's sequence (Triton's correlation id): a non-zero unsigned integer or a non-empty
/// string.
pub const SEQUENCE_ID: &str = "sequence_id";
/// The parameter marking a sequence's first request.
pub const SEQUENCE_START: &str = "sequence_start";
/// The parameter marking a sequence's last request.
pub const SEQUENCE_END: &str = "sequence_end";

/// A sequence's id. Triton keeps numeric and string ids apart: `5` and `"5"` are two sequences.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SequenceId {
    Number(u64),
    Text(String),
}

impl fmt::Display for SequenceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SequenceId::Number(id) => write!(f, "{id}"),
            SequenceId::Text(id) => write!(f, "\"{id}\""),
        }
    }
}

/// One request's place in a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    pub id: SequenceId,
    /// The sequence's first request: it may start over on another endpoint when the sequence's own is out.
    pub start: bool,
    pub end: bool,
}

impl Sequence {
    /// The sequence a request belongs to, from its parameters: none without `sequence_id` or with 0 or `""` (which
    /// Triton reads as "no sequence"). An id that is neither an unsigned integer nor a string, or flags that are not
    /// booleans, are refused.
    pub fn from_parameters(parameters: &Parameters) -> Result<Option<Sequence>> {
        let Some(value) = parameters.get(SEQUENCE_ID) else {
            return Ok(None);
        };
        let id = match value {
            ParamValue::Int64(0) | ParamValue::Uint64(0) => return Ok(None),
            ParamValue::String(text) if text.is_empty() => return Ok(None),
            ParamValue::Int64(id) if *id > 0 => SequenceId::Number(id.unsigned_abs()),
            ParamValue::Uint64(id) => SequenceId::Number(*id),
            ParamValue::String(text) => SequenceId::Text(text.clone()),
            ParamValue::Int64(id) => {
                return Err(Error::invalid(format!(
                    "parameter {SEQUENCE_ID} must be an unsigned integer or a string, not the negative number {id}"
                )));
            }
            other => {
                return Err(Error::invalid(format!(
                    "parameter {SEQUENCE_ID} must be an unsigned integer or a string, not a {}",
                    other.type_name()
                )));
            }
        };
        Ok(Some(Sequence {
            id,
            start: flag(parameters, SEQUENCE_START)?,
            end: flag(parameters, SEQUENCE_END)?,
        }))
    }

    /// The key that picks the version of a weighted model for this sequence: the same for every request of it, so a
    /// sequence never changes version.
    pub fn version_key(&self, model: &str) -> u64 {
        self.hash(&[model])
    }

    /// The key that ranks a backend's endpoints for this sequence of the backend's `model` at `version` (rendezvous
    /// hashing): gateways with the same configuration rank them alike, with nothing shared between them.
    pub fn endpoint_key(&self, model: &str, version: &str) -> u64 {
        self.hash(&[model, version])
    }

    fn hash(&self, names: &[&str]) -> u64 {
        let mut text = Vec::with_capacity(64);
        for name in names {
            text.extend_from_slice(name.as_bytes());
            text.push(0);
        }
        match &self.id {
            SequenceId::Number(id) => {
                text.push(b'n');
                text.extend_from_slice(&id.to_le_bytes());
            }
            SequenceId::Text(id) => {
                text.push(b's');
                text.extend_from_slice(id.as_bytes());
            }
        }
        xxhash_rust::xxh3::xxh3_64(&text)
    }
}

fn flag(parameters: &Parameters, name: &str) -> Result<bool> {
    match parameters.get(name) {
        None => Ok(false),
        Some(ParamValue::Bool(value)) => Ok(*value),
        Some(other) => Err(Error::invalid(format!(
            "parameter {name} must be a bool, not a {}",
            other.type_name()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parameters(pairs: &[(&str, ParamValue)]) -> Parameters {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect()
    }

    #[test]
    fn a_sequence_is_a_non_zero_unsigned_id_or_a_non_empty_string() {
        let read = |value: ParamValue| Sequence::from_parameters(&parameters(&[(SEQUENCE_ID, value)]));
        assert_eq!(read(ParamValue::Int64(0)).unwrap(), None);
        assert_eq!(read(ParamValue::String(String::new())).unwrap(), None);
        assert_eq!(read(ParamValue::Int64(7)).unwrap().unwrap().id, SequenceId::Number(7));
        assert_eq!(
            read(ParamValue::Uint64(u64::MAX)).unwrap().unwrap().id,
            SequenceId::Number(u64::MAX)
        );
        assert_eq!(
            read(ParamValue::String("a".into())).unwrap().unwrap().id,
            SequenceId::Text("a".into())
        );
        for bad in [ParamValue::Int64(-3), ParamValue::Double(1.5), ParamValue::Bool(true)] {
            let message = read(bad).unwrap_err().message().to_owned();
            assert!(message.contains(SEQUENCE_ID), "{message}");
        }
        assert_eq!(Sequence::from_parameters(&Parameters::new()).unwrap(), None);
    }

    #[test]
    fn flags_are_booleans() {
        let given = parameters(&[
            (SEQUENCE_ID, ParamValue::Int64(1)),
            (SEQUENCE_START, ParamValue::Bool(true)),
        ]);
        let sequence = Sequence::from_parameters(&given).unwrap().unwrap();
        assert!(sequence.start && !sequence.end);
        let given = parameters(&[
            (SEQUENCE_ID, ParamValue::Int64(1)),
            (SEQUENCE_END, ParamValue::Int64(1)),
        ]);
        assert!(
            Sequence::from_parameters(&given)
                .unwrap_err()
                .message()
                .contains(SEQUENCE_END)
        );
    }

    #[test]
    fn numeric_and_string_ids_are_different_sequences() {
        let number = Sequence {
            id: SequenceId::Number(5),
            start: false,
            end: false,
        };
        let text = Sequence {
            id: SequenceId::Text("5".into()),
            ..number.clone()
        };
        assert_ne!(number.endpoint_key("m", "1"), text.endpoint_key("m", "1"));
        assert_ne!(number.endpoint_key("m", "1"), number.endpoint_key("m", "2"));
        assert_eq!(number.endpoint_key("m", "1"), number.clone().endpoint_key("m", "1"));
    }
}

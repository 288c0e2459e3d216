//! Parameters: the ordered name -> value maps carried at request, tensor and response level.

use indexmap::IndexMap;

/// A parameter value. The protocol defines bool, int64 and string; Triton's clients also send double and uint64.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    Bool(bool),
    Int64(i64),
    Uint64(u64),
    Double(f64),
    String(String),
}

impl ParamValue {
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            ParamValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            ParamValue::Int64(v) => Some(*v),
            ParamValue::Uint64(v) => i64::try_from(*v).ok(),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            ParamValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value's type as the protocol names it, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            ParamValue::Bool(_) => "bool",
            ParamValue::Int64(_) => "int64",
            ParamValue::Uint64(_) => "uint64",
            ParamValue::Double(_) => "double",
            ParamValue::String(_) => "string",
        }
    }
}

impl From<bool> for ParamValue {
    fn from(v: bool) -> Self {
        ParamValue::Bool(v)
    }
}

impl From<i64> for ParamValue {
    fn from(v: i64) -> Self {
        ParamValue::Int64(v)
    }
}

impl From<&str> for ParamValue {
    fn from(v: &str) -> Self {
        ParamValue::String(v.to_owned())
    }
}

/// Parameters in the order they arrived. Equality ignores order, as for any map; protobuf maps carry no order, so
/// parameters that crossed protobuf come back sorted by name.
pub type Parameters = IndexMap<String, ParamValue>;

/// The parameter MLServer uses to say how a tensor or request should be decoded (`np`, `pd`, `str`, `base64`...).
pub const CONTENT_TYPE: &str = "content_type";

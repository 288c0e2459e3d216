//! Tensor element datatypes of the protocol (plus Triton's BF16) and shape arithmetic.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A tensor element type. Names are case-sensitive, exactly as the protocol spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    Bytes,
    /// bfloat16, Triton's extension to the protocol.
    Bf16,
}

impl DataType {
    pub const ALL: [DataType; 14] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
        DataType::Bf16,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
            DataType::Bf16 => "BF16",
        }
    }

    /// Size of one element in bytes; `None` for BYTES, whose elements vary in size.
    pub const fn element_size(self) -> Option<usize> {
        match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => Some(1),
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 | DataType::Bf16 => Some(2),
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => Some(4),
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => Some(8),
            DataType::Bytes => None,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DataType::Fp16 | DataType::Bf16 | DataType::Fp32 | DataType::Fp64)
    }

    /// Parses a protocol datatype name, case-sensitively.
    pub fn parse(name: &str) -> Result<DataType> {
        name.parse()
    }
}

impl FromStr for DataType {
    type Err = Error;

    fn from_str(name: &str) -> Result<DataType> {
        DataType::ALL.into_iter().find(|d| d.as_str() == name).ok_or_else(|| {
            Error::invalid(format!(
                "unknown datatype \"{}\" (expected one of BOOL, UINT8, UINT16, UINT32, UINT64, INT8, INT16, \
                 INT32, INT64, FP16, FP32, FP64, BYTES, BF16)",
                name.escape_debug()
            ))
        })
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The number of elements a shape holds, or an error when the product overflows `u64`.
pub fn element_count(shape: &[u64]) -> Result<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::invalid(format!("shape {shape:?} has more elements than fit in 64 bits")))
}

/// The number of data bytes a fixed-size tensor of this shape holds, or an error when it overflows.
pub fn byte_size(datatype: DataType, shape: &[u64]) -> Result<Option<u64>> {
    let Some(size) = datatype.element_size() else {
        return Ok(None);
    };
    let count = element_count(shape)?;
    count
        .checked_mul(size as u64)
        .map(Some)
        .ok_or_else(|| Error::invalid(format!("shape {shape:?} of {datatype} is larger than fits in 64 bits")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_case_sensitive() {
        for d in DataType::ALL {
            assert_eq!(DataType::parse(d.as_str()).unwrap(), d);
        }
        assert!(DataType::parse("fp32").is_err());
        assert!(DataType::parse("FLOAT").is_err());
        let message = DataType::parse("TYPE_FP32").unwrap_err().to_string();
        assert!(message.contains("TYPE_FP32") && message.contains("BF16"), "{message}");
    }

    #[test]
    fn element_sizes() {
        assert_eq!(DataType::Bool.element_size(), Some(1));
        assert_eq!(DataType::Bf16.element_size(), Some(2));
        assert_eq!(DataType::Fp64.element_size(), Some(8));
        assert_eq!(DataType::Bytes.element_size(), None);
    }

    #[test]
    fn shape_products_are_overflow_checked() {
        assert_eq!(element_count(&[]).unwrap(), 1);
        assert_eq!(element_count(&[2, 0, 5]).unwrap(), 0);
        assert!(element_count(&[u64::MAX, 2]).is_err());
        assert!(byte_size(DataType::Fp64, &[1 << 62]).is_err());
        assert_eq!(byte_size(DataType::Fp32, &[3, 2]).unwrap(), Some(24));
    }
}

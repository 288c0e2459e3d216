//! Tensors: name, datatype, shape, parameters and little-endian row-major data in one shared buffer.

use bytes::{BufMut, Bytes, BytesMut};

use super::datatype::{DataType, element_count};
use super::parameters::Parameters;
use crate::error::{Error, Result};

/// Size of the little-endian length that precedes each BYTES element.
pub const BYTES_LENGTH_PREFIX: usize = 4;

/// A tensor. `data` holds the elements little-endian and row-major; a BYTES tensor holds each element as a 4-byte
/// little-endian length followed by its bytes (the binary extension's layout). Decoded tensors slice the buffer they
/// arrived in rather than copying it.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<u64>,
    pub parameters: Parameters,
    pub data: Bytes,
}

impl Tensor {
    /// A tensor whose data has been checked against its datatype and shape.
    pub fn new(name: impl Into<String>, datatype: DataType, shape: Vec<u64>, data: Bytes) -> Result<Tensor> {
        let tensor = Tensor {
            name: name.into(),
            datatype,
            shape,
            parameters: Parameters::new(),
            data,
        };
        tensor.validate()?;
        Ok(tensor)
    }

    /// A BYTES tensor from its elements.
    pub fn from_bytes_elements<'a>(
        name: impl Into<String>,
        shape: Vec<u64>,
        elements: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Tensor> {
        let mut data = BytesMut::new();
        for element in elements {
            put_bytes_element(&mut data, element)?;
        }
        Tensor::new(name, DataType::Bytes, shape, data.freeze())
    }

    pub fn with_parameters(mut self, parameters: Parameters) -> Tensor {
        self.parameters = parameters;
        self
    }

    pub fn element_count(&self) -> Result<u64> {
        element_count(&self.shape)
    }

    /// Checks that the data holds exactly the elements the shape says, in the datatype's layout.
    pub fn validate(&self) -> Result<()> {
        check_data(self.datatype, &self.shape, &self.data)
            .map_err(|e| e.context(format_args!("tensor '{}'", self.name)))
    }

    /// The elements of a BYTES tensor. Call only on a validated tensor: a malformed layout ends the iteration early.
    pub fn bytes_elements(&self) -> BytesElements<'_> {
        BytesElements { rest: &self.data }
    }
}

/// Checks `data` against `datatype` and `shape` without trusting the shape for any allocation.
pub fn check_data(datatype: DataType, shape: &[u64], data: &[u8]) -> Result<()> {
    let count = element_count(shape)?;
    match datatype.element_size() {
        Some(size) => {
            let expected = count.checked_mul(size as u64);
            if expected != Some(data.len() as u64) {
                return Err(Error::invalid(format!(
                    "expected {count} {datatype} elements ({} bytes) for shape {shape:?}, got {} bytes",
                    expected.map_or_else(|| "more than 2^64".to_owned(), |e| e.to_string()),
                    data.len()
                )));
            }
            if datatype == DataType::Bool
                && let Some(pos) = data.iter().position(|&b| b > 1)
            {
                return Err(Error::invalid(format!(
                    "BOOL element {pos} is the byte {}, expected 0 or 1",
                    data[pos]
                )));
            }
            Ok(())
        }
        None => {
            let found = count_bytes_elements(data)?;
            if found != count {
                return Err(Error::invalid(format!(
                    "expected {count} BYTES elements for shape {shape:?}, got {found}"
                )));
            }
            Ok(())
        }
    }
}

/// Counts the elements of a length-prefixed BYTES buffer, rejecting a truncated prefix or element.
pub fn count_bytes_elements(mut data: &[u8]) -> Result<u64> {
    let mut count = 0u64;
    while !data.is_empty() {
        let Some((prefix, rest)) = data.split_first_chunk::<BYTES_LENGTH_PREFIX>() else {
            return Err(Error::invalid(format!(
                "BYTES element {count} has a truncated length prefix ({} of 4 bytes)",
                data.len()
            )));
        };
        let len = u32::from_le_bytes(*prefix) as usize;
        if rest.len() < len {
            return Err(Error::invalid(format!(
                "BYTES element {count} declares {len} bytes but only {} remain",
                rest.len()
            )));
        }
        data = &rest[len..];
        count += 1;
    }
    Ok(count)
}

/// Appends one BYTES element in the length-prefixed layout.
pub fn put_bytes_element(buffer: &mut BytesMut, element: &[u8]) -> Result<()> {
    let len = u32::try_from(element.len())
        .map_err(|_| Error::invalid(format!("a BYTES element of {} bytes exceeds 2^32 - 1", element.len())))?;
    buffer.reserve(BYTES_LENGTH_PREFIX + element.len());
    buffer.put_u32_le(len);
    buffer.put_slice(element);
    Ok(())
}

/// Iterator over the elements of a length-prefixed BYTES buffer.
#[derive(Debug, Clone)]
pub struct BytesElements<'a> {
    rest: &'a [u8],
}

impl<'a> BytesElements<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        BytesElements { rest: data }
    }
}

impl<'a> Iterator for BytesElements<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let (prefix, rest) = self.rest.split_first_chunk::<BYTES_LENGTH_PREFIX>()?;
        let len = u32::from_le_bytes(*prefix) as usize;
        if rest.len() < len {
            self.rest = &[];
            return None;
        }
        let (element, rest) = rest.split_at(len);
        self.rest = rest;
        Some(element)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_size_data_must_match_shape() {
        assert!(Tensor::new("t", DataType::Fp32, vec![2, 2], Bytes::from(vec![0u8; 16])).is_ok());
        let error = Tensor::new("t", DataType::Fp32, vec![2, 2], Bytes::from(vec![0u8; 12])).unwrap_err();
        assert!(error.to_string().contains("tensor 't'"), "{error}");
        assert!(
            error.to_string().contains("16 bytes") && error.to_string().contains("got 12"),
            "{error}"
        );
        assert!(Tensor::new("t", DataType::Bool, vec![1], Bytes::from_static(&[2])).is_err());
    }

    #[test]
    fn huge_declared_shapes_are_rejected_without_allocation() {
        let error = Tensor::new("t", DataType::Fp32, vec![1 << 40], Bytes::from_static(&[0; 10])).unwrap_err();
        assert!(error.to_string().contains("got 10 bytes"), "{error}");
        assert!(Tensor::new("t", DataType::Bytes, vec![1 << 40], Bytes::from_static(&[0; 8])).is_err());
    }

    #[test]
    fn bytes_layout() {
        let tensor = Tensor::from_bytes_elements("s", vec![2], [&b"ab"[..], &b""[..]]).unwrap();
        assert_eq!(&tensor.data[..], &[2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0]);
        assert_eq!(tensor.bytes_elements().collect::<Vec<_>>(), vec![&b"ab"[..], &b""[..]]);
        assert!(
            count_bytes_elements(&[1, 0, 0])
                .unwrap_err()
                .to_string()
                .contains("truncated length prefix")
        );
        assert!(
            count_bytes_elements(&[5, 0, 0, 0, 1])
                .unwrap_err()
                .to_string()
                .contains("declares 5 bytes")
        );
        assert!(Tensor::from_bytes_elements("s", vec![3], [&b"ab"[..]]).is_err());
    }
}

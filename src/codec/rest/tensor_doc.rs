//! One tensor object of a JSON header (`$request_input` or `$response_output`): read into a tensor whose data comes
//! from JSON `data` or from the next binary section, and written back the same two ways.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::data::{parse_data, write_data, write_json_string};
use super::params::{JsonParameters, write_parameters_field};
use crate::error::{Error, Result};
use crate::protocol::tensor::check_data;
use crate::protocol::{DataType, ParamValue, Parameters, Tensor, element_count};

/// The binary extension's parameter giving a tensor's section size in bytes.
pub const BINARY_DATA_SIZE: &str = "binary_data_size";

#[derive(Deserialize, Debug)]
pub struct TensorDoc<'a> {
    name: Option<String>,
    #[serde(borrow)]
    datatype: Option<Cow<'a, str>>,
    shape: Option<Vec<serde_json::Value>>,
    parameters: Option<JsonParameters>,
    #[serde(borrow)]
    data: Option<&'a RawValue>,
}

/// Binary sections after the JSON header, handed out in order.
#[derive(Debug)]
pub struct BinarySections {
    body: Bytes,
    offset: usize,
}

impl BinarySections {
    pub fn new(body: Bytes) -> Self {
        BinarySections { body, offset: 0 }
    }

    /// The next `size` bytes, as a slice of the received buffer.
    fn take(&mut self, size: u64, what: &str) -> Result<Bytes> {
        let remaining = self.body.len() - self.offset;
        let size = usize::try_from(size).ok().filter(|&s| s <= remaining).ok_or_else(|| {
            Error::invalid(format!(
                "{what} declares binary_data_size {size} but only {remaining} bytes of binary data remain"
            ))
        })?;
        let section = self.body.slice(self.offset..self.offset + size);
        self.offset += size;
        Ok(section)
    }

    /// Errors when bytes are left after the last section.
    pub fn finish(self) -> Result<()> {
        let left = self.body.len() - self.offset;
        if left > 0 {
            return Err(Error::invalid(format!(
                "{left} bytes of binary data are left over after the last binary tensor"
            )));
        }
        Ok(())
    }
}

impl TensorDoc<'_> {
    /// Builds the tensor; `kind` is "input" or "output" and `index` its position, for error messages.
    pub fn into_tensor(self, kind: &str, index: usize, sections: &mut BinarySections) -> Result<Tensor> {
        let name = self
            .name
            .ok_or_else(|| Error::invalid(format!("{kind} {index} has no \"name\"")))?;
        let what = format!("{kind} '{name}'");
        let datatype = self
            .datatype
            .ok_or_else(|| Error::invalid(format!("{what} has no \"datatype\"")))?;
        let datatype = DataType::parse(&datatype).map_err(|e| e.context(&what))?;
        let shape = parse_shape(self.shape, &what)?;
        let mut parameters = self.parameters.map(|p| p.0).unwrap_or_default();
        let binary_size = parameters.shift_remove(BINARY_DATA_SIZE);
        let data = match (self.data, binary_size) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(format!("{what} has both \"data\" and binary_data_size")));
            }
            (None, None) => {
                return Err(Error::invalid(format!(
                    "{what} has neither \"data\" nor binary_data_size"
                )));
            }
            (Some(raw), None) => {
                let count = element_count(&shape).map_err(|e| e.context(&what))?;
                parse_data(raw.get().as_bytes(), datatype, count).map_err(|e| e.context(&what))?
            }
            (None, Some(size)) => {
                let size = match size {
                    ParamValue::Int64(v) if v >= 0 => v.unsigned_abs(),
                    ParamValue::Uint64(v) => v,
                    other => {
                        return Err(Error::invalid(format!(
                            "{what}: binary_data_size must be a non-negative integer, got {other:?}"
                        )));
                    }
                };
                let section = sections.take(size, &what)?;
                check_data(datatype, &shape, &section)
                    .map_err(|e| e.context(format_args!("{what} (binary_data_size {size})")))?;
                section
            }
        };
        Ok(Tensor {
            name,
            datatype,
            shape,
            parameters,
            data,
        })
    }
}

fn parse_shape(shape: Option<Vec<serde_json::Value>>, what: &str) -> Result<Vec<u64>> {
    let shape = shape.ok_or_else(|| Error::invalid(format!("{what} has no \"shape\"")))?;
    shape
        .iter()
        .map(|dim| {
            dim.as_u64()
                .ok_or_else(|| Error::invalid(format!("{what}: shape dimension {dim} is not a non-negative integer")))
        })
        .collect()
}

/// Where a tensor's data goes when writing: inline JSON `data`, or a binary section after the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataForm {
    Json,
    Binary,
}

/// Appends one tensor object. Binary tensors get `binary_data_size` and their buffer is pushed onto `sections`
/// (shared, not copied).
pub fn write_tensor(out: &mut Vec<u8>, tensor: &Tensor, form: DataForm, sections: &mut Vec<Bytes>) -> Result<()> {
    out.extend_from_slice(b"{\"name\":");
    write_json_string(out, &tensor.name);
    out.extend_from_slice(b",\"datatype\":\"");
    out.extend_from_slice(tensor.datatype.as_str().as_bytes());
    out.extend_from_slice(b"\",\"shape\":");
    write_shape(out, &tensor.shape);
    match form {
        DataForm::Json => {
            write_parameters_field(out, &tensor.parameters);
            out.extend_from_slice(b",\"data\":");
            write_data(out, tensor.datatype, &tensor.data)
                .map_err(|e| e.context(format_args!("tensor '{}'", tensor.name)))?;
        }
        DataForm::Binary => {
            let mut parameters = Parameters::with_capacity(tensor.parameters.len() + 1);
            parameters.extend(tensor.parameters.iter().map(|(k, v)| (k.clone(), v.clone())));
            parameters.insert(
                BINARY_DATA_SIZE.to_owned(),
                ParamValue::Uint64(tensor.data.len() as u64),
            );
            write_parameters_field(out, &parameters);
            sections.push(tensor.data.clone());
        }
    }
    out.push(b'}');
    Ok(())
}

pub fn write_shape(out: &mut Vec<u8>, shape: &[u64]) {
    out.push(b'[');
    let mut buffer = itoa::Buffer::new();
    for (i, dim) in shape.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(buffer.format(*dim).as_bytes());
    }
    out.push(b']');
}

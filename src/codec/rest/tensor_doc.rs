//! One tensor object of a JSON header (`$request_input` or `$response_output`): read into a tensor whose data comes
//! from JSON `data` or from the next binary section, and written back the same two ways.

use bytes::Bytes;

use super::data::read_data;
use super::format::{write_data, write_json_string};
use super::params::{read_parameters, write_parameters_field};
use super::reader::JsonReader;
use crate::error::{Error, Result};
use crate::protocol::tensor::check_data;
use crate::protocol::{DataType, ParamValue, Parameters, Tensor, element_count};

/// The binary extension's parameter giving a tensor's section size in bytes.
pub const BINARY_DATA_SIZE: &str = "binary_data_size";

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

/// `data` as met in the object: parsed on the spot when the datatype and shape came first (the usual order), or
/// kept as text until they are known.
enum DataValue<'a> {
    Parsed(Bytes),
    Deferred(&'a [u8]),
}

#[derive(Default)]
struct Fields<'a> {
    name: Option<String>,
    datatype: Option<String>,
    shape: Option<Vec<u64>>,
    parameters: Option<Parameters>,
    data: Option<DataValue<'a>>,
}

/// Reads one tensor object (`$request_input` or `$response_output`); `kind` is "input" or "output" and `index` its
/// position, for error messages. Binary data comes from `sections`, in order.
pub fn read_tensor(
    reader: &mut JsonReader<'_>,
    kind: &str,
    index: usize,
    sections: &mut BinarySections,
) -> Result<Tensor> {
    let mut fields = Fields::default();
    read_fields(reader, &mut fields).map_err(|e| match &fields.name {
        Some(name) => e.context(format_args!("{kind} '{name}'")),
        None => e.context(format_args!("{kind} {index}")),
    })?;
    let name = fields
        .name
        .ok_or_else(|| Error::invalid(format!("{kind} {index} has no \"name\"")))?;
    let what = format!("{kind} '{name}'");
    let datatype = fields
        .datatype
        .ok_or_else(|| Error::invalid(format!("{what} has no \"datatype\"")))?;
    let datatype = DataType::parse(&datatype).map_err(|e| e.context(&what))?;
    let shape = fields
        .shape
        .ok_or_else(|| Error::invalid(format!("{what} has no \"shape\"")))?;
    let mut parameters = fields.parameters.unwrap_or_default();
    let binary_size = parameters.shift_remove(BINARY_DATA_SIZE);
    let data = match (fields.data, binary_size) {
        (Some(_), Some(_)) => return Err(Error::invalid(format!("{what} has both \"data\" and binary_data_size"))),
        (None, None) => {
            return Err(Error::invalid(format!(
                "{what} has neither \"data\" nor binary_data_size"
            )));
        }
        (Some(DataValue::Parsed(data)), None) => data,
        (Some(DataValue::Deferred(text)), None) => {
            let count = element_count(&shape).map_err(|e| e.context(&what))?;
            let mut data_reader = JsonReader::new(text);
            read_data(&mut data_reader, datatype, count).map_err(|e| e.context(&what))?
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

fn read_fields<'a>(reader: &mut JsonReader<'a>, fields: &mut Fields<'a>) -> Result<()> {
    let mut members = reader.object()?;
    while let Some(key) = members.next(reader)? {
        let duplicate = || Error::invalid(format!("\"{key}\" is given twice"));
        match key.as_ref() {
            "name" => {
                if fields.name.replace(reader.string()?.into_owned()).is_some() {
                    return Err(duplicate());
                }
            }
            "datatype" => {
                if fields.datatype.replace(reader.string()?.into_owned()).is_some() {
                    return Err(duplicate());
                }
            }
            "shape" => {
                let shape = read_shape(reader)?;
                if fields.shape.replace(shape).is_some() {
                    return Err(duplicate());
                }
            }
            "parameters" => {
                if fields.parameters.replace(read_parameters(reader)?).is_some() {
                    return Err(duplicate());
                }
            }
            "data" => {
                if fields.data.is_some() {
                    return Err(duplicate());
                }
                if reader.null() {
                    continue;
                }
                let known = fields
                    .datatype
                    .as_deref()
                    .and_then(|d| DataType::parse(d).ok())
                    .zip(fields.shape.as_ref());
                fields.data = Some(match known {
                    Some((datatype, shape)) => {
                        let count = element_count(shape)?;
                        DataValue::Parsed(read_data(reader, datatype, count)?)
                    }
                    None => DataValue::Deferred(reader.value_span()?),
                });
            }
            _ => reader.skip_value()?,
        }
    }
    Ok(())
}

fn read_shape(reader: &mut JsonReader<'_>) -> Result<Vec<u64>> {
    let mut shape = Vec::new();
    let mut elements = reader.array()?;
    while elements.next(reader)? {
        let token = reader.number_token()?;
        let dim = std::str::from_utf8(token)
            .ok()
            .and_then(|t| t.parse::<u64>().ok())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "shape dimension {} is not a non-negative integer",
                    String::from_utf8_lossy(token)
                ))
            })?;
        shape.push(dim);
    }
    Ok(shape)
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
            if tensor.parameters.contains_key(BINARY_DATA_SIZE) {
                // A size carried over from a binary or gRPC answer (KServe sets one on raw outputs) would announce
                // binary data that is not there.
                let mut parameters = tensor.parameters.clone();
                parameters.shift_remove(BINARY_DATA_SIZE);
                write_parameters_field(out, &parameters);
            } else {
                write_parameters_field(out, &tensor.parameters);
            }
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

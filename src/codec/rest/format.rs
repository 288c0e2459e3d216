//! Writing tensor bytes as the JSON `data` of a tensor: a flat array, floats in shortest round-trip form (NaN as
//! `null`, +-Infinity as `1e999` / `-1e999`; see docs/PROTOCOL.md).

use half::{bf16, f16};

use super::parallel;
use crate::error::{Error, Result};
use crate::protocol::DataType;
use crate::protocol::tensor::BytesElements;

/// Appends `data` (validated tensor bytes of `datatype`) as a flat JSON array.
pub fn write_data(out: &mut Vec<u8>, datatype: DataType, data: &[u8]) -> Result<()> {
    out.push(b'[');
    let start = out.len();
    match datatype {
        DataType::Bool => {
            out.reserve(data.len() * 6);
            for &b in data {
                out.extend_from_slice(if b != 0 { b"true," } else { b"false," });
            }
        }
        DataType::Uint8 => write_ints(out, data, |b: [u8; 1]| b[0]),
        DataType::Uint16 => write_ints(out, data, u16::from_le_bytes),
        DataType::Uint32 => write_ints(out, data, u32::from_le_bytes),
        DataType::Uint64 => write_ints(out, data, u64::from_le_bytes),
        DataType::Int8 => write_ints(out, data, i8::from_le_bytes),
        DataType::Int16 => write_ints(out, data, i16::from_le_bytes),
        DataType::Int32 => write_ints(out, data, i32::from_le_bytes),
        DataType::Int64 => write_ints(out, data, i64::from_le_bytes),
        DataType::Fp16 => write_floats(out, data, |b| f16::from_le_bytes(b).to_f32()),
        DataType::Bf16 => write_floats(out, data, |b| bf16::from_le_bytes(b).to_f32()),
        DataType::Fp32 => write_floats(out, data, f32::from_le_bytes),
        DataType::Fp64 => write_floats(out, data, f64::from_le_bytes),
        DataType::Bytes => {
            for (index, element) in BytesElements::new(data).enumerate() {
                let text = std::str::from_utf8(element).map_err(|_| {
                    Error::invalid(format!(
                        "BYTES element {index} is not valid UTF-8, so it cannot be written as JSON; \
                         ask for this tensor as binary data"
                    ))
                })?;
                write_json_string(out, text);
                out.push(b',');
            }
        }
    }
    if out.len() > start {
        // Replace the trailing comma.
        let last = out.len() - 1;
        out[last] = b']';
    } else {
        out.push(b']');
    }
    Ok(())
}

fn write_ints<const N: usize, I: itoa::Integer>(out: &mut Vec<u8>, data: &[u8], from: impl Fn([u8; N]) -> I + Sync) {
    let workers = parallel::workers(data.len() / N);
    if workers > 1 {
        return parallel::write::<N>(out, data, workers, |out, part| {
            write_ints_on_one_thread(out, part, &from)
        });
    }
    write_ints_on_one_thread(out, data, &from);
}

fn write_ints_on_one_thread<const N: usize, I: itoa::Integer>(
    out: &mut Vec<u8>,
    data: &[u8],
    from: &impl Fn([u8; N]) -> I,
) {
    let mut buffer = itoa::Buffer::new();
    out.reserve(data.len() / N * 21);
    for chunk in data.chunks_exact(N) {
        let value = from(chunk.try_into().unwrap_or([0; N]));
        out.extend_from_slice(buffer.format(value).as_bytes());
        out.push(b',');
    }
}

fn write_floats<const N: usize, F: zmij::Float + Copy + WriteSpecial>(
    out: &mut Vec<u8>,
    data: &[u8],
    from: impl Fn([u8; N]) -> F + Sync,
) {
    let workers = parallel::workers(data.len() / N);
    if workers > 1 {
        return parallel::write::<N>(out, data, workers, |out, part| {
            write_floats_on_one_thread(out, part, &from)
        });
    }
    write_floats_on_one_thread(out, data, &from);
}

fn write_floats_on_one_thread<const N: usize, F: zmij::Float + Copy + WriteSpecial>(
    out: &mut Vec<u8>,
    data: &[u8],
    from: &impl Fn([u8; N]) -> F,
) {
    let mut buffer = zmij::Buffer::new();
    // The longest shortest-round-trip text plus its comma: "-1.17549435e-38," (16) for f32, 25 for f64.
    out.reserve(data.len() / N * if N == 8 { 25 } else { 16 });
    for chunk in data.chunks_exact(N) {
        let value = from(chunk.try_into().unwrap_or([0; N]));
        match value.special() {
            None => out.extend_from_slice(buffer.format_finite(value).as_bytes()),
            Some(text) => out.extend_from_slice(text),
        }
        out.push(b',');
    }
}

/// The JSON text of a non-finite float, or `None` for a finite one.
pub(crate) trait WriteSpecial {
    fn special(self) -> Option<&'static [u8]>;
}

impl WriteSpecial for f32 {
    #[inline]
    fn special(self) -> Option<&'static [u8]> {
        f64::from(self).special()
    }
}

impl WriteSpecial for f64 {
    #[inline]
    fn special(self) -> Option<&'static [u8]> {
        if self.is_finite() {
            None
        } else if self.is_nan() {
            Some(b"null")
        } else if self > 0.0 {
            Some(b"1e999")
        } else {
            Some(b"-1e999")
        }
    }
}

/// Appends a JSON string literal.
pub(crate) fn write_json_string(out: &mut Vec<u8>, text: &str) {
    let clean = text.bytes().all(|c| c >= 0x20 && c != b'"' && c != b'\\');
    if clean {
        out.reserve(text.len() + 2);
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else if serde_json::to_writer(&mut *out, text).is_err() {
        // Writing into a Vec cannot fail; keep the output well-formed regardless.
        out.extend_from_slice(b"\"\"");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(datatype: DataType, data: &[u8]) -> String {
        let mut out = Vec::new();
        write_data(&mut out, datatype, data).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn non_utf8_bytes_cannot_be_json() {
        let mut out = Vec::new();
        let e = write_data(&mut out, DataType::Bytes, b"\x01\0\0\0\xff")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not valid UTF-8"), "{e}");
    }

    #[test]
    fn writes_every_integer_type() {
        assert_eq!(written(DataType::Int8, &[0xff, 5]), "[-1,5]");
        assert_eq!(
            written(DataType::Uint64, &u64::MAX.to_le_bytes()),
            "[18446744073709551615]"
        );
        assert_eq!(written(DataType::Bool, &[1, 0]), "[true,false]");
        assert_eq!(written(DataType::Int32, &[]), "[]");
        assert_eq!(written(DataType::Fp64, &1e300f64.to_le_bytes()), "[1e+300]");
        assert_eq!(written(DataType::Fp32, &1e-7f32.to_le_bytes()), "[1e-7]");
        assert_eq!(written(DataType::Fp64, &123456.5f64.to_le_bytes()), "[123456.5]");
    }
}

//! The Decthings tensor binary format <-> V2 tensors.
//!
//! Mapping: f32/f64/i8..i64/u8..u64/boolean are FP32/FP64/INT*/UINT*/BOOL; string is BYTES with
//! `content_type: "str"`; binary is BYTES; image/audio/video are BYTES with `content_type` "image"/"audio"/"video"
//! and `format` the 3-letter extension (a comma-separated list, one per element, when elements differ). Back: FP16
//! and BF16 widen to f32 (Decthings has no 16-bit float); BYTES with `content_type: "str"` become string and must be
//! UTF-8; media are restored from their parameters; other BYTES become binary.

use bytes::{BufMut, Bytes, BytesMut};
use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::protocol::tensor::{BYTES_LENGTH_PREFIX, put_bytes_element};
use crate::protocol::{CONTENT_TYPE, DataType, ParamValue, Parameters, Tensor, element_count};

/// The parameter naming a media element's file format (its 3-letter extension).
pub const FORMAT: &str = "format";

/// Element types of the format with their type bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ElementType {
    F32 = 1,
    F64 = 2,
    I8 = 3,
    I16 = 4,
    I32 = 5,
    I64 = 6,
    U8 = 7,
    U16 = 8,
    U32 = 9,
    U64 = 10,
    String = 11,
    Binary = 12,
    Boolean = 13,
    Image = 14,
    Audio = 15,
    Video = 16,
}

impl ElementType {
    pub fn from_byte(byte: u8) -> Result<ElementType> {
        use ElementType::*;
        Ok(match byte {
            1 => F32,
            2 => F64,
            3 => I8,
            4 => I16,
            5 => I32,
            6 => I64,
            7 => U8,
            8 => U16,
            9 => U32,
            10 => U64,
            11 => String,
            12 => Binary,
            13 => Boolean,
            14 => Image,
            15 => Audio,
            16 => Video,
            other => {
                return Err(Error::invalid(format!(
                    "unknown Decthings type byte {other} (expected 1 to 16)"
                )));
            }
        })
    }

    /// The V2 datatype of fixed-size element types; `None` for the variable-size ones.
    fn fixed_datatype(self) -> Option<DataType> {
        use ElementType::*;
        Some(match self {
            F32 => DataType::Fp32,
            F64 => DataType::Fp64,
            I8 => DataType::Int8,
            I16 => DataType::Int16,
            I32 => DataType::Int32,
            I64 => DataType::Int64,
            U8 => DataType::Uint8,
            U16 => DataType::Uint16,
            U32 => DataType::Uint32,
            U64 => DataType::Uint64,
            Boolean => DataType::Bool,
            String | Binary | Image | Audio | Video => return None,
        })
    }

    fn media_name(self) -> Option<&'static str> {
        match self {
            ElementType::Image => Some("image"),
            ElementType::Audio => Some("audio"),
            ElementType::Video => Some("video"),
            _ => None,
        }
    }
}

/// Appends `value` as the format's 64-bit unsigned varint.
pub fn put_varint(out: &mut BytesMut, value: u64) {
    if let Ok(v) = u8::try_from(value)
        && v < 253
    {
        out.put_u8(v);
    } else if let Ok(v) = u16::try_from(value) {
        out.put_u8(253);
        out.put_u16(v);
    } else if let Ok(v) = u32::try_from(value) {
        out.put_u8(254);
        out.put_u32(v);
    } else {
        out.put_u8(255);
        out.put_u64(value);
    }
}

/// A cursor over the encoded bytes that never reads past the end.
struct DecthingsReader<'a> {
    bytes: &'a Bytes,
    pos: usize,
}

impl DecthingsReader<'_> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        if n > self.remaining() {
            return Err(Error::invalid(format!(
                "Decthings tensor is truncated: {what} needs {n} bytes, {} remain",
                self.remaining()
            )));
        }
        let slice = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(slice)
    }

    fn byte(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn varint(&mut self, what: &str) -> Result<u64> {
        let varint_what = format!("the varint of {what}");
        Ok(match self.byte(&varint_what)? {
            253 => u64::from(u16::from_be_bytes(
                self.take(2, &varint_what)?.try_into().unwrap_or_default(),
            )),
            254 => u64::from(u32::from_be_bytes(
                self.take(4, &varint_what)?.try_into().unwrap_or_default(),
            )),
            255 => u64::from_be_bytes(self.take(8, &varint_what)?.try_into().unwrap_or_default()),
            small => u64::from(small),
        })
    }
}

/// Decodes one Decthings tensor, which must fill `bytes` exactly, into a V2 tensor called `name`. Fixed-size data is
/// a slice of `bytes`; variable-size elements are re-laid out with 4-byte length prefixes.
pub fn decode(bytes: &Bytes, name: &str) -> Result<Tensor> {
    let mut reader = DecthingsReader { bytes, pos: 0 };
    let tensor = read_tensor(&mut reader, name)?;
    if reader.remaining() > 0 {
        return Err(Error::invalid(format!(
            "{} trailing bytes after the Decthings tensor's last element",
            reader.remaining()
        )));
    }
    Ok(tensor)
}

/// Reads one tensor at the reader's position, leaving it after the tensor's last byte.
fn read_tensor(reader: &mut DecthingsReader<'_>, name: &str) -> Result<Tensor> {
    let bytes = reader.bytes;
    let element_type = ElementType::from_byte(reader.byte("the type byte")?)?;
    let ndims = reader.byte("the dimension count")?;
    let shape = (0..ndims)
        .map(|i| reader.varint(&format!("dimension {i}")))
        .collect::<Result<Vec<u64>>>()?;
    let count = element_count(&shape)?;
    let mut parameters = Parameters::new();
    let (datatype, data) = match element_type.fixed_datatype() {
        Some(datatype) => {
            let size = datatype.element_size().unwrap_or(1) as u64;
            let needed = count
                .checked_mul(size)
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n <= reader.remaining())
                .ok_or_else(|| {
                Error::invalid(format!(
                    "Decthings tensor is truncated: shape {shape:?} needs {count} elements of {size} bytes, {} bytes remain",
                    reader.remaining()
                ))
            })?;
            let start = reader.pos;
            reader.pos += needed;
            let data = bytes.slice(start..reader.pos);
            if datatype == DataType::Bool
                && let Some(i) = data.iter().position(|&b| b > 1)
            {
                return Err(Error::invalid(format!(
                    "Decthings boolean element {i} is {}, not 0 or 1",
                    data[i]
                )));
            }
            (datatype, data)
        }
        None => {
            // Each element takes at least one byte, so this reserve is bounded by what actually arrived.
            let bounded = usize::try_from(count).unwrap_or(usize::MAX).min(reader.remaining());
            let mut data = BytesMut::with_capacity(reader.remaining() + bounded * BYTES_LENGTH_PREFIX);
            let mut formats: Vec<[u8; 3]> = Vec::new();
            for index in 0..count {
                let what = format!("element {index}");
                let len = reader.varint(&what)?;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&l| l <= reader.remaining())
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "Decthings tensor is truncated: {what} declares {len} bytes, {} remain",
                            reader.remaining()
                        ))
                    })?;
                let mut element = reader.take(len, &what)?;
                match element_type {
                    ElementType::String => {
                        std::str::from_utf8(element)
                            .map_err(|e| Error::invalid(format!("Decthings string {what} is not valid UTF-8: {e}")))?;
                    }
                    ElementType::Image | ElementType::Audio | ElementType::Video => {
                        let Some((format, media)) = element.split_first_chunk::<3>() else {
                            return Err(Error::invalid(format!(
                                "Decthings media {what} has {len} bytes, fewer than its 3-byte format"
                            )));
                        };
                        if !format.iter().all(u8::is_ascii_alphanumeric) {
                            return Err(Error::invalid(format!(
                                "Decthings media {what} has format bytes {format:?}, not an ASCII file extension"
                            )));
                        }
                        formats.push(*format);
                        element = media;
                    }
                    _ => {}
                }
                put_bytes_element(&mut data, element)?;
            }
            if element_type == ElementType::String {
                parameters.insert(CONTENT_TYPE.to_owned(), ParamValue::String("str".to_owned()));
            }
            if let Some(media) = element_type.media_name() {
                parameters.insert(CONTENT_TYPE.to_owned(), ParamValue::String(media.to_owned()));
                if let Some(first) = formats.first() {
                    let text = if formats.iter().all(|f| f == first) {
                        String::from_utf8_lossy(first).into_owned()
                    } else {
                        formats
                            .iter()
                            .map(|f| String::from_utf8_lossy(f))
                            .collect::<Vec<_>>()
                            .join(",")
                    };
                    parameters.insert(FORMAT.to_owned(), ParamValue::String(text));
                }
            }
            (DataType::Bytes, data.freeze())
        }
    };
    Ok(Tensor {
        name: name.to_owned(),
        datatype,
        shape,
        parameters,
        data,
    })
}

/// Decodes the REST front door's Decthings body: entries, each a varint name length, the UTF-8 name, and one
/// Decthings tensor, until the body ends. Names must be unique.
pub fn decode_entries(body: &Bytes) -> Result<Vec<Tensor>> {
    let mut reader = DecthingsReader { bytes: body, pos: 0 };
    let mut tensors: Vec<Tensor> = Vec::new();
    while reader.remaining() > 0 {
        let index = tensors.len();
        let length = reader.varint(&format!("the name length of entry {index}"))?;
        let length = usize::try_from(length)
            .ok()
            .filter(|&l| l <= reader.remaining())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "Decthings entry {index} declares a name of {length} bytes, {} remain",
                    reader.remaining()
                ))
            })?;
        let name = std::str::from_utf8(reader.take(length, "a name")?)
            .map_err(|_| Error::invalid(format!("the name of Decthings entry {index} is not valid UTF-8")))?
            .to_owned();
        if name.is_empty() {
            return Err(Error::invalid(format!("Decthings entry {index} has an empty name")));
        }
        if tensors.iter().any(|t| t.name == name) {
            return Err(Error::invalid(format!(
                "Decthings entry name '{name}' is used more than once"
            )));
        }
        let tensor = read_tensor(&mut reader, &name).map_err(|e| e.context(format_args!("entry '{name}'")))?;
        tensors.push(tensor);
    }
    Ok(tensors)
}

/// Encodes tensors as the REST front door's Decthings body (see [`decode_entries`]).
pub fn encode_entries(tensors: &[Tensor]) -> Result<Bytes> {
    let mut out = BytesMut::new();
    for tensor in tensors {
        put_varint(&mut out, tensor.name.len() as u64);
        out.put_slice(tensor.name.as_bytes());
        out.put_slice(&encode(tensor)?);
    }
    Ok(out.freeze())
}

/// Encodes a validated V2 tensor as a Decthings tensor (see the module's mapping).
pub fn encode(tensor: &Tensor) -> Result<Bytes> {
    let what = format!("tensor '{}'", tensor.name);
    let content_type = tensor.parameters.get(CONTENT_TYPE).and_then(ParamValue::as_str);
    let element_type = match tensor.datatype {
        DataType::Fp32 | DataType::Fp16 | DataType::Bf16 => ElementType::F32,
        DataType::Fp64 => ElementType::F64,
        DataType::Int8 => ElementType::I8,
        DataType::Int16 => ElementType::I16,
        DataType::Int32 => ElementType::I32,
        DataType::Int64 => ElementType::I64,
        DataType::Uint8 => ElementType::U8,
        DataType::Uint16 => ElementType::U16,
        DataType::Uint32 => ElementType::U32,
        DataType::Uint64 => ElementType::U64,
        DataType::Bool => ElementType::Boolean,
        DataType::Bytes => match content_type {
            Some("str") => ElementType::String,
            Some("image") => ElementType::Image,
            Some("audio") => ElementType::Audio,
            Some("video") => ElementType::Video,
            _ => ElementType::Binary,
        },
    };
    let ndims = u8::try_from(tensor.shape.len()).map_err(|_| {
        Error::invalid(format!(
            "{what} has {} dimensions; Decthings allows 255",
            tensor.shape.len()
        ))
    })?;
    let mut out = BytesMut::with_capacity(2 + tensor.shape.len() * 9 + tensor.data.len() * 2);
    out.put_u8(element_type as u8);
    out.put_u8(ndims);
    for &dim in &tensor.shape {
        put_varint(&mut out, dim);
    }
    match tensor.datatype {
        DataType::Fp16 => tensor
            .data
            .chunks_exact(2)
            .for_each(|c| out.put_f32_le(f16::from_le_bytes([c[0], c[1]]).to_f32())),
        DataType::Bf16 => {
            tensor
                .data
                .chunks_exact(2)
                .for_each(|c| out.put_f32_le(bf16::from_le_bytes([c[0], c[1]]).to_f32()));
        }
        DataType::Bytes => encode_variable(&mut out, tensor, element_type, &what)?,
        _ => out.put_slice(&tensor.data),
    }
    Ok(out.freeze())
}

fn encode_variable(out: &mut BytesMut, tensor: &Tensor, element_type: ElementType, what: &str) -> Result<()> {
    let count = tensor.bytes_elements().count();
    let formats: Vec<&str> = match element_type.media_name() {
        // A media tensor with no elements has no format to write.
        Some(_) if count == 0 => Vec::new(),
        Some(media) => {
            let format = tensor.parameters.get(FORMAT).and_then(ParamValue::as_str).unwrap_or("");
            let formats: Vec<&str> = format.split(',').collect();
            for f in &formats {
                if f.len() != 3 || !f.bytes().all(|b| b.is_ascii_alphanumeric()) {
                    return Err(Error::invalid(format!(
                        "{what} is {media} but its format parameter \"{format}\" is not a 3-letter extension \
                         (or a comma-separated list of them)"
                    )));
                }
            }
            formats
        }
        None => Vec::new(),
    };
    if formats.len() > 1 && formats.len() != count {
        return Err(Error::invalid(format!(
            "{what} lists {} formats for {count} elements",
            formats.len()
        )));
    }
    for (index, element) in tensor.bytes_elements().enumerate() {
        if element_type == ElementType::String && std::str::from_utf8(element).is_err() {
            return Err(Error::invalid(format!(
                "{what} has content_type \"str\" but element {index} is not valid UTF-8"
            )));
        }
        match formats.get(if formats.len() == 1 { 0 } else { index }) {
            Some(format) => {
                put_varint(out, element.len() as u64 + 3);
                out.put_slice(format.as_bytes());
            }
            None => put_varint(out, element.len() as u64),
        }
        out.put_slice(element);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(value: u64) -> Vec<u8> {
        let mut out = BytesMut::new();
        put_varint(&mut out, value);
        out.to_vec()
    }

    #[test]
    fn varints_of_the_spec() {
        assert_eq!(varint(18), [18]);
        assert_eq!(varint(819), [253, 3, 51]);
        assert_eq!(varint(252), [252]);
        assert_eq!(varint(253), [253, 0, 253]);
        assert_eq!(varint(65536), [254, 0, 1, 0, 0]);
        assert_eq!(varint(1 << 32), [255, 0, 0, 0, 1, 0, 0, 0, 0]);
    }

    #[test]
    fn the_spec_string_example_byte_for_byte() {
        let expected: &[u8] = b"\x0b\x01\x02\x05hello\x08, world!";
        let tensor = decode(&Bytes::from_static(expected), "greeting").unwrap();
        assert_eq!(tensor.datatype, DataType::Bytes);
        assert_eq!(tensor.shape, vec![2]);
        assert_eq!(
            tensor.parameters.get(CONTENT_TYPE),
            Some(&ParamValue::String("str".into()))
        );
        assert_eq!(
            tensor.bytes_elements().collect::<Vec<_>>(),
            vec![&b"hello"[..], &b", world!"[..]]
        );
        assert_eq!(&encode(&tensor).unwrap()[..], expected);
    }

    #[test]
    fn media_keep_their_formats() {
        let encoded: &[u8] = b"\x0e\x01\x02\x05pngab\x06jpgxyz";
        let tensor = decode(&Bytes::from_static(encoded), "img").unwrap();
        assert_eq!(
            tensor.parameters.get(FORMAT),
            Some(&ParamValue::String("png,jpg".into()))
        );
        assert_eq!(
            tensor.parameters.get(CONTENT_TYPE),
            Some(&ParamValue::String("image".into()))
        );
        assert_eq!(
            tensor.bytes_elements().collect::<Vec<_>>(),
            vec![&b"ab"[..], &b"xyz"[..]]
        );
        assert_eq!(&encode(&tensor).unwrap()[..], encoded);
        let empty: &[u8] = b"\x10\x01\x00";
        let video = decode(&Bytes::from_static(empty), "v").unwrap();
        assert_eq!(video.parameters.get(FORMAT), None);
        assert_eq!(&encode(&video).unwrap()[..], empty);
        let same: &[u8] = b"\x0f\x01\x01\x04mp3a";
        let audio = decode(&Bytes::from_static(same), "a").unwrap();
        assert_eq!(audio.parameters.get(FORMAT), Some(&ParamValue::String("mp3".into())));
        assert_eq!(&encode(&audio).unwrap()[..], same);
    }

    #[test]
    fn fixed_size_data_is_a_slice_of_the_input() {
        let encoded = Bytes::from_static(b"\x05\x02\x01\x02\x01\0\0\0\x02\0\0\0");
        let tensor = decode(&encoded, "x").unwrap();
        assert_eq!(tensor.datatype, DataType::Int32);
        assert_eq!(tensor.shape, vec![1, 2]);
        assert_eq!(tensor.data.as_ptr(), encoded[4..].as_ptr());
        assert_eq!(encode(&tensor).unwrap(), encoded);
    }

    #[test]
    fn rejections() {
        let cases: [(&[u8], &str); 9] = [
            (b"", "truncated"),
            (b"\x11\x00", "unknown Decthings type byte 17"),
            (b"\x00\x00", "unknown Decthings type byte 0"),
            (b"\x01\x01\xfd\x01", "varint of dimension 0"),
            (b"\x01\x01\x02\0\0\x80\x3f", "truncated"),
            (b"\x01\x01\x01\0\0\x80\x3f\x00", "1 trailing bytes"),
            (b"\x0b\x01\x01\x02\xff\xfe", "not valid UTF-8"),
            (b"\x0b\x01\x02\x01a", "varint of element 1"),
            (b"\x0e\x01\x01\x02pn", "fewer than its 3-byte format"),
        ];
        for (bytes, message) in cases {
            let error = decode(&Bytes::from_static(bytes), "t").unwrap_err().to_string();
            assert!(error.contains(message), "{bytes:?}: {error}");
        }
        let huge = Bytes::from_static(b"\x01\x01\xff\0\0\x01\0\0\0\0\0\0\0\0\0\0");
        assert!(decode(&huge, "t").unwrap_err().to_string().contains("truncated"));
        let many_strings = Bytes::from_static(b"\x0b\x01\xff\0\0\x01\0\0\0\0\0\x01a");
        assert!(decode(&many_strings, "t").is_err());
        let bad_bool = Bytes::from_static(b"\x0d\x01\x01\x02");
        assert!(decode(&bad_bool, "t").unwrap_err().to_string().contains("not 0 or 1"));
    }

    #[test]
    fn entries_frame_named_tensors() {
        let body: &[u8] = b"\x02in\x05\x01\x01\x07\0\0\0\x01s\x0b\x01\x01\x02hi";
        let tensors = decode_entries(&Bytes::from_static(body)).unwrap();
        assert_eq!(tensors.len(), 2);
        assert_eq!((tensors[0].name.as_str(), tensors[0].datatype), ("in", DataType::Int32));
        assert_eq!(tensors[1].bytes_elements().collect::<Vec<_>>(), vec![&b"hi"[..]]);
        assert_eq!(&encode_entries(&tensors).unwrap()[..], body);
        assert!(decode_entries(&Bytes::new()).unwrap().is_empty());
        let cases: [(&[u8], &str); 5] = [
            (b"\x05ab", "declares a name of 5 bytes"),
            (b"\x01\xff\x01\x00", "not valid UTF-8"),
            (b"\x00\x01\x00", "empty name"),
            (b"\x01a\x01\x01\x02\0\0\x80", "entry 'a'"),
            (b"\x01a\x0d\x00\x01\x01a\x0d\x00\x01", "used more than once"),
        ];
        for (bad, message) in cases {
            let error = decode_entries(&Bytes::from_static(bad)).unwrap_err().to_string();
            assert!(error.contains(message), "{bad:?}: {error}");
        }
    }

    #[test]
    fn half_floats_widen_to_f32() {
        let tensor = Tensor::new(
            "h",
            DataType::Fp16,
            vec![1],
            Bytes::copy_from_slice(&f16::from_f32(1.5).to_le_bytes()),
        )
        .unwrap();
        let encoded = encode(&tensor).unwrap();
        assert_eq!(&encoded[..], &[1, 1, 1, 0, 0, 0xc0, 0x3f]);
        let back = decode(&encoded, "h").unwrap();
        assert_eq!(back.datatype, DataType::Fp32);
    }
}

//! Reading the JSON `data` of a tensor straight into little-endian bytes.
//!
//! JSON conventions for floats (documented in docs/PROTOCOL.md): `null` is NaN (MLServer's convention) and NaN is
//! written as `null`; +-Infinity is written as `1e999` / `-1e999`, which every IEEE-754 parser rounds to infinity.
//! On input, float tensors also accept the strings "NaN", "Infinity", "-Infinity", "inf" and "-inf", and numbers
//! beyond the type's range round to infinity as IEEE-754 prescribes. Integers must be written as integers.

use bytes::Bytes;
use half::{bf16, f16};

use super::number::{parse_f32, parse_f64};
use super::parallel;
use super::reader::JsonReader;
use crate::error::{Error, Result};
use crate::protocol::DataType;

/// Deepest nesting of `data` arrays accepted: no tensor has 128 dimensions.
pub const MAX_DATA_DEPTH: u32 = 128;

/// Parses JSON `data` text into tensor bytes holding exactly `count` elements of `datatype`, flat or nested.
pub fn parse_data(text: &[u8], datatype: DataType, count: u64) -> Result<Bytes> {
    let mut reader = JsonReader::new(text);
    let data = read_data(&mut reader, datatype, count)?;
    reader.end()?;
    Ok(data)
}

/// Reads the `data` value at the reader's position (an array nested to any depth, or a lone scalar) into tensor bytes
/// holding exactly `count` elements of `datatype`. Numbers go straight into little-endian bytes.
pub fn read_data(reader: &mut JsonReader<'_>, datatype: DataType, count: u64) -> Result<Bytes> {
    // Every element takes at least one character and one separator, so the text bounds the element count: a shape
    // that claims more is rejected before anything is allocated for it.
    let most = ((reader.text.len() - reader.pos) as u64).div_ceil(2);
    if count > most {
        return Err(Error::invalid(format!(
            "shape needs {count} elements but `data` holds at most {most}"
        )));
    }
    let count = usize::try_from(count).map_err(|_| Error::invalid("too many elements for this machine"))?;
    let r = reader;
    let out = match datatype {
        DataType::Bool => fixed::<1>(r, count, datatype, parse_bool)?,
        DataType::Uint8 => fixed::<1>(r, count, datatype, |s| int_le::<1>(s, 0, u8::MAX.into()))?,
        DataType::Uint16 => fixed::<2>(r, count, datatype, |s| int_le::<2>(s, 0, u16::MAX.into()))?,
        DataType::Uint32 => fixed::<4>(r, count, datatype, |s| int_le::<4>(s, 0, u32::MAX.into()))?,
        DataType::Uint64 => fixed::<8>(r, count, datatype, |s| int_le::<8>(s, 0, u64::MAX.into()))?,
        DataType::Int8 => fixed::<1>(r, count, datatype, |s| int_le::<1>(s, i8::MIN.into(), i8::MAX.into()))?,
        DataType::Int16 => fixed::<2>(r, count, datatype, |s| int_le::<2>(s, i16::MIN.into(), i16::MAX.into()))?,
        DataType::Int32 => fixed::<4>(r, count, datatype, |s| int_le::<4>(s, i32::MIN.into(), i32::MAX.into()))?,
        DataType::Int64 => fixed::<8>(r, count, datatype, |s| int_le::<8>(s, i64::MIN.into(), i64::MAX.into()))?,
        DataType::Fp16 => fixed::<2>(r, count, datatype, |s| {
            float_le(s, parse_f64, |v| f16::from_f64(v).to_le_bytes())
        })?,
        DataType::Bf16 => fixed::<2>(r, count, datatype, |s| {
            float_le(s, parse_f64, |v| bf16::from_f64(v).to_le_bytes())
        })?,
        DataType::Fp32 => fixed::<4>(r, count, datatype, |s| float_le(s, parse_f32, f32::to_le_bytes))?,
        DataType::Fp64 => fixed::<8>(r, count, datatype, |s| float_le(s, parse_f64, f64::to_le_bytes))?,
        DataType::Bytes => strings(r, count)?,
    };
    Ok(Bytes::from(out))
}

/// Why one scalar could not become an element; the caller adds which element it was.
struct ScalarError(String);

type Scalar<const N: usize> = std::result::Result<([u8; N], usize), ScalarError>;

fn element_error(index: usize, datatype: DataType, error: ScalarError) -> Error {
    Error::invalid(format!("element {index} of {datatype} data: {}", error.0))
}

fn count_error(expected: usize, got: usize) -> Error {
    Error::invalid(format!(
        "expected {expected} elements (the product of the shape), got {got}"
    ))
}

/// Walks the nested arrays of `data`, calling `element` at each scalar with the number of scalars seen before it.
#[inline(always)]
fn walk(
    reader: &mut JsonReader<'_>,
    mut element: impl FnMut(&mut JsonReader<'_>, usize) -> Result<()>,
) -> Result<usize> {
    let mut depth = 0u32;
    let mut seen = 0usize;
    'value: loop {
        reader.skip_ws();
        match reader.text.get(reader.pos) {
            Some(b'[') => {
                depth += 1;
                if depth > MAX_DATA_DEPTH {
                    return Err(reader.error(format_args!("`data` is nested deeper than {MAX_DATA_DEPTH} levels")));
                }
                reader.pos += 1;
                reader.skip_ws();
                if reader.text.get(reader.pos) == Some(&b']') {
                    reader.pos += 1;
                    depth -= 1;
                } else {
                    continue 'value;
                }
            }
            Some(b'{') => {
                return Err(Error::invalid(format!(
                    "element {seen} of `data` is an object, not a tensor element"
                )));
            }
            Some(_) => {
                element(reader, seen)?;
                seen += 1;
                // Flat runs ("1.5,2.25,-3") are what serializers emit: take them without the general machinery.
                while reader.text.get(reader.pos) == Some(&b',')
                    && reader
                        .text
                        .get(reader.pos + 1)
                        .is_some_and(|&c| c == b'-' || c.is_ascii_digit() || c == b'"')
                {
                    reader.pos += 1;
                    element(reader, seen)?;
                    seen += 1;
                }
            }
            None => return Err(reader.error("unexpected end of `data`")),
        }
        // After a value: separators and closing brackets.
        loop {
            if depth == 0 {
                return Ok(seen);
            }
            reader.skip_ws();
            match reader.text.get(reader.pos) {
                Some(b',') => {
                    reader.pos += 1;
                    continue 'value;
                }
                Some(b']') => {
                    reader.pos += 1;
                    depth -= 1;
                }
                _ => return Err(reader.error("expected ',' or ']' in `data`")),
            }
        }
    }
}

#[inline(always)]
fn fixed<const N: usize>(
    reader: &mut JsonReader<'_>,
    count: usize,
    datatype: DataType,
    parse_one: impl Fn(&[u8]) -> Scalar<N> + Sync,
) -> Result<Vec<u8>> {
    let workers = parallel::workers(count);
    if workers > 1 {
        reader.skip_ws();
        let flat = parallel::parse_flat(&reader.text[reader.pos..], count, workers, |s| parse_one(s).ok());
        if let Some((out, len)) = flat {
            reader.pos += len;
            return Ok(out);
        }
    }
    // Zeroed up front (fresh zero pages from the allocator cost nothing) so each element is one fixed-size store.
    let mut out = vec![0u8; count * N];
    let seen = walk(
        reader,
        #[inline(always)]
        |reader, index| {
            let (bytes, len) = parse_one(&reader.text[reader.pos..]).map_err(|e| element_error(index, datatype, e))?;
            if let Some(slot) = out.get_mut(index * N..index * N + N) {
                slot.copy_from_slice(&bytes);
            }
            reader.pos += len;
            Ok(())
        },
    )?;
    if seen != count {
        return Err(count_error(count, seen));
    }
    Ok(out)
}

fn strings(reader: &mut JsonReader<'_>, count: usize) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity((reader.text.len() - reader.pos).min(count.saturating_mul(8)));
    let seen = walk(reader, |reader, index| {
        if reader.text[reader.pos] != b'"' {
            let found = describe_token(&reader.text[reader.pos..]);
            return Err(element_error(
                index,
                DataType::Bytes,
                ScalarError(format!("expected a string, got {found}")),
            ));
        }
        let text = reader.string()?;
        if index < count {
            let len = u32::try_from(text.len())
                .map_err(|_| element_error(index, DataType::Bytes, ScalarError("longer than 2^32 - 1 bytes".into())))?;
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(text.as_bytes());
        }
        Ok(())
    })?;
    if seen != count {
        return Err(count_error(count, seen));
    }
    Ok(out)
}

/// Length of the JSON string token at the start of `s` (which begins with a quote), quotes included; all of `s`
/// when the string is not terminated.
fn string_len(s: &[u8]) -> usize {
    let mut i = 1;
    while let Some(offset) = s.get(i..).and_then(|rest| memchr::memchr2(b'"', b'\\', rest)) {
        i += offset;
        if s[i] == b'\\' {
            i += 2;
        } else {
            return i + 1;
        }
    }
    s.len()
}

/// Length of the scalar token at the start of `s`.
fn token_len(s: &[u8]) -> usize {
    if s.first() == Some(&b'"') {
        return string_len(s);
    }
    s.iter()
        .position(|c| matches!(c, b',' | b']' | b' ' | b'\n' | b'\r' | b'\t' | b'}' | b'{' | b'['))
        .unwrap_or(s.len())
}

/// A short quotation of the token at the start of `s`, for error messages.
fn describe_token(s: &[u8]) -> String {
    match s.first() {
        Some(b'{') => "an object".to_owned(),
        _ => {
            let token = &s[..token_len(s).clamp(1, 40)];
            format!("`{}`", String::from_utf8_lossy(token))
        }
    }
}

fn parse_bool(s: &[u8]) -> Scalar<1> {
    if s.starts_with(b"true") {
        Ok(([1], 4))
    } else if s.starts_with(b"false") {
        Ok(([0], 5))
    } else {
        Err(ScalarError(format!(
            "expected true or false, got {}",
            describe_token(s)
        )))
    }
}

/// Parses an integer token and checks it against `[min, max]`, giving its `N` little-endian bytes.
#[inline(always)]
fn int_le<const N: usize>(s: &[u8], min: i128, max: i128) -> Scalar<N> {
    let negative = s.first() == Some(&b'-');
    let digits_start = usize::from(negative);
    let digits = s[digits_start..].iter().take_while(|c| c.is_ascii_digit()).count();
    let end = digits_start + digits;
    if digits == 0 || matches!(s.get(end), Some(b'.' | b'e' | b'E')) {
        let what = if digits == 0 { "" } else { "non-integer " };
        return Err(ScalarError(format!(
            "expected an integer, got {what}{}",
            describe_token(s)
        )));
    }
    let mut magnitude: u64 = 0;
    let mut overflow = false;
    for &c in &s[digits_start..end] {
        match magnitude
            .checked_mul(10)
            .and_then(|m| m.checked_add(u64::from(c - b'0')))
        {
            Some(m) => magnitude = m,
            None => overflow = true,
        }
    }
    let value = if negative {
        -i128::from(magnitude)
    } else {
        i128::from(magnitude)
    };
    if overflow || value < min || value > max {
        return Err(ScalarError(format!(
            "{} is out of range [{min}, {max}]",
            String::from_utf8_lossy(&s[..end])
        )));
    }
    let bytes = value.to_le_bytes();
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[..N]);
    Ok((out, end))
}

/// Parses a float element: a number, `null` (NaN), or one of the special strings.
#[inline(always)]
fn float_le<F: SpecialFloat, const N: usize>(
    s: &[u8],
    parse: impl Fn(&[u8]) -> Option<(F, usize)>,
    to_bytes: impl Fn(F) -> [u8; N],
) -> Scalar<N> {
    match s[0] {
        b'-' | b'0'..=b'9' => match parse(s) {
            Some((value, len)) => Ok((to_bytes(value), len)),
            None => Err(ScalarError(format!("expected a number, got {}", describe_token(s)))),
        },
        b'n' if s.starts_with(b"null") => Ok((to_bytes(<F as SpecialFloat>::NAN), 4)),
        b'"' => {
            let len = string_len(s);
            if len < 2 || s[len - 1] != b'"' {
                return Err(ScalarError("unterminated string".into()));
            }
            let value = match &s[1..len - 1] {
                b"NaN" | b"nan" => <F as SpecialFloat>::NAN,
                b"Infinity" | b"inf" => <F as SpecialFloat>::INFINITY,
                b"-Infinity" | b"-inf" => <F as SpecialFloat>::NEG_INFINITY,
                _ => {
                    return Err(ScalarError(format!(
                        "expected a number, got the string {}",
                        describe_token(s)
                    )));
                }
            };
            Ok((to_bytes(value), len))
        }
        _ => Err(ScalarError(format!("expected a number, got {}", describe_token(s)))),
    }
}

trait SpecialFloat {
    const NAN: Self;
    const INFINITY: Self;
    const NEG_INFINITY: Self;
}

impl SpecialFloat for f32 {
    const NAN: f32 = f32::NAN;
    const INFINITY: f32 = f32::INFINITY;
    const NEG_INFINITY: f32 = f32::NEG_INFINITY;
}

impl SpecialFloat for f64 {
    const NAN: f64 = f64::NAN;
    const INFINITY: f64 = f64::INFINITY;
    const NEG_INFINITY: f64 = f64::NEG_INFINITY;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::rest::format::write_data;

    fn parse(text: &str, datatype: DataType, count: u64) -> Result<Bytes> {
        parse_data(text.as_bytes(), datatype, count)
    }

    fn written(datatype: DataType, data: &[u8]) -> String {
        let mut out = Vec::new();
        write_data(&mut out, datatype, data).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn unterminated_strings_end_at_the_end() {
        assert_eq!(string_len(b"\"ab\\"), 4);
        assert_eq!(string_len(b"\"ab\\\""), 5);
        assert_eq!(string_len(b"\"a\\\"b\""), 6);
        assert!(parse("\"\\\\\\", DataType::Fp16, 1).is_err());
    }

    #[test]
    fn flat_and_nested_data_give_the_same_bytes() {
        let flat = parse("[1, 2, 3, 4]", DataType::Uint32, 4).unwrap();
        let nested = parse("[[1, 2], [3, 4]]", DataType::Uint32, 4).unwrap();
        assert_eq!(flat, nested);
        assert_eq!(&flat[..], &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]);
    }

    #[test]
    fn nesting_depth_is_limited() {
        let nest = |depth: usize| format!("{}7{}", "[".repeat(depth), "]".repeat(depth));
        assert_eq!(&parse(&nest(128), DataType::Int8, 1).unwrap()[..], &[7]);
        let e = parse(&nest(129), DataType::Int8, 1).unwrap_err().to_string();
        assert!(e.contains("deeper than 128"), "{e}");
        assert!(parse(&nest(100_000), DataType::Bytes, 1).is_err());
        assert!(parse("[1,]", DataType::Int8, 1).is_err());
        assert!(parse("[1 2]", DataType::Int8, 2).is_err());
        assert!(parse("[1]]", DataType::Int8, 1).is_err());
        assert!(parse("[[1]", DataType::Int8, 1).is_err());
        assert_eq!(&parse(" [ [ 1 ] , [ ] , 2 ] ", DataType::Int8, 2).unwrap()[..], &[1, 2]);
    }

    #[test]
    fn integers_are_range_checked() {
        let e = parse("[300]", DataType::Uint8, 1).unwrap_err().to_string();
        assert!(e.contains("300 is out of range [0, 255]"), "{e}");
        let e = parse("[-1]", DataType::Uint32, 1).unwrap_err().to_string();
        assert!(e.contains("-1 is out of range"), "{e}");
        let e = parse("[1, 1.5]", DataType::Int32, 2).unwrap_err().to_string();
        assert!(e.contains("element 1") && e.contains("non-integer `1.5`"), "{e}");
        let e = parse("[99999999999999999999999]", DataType::Int64, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("out of range"), "{e}");
        assert_eq!(
            &parse("[-9223372036854775808]", DataType::Int64, 1).unwrap()[..],
            &i64::MIN.to_le_bytes()
        );
        assert_eq!(
            &parse("[18446744073709551615]", DataType::Uint64, 1).unwrap()[..],
            &u64::MAX.to_le_bytes()
        );
        assert!(parse("[true]", DataType::Int32, 1).is_err());
    }

    #[test]
    fn floats_and_their_special_values() {
        let bytes = parse("[0.1, null, \"-Infinity\", 1e999]", DataType::Fp32, 4).unwrap();
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(values[0], 0.1f32);
        assert!(values[1].is_nan());
        assert_eq!(values[2], f32::NEG_INFINITY);
        assert_eq!(values[3], f32::INFINITY);
        let e = parse("[\"1.0\"]", DataType::Fp32, 1).unwrap_err().to_string();
        assert!(e.contains("expected a number, got the string"), "{e}");
        assert!(parse("[true]", DataType::Fp64, 1).is_err());
        assert_eq!(written(DataType::Fp32, &bytes), "[0.1,null,-1e999,1e999]");
    }

    #[test]
    fn half_precision_rounds_to_nearest_even() {
        // 1 + 2^-11 lies exactly between two FP16 values (1 and 1 + 2^-10); the even one is 1.
        let bytes = parse("[1.00048828125, 65504, 0.1]", DataType::Fp16, 3).unwrap();
        assert_eq!(&bytes[..2], &f16::from_f32(1.0).to_le_bytes());
        assert_eq!(&bytes[2..4], &f16::MAX.to_le_bytes());
        assert_eq!(written(DataType::Fp16, &bytes[..4]), "[1.0,65504.0]");
        let bf = parse("[1.5, -2]", DataType::Bf16, 2).unwrap();
        assert_eq!(written(DataType::Bf16, &bf), "[1.5,-2.0]");
    }

    #[test]
    fn element_count_must_match() {
        let e = parse("[1, 2, 3]", DataType::Int32, 4).unwrap_err().to_string();
        assert!(e.contains("expected 4 elements") && e.contains("got 3"), "{e}");
        let e = parse("[1, 2, 3]", DataType::Int32, 2).unwrap_err().to_string();
        assert!(e.contains("expected 2 elements") && e.contains("got 3"), "{e}");
        let e = parse("[1]", DataType::Int32, 1 << 40).unwrap_err().to_string();
        assert!(e.contains("at most 2"), "{e}");
    }

    #[test]
    fn bools_and_strings() {
        assert_eq!(&parse("[true, false]", DataType::Bool, 2).unwrap()[..], &[1, 0]);
        assert!(parse("[1]", DataType::Bool, 1).is_err());
        let bytes = parse(r#"["ab", "c\"\u00e9", ""]"#, DataType::Bytes, 3).unwrap();
        assert_eq!(&bytes[..], b"\x02\0\0\0ab\x04\0\0\0c\"\xc3\xa9\0\0\0\0");
        assert_eq!(written(DataType::Bytes, &bytes), r#"["ab","c\"é",""]"#);
        let e = parse("[1]", DataType::Bytes, 1).unwrap_err().to_string();
        assert!(e.contains("expected a string, got `1`"), "{e}");
        let e = parse(r#"[{"a": 1}]"#, DataType::Bytes, 1).unwrap_err().to_string();
        assert!(e.contains("element 0 of `data` is an object"), "{e}");
    }
}

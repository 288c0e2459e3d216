//! Tensors large enough to take the multi-threaded paths give exactly what the one-thread paths give.

use oipgate::codec::rest::parallel::PARALLEL_MIN_ELEMENTS;
use oipgate::codec::rest::{data, format};
use oipgate::protocol::DataType;

const COUNT: usize = PARALLEL_MIN_ELEMENTS * 2 + 17;

fn floats() -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..COUNT)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Finite values of every magnitude.
            let bits = (state >> 32) as u32;
            let value = f32::from_bits(bits);
            if value.is_finite() {
                value
            } else {
                f32::from_bits(bits & 0x3fff_ffff)
            }
        })
        .collect()
}

#[test]
fn large_float_arrays_match_serde_json_text_and_parse_back_exactly() {
    let values = floats();
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut text = Vec::new();
    format::write_data(&mut text, DataType::Fp32, &raw).unwrap();
    assert_eq!(
        text,
        serde_json::to_vec(&values).unwrap(),
        "same shortest text as serde_json"
    );
    let parsed = data::parse_data(&text, DataType::Fp32, COUNT as u64).unwrap();
    assert!(parsed == raw, "parsed bytes differ from the original bits");
    // Spaces after commas, as Python's json.dumps writes them.
    let spaced = String::from_utf8(text).unwrap().replace(',', ", ");
    assert!(data::parse_data(spaced.as_bytes(), DataType::Fp32, COUNT as u64).unwrap() == raw);
}

#[test]
fn large_integer_arrays_match_serde_json() {
    let values: Vec<i64> = (0..COUNT as i64)
        .map(|i| i.wrapping_mul(0x5851_f42d_4c95_7f2d))
        .collect();
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut text = Vec::new();
    format::write_data(&mut text, DataType::Int64, &raw).unwrap();
    assert_eq!(text, serde_json::to_vec(&values).unwrap());
    assert!(data::parse_data(&text, DataType::Int64, COUNT as u64).unwrap() == raw);
}

#[test]
fn errors_deep_in_large_arrays_are_the_one_thread_errors() {
    let mut elements = vec!["1"; COUNT];
    elements[COUNT - 5] = "300";
    let text = format!("[{}]", elements.join(","));
    let error = data::parse_data(text.as_bytes(), DataType::Uint8, COUNT as u64)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&format!("element {} of UINT8 data: 300 is out of range", COUNT - 5)),
        "{error}"
    );
    let short = data::parse_data(text.as_bytes(), DataType::Uint16, COUNT as u64 + 1)
        .unwrap_err()
        .to_string();
    assert!(short.contains(&format!("expected {} elements", COUNT + 1)), "{short}");
    let trailing = format!("[{},]", vec!["1"; COUNT].join(","));
    let trailing = data::parse_data(trailing.as_bytes(), DataType::Int32, COUNT as u64)
        .unwrap_err()
        .to_string();
    // The trailing comma promises an element past the last one (elements count from 0).
    let expected = format!("element {} of INT32 data: expected an integer, got `]`", COUNT);
    assert!(trailing.contains(&expected), "{trailing}");
    let nested = format!("[[{}],[1]]", vec!["1"; COUNT - 1].join(","));
    assert_eq!(
        data::parse_data(nested.as_bytes(), DataType::Int8, COUNT as u64)
            .unwrap()
            .len(),
        COUNT
    );
}

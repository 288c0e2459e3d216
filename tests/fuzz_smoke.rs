//! The fuzz targets' bodies under proptest, so every test run throws arbitrary and mutated inputs at each decoder.
//! (The coverage-guided fuzzers in fuzz/ go much further; see README.md.)

use bytes::Bytes;
use oipgate::fuzzing;
use proptest::prelude::*;

const JSON_SEEDS: &[&str] = &[
    r#"{"id":"1","parameters":{"a":1,"b":"x"},"inputs":[{"name":"x","datatype":"FP32","shape":[2,2],"data":[[1,2],[3,null]]},{"name":"s","datatype":"BYTES","shape":[1],"data":["\u00e9"]}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]}"#,
    r#"{"inputs":[{"name":"b","datatype":"BOOL","shape":[3],"data":[true,false,true]},{"name":"i","datatype":"INT8","shape":[2],"data":[-128,127]}]}"#,
    r#"{"inputs":[{"data":[1,2,3],"shape":[3],"datatype":"UINT64","name":"late"}]}"#,
];

/// Mutations of a seed: overwrite, insert and delete bytes at chosen places.
fn mutated(seeds: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(seeds),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
    )
        .prop_map(|(seed, edits)| {
            let mut bytes = seed.as_bytes().to_vec();
            for (at, byte, kind) in edits {
                let i = at.index(bytes.len().max(1));
                match kind {
                    0 if !bytes.is_empty() => {
                        let last = bytes.len() - 1;
                        bytes[i.min(last)] = byte;
                    }
                    1 => bytes.insert(i.min(bytes.len()), byte),
                    _ if !bytes.is_empty() => {
                        let last = bytes.len() - 1;
                        bytes.remove(i.min(last));
                    }
                    _ => {}
                }
            }
            bytes
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn json_request_arbitrary(data in prop::collection::vec(any::<u8>(), 0..256)) { fuzzing::json_request(&data); }

    #[test]
    fn json_request_mutated(data in mutated(JSON_SEEDS)) { fuzzing::json_request(&data); }

    #[test]
    fn binary_request_mutated(data in mutated(JSON_SEEDS), tail in prop::collection::vec(any::<u8>(), 0..64), length in any::<u16>()) {
        let mut input = length.to_le_bytes().to_vec();
        input.extend_from_slice(&data);
        input.extend_from_slice(&tail);
        fuzzing::binary_request(&input);
    }

    #[test]
    fn protobuf_request_arbitrary(data in prop::collection::vec(any::<u8>(), 0..256)) { fuzzing::protobuf_request(&data); }

    #[test]
    fn generate_answer_mutated(data in mutated(&[
        "data: {\"text_output\":\"Hel\",\"model_name\":\"llm\",\"model_version\":\"1\"}\n\ndata: {\"text_output\":[\"lo\",\"!\"],\"num_output_tokens\":2}\n\n",
        r#"{"OUTPUT0":[1,2,3],"OUTPUT1":4,"model_name":"m","parameters":{"a":1}}"#,
        "data:{\"error\":\"broken\"}\n\n: keep-alive\n\n",
    ])) {
        fuzzing::generate_answer(&data);
    }

    #[test]
    fn generate_answer_arbitrary(data in prop::collection::vec(any::<u8>(), 0..128)) { fuzzing::generate_answer(&data); }

    #[test]
    fn rename_mutated(data in mutated(&[r#"{"model_name":"up","model_version":"1","id":"x","outputs":[{"name":"o","data":[1,"a\"b"]}]}"#, r#"{"outputs":[],"model_name":""}"#])) {
        fuzzing::rename(&data);
    }

    #[test]
    fn splice_arbitrary(data in prop::collection::vec(any::<u8>(), 0..128)) { fuzzing::splice(&data); }

    #[test]
    fn decthings_arbitrary(data in prop::collection::vec(any::<u8>(), 0..64)) { fuzzing::decthings(&data); }

    #[test]
    fn decthings_valid_prefixes(kind in 1u8..=16, dims in prop::collection::vec(0u8..4, 0..3), tail in prop::collection::vec(any::<u8>(), 0..48)) {
        let mut input = vec![kind, u8::try_from(dims.len()).unwrap()];
        input.extend_from_slice(&dims);
        input.extend_from_slice(&tail);
        fuzzing::decthings(&input);
    }
}

/// A varint of `value` written in `bytes` bytes (padded with continuation bytes, as some encoders never do), with
/// `extra` bits set above the 32 of a key where a fifth byte can carry them.
fn varint_shaped(value: u64, bytes: usize, extra: u8) -> Vec<u8> {
    let mut natural = 1;
    while value >> (7 * natural) != 0 {
        natural += 1;
    }
    let bytes = bytes.max(natural);
    let mut out = Vec::new();
    for index in 0..bytes {
        let mut byte = ((value >> (7 * index).min(63)) & 0x7f) as u8;
        if index == 4 {
            byte |= extra << 4;
        }
        if index + 1 < bytes {
            byte |= 0x80;
        }
        out.push(byte);
    }
    out
}

/// A field of `number` and `wire` type whose key takes the shape asked for, carrying `payload` when length-delimited.
fn field_shaped(number: u64, wire: u64, (bytes, extra): (usize, u8), payload: &[u8]) -> Vec<u8> {
    let mut field = varint_shaped(number << 3 | wire, bytes, extra);
    match wire {
        0 => field.push(1),
        1 => field.extend_from_slice(&[0; 8]),
        5 => field.extend_from_slice(&[0; 4]),
        _ => {
            field.extend(varint_shaped(payload.len() as u64, 1, 0));
            field.extend_from_slice(payload);
        }
    }
    field
}

/// Key shapes: mostly canonical, sometimes padded (within five bytes and past them) or carrying bits above 32.
fn key_shape() -> impl Strategy<Value = (usize, u8)> {
    prop_oneof![4 => Just((1usize, 0u8)), 2 => (1usize..=10, Just(0u8)), 1 => (5usize..=5, 0u8..8)]
}

/// A parameters map entry (its name one of those the gateway acts on, or not), its keys shaped as drawn.
fn parameter_entry() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(vec![
            "shared_memory_region",
            "shared_memory_offset",
            "sequence_id",
            "priority",
            "a",
        ]),
        key_shape(),
        key_shape(),
        any::<u8>(),
    )
        .prop_map(|(name, name_key, value_key, value)| {
            let mut entry = field_shaped(1, 2, name_key, name.as_bytes());
            // An int64_param (field 2 of InferParameter, a varint).
            let parameter = [0x10, value & 0x7f];
            entry.extend(field_shaped(2, 2, value_key, &parameter));
            entry
        })
}

/// A `ModelInferRequest` of fields in any order and number: names, request parameters, inputs and outputs with
/// parameters, and unknown fields, each key in a drawn shape and its wire type sometimes wrong.
fn keyed_message() -> impl Strategy<Value = Vec<u8>> {
    let field = (
        prop::sample::select(vec![1u64, 2, 3, 4, 5, 6, 7, 99, 536_870_913]),
        prop_oneof![8 => Just(2u64), 1 => prop::sample::select(vec![0u64, 1, 3, 4, 5, 6, 7])],
        key_shape(),
        prop::sample::select(vec!["m", "other", ""]),
        parameter_entry(),
        (key_shape(), key_shape()),
    )
        .prop_map(|(number, wire, shape, name, entry, (tensor_key, parameters_key))| {
            let payload = match number {
                4 => entry,
                5 | 6 => {
                    // A tensor: its name, then its parameters (field 4 of an input, 2 of an output).
                    let mut tensor = field_shaped(1, 2, tensor_key, b"x");
                    tensor.extend(field_shaped(if number == 5 { 4 } else { 2 }, 2, parameters_key, &entry));
                    tensor
                }
                _ => name.as_bytes().to_vec(),
            };
            field_shaped(number & ((1 << 61) - 1), wire, shape, &payload)
        });
    prop::collection::vec(field, 0..6).prop_map(|fields| fields.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn protobuf_keys_in_every_shape(message in keyed_message()) { fuzzing::protobuf_keys(&message); }

    #[test]
    fn protobuf_keys_arbitrary(data in prop::collection::vec(any::<u8>(), 0..128)) { fuzzing::protobuf_keys(&data); }

    #[test]
    fn leading_fields_in_every_shape(message in keyed_message()) { fuzzing::leading_fields(&message); }

    #[test]
    fn leading_fields_arbitrary(data in prop::collection::vec(any::<u8>(), 0..128)) { fuzzing::leading_fields(&data); }
}

/// A chunked body's framing: chunks of drawn sizes with and without extensions, a last chunk, trailers; line ends
/// sometimes a bare LF or CR.
fn chunked_body() -> impl Strategy<Value = Vec<u8>> {
    let line_end = prop_oneof![8 => Just("\r\n"), 1 => Just("\n"), 1 => Just("\r")];
    let chunk = (0usize..40, any::<bool>(), line_end.clone(), line_end.clone());
    (
        prop::collection::vec(chunk, 0..5),
        prop::collection::vec(("[a-z-]{1,8}", line_end.clone()), 0..3),
        line_end,
    )
        .prop_map(|(chunks, trailers, last_end)| {
            let mut body = Vec::new();
            for (size, extension, size_end, data_end) in chunks {
                body.extend_from_slice(format!("{size:x}").as_bytes());
                if extension {
                    body.extend_from_slice(b";name=value");
                }
                body.extend_from_slice(size_end.as_bytes());
                body.extend(std::iter::repeat_n(b'x', size));
                body.extend_from_slice(data_end.as_bytes());
            }
            body.extend_from_slice(b"0\r\n");
            for (name, end) in trailers {
                body.extend_from_slice(format!("{name}: 1{end}").as_bytes());
            }
            body.extend_from_slice(last_end.as_bytes());
            body
        })
}

/// One request of a pipeline: its Host fields, its body's framing fields (lengths, codings, both), and a body.
fn request_head_and_body() -> impl Strategy<Value = Vec<u8>> {
    let hosts = prop::sample::select(vec!["host: x\r\n", "", "host: a\r\nhost: b\r\n", "host: a b\r\n"]);
    let framing = prop::sample::select(vec![
        "",
        "content-length: 3\r\n",
        "content-length: 3, 3\r\n",
        "content-length: 3\r\ncontent-length: 3\r\n",
        "content-length: 3\r\ncontent-length: 4\r\n",
        "content-length: +3\r\n",
        "transfer-encoding: chunked\r\n",
        "transfer-encoding: Chunked \r\n",
        "transfer-encoding: gzip, chunked\r\n",
        "transfer-encoding: chunked, chunked\r\n",
        "transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n",
        "transfer-encoding: chunked, gzip\r\n",
        "transfer-encoding: chunked\r\ncontent-length: 3\r\n",
    ]);
    let version = prop::sample::select(vec!["HTTP/1.1", "HTTP/1.0"]);
    let body = prop_oneof![Just(b"abc".to_vec()), chunked_body()];
    (version, hosts, framing, body).prop_map(|(version, hosts, framing, body)| {
        let mut request = format!("POST /v2/models/m/infer {version}\r\n{hosts}{framing}\r\n").into_bytes();
        request.extend(body);
        request
    })
}

/// Pipelines of such requests, sometimes mutated.
fn pipeline() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(request_head_and_body(), 1..4),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    )
        .prop_map(|(requests, edits)| {
            let mut bytes = requests.concat();
            for (at, byte) in edits {
                let index = at.index(bytes.len());
                bytes[index] = byte;
            }
            bytes
        })
}

/// A backend's answer: status, framing fields and a body.
fn answer() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u8>(),
        prop::sample::select(vec![
            "200 OK",
            "100 Continue",
            "204 No Content",
            "304 Not Modified",
            "101 Switching",
        ]),
        prop::sample::select(vec![
            "",
            "content-length: 3\r\n",
            "content-length: 3, 3\r\n",
            "transfer-encoding: chunked\r\n",
            "transfer-encoding: chunked\r\ncontent-length: 9\r\n",
            "transfer-encoding: gzip\r\n",
            "connection: close\r\n",
            // Headers passed back as lines, or read into a map for naming one or for their number.
            "content-type: a\r\nx-request-id: b\r\ncontent-length: 3\r\n",
            "connection: keep-alive, x-a\r\nx-a: 1\r\ncontent-length: 3\r\n",
            "x-a: 1\r\nx-a: 2\r\nx-a: 3\r\nx-a: 4\r\nx-a: 5\r\nx-a: 6\r\nx-a: 7\r\nx-a: 8\r\nx-a: 9\r\n",
            "connection: close\r\nclose: x\r\ncontent-length: 3\r\n",
            "transfer-encoding: ,\r\ncontent-length: 3\r\n",
            "inference-header-content-length: 1\u{a0}\r\ncontent-length: 3\r\n",
        ]),
        prop_oneof![Just(b"abc".to_vec()), chunked_body()],
    )
        .prop_map(|(flags, status, framing, body)| {
            let mut answer = vec![flags];
            answer.extend_from_slice(format!("HTTP/1.1 {status}\r\n{framing}\r\n").as_bytes());
            answer.extend(body);
            answer
        })
}

/// JSON requests whose keys may name shared memory, plainly or with escapes, anywhere.
fn keyed_json() -> impl Strategy<Value = Vec<u8>> {
    let key = prop::sample::select(vec![
        "shared_memory_region",
        "\\u0073hared_memory_offset",
        "shared\\u005fmemory_byte_size",
        "sequence_id",
        "parameters",
        "name",
        "data",
    ]);
    let value = prop::sample::select(vec![
        "1",
        "\"shared_memory_region\"",
        "[1,2]",
        "{}",
        "null",
        "\"a\\\"b\"",
    ]);
    let member = (key, value).prop_map(|(key, value)| format!("\"{key}\":{value}"));
    (
        prop::collection::vec(member.clone(), 0..4),
        prop::collection::vec(member, 0..3),
        any::<u8>(),
    )
        .prop_map(|(outer, inner, piece)| {
            let inner = inner.join(",");
            let mut members = outer;
            members.push(format!("\"inputs\":[{{{inner}}}]"));
            let mut bytes = vec![piece];
            bytes.extend_from_slice(format!("{{{}}}", members.join(",")).as_bytes());
            bytes
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn chunked_framings(piece in any::<u8>(), body in chunked_body(), tail in prop::collection::vec(any::<u8>(), 0..8)) {
        let mut input = vec![piece];
        input.extend(body);
        input.extend(tail);
        fuzzing::chunked(&input);
    }

    #[test]
    fn chunked_arbitrary(data in prop::collection::vec(any::<u8>(), 0..96)) { fuzzing::chunked(&data); }

    #[test]
    fn http1_pipelines(bytes in pipeline()) {
        fuzzing::http1_framing(&bytes);
        fuzzing::http1_request_head(&bytes);
    }

    #[test]
    fn http1_answers(bytes in answer()) { fuzzing::http1_answer(&bytes); }

    #[test]
    fn http1_arbitrary(data in prop::collection::vec(any::<u8>(), 0..128)) {
        fuzzing::http1_framing(&data);
        fuzzing::http1_request_head(&data);
        fuzzing::http1_answer(&data);
    }

    #[test]
    fn compression_arbitrary(data in prop::collection::vec(any::<u8>(), 0..256)) { fuzzing::compression(&data); }

    #[test]
    fn key_scan_of_keyed_json(bytes in keyed_json()) { fuzzing::key_scan(&bytes); }

    #[test]
    fn key_scan_mutated(data in mutated(JSON_SEEDS), piece in any::<u8>()) {
        let mut input = vec![piece];
        input.extend(data);
        fuzzing::key_scan(&input);
    }
}

#[test]
fn protobuf_mutations_of_a_valid_message() {
    use oipgate::codec::protobuf::request_to_proto;
    use oipgate::codec::rest::{RestRequest, decode_request};
    use prost::Message;
    let RestRequest::Request { request, .. } =
        decode_request(Bytes::from_static(JSON_SEEDS[0].as_bytes()), None).unwrap()
    else {
        panic!()
    };
    let wire = request_to_proto(request).encode_to_vec();
    for i in 0..wire.len() {
        for byte in [0u8, 1, 0x7f, 0x80, 0xff] {
            let mut mutated = wire.clone();
            mutated[i] = byte;
            fuzzing::protobuf_request(&mutated);
            fuzzing::splice(&mutated);
            fuzzing::protobuf_keys(&mutated);
        }
        fuzzing::protobuf_request(&wire[..i]);
        fuzzing::splice(&wire[..i]);
    }
}

/// Inputs the coverage-guided fuzzers found crashes with, kept as regressions.
const FUZZ_CRASHES: &[(&str, &[u8])] = &[
    // An unterminated string ending in a backslash, as a float tensor's `data`: the string scanner stepped past the end.
    // A dimension written as a non-minimal varint (253, then 0 as u16): valid, but re-encoded minimally.
    ("decthings", b"\x0b\x0b\xd0\x00G\x03\xfa\xfd\x00\x00\x00\x00\x00\x00!"),
    // A map field (parameters) sent with the varint wire type: prost reads the next bytes as its entry.
    ("splice", b"\x20\x02\x0a\x00"),
    // A parameters map entry with neither key nor value: prost keeps it empty, the reader drops it (no value).
    ("leading_fields", b"\x22\x00"),
    ("json_request", b"{\x22iparametersraoeters\x22:{\x22a\x22:1},\x22inputs\x22:[{\x22namex\x22:\x22\x22,\x22datatype\x22:\x22FP16\x22,\x22shape\x22:[2,2],\x22data\x22:\x22\xa3\xa3\xa3\xa4\xa3\xa3\xa3\xa3\xa3\xa3n`me\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3V\x5c\x5c\x5c\x5c\x5c\x5c\x5c\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xe3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3\xa3]\x5c\x5c\x5c\x5c\x5c\x5c\x5c\xa3\x5c\x5c\x5c"),
];

#[test]
fn fuzz_crash_regressions() {
    for (target, input) in FUZZ_CRASHES {
        match *target {
            "json_request" => fuzzing::json_request(input),
            "binary_request" => fuzzing::binary_request(input),
            "protobuf_request" => fuzzing::protobuf_request(input),
            "splice" => fuzzing::splice(input),
            "protobuf_keys" => fuzzing::protobuf_keys(input),
            "chunked" => fuzzing::chunked(input),
            "http1_framing" => fuzzing::http1_framing(input),
            "http1_request_head" => fuzzing::http1_request_head(input),
            "http1_answer" => fuzzing::http1_answer(input),
            "compression" => fuzzing::compression(input),
            "key_scan" => fuzzing::key_scan(input),
            "leading_fields" => fuzzing::leading_fields(input),
            _ => fuzzing::decthings(input),
        }
    }
}

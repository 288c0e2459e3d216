//! Entry points for the fuzz targets in fuzz/ (and their proptest smoke, tests/fuzz_smoke.rs): each feeds arbitrary
//! bytes to a reader of client or backend bytes and checks what it makes of them against a reference (re-encoding,
//! another decoder, the RFC's rules, the same bytes cut otherwise). None may panic.

use bytes::Bytes;
use prost::Message;

use crate::codec::rest::{self, RestRequest};
use crate::codec::{decthings, protobuf};
use crate::proto::ModelInferRequest;

/// The JSON request decoder: whatever it accepts is valid, encodes (in the binary extension, which carries every
/// value exactly), and decodes again to the same request.
pub fn json_request(data: &[u8]) {
    let Ok(RestRequest::Request { request, .. }) = rest::decode_request(Bytes::copy_from_slice(data), None) else {
        return;
    };
    for input in &request.inputs {
        assert!(input.validate().is_ok(), "accepted an invalid tensor");
    }
    let body = rest::encode_request(&request, true).expect("a request the decoder accepted encodes");
    let again = rest::decode_request(body.to_bytes(), body.header_length.map(|l| l as u64))
        .expect("a re-encoded request decodes");
    let RestRequest::Request { request: again, .. } = again else {
        panic!("a re-encoded request decodes as a raw binary body");
    };
    // Compared as written out: a NaN parameter is the same parameter, though not equal to itself.
    assert_eq!(
        format!("{again:?}"),
        format!("{request:?}"),
        "the round trip changed the request"
    );
}

/// The binary-extension parser (the first two bytes choose the header length): whatever it accepts, answered with
/// its inputs as outputs, encodes and decodes again to the same tensors.
pub fn binary_request(data: &[u8]) {
    let Some((prefix, body)) = data.split_first_chunk::<2>() else {
        return;
    };
    let header_length = u64::from(u16::from_le_bytes(*prefix)) % (body.len() as u64 + 2);
    let body = Bytes::copy_from_slice(body);
    let Ok(RestRequest::Request {
        request,
        binary_outputs,
    }) = rest::decode_request(body, Some(header_length))
    else {
        return;
    };
    for input in &request.inputs {
        assert!(input.validate().is_ok(), "accepted an invalid tensor");
    }
    let response = crate::protocol::InferResponse {
        outputs: request.inputs.clone(),
        ..Default::default()
    };
    // As the request asked (some outputs as JSON, which writes every NaN alike): it must encode and decode.
    let asked = rest::encode_response(&response, &binary_outputs).expect("accepted tensors encode as asked");
    rest::decode_response(asked.to_bytes(), asked.header_length.map(|l| l as u64))
        .expect("an answer encoded as asked decodes");
    // All binary, which carries every bit: the same tensors come back.
    let all_binary = rest::BinaryOutputs {
        all: true,
        outputs: Vec::new(),
    };
    let encoded = rest::encode_response(&response, &all_binary).expect("accepted tensors encode as an answer");
    let back = rest::decode_response(encoded.to_bytes(), encoded.header_length.map(|l| l as u64))
        .expect("a re-encoded answer decodes");
    assert_eq!(back.outputs.len(), request.inputs.len());
    for (output, input) in back.outputs.iter().zip(&request.inputs) {
        assert_eq!(
            (&output.name, output.datatype, &output.shape, &output.data),
            (&input.name, input.datatype, &input.shape, &input.data),
            "the round trip changed a tensor"
        );
    }
}

/// The protobuf conversion.
pub fn protobuf_request(data: &[u8]) {
    let Ok(message) = ModelInferRequest::decode(Bytes::copy_from_slice(data)) else {
        return;
    };
    if let Ok(request) = protobuf::request_from_proto(message) {
        for input in &request.inputs {
            assert!(input.validate().is_ok(), "accepted an invalid tensor");
        }
        let again = protobuf::request_from_proto(protobuf::request_to_proto(request.clone()));
        assert_eq!(
            again.ok().as_ref(),
            Some(&request),
            "protobuf round trip changed the request"
        );
    }
}

/// The Decthings decoder.
pub fn decthings(data: &[u8]) {
    let bytes = Bytes::copy_from_slice(data);
    if let Ok(tensor) = decthings::decode(&bytes, "t") {
        assert!(tensor.validate().is_ok(), "accepted an invalid tensor");
        // Non-minimal varints decode but re-encode minimally, so compare tensors, not bytes.
        let encoded = decthings::encode(&tensor).expect("a decoded tensor encodes");
        let again = decthings::decode(&encoded, "t").expect("a re-encoded tensor decodes");
        assert_eq!(again, tensor, "Decthings round trip changed the tensor");
    }
    if let Ok(tensors) = decthings::decode_entries(&bytes) {
        let encoded = decthings::encode_entries(&tensors).expect("decoded entries encode");
        let again = decthings::decode_entries(&encoded).expect("re-encoded entries decode");
        assert_eq!(again, tensors, "Decthings entries round trip changed the tensors");
    }
}

/// The passthrough splicer: on canonically encoded messages (what real clients send) it agrees with prost, and a
/// renamed message decodes to the original with only the names changed. On anything else it must only not panic:
/// prost accepts some malformed framing (a map field with the wrong wire type) that the splicer reads by the spec.
pub fn splice(data: &[u8]) {
    use crate::codec::splice;
    let bytes = Bytes::copy_from_slice(data);
    let canonical = ModelInferRequest::decode(bytes.clone())
        .ok()
        .filter(|m| m.encode_to_vec() == data);
    let Ok(fields) = splice::model_fields(&bytes) else {
        assert!(canonical.is_none(), "the splicer rejected a canonical message");
        return;
    };
    let renamed = splice::rename(&bytes, "renamed", "9").expect("framing was already checked");
    let Some(mut original) = canonical else { return };
    assert_eq!(
        (fields.name, fields.version),
        (original.model_name.as_str(), original.model_version.as_str())
    );
    let renamed: Vec<u8> = renamed.concat();
    let again = ModelInferRequest::decode(&renamed[..]).expect("a renamed valid message decodes");
    assert_eq!(
        (again.model_name.as_str(), again.model_version.as_str()),
        ("renamed", "9"),
        "the names asked for"
    );
    original.model_name = "renamed".into();
    original.model_version = "9".into();
    assert_eq!(again, original, "renaming changed more than the names");
}

/// The endpoint picker's read of a `ModelInferRequest`'s leading fields from its first bytes: no prefix reads them
/// otherwise than the whole message does (the same length, more to come, or the same refusal where the whole is
/// refused), and on a canonical message (what clients send, fields in number order) the name, version and parameters
/// read from the leading fields alone are prost's.
pub fn leading_fields(data: &[u8]) {
    use crate::codec::splice;
    let whole = splice::leading_length(data, true);
    for cut in 0..=data.len() {
        match (splice::leading_length(&data[..cut], false), &whole) {
            (Ok(None), _) | (Err(_), Err(_)) => {}
            (Ok(Some(length)), Ok(Some(whole_length))) => assert_eq!(length, *whole_length, "prefix of {cut}"),
            (prefix, whole) => panic!("a prefix of {cut} bytes read {prefix:?}, the whole message {whole:?}"),
        }
    }
    let Ok(Some(length)) = whole else { return };
    let canonical = ModelInferRequest::decode(data)
        .ok()
        .filter(|m| m.encode_to_vec() == data);
    let Some(message) = canonical else { return };
    let leading = &data[..length];
    let fields = splice::model_fields(leading).expect("a canonical message's leading fields read");
    assert_eq!(
        (fields.name, fields.version, fields.id),
        (
            message.model_name.as_str(),
            message.model_version.as_str(),
            message.id.as_str()
        )
    );
    let parameters = splice::parameters(leading).expect("a canonical message's parameters read");
    // An entry with no value means nothing to routing and is dropped by the reader (prost keeps it, empty).
    let mut valued: Vec<&str> = message
        .parameters
        .iter()
        .filter(|(_, value)| value.parameter_choice.is_some())
        .map(|(key, _)| key.as_str())
        .collect();
    let mut read: Vec<&str> = parameters.keys().map(String::as_str).collect();
    valued.sort_unstable();
    read.sort_unstable();
    assert_eq!(read, valued, "parameters read from the leading fields");
}

/// A message's top-level fields as C++ protobuf reads them (`ReadTag`, `ReadSize` and `VarintParse` of its
/// parse_context.h): a key of at most five bytes whose bits above 32 are dropped, a length of at most five bytes
/// below 2 GiB, a varint of at most ten bytes; `None` where it refuses the message.
fn cpp_fields(message: &[u8]) -> Option<Vec<(u32, u8, std::ops::Range<usize>)>> {
    fn varint(bytes: &[u8], pos: &mut usize, most: u32) -> Option<u64> {
        let mut value = 0u64;
        for index in 0..most {
            let byte = *bytes.get(*pos)?;
            *pos += 1;
            value |= u64::from(byte & 0x7f).checked_shl(7 * index).unwrap_or(0);
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    let mut fields = Vec::new();
    let mut pos = 0;
    while pos < message.len() {
        // The bits above 32 dropped, as C++ drops them.
        let tag = u32::try_from(varint(message, &mut pos, 5)? & u64::from(u32::MAX)).ok()?;
        let (number, wire) = (tag >> 3, (tag & 7) as u8);
        if number == 0 {
            return None;
        }
        let mut start = pos;
        match wire {
            0 => {
                varint(message, &mut pos, 10)?;
            }
            1 => pos += 8,
            5 => pos += 4,
            2 => {
                let length = varint(message, &mut pos, 5)?;
                if length > u64::from(i32::MAX.unsigned_abs()) {
                    return None;
                }
                start = pos;
                pos = pos.checked_add(usize::try_from(length).ok()?)?;
            }
            // Groups are read by C++; the gateway refuses them, so they are never compared.
            _ => return None,
        }
        if pos > message.len() {
            return None;
        }
        fields.push((number, wire, start..pos));
    }
    Some(fields)
}

/// Whether C++ protobuf reads the fields of `message` where the gateway does, from the top level down through
/// the messages whose names and parameters the gateway reads (tensors, their parameters, map entries).
fn read_as_cpp_reads(message: &[u8], depth: u8) -> bool {
    use crate::codec::splice::field_places;
    let Ok(ours) = field_places(message) else {
        // The gateway refuses it: nothing of it reaches a backend.
        return true;
    };
    let Some(theirs) = cpp_fields(message) else {
        // C++ refuses it: the backend answers an error.
        return true;
    };
    if ours != theirs {
        return false;
    }
    // Down into the messages the gateway looks inside: top-level inputs (5) and outputs (6), their parameters
    // (4 and 2), each map entry's value (2).
    let inside: &[u32] = match depth {
        0 => &[4, 5, 6],
        1 => &[2, 4],
        _ => &[],
    };
    ours.iter()
        .filter(|(number, wire, _)| *wire == 2 && inside.contains(number))
        .all(|(_, _, value)| read_as_cpp_reads(&message[value.clone()], depth + 1))
}

/// The protobuf key reader against C++ protobuf's reading of keys and against prost: every field the gateway reads
/// where C++ reads one is the same field to both, and whatever message the gateway reads (names, request parameters,
/// shared memory refused), prost, where it decodes the message too, reads the same names and parameters and finds no
/// shared-memory parameter the gateway let through. (The real upb decoder of the `protobuf` Python package is held to
/// the same in the interop suite, scripts/interop.)
pub fn protobuf_keys(data: &[u8]) {
    use crate::codec::splice;
    use crate::protocol::reserved::SHARED_MEMORY;
    assert!(
        read_as_cpp_reads(data, 0),
        "the gateway reads fields where C++ protobuf reads others"
    );
    let (Ok(fields), Ok(parameters)) = (
        splice::model_fields(data),
        splice::parameters_refusing_shared_memory(data),
    ) else {
        return;
    };
    let Ok(decoded) = ModelInferRequest::decode(data) else {
        return;
    };
    assert_eq!(
        (fields.name, fields.version, fields.id),
        (
            decoded.model_name.as_str(),
            decoded.model_version.as_str(),
            decoded.id.as_str()
        ),
        "the gateway and prost read different names"
    );
    let theirs: crate::protocol::Parameters = decoded
        .parameters
        .into_iter()
        .filter_map(|(key, value)| Some((key, protobuf::value_from_proto(value.parameter_choice?))))
        .collect();
    let mut ours = parameters;
    ours.sort_keys();
    let mut theirs = theirs;
    theirs.sort_keys();
    // Compared as written out: a NaN parameter is the same parameter, though not equal to itself.
    assert_eq!(
        format!("{ours:?}"),
        format!("{theirs:?}"),
        "the gateway and prost read different request parameters"
    );
    let tensor_parameters = decoded
        .inputs
        .iter()
        .flat_map(|input| input.parameters.keys())
        .chain(decoded.outputs.iter().flat_map(|output| output.parameters.keys()));
    for key in tensor_parameters {
        assert!(
            !SHARED_MEMORY.contains(&key.as_str()),
            "prost reads {key} in a tensor the gateway let through"
        );
    }
}

/// Renaming a backend's JSON header on the passthrough path: never panics, always fills exactly the announced
/// length, and what it accepts stays valid JSON with the new names.
pub fn rename(data: &[u8]) {
    use crate::codec::rest::rename::{rename_header, renamed_length};
    let Some(length) = renamed_length(data.len(), "public", "7") else {
        return;
    };
    if let Ok(renamed) = rename_header(data, "public", "7", length) {
        assert_eq!(
            renamed.len(),
            length,
            "the renamed header does not fill the announced length"
        );
        if serde_json::from_slice::<serde_json::Value>(data).is_ok() {
            let value: serde_json::Value = serde_json::from_slice(&renamed).expect("renamed JSON stays JSON");
            assert_eq!(value["model_name"], "public");
            assert_eq!(value["model_version"], "7");
        }
    }
}

/// The first byte of a fuzz input as a piece size (1 to 64) for readers fed in pieces, and the rest.
fn piece_size(data: &[u8]) -> Option<(usize, &[u8])> {
    let (&first, rest) = data.split_first()?;
    Some((usize::from(first % 64) + 1, rest))
}

/// A chunked body read from the start of `bytes` by the RFC 9112 §7.1 grammar, whole, written apart from the door's
/// reader: its data and the bytes after it; `Err` for framing the grammar (every line ended by CR LF) does not
/// allow, `Ok(None)` when `bytes` ends before the body does.
fn reference_chunked(bytes: &[u8]) -> Result<Option<(Vec<u8>, usize)>, ()> {
    fn line(bytes: &[u8], at: usize) -> Result<Option<(&[u8], usize)>, ()> {
        let Some(end) = bytes[at..].iter().position(|&byte| byte == b'\n') else {
            // No line end yet: a bare CR before the end of what is at hand is malformed only once followed.
            return match bytes[at..].iter().position(|&byte| byte == b'\r') {
                Some(cr) if at + cr + 1 < bytes.len() => Err(()),
                _ => Ok(None),
            };
        };
        let line = &bytes[at..at + end];
        let Some(line) = line.strip_suffix(b"\r") else {
            return Err(());
        };
        if line.contains(&b'\r') {
            return Err(());
        }
        Ok(Some((line, at + end + 1)))
    }
    let mut data = Vec::new();
    let mut at = 0;
    loop {
        let Some((size_line, next)) = line(bytes, at)? else {
            return Ok(None);
        };
        let digits = size_line.iter().take_while(|byte| byte.is_ascii_hexdigit()).count();
        if digits == 0 {
            return Err(());
        }
        let rest = &size_line[digits..];
        let blanks = rest.iter().take_while(|byte| matches!(byte, b' ' | b'\t')).count();
        if !(rest[blanks..].is_empty() || rest[blanks] == b';') {
            return Err(());
        }
        let mut size: u64 = 0;
        for &digit in &size_line[..digits] {
            let value = u64::from(char::from(digit).to_digit(16).unwrap_or(0));
            size = size
                .checked_mul(16)
                .and_then(|size| size.checked_add(value))
                .ok_or(())?;
        }
        at = next;
        if size == 0 {
            // Trailer lines, then an empty one.
            loop {
                let Some((trailer, next)) = line(bytes, at)? else {
                    return Ok(None);
                };
                at = next;
                if trailer.is_empty() {
                    return Ok(Some((data, at)));
                }
            }
        }
        let size = usize::try_from(size).map_err(|_| ())?;
        if bytes.len() - at < size {
            // Short: what there is of it must not be framing that breaks later.
            return Ok(None);
        }
        data.extend_from_slice(&bytes[at..at + size]);
        at += size;
        match bytes.get(at..at + 2) {
            Some(b"\r\n") => at += 2,
            Some(_) => return Err(()),
            None if bytes.get(at).is_none_or(|&byte| byte == b'\r') => return Ok(None),
            None => return Err(()),
        }
    }
}

/// The door's chunked reader, fed the body a piece at a time: its data and the bytes after it, as
/// [`reference_chunked`] gives them.
fn door_chunked(bytes: &[u8], piece: usize) -> Result<Option<(Vec<u8>, usize)>, ()> {
    use crate::codec::http1::{BadFraming, Framing};
    let mut framing = Framing::chunked();
    let mut read = bytes::BytesMut::new();
    let mut data = Vec::new();
    let mut fed = 0;
    loop {
        match framing.take(&mut read) {
            Err(BadFraming::Malformed) => return Err(()),
            // Framing without end is refused; the grammar has no such bound.
            Err(BadFraming::TooMuchFraming) => return Ok(None),
            Ok(Some(chunk)) => data.extend_from_slice(&chunk),
            Ok(None) if framing.is_done() => return Ok(Some((data, fed - read.len()))),
            Ok(None) => {
                if fed == bytes.len() {
                    return Ok(None);
                }
                let next = (fed + piece).min(bytes.len());
                read.extend_from_slice(&bytes[fed..next]);
                fed = next;
            }
        }
    }
}

/// The chunked decoder: the same data and end whatever pieces the body comes in, and what the RFC's grammar reads.
pub fn chunked(data: &[u8]) {
    let Some((piece, body)) = piece_size(data) else { return };
    let whole = door_chunked(body, body.len().max(1));
    assert_eq!(door_chunked(body, piece), whole, "pieces of {piece} read otherwise");
    let reference = reference_chunked(body);
    match (&whole, &reference) {
        (Ok(Some(door)), Ok(Some(rfc))) => assert_eq!(door, rfc, "the door and the grammar read another body"),
        // The door reads no body the grammar refuses, nor refuses one it reads whole.
        (Ok(Some(_)), Err(())) => panic!("the door reads framing the grammar refuses"),
        (Err(()), Ok(Some(_))) => panic!("the door refuses a body the grammar reads"),
        _ => {}
    }
}

/// A pipeline of requests read by the door: the end of each request it takes whole, then how it stopped (`Err` with
/// the status it refused one with).
fn door_requests(bytes: &[u8]) -> (Vec<usize>, Result<(), u16>) {
    let mut read = bytes::BytesMut::from(bytes);
    let mut ends = Vec::new();
    loop {
        let framing = match crate::frontend::rest::read_request_head(&mut read) {
            Ok(Some(framing)) => framing,
            Ok(None) => return (ends, Ok(())),
            Err(status) => return (ends, Err(status.as_u16())),
        };
        let mut framing = framing;
        loop {
            match framing.take(&mut read) {
                Err(_) => return (ends, Err(400)),
                Ok(Some(_)) => {}
                Ok(None) if framing.is_done() => break,
                Ok(None) => return (ends, Ok(())),
            }
        }
        ends.push(bytes.len() - read.len());
    }
}

/// A pipeline of requests read by httparse and RFC 9112's rules for a body's length (§6.3), written apart from the
/// door: the end of each request, then how it stopped.
fn reference_requests(bytes: &[u8]) -> (Vec<usize>, Result<(), ()>) {
    let mut ends = Vec::new();
    let mut at = 0;
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 100];
        let mut request = httparse::Request::new(&mut headers);
        let head = match request.parse(&bytes[at..]) {
            Ok(httparse::Status::Complete(length)) => length,
            Ok(httparse::Status::Partial) => return (ends, Ok(())),
            Err(_) => return (ends, Err(())),
        };
        let http11 = request.version == Some(1);
        let headers: &[httparse::Header<'_>] = request.headers;
        let named = |name: &'static str| {
            headers
                .iter()
                .filter(move |header| header.name.eq_ignore_ascii_case(name))
        };
        // §3.2: Host once in HTTP/1.1, at most once in 1.0.
        let hosts = named("host").count();
        if hosts > 1 || (http11 && hosts == 0) {
            return (ends, Err(()));
        }
        let lengths: Vec<&[u8]> = named("content-length")
            .flat_map(|header| header.value.split(|&byte| byte == b','))
            .map(<[u8]>::trim_ascii)
            .collect();
        let codings: Vec<Vec<u8>> = named("transfer-encoding")
            .flat_map(|header| header.value.split(|&byte| byte == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|coding| !coding.is_empty())
            .map(<[u8]>::to_ascii_lowercase)
            .collect();
        let transfer_encoded = named("transfer-encoding").count() > 0;
        at += head;
        let body = if transfer_encoded {
            // §6.1 and §6.3: refused beside a length, in HTTP/1.0, unless chunked alone and once.
            if !lengths.is_empty() || !http11 || codings != [b"chunked".to_vec()] {
                return (ends, Err(()));
            }
            match reference_chunked(&bytes[at..]) {
                Ok(Some((_, length))) => length,
                Ok(None) => return (ends, Ok(())),
                Err(()) => return (ends, Err(())),
            }
        } else if lengths.is_empty() {
            0
        } else {
            // §8.6: digits, the same however often given.
            let valid = lengths
                .iter()
                .all(|length| !length.is_empty() && length.iter().all(u8::is_ascii_digit));
            let values: Vec<Option<u64>> = lengths
                .iter()
                .map(|length| std::str::from_utf8(length).ok()?.parse().ok())
                .collect();
            if !valid || values.iter().any(Option::is_none) || values.windows(2).any(|pair| pair[0] != pair[1]) {
                return (ends, Err(()));
            }
            let Some(length) = values[0].and_then(|length| usize::try_from(length).ok()) else {
                return (ends, Err(()));
            };
            if bytes.len() - at < length {
                return (ends, Ok(()));
            }
            length
        };
        at += body;
        ends.push(at);
    }
}

/// The door's framing of pipelined requests against httparse and the RFC's rules: every request the door takes
/// ends where the reference says it does (a request boundary placed otherwise is request smuggling), and the door
/// takes none the reference refuses. The door may refuse more (its limits on heads, targets and names).
pub fn http1_framing(data: &[u8]) {
    let (door, door_stop) = door_requests(data);
    let (reference, reference_stop) = reference_requests(data);
    assert!(
        reference.starts_with(&door),
        "the door ends requests at {door:?} ({door_stop:?}), the reference at {reference:?} ({reference_stop:?})"
    );
    if door.len() == reference.len() && reference_stop.is_err() {
        assert!(
            door_stop.is_err(),
            "the door waits on a request the reference refuses: {door:?} {door_stop:?}"
        );
    }
}

/// The request head reader on its own: never panics, and takes off the buffer exactly the head httparse reads.
pub fn http1_request_head(data: &[u8]) {
    let mut read = bytes::BytesMut::from(data);
    if let Ok(Some(_)) = crate::frontend::rest::read_request_head(&mut read) {
        let mut headers = [httparse::EMPTY_HEADER; 100];
        let parsed = httparse::Request::new(&mut headers).parse(data);
        assert_eq!(
            match parsed {
                Ok(httparse::Status::Complete(length)) => Some(length),
                _ => None,
            },
            Some(data.len() - read.len()),
            "the head taken is not the head httparse reads"
        );
    }
}

/// The backend answer reader: never panics; an answer's body is framed by its chunks, its length or the connection's
/// end, and only an answer framed by its length or chunks keeps its connection; its headers read as lines (a
/// passthrough's) or into a map, it is read alike.
pub fn http1_answer(data: &[u8]) {
    use crate::codec::http1::Framing;
    let Some((&flags, bytes)) = data.split_first() else {
        return;
    };
    let (asked_head, as_lines) = (flags & 1 == 1, flags & 2 == 2);
    let mut read = bytes::BytesMut::from(bytes);
    let answered = crate::upstream::read_answer_head(&mut read, asked_head, as_lines);
    if as_lines {
        // Its headers left as lines or read into a map, an answer says the same of its status, framing and
        // connection, and is refused for the same fault.
        let mapped = crate::upstream::read_answer_head(&mut bytes::BytesMut::from(bytes), asked_head, false);
        let said = |answer: &std::io::Result<_>| format!("{:?}", answer.as_ref().map_err(ToString::to_string));
        assert_eq!(said(&answered), said(&mapped));
        // And what it passes back: the lines write what the filtered map would.
        crate::upstream::answer_lines_match_map(bytes, asked_head);
    }
    let Ok(Some((status, mut framing, reusable))) = answered else {
        return;
    };
    assert!(!status.is_informational());
    if reusable {
        assert!(
            !matches!(framing, Framing::UntilClose),
            "an answer read to its connection's end is kept"
        );
    }
    while let Ok(Some(_)) = framing.take(&mut read) {}
}

/// The gzip and deflate readers: never more than the limit comes out, a malformed body is refused naming its coding,
/// and a body compressed by flate2 comes back as it was.
pub fn compression(data: &[u8]) {
    use crate::codec::compression::{Coding, decompress};
    use std::io::Write;
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    let coding = if flags & 1 == 0 { Coding::Gzip } else { Coding::Deflate };
    let limit = 1u64 << (u32::from(flags >> 1) % 24);
    match decompress(coding, body, limit, "request body") {
        Ok(out) => assert!(
            out.len() as u64 <= limit,
            "{} bytes out past a limit of {limit}",
            out.len()
        ),
        Err(error) => assert!(
            error.http_status() == 413 || error.message().contains(coding.name()),
            "{}",
            error.message()
        ),
    }
    let compressed = match coding {
        Coding::Gzip => {
            let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(body).and_then(|()| encoder.finish())
        }
        Coding::Deflate => {
            let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(body).and_then(|()| encoder.finish())
        }
    }
    .expect("compressing in memory");
    let back = decompress(coding, &compressed, body.len() as u64, "request body").expect("a body flate2 compressed");
    assert_eq!(&back[..], body, "the body came back otherwise");
}

/// The JSON key scan: the same verdict however the body is cut, and against serde_json on valid JSON a
/// shared-memory key found exactly where serde_json finds one as an object's key.
pub fn key_scan(data: &[u8]) {
    use crate::codec::rest::key_scan::KeyScan;
    use crate::protocol::reserved::SHARED_MEMORY;
    let Some((piece, body)) = piece_size(data) else { return };
    let verdict = |size: usize| {
        let mut scan = KeyScan::new(None, u64::MAX);
        body.chunks(size.max(1))
            .try_for_each(|chunk| scan.feed(chunk))
            .map_err(|error| error.message().to_owned())
    };
    let whole = verdict(body.len());
    assert_eq!(verdict(piece), whole, "pieces of {piece} read otherwise");
    fn names_shared_memory(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::Object(members) => members
                .iter()
                .any(|(key, value)| SHARED_MEMORY.contains(&key.as_str()) || names_shared_memory(value)),
            serde_json::Value::Array(values) => values.iter().any(names_shared_memory),
            _ => false,
        }
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    let found = whole
        .as_ref()
        .err()
        .is_some_and(|message| message.contains("cannot cross a gateway"));
    if names_shared_memory(&value) {
        // Refused for it, or for another key read before it.
        assert!(whole.is_err(), "a shared-memory key serde_json reads passed the scan");
    } else {
        assert!(
            !found,
            "the scan found a shared-memory key serde_json does not: {whole:?}"
        );
    }
}

/// A REST backend's generate answers as the gateway reads them: the server-sent events of a stream, cut where each
/// ends however the bytes arrive; and the tokens each event (or the whole body, as a `generate` answer) carries for a
/// token budget, never more for one output than for all of them.
pub fn generate_answer(data: &[u8]) {
    use crate::codec::rest::generate::{EventReader, answer_tokens};
    let mut whole = EventReader::new(usize::MAX);
    let at_once = whole.push(data);
    // In two chunks, cut where the data says, and in chunks of a few bytes: the same events, the same rest.
    let cut = usize::from(data.first().copied().unwrap_or(0)).min(data.len());
    for chunks in [data.chunks(cut.max(1)), data.chunks(3)] {
        let mut piecewise = EventReader::new(usize::MAX);
        let events: Vec<Vec<u8>> = chunks.flat_map(|chunk| piecewise.push(chunk)).collect();
        assert_eq!(at_once, events, "the events depend on how the bytes arrived");
        assert_eq!(
            whole.pending(),
            piecewise.pending(),
            "the rest depends on how the bytes arrived"
        );
    }
    // Held to a bound, the reader gives the same events until one outgrows it, and then holds nothing.
    let mut bounded = EventReader::new(32);
    let events: Vec<Vec<u8>> = data.chunks(5).flat_map(|chunk| bounded.push(chunk)).collect();
    assert!(at_once.starts_with(&events), "a bounded reader's events differ");
    assert!(
        bounded.pending().len() <= 32,
        "the bounded reader holds {} bytes",
        bounded.pending().len()
    );
    if !bounded.too_long() {
        assert_eq!(events, at_once, "a reader within its bound missed events");
    }
    for json in at_once.iter().map(Vec::as_slice).chain([data]) {
        let all = answer_tokens(json, None, false);
        let Ok(members) =
            serde_json::from_slice::<std::collections::BTreeMap<String, &serde_json::value::RawValue>>(json)
        else {
            assert_eq!(all, 0, "tokens counted in what is no JSON object");
            continue;
        };
        for name in members.keys() {
            let one = answer_tokens(json, Some(name), false);
            let named = !matches!(name.as_str(), "model_name" | "model_version" | "id" | "parameters");
            assert!(
                !named || one <= all,
                "output {name} carries {one} tokens, all of them {all}"
            );
            answer_tokens(json, Some(name), true);
        }
    }
}

//! A parsed HTTP/1.1 head's headers, read in place: where each lies in the head, what they say of the body and the
//! connection (the one reading for requests and answers), into a map or left as lines to be passed on.

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_LENGTH, EXPECT, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue};

use super::{PLACED, TransferCodings, content_length};

/// Where a parsed head's headers lie in its buffer (the first [`PLACED`] of them), noted while the parse borrows the
/// buffer, so that once the head is split off the header values can be slices of it.
#[derive(Debug)]
pub struct Places {
    count: usize,
    /// Each header's name and value as offsets into the head: start and end of the name, start and end of the value.
    /// Offsets of 32 bits (a head is bounded far below 4 GiB, and one past it is read again) and an array that is
    /// `Copy`, read where it stands: this is filled and read for every head either way, and an array of ranges took
    /// two copies of half a kilobyte a head.
    places: [[u32; 4]; PLACED],
}

/// Notes where `headers`, parsed from the buffer that starts at `base`, lie in it.
pub fn places(headers: &[httparse::Header<'_>], base: *const u8) -> Places {
    let mut places = [[0; 4]; PLACED];
    let base = base as usize;
    let mut fits = true;
    for (place, header) in places.iter_mut().zip(headers) {
        let mut at = |bytes: &[u8]| {
            let start = bytes.as_ptr() as usize - base;
            let (start, end) = (u32::try_from(start), u32::try_from(start + bytes.len()));
            fits &= start.is_ok() && end.is_ok();
            (start.unwrap_or(0), end.unwrap_or(0))
        };
        let (name, value) = (at(header.name.as_bytes()), at(header.value));
        *place = [name.0, name.1, value.0, value.1];
    }
    Places {
        // A head whose offsets do not fit is read again, as one with more headers than are placed.
        count: if fits {
            headers.len()
        } else {
            headers.len().max(PLACED + 1)
        },
        places,
    }
}

impl Places {
    pub fn count(&self) -> usize {
        self.count
    }

    /// Each header of `head` (the bytes the places were noted in): its place, its name and its value, when the places
    /// hold them all.
    pub fn all<'h>(&'h self, head: &'h [u8]) -> Option<impl Iterator<Item = ([u32; 4], &'h [u8], &'h [u8])>> {
        (self.count <= PLACED).then(|| {
            self.places[..self.count].iter().map(|&place| {
                let [name_start, name_end, value_start, value_end] = place;
                (
                    place,
                    &head[name_start as usize..name_end as usize],
                    &head[value_start as usize..value_end as usize],
                )
            })
        })
    }

    /// Hands each header of `head` (the buffer's head, split off: the bytes the places were noted in) to `note`, its
    /// value a slice of `head`: from the places noted when they hold them all, else by reading the header lines again
    /// (`malformed` if they cannot be, which a head already parsed whole never is).
    pub fn each<E>(
        &self,
        head: &Bytes,
        malformed: impl FnOnce() -> E,
        mut note: impl FnMut(&[u8], FieldValue<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        if let Some(all) = self.all(head) {
            for (_, name, bytes) in all {
                note(name, FieldValue { head, bytes })?;
            }
            return Ok(());
        }
        // After the start line (and the empty lines a request may come after).
        let start = head.iter().position(|byte| !matches!(byte, b'\r' | b'\n')).unwrap_or(0);
        let lines = memchr::memchr(b'\n', &head[start..]).map_or(&[][..], |end| &head[start + end + 1..]);
        let mut headers = vec![httparse::EMPTY_HEADER; self.count];
        let Ok(httparse::Status::Complete((_, parsed))) = httparse::parse_headers(lines, &mut headers) else {
            return Err(malformed());
        };
        for header in parsed {
            note(
                header.name.as_bytes(),
                FieldValue {
                    head,
                    bytes: header.value,
                },
            )?;
        }
        Ok(())
    }
}

/// A header's value where it lies in its head: read as bytes, and made a [`HeaderValue`] (a share of the head, whose
/// count is an atomic read-modify-write each way) only for a header that is kept.
#[derive(Debug, Clone, Copy)]
pub struct FieldValue<'a> {
    head: &'a Bytes,
    bytes: &'a [u8],
}

impl FieldValue<'_> {
    pub fn as_bytes(&self) -> &[u8] {
        self.bytes
    }

    /// The value, sharing the head's bytes.
    pub fn to_value(self) -> HeaderValue {
        parsed_value(self.head.slice_ref(self.bytes))
    }
}

/// A header value httparse has read, taken without checking its bytes again: each header of every message passes
/// here, and checking a value byte by byte is most of what noting a header costs.
#[allow(unsafe_code)]
fn parsed_value(value: Bytes) -> HeaderValue {
    // SAFETY: not a memory safety matter, but `HeaderValue`'s promise that its bytes are a valid field value. httparse
    // reads a value only as bytes that are a horizontal tab, visible ASCII, a space or obs-text (0x80-0xFF), which are
    // exactly the bytes `HeaderValue` allows, and the obsolete folded lines that would bring a CR LF are not enabled
    // (`ParserConfig::default()` in both heads' parsers). Every value handed here is a slice of a parsed header value.
    debug_assert!(HeaderValue::from_bytes(&value).is_ok(), "{value:?}");
    unsafe { HeaderValue::from_maybe_shared_unchecked(value) }
}

/// What a head's headers say of its body and its connection, gathered as each is read (and, but for an answer left
/// as lines, put in the map): the one reading of them for requests (the REST door) and answers (the backend
/// client).
#[derive(Debug)]
pub struct ParsedHeaders {
    pub headers: HeaderMap,
    /// Content-Length, when given (the same value however often; the map holds it once, as digits).
    pub length: Option<u64>,
    /// The transfer codings listed.
    pub codings: TransferCodings,
    /// `Connection` named `close`.
    pub close: bool,
    /// `Connection` named `keep-alive`.
    pub keep_alive: bool,
    /// `Expect: 100-continue`.
    pub expects_continue: bool,
    /// `Connection` named a header (one of this hop's, never passed on).
    pub nominates: bool,
    /// A header no reader of these messages looks at, left out of the map (lower case).
    unread: &'static [u8],
}

/// A header [`ParsedHeaders::note`] cannot take.
#[derive(Debug)]
pub enum BadHeader {
    Name,
    Length,
    TwoLengths,
}

impl ParsedHeaders {
    /// Room for `count` headers; `unread` (lower case) is not kept.
    pub fn new(count: usize, unread: &'static [u8]) -> ParsedHeaders {
        ParsedHeaders {
            unread,
            headers: HeaderMap::with_capacity(count),
            length: None,
            codings: TransferCodings::default(),
            close: false,
            keep_alive: false,
            expects_continue: false,
            nominates: false,
        }
    }

    pub fn note(&mut self, name: &[u8], value: FieldValue<'_>) -> Result<(), BadHeader> {
        match self.read(name, value.as_bytes())? {
            Some((name, Said::AsSent)) => self.headers.append(name, value.to_value()),
            Some((name, Said::Length(length))) => self.headers.append(name, HeaderValue::from(length)),
            Some((_, Said::Again)) | None => return Ok(()),
        };
        Ok(())
    }

    /// Reads what one header says of the body and the connection, keeping nothing: its name, and how it is held;
    /// `None` for the header no reader looks at.
    pub fn read(&mut self, name: &[u8], value: &[u8]) -> Result<Option<(HeaderName, Said)>, BadHeader> {
        if name.len() == self.unread.len() && name.eq_ignore_ascii_case(self.unread) {
            return Ok(None);
        }
        let name = match known_name(name) {
            Some(known) => known,
            None => HeaderName::from_bytes(name).map_err(|_| BadHeader::Name)?,
        };
        if name == CONTENT_LENGTH {
            let said = content_length(value).ok_or(BadHeader::Length)?;
            match self.length.replace(said) {
                Some(before) if before != said => return Err(BadHeader::TwoLengths),
                // The same length again: held once.
                Some(_) => return Ok(Some((name, Said::Again))),
                None => {}
            }
            // A list of the same length (`5, 5`), or digits led by zeros, goes on as its one value.
            if !is_canonical_length(value) {
                return Ok(Some((name, Said::Length(said))));
            }
        } else if name == TRANSFER_ENCODING {
            self.codings.note(value);
        } else if name == CONNECTION {
            for token in value.split(|&byte| byte == b',').map(<[u8]>::trim_ascii) {
                if token.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    self.keep_alive = true;
                } else if !token.is_empty() {
                    self.nominates = true;
                }
            }
        } else if name == EXPECT {
            self.expects_continue = value.eq_ignore_ascii_case(b"100-continue");
        }
        Ok(Some((name, Said::AsSent)))
    }
}

/// How a header read is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Said {
    /// As it was sent.
    AsSent,
    /// As this length, its one value written as digits.
    Length(u64),
    /// Not again: it repeats a length already held.
    Again,
}

/// The most header lines an answer passed back as it came keeps; one that passes more on is read into a map.
pub const KEPT_LINES: usize = 8;

/// The names the gateway sets on an answer passed back as lines, each in place of the answer's own lines of that
/// name: the request id, and the version that served it.
static SET_ON_LINES: [HeaderName; 2] = [crate::headers::REQUEST_ID, crate::headers::OIP_MODEL_VERSION];
const SET_REQUEST_ID: usize = 0;
const SET_SERVED_VERSION: usize = 1;

// A kept line's bit in `KeptLines::named` is one of a byte's.
const _: () = assert!(KEPT_LINES <= u8::BITS as usize);

/// Which of a head's header lines are passed on: their places in the head, and which of them have a name the
/// gateway sets.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeptLines {
    /// Name start, name end, value start and value end of each line kept.
    places: [[u32; 4]; KEPT_LINES],
    count: u8,
    /// For each of [`SET_ON_LINES`], its lines among those kept (bit `i` for line `i`).
    named: [u8; SET_ON_LINES.len()],
}

impl KeptLines {
    /// Keeps the line of `name` at `place`; `false` when there is no more room.
    pub fn keep(&mut self, place: [u32; 4], name: &HeaderName) -> bool {
        let count = usize::from(self.count);
        if count == KEPT_LINES {
            return false;
        }
        self.places[count] = place;
        if let Some(set) = SET_ON_LINES.iter().position(|set| set == name) {
            self.named[set] |= 1 << count;
        }
        self.count += 1;
        true
    }
}

/// A head's header lines left where they lie in it, those to be passed on kept, and the few the gateway sets in
/// their place: an answer passed back as it came is written from these, with no map built for its headers.
#[derive(Debug)]
pub struct HeaderLines {
    head: Bytes,
    kept: KeptLines,
    /// A value for each of [`SET_ON_LINES`], written in place of the kept lines of its name.
    set: [Option<HeaderValue>; SET_ON_LINES.len()],
}

impl HeaderLines {
    /// The lines of `head` that `kept` holds.
    pub fn new(head: Bytes, kept: KeptLines) -> HeaderLines {
        HeaderLines {
            head,
            kept,
            set: [const { None }; SET_ON_LINES.len()],
        }
    }

    /// Sets the request id to `value`, in place of the lines that name one.
    pub fn set_request_id(&mut self, value: HeaderValue) {
        self.set[SET_REQUEST_ID] = Some(value);
    }

    /// Sets the version that served the answer to `value`, in place of the lines that name one.
    pub fn set_served_version(&mut self, value: HeaderValue) {
        self.set[SET_SERVED_VERSION] = Some(value);
    }

    /// Hands each line to write to `line`: its name as sent and its value, then the names set (lower case).
    pub fn each(&self, mut line: impl FnMut(&[u8], &[u8])) {
        let mut replaced = 0;
        for (set, named) in self.set.iter().zip(self.kept.named) {
            if set.is_some() {
                replaced |= named;
            }
        }
        let kept = &self.kept.places[..usize::from(self.kept.count)];
        for (index, &[name_start, name_end, value_start, value_end]) in kept.iter().enumerate() {
            if replaced & (1 << index) == 0 {
                line(
                    &self.head[name_start as usize..name_end as usize],
                    &self.head[value_start as usize..value_end as usize],
                );
            }
        }
        for (name, value) in SET_ON_LINES.iter().zip(&self.set) {
            if let Some(value) = value {
                line(name.as_str().as_bytes(), value.as_bytes());
            }
        }
    }
}

/// Whether a Content-Length value is a length as a sender should write it: digits, with no leading zero.
fn is_canonical_length(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= 19
        && value.iter().all(u8::is_ascii_digit)
        && (value.len() == 1 || value[0] != b'0')
}

/// The names that most of the gateway's messages carry, each taken from here rather than parsed again (and, for
/// those `http` does not know, allocated) for every message that carries it: `HeaderName::from_bytes` lowers a name
/// into a scratch buffer and matches it against every standard name, about 130 instructions a name.
static KNOWN: [HeaderName; 16] = [
    http::header::HOST,
    http::header::DATE,
    http::header::ACCEPT,
    http::header::SERVER,
    EXPECT,
    http::header::USER_AGENT,
    CONNECTION,
    http::header::CONTENT_TYPE,
    crate::headers::REQUEST_ID,
    CONTENT_LENGTH,
    http::header::ACCEPT_ENCODING,
    http::header::CONTENT_ENCODING,
    TRANSFER_ENCODING,
    crate::headers::OIP_MODEL_VERSION,
    crate::headers::INFERENCE_HEADER_CONTENT_LENGTH,
    http::header::AUTHORIZATION,
];

/// `name` as one of the [`KNOWN`] names, when it is one (in any case): its length and first letter pick the one it
/// can be.
fn known_name(name: &[u8]) -> Option<HeaderName> {
    let first = name.first()?.to_ascii_lowercase();
    let index = match (name.len(), first) {
        (4, b'h') => 0,
        (4, b'd') => 1,
        (6, b'a') => 2,
        (6, b's') => 3,
        (6, b'e') => 4,
        (10, b'u') => 5,
        (10, b'c') => 6,
        (12, b'c') => 7,
        (12, b'x') => 8,
        (14, b'c') => 9,
        (15, b'a') => 10,
        (16, b'c') => 11,
        (17, b't') => 12,
        (17, b'o') => 13,
        (31, b'i') => 14,
        (13, b'a') => 15,
        _ => return None,
    };
    let known = &KNOWN[index];
    folded_eq(name, known.as_str().as_bytes()).then(|| known.clone())
}

/// Whether `name` (token characters, as the parser took them) is `lower` (lower-case letters and dashes) in any
/// case, eight bytes at a time: setting a byte's 0x20 bit lowers a capital and makes no other token character a
/// letter or a dash.
fn folded_eq(name: &[u8], lower: &[u8]) -> bool {
    if name.len() != lower.len() {
        return false;
    }
    let (mut name_words, mut lower_words) = (name.chunks_exact(8), lower.chunks_exact(8));
    let word = |bytes: &[u8]| u64::from_ne_bytes(bytes.try_into().unwrap_or_default());
    for (name_word, lower_word) in (&mut name_words).zip(&mut lower_words) {
        if word(name_word) | 0x2020_2020_2020_2020 != word(lower_word) {
            return false;
        }
    }
    name_words
        .remainder()
        .iter()
        .zip(lower_words.remainder())
        .all(|(byte, lower)| byte | 0x20 == *lower)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    /// A value standing alone, as its own head.
    fn field(head: &Bytes) -> FieldValue<'_> {
        FieldValue { head, bytes: head }
    }

    #[test]
    fn header_names_are_noted_lower_case_whichever_way_they_are_read_and_the_unread_one_left_out() {
        let mut said = ParsedHeaders::new(4, b"date");
        for name in [
            &b"X-Request-ID"[..],
            b"inference-header-content-length",
            b"X-Custom",
            b"Date",
            b"Content-Type",
        ] {
            said.note(name, field(&Bytes::from_static(b"1"))).unwrap();
        }
        let names: Vec<&str> = said.headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(
            names,
            [
                "x-request-id",
                "inference-header-content-length",
                "x-custom",
                "content-type"
            ]
        );
        for known in &KNOWN {
            assert_eq!(
                known_name(known.as_str().to_uppercase().as_bytes()).as_ref(),
                Some(known)
            );
        }
        assert_eq!(known_name(b"x-request-i"), None);
        assert_eq!(known_name(b"content-typo"), None);
        assert_eq!(known_name(b"Inference-Header-Content-Lengti"), None);
        assert_eq!(
            known_name(b"Inference-Header-Content-Length"),
            Some(crate::headers::INFERENCE_HEADER_CONTENT_LENGTH)
        );
        assert_eq!(known_name(b""), None);
        assert_eq!(known_name(b"X-REQUEST-ID"), Some(crate::headers::REQUEST_ID));
        assert!(matches!(
            said.note(b"bad name", field(&Bytes::from_static(b""))),
            Err(BadHeader::Name)
        ));
    }

    /// The word-at-a-time comparison against a known name agrees with `eq_ignore_ascii_case` for every name the
    /// parser can take that is a known name with one byte changed to any token character.
    #[test]
    fn known_names_are_matched_in_any_case_and_no_other_token_matches() {
        let token: Vec<u8> = (0x21..0x7f_u8)
            .filter(|byte| !b"\"(),/:;<=>?@[\\]{}".contains(byte))
            .collect();
        for known in &KNOWN {
            let lower = known.as_str().as_bytes();
            for position in 0..lower.len() {
                for &byte in &token {
                    let mut name = lower.to_vec();
                    name[position] = byte;
                    assert_eq!(folded_eq(&name, lower), name.eq_ignore_ascii_case(lower), "{name:?}");
                }
            }
        }
    }

    #[test]
    fn a_length_given_twice_or_as_a_list_is_kept_once_as_digits() {
        let mut said = ParsedHeaders::new(4, b"");
        said.note(b"content-length", field(&Bytes::from_static(b"5, 5")))
            .unwrap();
        said.note(b"Content-Length", field(&Bytes::from_static(b"5"))).unwrap();
        assert_eq!(said.length, Some(5));
        let values: Vec<_> = said.headers.get_all(CONTENT_LENGTH).iter().collect();
        assert_eq!(values, [HeaderValue::from_static("5")]);
        let mut said = ParsedHeaders::new(1, b"");
        said.note(b"content-length", field(&Bytes::from_static(b"007")))
            .unwrap();
        assert_eq!(said.headers[CONTENT_LENGTH], "7");
        assert!(matches!(
            said.note(b"content-length", field(&Bytes::from_static(b"8"))),
            Err(BadHeader::TwoLengths)
        ));
    }

    #[test]
    fn headers_past_the_placed_ones_are_read_again_as_slices_of_the_head() {
        for count in [1, PLACED, PLACED + 1, 40] {
            let lines: String = (0..count)
                .map(|index| format!("x-{index}: value {index}\r\n"))
                .collect();
            let text = format!("\r\nPOST /v2 HTTP/1.1\r\n{lines}\r\nBODY");
            let mut read = BytesMut::from(text.as_bytes());
            let mut slots = [const { std::mem::MaybeUninit::uninit() }; 64];
            let mut request = httparse::Request::new(&mut []);
            let length = match httparse::ParserConfig::default()
                .parse_request_with_uninit_headers(&mut request, &read, &mut slots)
                .unwrap()
            {
                httparse::Status::Complete(length) => length,
                httparse::Status::Partial => panic!("partial"),
            };
            let places = places(request.headers, read.as_ptr());
            let head = read.split_to(length).freeze();
            let mut seen = Vec::new();
            places
                .each(
                    &head,
                    || "malformed",
                    |name, value| {
                        assert!(
                            head.as_ptr_range().contains(&value.as_bytes().as_ptr()),
                            "a slice of the head"
                        );
                        seen.push(format!(
                            "{}={}",
                            String::from_utf8_lossy(name),
                            String::from_utf8_lossy(value.as_bytes())
                        ));
                        Ok(())
                    },
                )
                .unwrap();
            let expected: Vec<String> = (0..count).map(|index| format!("x-{index}=value {index}")).collect();
            assert_eq!(seen, expected, "{count} headers");
        }
    }
}

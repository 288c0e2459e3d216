//! A JSON request header read as it passes, a piece at a time, for the keys the gateway must see wherever they
//! stand: a shared-memory parameter anywhere (it cannot cross a gateway), a routing key given twice in the request's
//! own `parameters`, or that object given twice where either names one (backends read the first or the last), and a
//! parameter the gateway routes by that lies beyond the bytes it read before routing. Keys are read as JSON reads
//! them, escapes and all; nothing else is decoded, and nothing is kept but the key being read.

use crate::error::{Error, Result};
use crate::protocol::reserved;

/// The request parameters the gateway acts on before it sends a request: where the request goes and how long and
/// how urgently it runs.
pub const ROUTING: [&str; 5] = [
    crate::protocol::sequence::SEQUENCE_ID,
    crate::protocol::sequence::SEQUENCE_START,
    crate::protocol::sequence::SEQUENCE_END,
    reserved::PRIORITY,
    reserved::TIMEOUT,
];

/// The deepest nesting read (the JSON reader's own bound).
const MOST_DEPTH: u8 = 128;
/// The longest key kept to compare: longer keys are none of those looked for.
const KEPT_KEY: usize = 24;

/// What the bytes of a JSON header seen so far mean for the next byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lexing {
    /// Between tokens, or within a number or a literal.
    Between,
    /// Within a string; a key's characters are kept.
    Text { key: bool },
    /// After a backslash within a string.
    Escape { key: bool },
    /// Within a `\u` escape: how many hex digits are read, and their value so far.
    Unicode { key: bool, digits: u8, value: u32 },
}

/// A JSON header's keys, read as its bytes pass.
#[derive(Debug, Clone)]
pub struct KeyScan {
    /// Bytes of the header read so far.
    seen: u64,
    /// Bytes of it the gateway read before routing: a routing parameter past them was not seen.
    routed: u64,
    /// Bytes that are the header (the binary extension's header length); past them, tensor data.
    header: u64,
    lexing: Lexing,
    depth: u8,
    /// Bit `n` set: the container at depth `n + 1` is an object.
    objects: u128,
    /// Within an object, a key comes next.
    key_next: bool,
    key: [u8; KEPT_KEY],
    key_length: usize,
    /// The key being read is longer than any looked for, or holds a character none of them has.
    key_other: bool,
    /// The top-level `parameters` key was read; its value comes next.
    parameters_next: bool,
    /// How often the top-level `parameters` key was given.
    parameters_given: u8,
    /// Within the top-level `parameters` object (at depth 2).
    in_parameters: bool,
    /// The routing parameters named in it, one bit each (of [`ROUTING`]).
    routing_named: u8,
    /// A top-level `parameters` has named a routing parameter.
    routing_ever: bool,
}

/// The bytes that change what the lexer is doing between tokens.
static BETWEEN: [bool; 256] = {
    let mut table = [false; 256];
    let mut index = 0;
    let significant = b"\"{}[],";
    while index < significant.len() {
        table[significant[index] as usize] = true;
        index += 1;
    }
    table
};

impl KeyScan {
    /// A scan of a JSON header of `header` bytes (`None`: the whole body is JSON), of which the gateway read the
    /// first `routed` before routing.
    pub fn new(header: Option<u64>, routed: u64) -> KeyScan {
        KeyScan {
            seen: 0,
            routed,
            header: header.unwrap_or(u64::MAX),
            lexing: Lexing::Between,
            depth: 0,
            objects: 0,
            key_next: false,
            key: [0; KEPT_KEY],
            key_length: 0,
            key_other: false,
            parameters_next: false,
            parameters_given: 0,
            in_parameters: false,
            routing_named: 0,
            routing_ever: false,
        }
    }

    /// Bytes of the header read so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Reads the next piece of the body; refuses the request at the first key that must not pass.
    pub fn feed(&mut self, piece: &[u8]) -> Result<()> {
        let left = self.header.saturating_sub(self.seen);
        let piece = &piece[..piece.len().min(usize::try_from(left).unwrap_or(usize::MAX))];
        let mut at = 0;
        while at < piece.len() {
            match self.lexing {
                Lexing::Between => {
                    // Numbers, literals, blanks and colons change nothing: stepped over a table look-up at a time.
                    match piece[at..].iter().position(|&byte| BETWEEN[usize::from(byte)]) {
                        Some(offset) => at += offset,
                        None => break,
                    }
                    let position = self.seen + at as u64;
                    self.structural(piece[at], position)?;
                    at += 1;
                }
                Lexing::Text { key: false } => {
                    // A value's text is skipped to its next quote or backslash.
                    match memchr::memchr2(b'"', b'\\', &piece[at..]) {
                        Some(offset) => at += offset,
                        None => break,
                    }
                    self.lexing = if piece[at] == b'"' {
                        Lexing::Between
                    } else {
                        Lexing::Escape { key: false }
                    };
                    at += 1;
                }
                _ => {
                    let position = self.seen + at as u64;
                    self.in_text(piece[at], position)?;
                    at += 1;
                }
            }
        }
        self.seen += piece.len() as u64;
        Ok(())
    }

    /// A quote or a structural character, between tokens.
    fn structural(&mut self, byte: u8, position: u64) -> Result<()> {
        match byte {
            b'"' => {
                let key = self.key_next && self.in_object();
                if key {
                    self.key_length = 0;
                    self.key_other = false;
                }
                self.lexing = Lexing::Text { key };
            }
            b'{' | b'[' => {
                if self.depth >= MOST_DEPTH {
                    return Err(Error::invalid(format!(
                        "the request's JSON is nested deeper than {MOST_DEPTH} levels"
                    )));
                }
                let object = byte == b'{';
                if object {
                    self.objects |= 1 << self.depth;
                } else {
                    self.objects &= !(1 << self.depth);
                }
                self.depth += 1;
                self.key_next = object;
                if self.parameters_next && object && self.depth == 2 {
                    self.in_parameters = true;
                    self.routing_named = 0;
                }
                self.parameters_next = false;
            }
            b'}' | b']' => {
                if self.depth == 2 && self.in_parameters {
                    self.in_parameters = false;
                    // Closed past what the router read: whatever it names, the router did not see.
                    if position >= self.routed && self.routing_named != 0 {
                        return Err(unrouted(
                            ROUTING[self.routing_named.trailing_zeros() as usize],
                            self.routed,
                        ));
                    }
                }
                self.depth = self.depth.saturating_sub(1);
                self.key_next = false;
                self.parameters_next = false;
            }
            // `,`: in an object, a key comes next.
            _ => {
                self.key_next = self.in_object();
                self.parameters_next = false;
            }
        }
        Ok(())
    }

    fn in_object(&self) -> bool {
        self.depth > 0 && self.objects & (1 << (self.depth - 1)) != 0
    }

    /// A byte within a key, or within an escape of any string.
    fn in_text(&mut self, byte: u8, position: u64) -> Result<()> {
        match self.lexing {
            Lexing::Text { key } => match byte {
                b'"' => {
                    self.lexing = Lexing::Between;
                    if key {
                        self.key_next = false;
                        return self.key_read(position);
                    }
                }
                b'\\' => self.lexing = Lexing::Escape { key },
                _ => self.key_char(u32::from(byte)),
            },
            Lexing::Escape { key } => {
                self.lexing = if byte == b'u' {
                    Lexing::Unicode {
                        key,
                        digits: 0,
                        value: 0,
                    }
                } else {
                    if key {
                        let unescaped = match byte {
                            b'b' => 0x08,
                            b'f' => 0x0c,
                            b'n' => u32::from(b'\n'),
                            b'r' => u32::from(b'\r'),
                            b't' => u32::from(b'\t'),
                            other => u32::from(other),
                        };
                        self.key_char(unescaped);
                    }
                    Lexing::Text { key }
                };
            }
            Lexing::Unicode { key, digits, value } => {
                let digit = char::from(byte).to_digit(16).unwrap_or(0);
                let value = value << 4 | digit;
                self.lexing = if digits == 3 {
                    if key {
                        self.key_char(value);
                    }
                    Lexing::Text { key }
                } else {
                    Lexing::Unicode {
                        key,
                        digits: digits + 1,
                        value,
                    }
                };
            }
            Lexing::Between => {}
        }
        Ok(())
    }

    /// One character of the key being read (a code point: none looked for has one beyond ASCII).
    fn key_char(&mut self, character: u32) {
        match u8::try_from(character) {
            Ok(byte) if byte.is_ascii() && self.key_length < KEPT_KEY => {
                self.key[self.key_length] = byte;
                self.key_length += 1;
            }
            _ => self.key_other = true,
        }
    }

    /// A key has been read whole.
    fn key_read(&mut self, position: u64) -> Result<()> {
        if self.key_other {
            return Ok(());
        }
        let key = &self.key[..self.key_length];
        if let Some(name) = reserved::SHARED_MEMORY.iter().find(|name| name.as_bytes() == key) {
            return Err(reserved::shared_memory_anywhere(name));
        }
        if self.depth == 1 && key == b"parameters" {
            self.parameters_given = self.parameters_given.saturating_add(1);
            // Given twice, it matters once either names what the gateway acts on.
            if self.parameters_given > 1 && self.routing_ever {
                return Err(twice("parameters"));
            }
            self.parameters_next = true;
        } else if self.depth == 2
            && self.in_parameters
            && let Some(index) = ROUTING.iter().position(|name| name.as_bytes() == key)
        {
            let bit = 1 << index;
            if self.routing_named & bit != 0 {
                return Err(twice(ROUTING[index]));
            }
            self.routing_named |= bit;
            self.routing_ever = true;
            if self.parameters_given > 1 {
                return Err(twice("parameters"));
            }
            if position >= self.routed {
                return Err(unrouted(ROUTING[index], self.routed));
            }
        }
        Ok(())
    }
}

fn twice(name: &str) -> Error {
    Error::invalid(format!(
        "the request gives \"{name}\" twice: backends read either the first or the last, so it is refused"
    ))
}

fn unrouted(name: &str, routed: u64) -> Error {
    Error::invalid(format!(
        "the request's parameter {name} lies past the first {routed} bytes of its body, which the gateway reads to \
         route it; send \"parameters\" ahead of \"inputs\""
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan's verdict on `text` fed in pieces of `size` bytes.
    fn scan(text: &str, routed: u64, size: usize) -> std::result::Result<(), String> {
        let mut scan = KeyScan::new(None, routed);
        for piece in text.as_bytes().chunks(size) {
            scan.feed(piece).map_err(|error| error.message().to_owned())?;
        }
        Ok(())
    }

    fn every_size(text: &str, routed: u64) -> std::result::Result<(), String> {
        let whole = scan(text, routed, text.len().max(1));
        for size in 1..text.len() {
            assert_eq!(scan(text, routed, size), whole, "{text} in pieces of {size}");
        }
        whole
    }

    #[test]
    fn shared_memory_is_found_as_a_key_anywhere_escaped_or_not_and_never_in_a_value() {
        for text in [
            r#"{"inputs":[{"name":"x","parameters":{"shared_memory_region":"r"}}]}"#,
            r#"{"outputs":[{"name":"y","parameters":{"shared_memory_offset":0}}]}"#,
            r#"{"parameters":{"shared_memory_byte_size":4},"inputs":[]}"#,
            r#"{"inputs":[{"data":[1,2,3],"name":"x","parameters":{"\u0073hared_memory_region":"r"}}]}"#,
            r#"{"inputs":[{"parameters":{"shared_memory_regio\u006e":"r"}}]}"#,
            r#"{"inputs":[{"parameters":{"shared\u005fmemory_region":"r"}}]}"#,
            r#"{"x":{"y":[{"z":{"shared_memory_region":1}}]}}"#,
        ] {
            let refused = every_size(text, u64::MAX).expect_err(text);
            assert!(refused.contains("cannot cross a gateway"), "{text}: {refused}");
        }
        for text in [
            r#"{"inputs":[{"name":"shared_memory_region","datatype":"BYTES","data":["shared_memory_region"]}]}"#,
            r#"{"inputs":[{"name":"x","data":["\"shared_memory_region\":1"]}]}"#,
            r#"{"inputs":[{"name":"x","parameters":{"shared_memory_region_not":1}}]}"#,
            r#"{"inputs":[{"name":"x","data":["\\","shared_memory_region"]}]}"#,
        ] {
            assert_eq!(every_size(text, u64::MAX), Ok(()), "{text}");
        }
    }

    #[test]
    fn the_top_level_parameters_and_their_routing_keys_are_read_once_and_within_what_was_routed() {
        let late = r#"{"inputs":[{"name":"x","data":[1,2,3,4,5,6,7,8]}],"parameters":{"sequence_id":5}}"#;
        let refused = every_size(late, 40).unwrap_err();
        assert!(
            refused.contains("parameter sequence_id lies past the first 40 bytes"),
            "{refused}"
        );
        assert_eq!(every_size(late, u64::MAX), Ok(()));
        // Begun within what was routed, closed past it: the router did not read it whole.
        let cut = r#"{"parameters":{"sequence_id":5,"x":"a long value that runs past the bytes routed"},"inputs":[]}"#;
        assert!(every_size(cut, 40).unwrap_err().contains("sequence_id lies past"));
        assert_eq!(every_size(cut, u64::MAX), Ok(()));
        // Parameters without a routing key may lie anywhere; tensors' parameters are not the request's.
        assert_eq!(every_size(r#"{"inputs":[],"parameters":{"custom":1}}"#, 5), Ok(()));
        assert_eq!(
            every_size(r#"{"inputs":[{"name":"x","parameters":{"priority":1}}]}"#, 5),
            Ok(())
        );
        assert_eq!(
            every_size(r#"{"parameters":{"a":1},"inputs":[],"parameters":{"b":2}}"#, u64::MAX),
            Ok(()),
            "given twice, naming nothing the gateway acts on"
        );
        for twice in [
            r#"{"parameters":{"priority":1},"inputs":[],"parameters":{"priority":2}}"#,
            r#"{"parameters":{"a":1},"inputs":[],"parameters":{"timeout":2}}"#,
            r#"{"parameters":{"priority":1,"priority":2}}"#,
            r#"{"parameters":{"sequence_id":1,"\u0073equence_id":2}}"#,
        ] {
            let refused = every_size(twice, u64::MAX).expect_err(twice);
            assert!(refused.contains("twice"), "{twice}: {refused}");
        }
    }

    #[test]
    fn only_the_header_is_read_and_nesting_is_bounded() {
        let header = r#"{"inputs":[{"name":"x","parameters":{"binary_data_size":4}}]}"#;
        let mut body = header.as_bytes().to_vec();
        body.extend_from_slice(br#""shared_memory_region":{"#);
        let mut scan = KeyScan::new(Some(header.len() as u64), u64::MAX);
        scan.feed(&body).unwrap();
        assert_eq!(scan.seen(), header.len() as u64);
        let deep = "[".repeat(200);
        assert!(scan_text_error(&deep).contains("nested deeper"));
    }

    fn scan_text_error(text: &str) -> String {
        KeyScan::new(None, u64::MAX)
            .feed(text.as_bytes())
            .unwrap_err()
            .message()
            .to_owned()
    }
}

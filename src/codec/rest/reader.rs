//! A strict, allocation-light JSON pull reader for inference bodies: it walks the text once, so a tensor's `data`
//! is parsed in place instead of being skipped by one parser and read again by another.

use std::borrow::Cow;

use crate::error::{Error, Result};

/// Deepest nesting accepted anywhere in a body (arrays and objects). The reader never recurses; this bounds sanity,
/// not the stack.
pub const MAX_DEPTH: usize = 128;

#[derive(Debug)]
pub struct JsonReader<'a> {
    pub(crate) text: &'a [u8],
    pub(crate) pos: usize,
}

/// Iterates the members of an object: `while let Some(key) = members.next(reader)? { read the value }`.
#[derive(Debug)]
pub struct Members {
    first: bool,
}

/// Iterates the elements of an array: `while elements.next(reader)? { read the element }`.
#[derive(Debug)]
pub struct Elements {
    first: bool,
}

impl<'a> JsonReader<'a> {
    pub fn new(text: &'a [u8]) -> Self {
        JsonReader { text, pos: 0 }
    }

    /// A syntax error at the current position.
    pub fn error(&self, message: impl std::fmt::Display) -> Error {
        Error::invalid(format!("invalid JSON at byte {}: {message}", self.pos))
    }

    #[inline]
    pub fn skip_ws(&mut self) {
        while let Some(&c) = self.text.get(self.pos) {
            if c > b' ' || !matches!(c, b' ' | b'\n' | b'\r' | b'\t') {
                break;
            }
            self.pos += 1;
        }
    }

    /// The next significant byte, without consuming it.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.text.get(self.pos).copied()
    }

    fn found(&self) -> String {
        match self.text.get(self.pos) {
            None => "the end of the body".to_owned(),
            Some(&c) if c.is_ascii_graphic() => format!("'{}'", c as char),
            Some(&c) => format!("byte 0x{c:02x}"),
        }
    }

    pub fn expect(&mut self, byte: u8) -> Result<()> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(format_args!("expected '{}', found {}", byte as char, self.found())))
        }
    }

    /// Fails unless only whitespace remains.
    pub fn end(&mut self) -> Result<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.error(format_args!("unexpected {} after the value", self.found()))),
        }
    }

    pub fn object(&mut self) -> Result<Members> {
        self.expect(b'{')?;
        Ok(Members { first: true })
    }

    pub fn array(&mut self) -> Result<Elements> {
        self.expect(b'[')?;
        Ok(Elements { first: true })
    }

    /// Consumes `null` if it is next.
    pub fn null(&mut self) -> bool {
        if self.peek() == Some(b'n') && self.text[self.pos..].starts_with(b"null") {
            self.pos += 4;
            true
        } else {
            false
        }
    }

    pub fn bool(&mut self) -> Result<bool> {
        let next = self.peek();
        let rest = &self.text[self.pos..];
        match next {
            Some(b't') if rest.starts_with(b"true") => {
                self.pos += 4;
                Ok(true)
            }
            Some(b'f') if rest.starts_with(b"false") => {
                self.pos += 5;
                Ok(false)
            }
            _ => Err(self.error(format_args!("expected true or false, found {}", self.found()))),
        }
    }

    /// A string, borrowed from the text unless it has escapes.
    pub fn string(&mut self) -> Result<Cow<'a, str>> {
        if self.peek() != Some(b'"') {
            return Err(self.error(format_args!("expected a string, found {}", self.found())));
        }
        let open = self.pos;
        let mut i = open + 1;
        let mut escaped = false;
        loop {
            let Some(offset) = memchr::memchr2(b'"', b'\\', &self.text[i..]) else {
                self.pos = self.text.len();
                return Err(self.error("unterminated string"));
            };
            i += offset;
            if self.text[i] == b'"' {
                break;
            }
            escaped = true;
            i += 2;
            if i > self.text.len() {
                self.pos = self.text.len();
                return Err(self.error("unterminated string"));
            }
        }
        let body = &self.text[open + 1..i];
        if escaped {
            // Escapes are rare in inference bodies: let serde_json decode them (surrogate pairs included).
            let text: String = serde_json::from_slice(&self.text[open..=i])
                .map_err(|e| self.error(format_args!("invalid string: {e}")))?;
            self.pos = i + 1;
            return Ok(Cow::Owned(text));
        }
        if let Some(at) = body.iter().position(|&c| c < 0x20) {
            self.pos = open + 1 + at;
            return Err(self.error("control character inside a string"));
        }
        let text = std::str::from_utf8(body).map_err(|e| self.error(format_args!("string is not UTF-8: {e}")))?;
        self.pos = i + 1;
        Ok(Cow::Borrowed(text))
    }

    /// The text of a number token, checked against JSON's number grammar.
    pub fn number_token(&mut self) -> Result<&'a [u8]> {
        self.skip_ws();
        let start = self.pos;
        let text = self.text;
        let mut i = start;
        if text.get(i) == Some(&b'-') {
            i += 1;
        }
        let int_start = i;
        while text.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == int_start || (text[int_start] == b'0' && i - int_start > 1) {
            return Err(self.error(format_args!("expected a number, found {}", self.found())));
        }
        if text.get(i) == Some(&b'.') {
            i += 1;
            let frac = i;
            while text.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == frac {
                self.pos = i;
                return Err(self.error("expected a digit after the decimal point"));
            }
        }
        if matches!(text.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(text.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            let exp = i;
            while text.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == exp {
                self.pos = i;
                return Err(self.error("expected a digit in the exponent"));
            }
        }
        self.pos = i;
        Ok(&text[start..i])
    }

    /// Skips one value of any kind, checking its syntax.
    pub fn skip_value(&mut self) -> Result<()> {
        let mut closers: Vec<u8> = Vec::new();
        loop {
            // One value.
            match self.peek() {
                Some(b'{') => {
                    self.pos += 1;
                    if self.peek() == Some(b'}') {
                        self.pos += 1;
                    } else {
                        closers.push(b'}');
                        self.string()?;
                        self.expect(b':')?;
                        if closers.len() > MAX_DEPTH {
                            return Err(self.error(format_args!("nested deeper than {MAX_DEPTH} levels")));
                        }
                        continue;
                    }
                }
                Some(b'[') => {
                    self.pos += 1;
                    if self.peek() == Some(b']') {
                        self.pos += 1;
                    } else {
                        closers.push(b']');
                        if closers.len() > MAX_DEPTH {
                            return Err(self.error(format_args!("nested deeper than {MAX_DEPTH} levels")));
                        }
                        continue;
                    }
                }
                Some(b'"') => {
                    self.string()?;
                }
                Some(b't' | b'f') => {
                    self.bool()?;
                }
                Some(b'n') => {
                    if !self.null() {
                        return Err(self.error(format_args!("expected a value, found {}", self.found())));
                    }
                }
                _ => {
                    self.number_token()?;
                }
            }
            // Close what the value ended.
            loop {
                let Some(&closer) = closers.last() else { return Ok(()) };
                match self.peek() {
                    Some(b',') => {
                        self.pos += 1;
                        if closer == b'}' {
                            self.string()?;
                            self.expect(b':')?;
                        }
                        break;
                    }
                    Some(c) if c == closer => {
                        self.pos += 1;
                        closers.pop();
                    }
                    _ => {
                        return Err(self.error(format_args!(
                            "expected ',' or '{}', found {}",
                            closer as char,
                            self.found()
                        )));
                    }
                }
            }
        }
    }

    /// Skips one value and gives its text.
    pub fn value_span(&mut self) -> Result<&'a [u8]> {
        self.skip_ws();
        let start = self.pos;
        self.skip_value()?;
        Ok(&self.text[start..self.pos])
    }
}

impl Members {
    /// The next member's key, with the reader positioned at its value; `None` after the closing brace.
    pub fn next<'a>(&mut self, reader: &mut JsonReader<'a>) -> Result<Option<Cow<'a, str>>> {
        match reader.peek() {
            Some(b'}') => {
                reader.pos += 1;
                return Ok(None);
            }
            Some(b',') if !self.first => reader.pos += 1,
            _ if self.first => {}
            _ => return Err(reader.error(format_args!("expected ',' or '}}', found {}", reader.found()))),
        }
        self.first = false;
        let key = reader.string()?;
        reader.expect(b':')?;
        Ok(Some(key))
    }
}

impl Elements {
    /// Whether another element follows, with the reader positioned at it.
    pub fn next(&mut self, reader: &mut JsonReader<'_>) -> Result<bool> {
        match reader.peek() {
            Some(b']') => {
                reader.pos += 1;
                return Ok(false);
            }
            Some(b',') if !self.first => reader.pos += 1,
            _ if self.first => {}
            _ => return Err(reader.error(format_args!("expected ',' or ']', found {}", reader.found()))),
        }
        self.first = false;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skip(text: &str) -> Result<()> {
        let mut reader = JsonReader::new(text.as_bytes());
        reader.skip_value()?;
        reader.end()
    }

    #[test]
    fn skips_valid_json() {
        for text in [
            "1",
            "-0.5e+3",
            "\"a\\\"b\"",
            "[]",
            "{}",
            "[1,[2,{\"a\":[true,false,null]}]]",
            " { \"k\" : 1 } ",
        ] {
            skip(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }

    #[test]
    fn rejects_invalid_json() {
        for text in [
            "",
            "[1,]",
            "[1 2]",
            "{\"a\"}",
            "{\"a\":1,}",
            "01",
            "1.",
            "-",
            "\"abc",
            "tru",
            "[1]]",
            "{1:2}",
            "\"\u{1}\"",
        ] {
            assert!(skip(text).is_err(), "{text:?} should be rejected");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(skip(&deep).unwrap_err().to_string().contains("deeper than 128"));
    }

    #[test]
    fn strings_borrow_unless_escaped() {
        let mut reader = JsonReader::new(br#""plain" "esc\u00e9\n""#);
        assert!(matches!(reader.string().unwrap(), Cow::Borrowed("plain")));
        assert_eq!(reader.string().unwrap(), "escé\n");
        assert!(JsonReader::new(b"\"\xff\"").string().is_err());
        assert!(JsonReader::new(br#""\ud800""#).string().is_err());
    }

    #[test]
    fn members_and_elements() {
        let mut reader = JsonReader::new(br#"{"a": [1, 2], "b": {}}"#);
        let mut members = reader.object().unwrap();
        let mut keys = Vec::new();
        while let Some(key) = members.next(&mut reader).unwrap() {
            keys.push(key.into_owned());
            reader.skip_value().unwrap();
        }
        assert_eq!(keys, ["a", "b"]);
        reader.end().unwrap();
        let mut reader = JsonReader::new(b"[1,2,3]");
        let mut elements = reader.array().unwrap();
        let mut n = 0;
        while elements.next(&mut reader).unwrap() {
            reader.number_token().unwrap();
            n += 1;
        }
        assert_eq!(n, 3);
    }
}

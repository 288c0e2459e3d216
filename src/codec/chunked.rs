//! HTTP/1.1 chunked framing (RFC 9112 §7.1) read as it arrives, a byte at a time, every line ended by CR LF: the
//! one reader of it, under `codec::http1::Framing`, which takes a chunked body off a buffer for the REST door's
//! requests and the REST backend client's answers.

/// Where a chunked body's reading stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// At a size line's start: a hex digit must come.
    Start,
    /// Within the size's digits.
    Size(u64),
    /// Blanks after the size: no more digits.
    SizeBlank(u64),
    /// An extension, to the line's end.
    Extension(u64),
    /// After the size line's carriage return.
    SizeEnd(u64),
    /// Data, with this many bytes still to come.
    Data(u64),
    /// After a chunk's data: its carriage return, then its line feed.
    DataReturn,
    DataEnd,
    /// After the last chunk, at a trailer line's start (an empty one ends the body).
    Trailer,
    /// Within a trailer line.
    TrailerLine,
    /// After a trailer line's carriage return.
    TrailerLineEnd,
    /// After a carriage return at a trailer line's start.
    End,
    /// The body has ended.
    Done,
}

/// Framing that hyper refuses: the body cannot be followed past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

impl Chunk {
    /// Reads the framing at the start of `bytes`, taking it off, up to a chunk's data (the state is then `Data`), the
    /// body's end (`Done`, with `bytes` left at what follows the body) or the end of `bytes`.
    pub fn frame(&mut self, bytes: &mut &[u8]) -> Result<(), Malformed> {
        while let Some(&byte) = bytes.first() {
            if matches!(self, Chunk::Data(_) | Chunk::Done) {
                return Ok(());
            }
            *bytes = &bytes[1..];
            *self = match (*self, byte) {
                (Chunk::Start | Chunk::Size(_), b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F') => {
                    let size = if let Chunk::Size(size) = *self { size } else { 0 };
                    let digit = char::from(byte).to_digit(16).map_or(0, u64::from);
                    Chunk::Size(
                        size.checked_mul(16)
                            .and_then(|size| size.checked_add(digit))
                            .ok_or(Malformed)?,
                    )
                }
                (Chunk::Size(size) | Chunk::SizeBlank(size), b' ' | b'\t') => Chunk::SizeBlank(size),
                (Chunk::Size(size) | Chunk::SizeBlank(size), b';') => Chunk::Extension(size),
                (Chunk::Size(size) | Chunk::SizeBlank(size) | Chunk::Extension(size), b'\r') => Chunk::SizeEnd(size),
                (Chunk::Extension(_), b'\n') => return Err(Malformed),
                (Chunk::Extension(size), _) => Chunk::Extension(size),
                (Chunk::SizeEnd(0), b'\n') => Chunk::Trailer,
                (Chunk::SizeEnd(size), b'\n') => Chunk::Data(size),
                (Chunk::DataReturn, b'\r') => Chunk::DataEnd,
                (Chunk::DataEnd, b'\n') => Chunk::Start,
                (Chunk::Trailer, b'\r') => Chunk::End,
                (Chunk::End, b'\n') => Chunk::Done,
                (Chunk::TrailerLine, b'\r') => Chunk::TrailerLineEnd,
                (Chunk::TrailerLineEnd, b'\n') => Chunk::Trailer,
                // Every line of the framing ends with CR LF, a trailer's as a size's: a bare LF, read by some
                // proxies as a line's end and by others as none, would let them see different bodies.
                (Chunk::Trailer | Chunk::TrailerLine, b'\n') => return Err(Malformed),
                (Chunk::Trailer | Chunk::TrailerLine, _) => Chunk::TrailerLine,
                _ => return Err(Malformed),
            };
        }
        Ok(())
    }

    /// Notes `taken` bytes of the current chunk's data as read (at most what is left of it).
    pub fn took(&mut self, taken: u64) {
        if let Chunk::Data(left) = *self {
            *self = match left.saturating_sub(taken) {
                0 => Chunk::DataReturn,
                left => Chunk::Data(left),
            };
        }
    }

    /// The bytes of the current chunk's data still to come; none outside data.
    pub fn data_left(&self) -> Option<u64> {
        match *self {
            Chunk::Data(left) => Some(left),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The data of a chunked body read in pieces of `size` bytes, and what follows it.
    fn read(body: &[u8], size: usize) -> Result<(Vec<u8>, Vec<u8>), Malformed> {
        let mut chunk = Chunk::Start;
        let mut data = Vec::new();
        for (index, mut piece) in body.chunks(size).enumerate() {
            let end = index * size + piece.len();
            while !piece.is_empty() {
                if chunk == Chunk::Done {
                    return Ok((data, body[end - piece.len()..].to_vec()));
                }
                if let Some(left) = chunk.data_left() {
                    let taken = piece.len().min(usize::try_from(left).unwrap());
                    data.extend_from_slice(&piece[..taken]);
                    piece = &piece[taken..];
                    chunk.took(taken as u64);
                    continue;
                }
                chunk.frame(&mut piece)?;
            }
        }
        assert_eq!(chunk, Chunk::Done, "the body ended");
        Ok((data, Vec::new()))
    }

    #[test]
    fn chunks_are_read_alike_in_pieces_of_any_size() {
        let body =
            b"5;name=value\r\nhello\r\n6 \r\n world\r\nA\r\n0123456789\r\n0\r\nx-trailer: 1\r\nx-two: 2\r\n\r\nNEXT";
        for size in 1..=body.len() {
            let (data, after) = read(body, size).unwrap();
            assert_eq!(data, b"hello world0123456789", "pieces of {size}");
            assert_eq!(after, b"NEXT", "pieces of {size}");
        }
    }

    #[test]
    fn framing_hyper_refuses_and_bare_line_feeds_are_malformed() {
        for body in [
            &b"zz\r\n"[..],
            b"\r\n",
            b"1;a\nb\r\n",
            b"1\r\nab\r\n",
            b"1\r\na\n",
            b"1 2\r\n",
            b"fffffffffffffffff\r\n",
            b"1\nx\r\n",
            b"0\r\nx-trailer: 1\n\r\n",
            b"0\r\n\n",
            b"0\r\nx-trailer: 1\r\r\n",
            b"1\r\nx\n",
        ] {
            assert_eq!(
                read(body, body.len()),
                Err(Malformed),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}

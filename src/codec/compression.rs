//! HTTP content codings as Triton's REST API takes them: `gzip` and `deflate` (zlib) request bodies, decompressed
//! within a bound, and answers compressed for a client that accepts them (`Accept-Encoding` with q-values).

use std::io::{Read, Write};

use bytes::Bytes;
use flate2::Compression;
use http::HeaderMap;

use crate::error::{Error, ErrorKind, Origin, Result};

/// What the gateway says it takes, in a 415 answer's `Accept-Encoding`.
pub const ACCEPTED: &str = "gzip, deflate";
/// Answers shorter than this go uncompressed: a gzip header and trailer would outweigh what it saves.
pub const MIN_COMPRESSED_BYTES: usize = 1024;
/// The first piece of a decompressed body of unknown size.
const STEP: usize = 64 * 1024;
/// The size of each further piece.
const PIECE: usize = 1 << 20;
/// The most deflate expands its input: 258 bytes from each two-bit code, about 1032 to 1.
const MOST_DEFLATE_RATIO: u64 = 1032;

/// A content coding the gateway reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    /// HTTP's `deflate`: the zlib format (RFC 1950), as Triton and its clients write it.
    Deflate,
}

impl Coding {
    pub fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
        }
    }
}

/// The coding of a request body from its `Content-Encoding`: `None` for none or `identity`; any other coding is
/// refused with 415, naming it.
pub fn request_coding(headers: &HeaderMap) -> Result<Option<Coding>> {
    let mut coding = None;
    for value in headers.get_all(http::header::CONTENT_ENCODING) {
        let text = value
            .to_str()
            .map_err(|_| unsupported("a Content-Encoding that is not text"))?;
        for token in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let this = match token.to_ascii_lowercase().as_str() {
                "identity" => continue,
                "gzip" | "x-gzip" => Coding::Gzip,
                "deflate" => Coding::Deflate,
                other => return Err(unsupported(&format!("Content-Encoding '{other}'"))),
            };
            if coding.replace(this).is_some() {
                return Err(unsupported("a body compressed more than once"));
            }
        }
    }
    Ok(coding)
}

/// The coding of a backend's answer from its `Content-Encoding`: `None` for none or `identity`; any other coding is a
/// broken answer the gateway cannot read.
pub fn answer_content_coding(headers: &HeaderMap, authority: &str) -> Result<Option<Coding>> {
    request_coding(headers).map_err(|_| {
        Error::new(
            ErrorKind::BadGateway,
            Origin::Upstream,
            format!("backend {authority} answered in a Content-Encoding the gateway cannot read ({ACCEPTED} are)"),
        )
    })
}

fn unsupported(what: &str) -> Error {
    Error::new(
        ErrorKind::UnsupportedEncoding,
        Origin::Client,
        format!("{what} is not supported; request bodies may be {ACCEPTED} or identity"),
    )
}

/// Decompresses a whole body (`what` names it in errors: "request body"), refusing it as soon as its decompressed size passes `limit` (so a small body that
/// expands without bound costs at most `limit` bytes), and naming a body that does not decompress. The output is
/// written into pieces that never move (a growing buffer's earlier copies would each stay in memory for a while),
/// one piece sized exactly when a gzip trailer tells the size.
pub fn decompress(coding: Coding, compressed: &[u8], limit: u64, what: &str) -> Result<Bytes> {
    let too_large = || {
        Error::new(
            ErrorKind::PayloadTooLarge,
            Origin::Client,
            format!(
                "{what} decompresses to more than the limit of {limit} bytes ({} compressed)",
                compressed.len()
            ),
        )
    };
    // gzip's trailer holds the size modulo 2^32, when the body is whole: a size to make room for, never a reason to
    // refuse (a truncated body's last bytes are no trailer), and no more than deflate can expand the body to.
    let hint = match coding {
        Coding::Gzip if compressed.len() >= 18 && compressed.starts_with(&[0x1f, 0x8b]) => {
            let tail: [u8; 4] = compressed[compressed.len() - 4..].try_into().unwrap_or_default();
            let most = (compressed.len() as u64).saturating_mul(MOST_DEFLATE_RATIO).min(limit);
            Some(u64::from(u32::from_le_bytes(tail))).filter(|size| *size <= most)
        }
        _ => None,
    };
    let reader: Box<dyn Read + '_> = match coding {
        Coding::Gzip => Box::new(flate2::read::MultiGzDecoder::new(compressed)),
        Coding::Deflate => Box::new(flate2::read::ZlibDecoder::new(compressed)),
    };
    let mut bounded = reader.take(limit.saturating_add(1));
    let first = hint.map_or(STEP, |size| usize::try_from(size).unwrap_or(STEP).saturating_add(1));
    let mut pieces: Vec<Vec<u8>> = vec![Vec::with_capacity(first)];
    let mut total: u64 = 0;
    let mut step = [0u8; 8192];
    loop {
        let read = bounded
            .read(&mut step)
            .map_err(|e| Error::invalid(format!("the {what} does not decompress as {}: {e}", coding.name())))?;
        if read == 0 {
            break;
        }
        total += read as u64;
        if total > limit {
            return Err(too_large());
        }
        let mut rest = &step[..read];
        while !rest.is_empty() {
            let piece = pieces.last_mut().unwrap_or_else(|| unreachable!());
            let room = piece.capacity() - piece.len();
            if room == 0 {
                pieces.push(Vec::with_capacity(PIECE));
                continue;
            }
            let (now, later) = rest.split_at(room.min(rest.len()));
            piece.extend_from_slice(now);
            rest = later;
        }
    }
    Ok(match pieces.len() {
        1 => Bytes::from(pieces.pop().unwrap_or_default()),
        _ => Bytes::from(pieces.concat()),
    })
}

/// The coding to answer in for a client's `Accept-Encoding`: the accepted one with the highest q-value (gzip on a
/// tie, `*` standing for gzip), or `None` for identity.
pub fn answer_coding(headers: &HeaderMap) -> Option<Coding> {
    let mut best: Option<(Coding, u32)> = None;
    for value in headers.get_all(http::header::ACCEPT_ENCODING) {
        let Ok(text) = value.to_str() else { continue };
        for item in text.split(',') {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let quality = parts
                .filter_map(|p| p.trim().strip_prefix("q=").or_else(|| p.trim().strip_prefix("Q=")))
                .find_map(thousandths)
                .unwrap_or(1000);
            let coding = match name.as_str() {
                "gzip" | "x-gzip" | "*" => Coding::Gzip,
                "deflate" => Coding::Deflate,
                _ => continue,
            };
            if quality == 0 {
                continue;
            }
            let better = match best {
                None => true,
                Some((held, q)) => quality > q || (quality == q && coding == Coding::Gzip && held != Coding::Gzip),
            };
            if better {
                best = Some((coding, quality));
            }
        }
    }
    best.map(|(coding, _)| coding)
}

/// A q-value (RFC 9110: `0`, `1` or either with up to three decimals) in thousandths; out of range values are
/// clamped to 1.
fn thousandths(text: &str) -> Option<u32> {
    let (whole, fraction) = text.trim().split_once('.').unwrap_or((text.trim(), ""));
    if fraction.len() > 3 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole: u32 = whole.parse().ok()?;
    let fraction: u32 = format!("{fraction:0<3}").parse().ok()?;
    Some((whole * 1000 + fraction).min(1000))
}

/// A streaming compressor: chunks in, compressed chunks out as soon as the encoder gives them.
pub struct Compressor {
    encoder: Encoder,
}

enum Encoder {
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    Deflate(flate2::write::ZlibEncoder<Vec<u8>>),
}

impl std::fmt::Debug for Compressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compressor")
    }
}

impl Compressor {
    pub fn new(coding: Coding) -> Compressor {
        // Level 1: answers are on the request path, where a little size costs less than more CPU.
        let level = Compression::fast();
        Compressor {
            encoder: match coding {
                Coding::Gzip => Encoder::Gzip(flate2::write::GzEncoder::new(Vec::new(), level)),
                Coding::Deflate => Encoder::Deflate(flate2::write::ZlibEncoder::new(Vec::new(), level)),
            },
        }
    }

    /// Compresses a chunk; gives what the encoder has produced so far (possibly nothing).
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        let written = match &mut self.encoder {
            Encoder::Gzip(encoder) => encoder.write_all(chunk),
            Encoder::Deflate(encoder) => encoder.write_all(chunk),
        };
        debug_assert!(written.is_ok(), "writing to a Vec does not fail");
        let out = match &mut self.encoder {
            Encoder::Gzip(encoder) => encoder.get_mut(),
            Encoder::Deflate(encoder) => encoder.get_mut(),
        };
        Bytes::from(std::mem::take(out))
    }

    /// Ends the stream; gives the rest.
    pub fn finish(self) -> Bytes {
        let out = match self.encoder {
            Encoder::Gzip(encoder) => encoder.finish(),
            Encoder::Deflate(encoder) => encoder.finish(),
        };
        Bytes::from(out.unwrap_or_default())
    }
}

/// A whole message given as chunks, compressed; the chunks are read where they lie, never joined.
pub fn compress(coding: Coding, chunks: &[Bytes]) -> Vec<Bytes> {
    let mut compressor = Compressor::new(coding);
    let mut compressed: Vec<Bytes> = chunks.iter().map(|chunk| compressor.push(chunk)).collect();
    compressed.push(compressor.finish());
    compressed.retain(|chunk| !chunk.is_empty());
    compressed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: http::header::HeaderName, value: &'static str) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(name, http::HeaderValue::from_static(value));
        map
    }

    #[test]
    fn request_codings() {
        let coding = |value| request_coding(&headers(http::header::CONTENT_ENCODING, value));
        assert_eq!(coding("gzip").unwrap(), Some(Coding::Gzip));
        assert_eq!(coding("Deflate").unwrap(), Some(Coding::Deflate));
        assert_eq!(coding("identity").unwrap(), None);
        let refused = coding("br").unwrap_err();
        assert_eq!(refused.http_status(), 415);
        assert!(refused.message().contains("Content-Encoding 'br'"));
        assert!(coding("gzip, gzip").is_err());
    }

    #[test]
    fn q_values_choose_the_answer_coding() {
        let coding = |value| answer_coding(&headers(http::header::ACCEPT_ENCODING, value));
        assert_eq!(coding("gzip"), Some(Coding::Gzip));
        assert_eq!(coding("deflate, gzip;q=0.5"), Some(Coding::Deflate));
        assert_eq!(coding("gzip;q=0, deflate;q=0.1"), Some(Coding::Deflate));
        assert_eq!(coding("br, identity"), None);
        assert_eq!(coding("*"), Some(Coding::Gzip));
        assert_eq!(coding("deflate;q=0.8, gzip;q=0.8"), Some(Coding::Gzip));
    }

    #[test]
    fn round_trips_and_a_bomb_stops_at_the_limit() {
        for coding in [Coding::Gzip, Coding::Deflate] {
            let mut compressor = Compressor::new(coding);
            let mut compressed = compressor.push(b"hello ").to_vec();
            compressed.extend_from_slice(&compressor.push(b"gateway"));
            compressed.extend_from_slice(&compressor.finish());
            assert_eq!(
                &decompress(coding, &compressed, 100, "request body").unwrap()[..],
                b"hello gateway"
            );
            let mut bomb = Compressor::new(coding);
            let mut compressed = bomb.push(&vec![0u8; 10 << 20]).to_vec();
            compressed.extend_from_slice(&bomb.finish());
            let refused = decompress(coding, &compressed, 1 << 20, "request body").unwrap_err();
            assert_eq!(refused.http_status(), 413);
            let refused = decompress(coding, b"not compressed at all", 100, "request body").unwrap_err();
            assert!(
                refused.message().contains("does not decompress"),
                "{}",
                refused.message()
            );
        }
    }

    #[test]
    fn a_truncated_body_is_malformed_naming_its_coding_however_it_is_cut() {
        let data = vec![7u8; 100_000];
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), Compression::default());
        gzip.write_all(&data).unwrap();
        let gzip = gzip.finish().unwrap();
        let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), Compression::default());
        zlib.write_all(&data).unwrap();
        let zlib = zlib.finish().unwrap();
        for (coding, whole) in [(Coding::Gzip, &gzip), (Coding::Deflate, &zlib)] {
            assert_eq!(
                decompress(coding, whole, 1 << 20, "request body").unwrap().len(),
                data.len()
            );
            for cut in 1..whole.len() {
                let error = decompress(coding, &whole[..whole.len() - cut], 1 << 20, "request body").unwrap_err();
                assert_eq!(
                    error.http_status(),
                    400,
                    "{} cut by {cut}: {}",
                    coding.name(),
                    error.message()
                );
                assert!(
                    error
                        .message()
                        .contains(&format!("does not decompress as {}", coding.name())),
                    "{}",
                    error.message()
                );
            }
        }
    }
}

//! A new connection's opening, read by the gateway before any protocol engine takes it: HTTP/2's preface told from
//! an HTTP/1.1 request, each wait on the stream's readiness (never a poll on a timer), the first byte within the
//! idle time and the rest of a preface within the head's time limit, as an HTTP/1.1 head is held to; then the
//! stream rewound so hyper reads the preface itself.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// The first bytes of an HTTP/2 connection (RFC 9113, section 3.4).
pub const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a connection opened with.
#[derive(Debug, PartialEq, Eq)]
pub enum Opening {
    /// HTTP/2's whole preface, read off the stream.
    Preface,
    /// Other bytes (an HTTP/1.1 request's first), read off the stream.
    Other(BytesMut),
    /// The client closed the connection, the stream failed, or the idle or head time ran out.
    Closed,
}

/// Reads a connection's opening: its first bytes within `idle`, and once they began a preface, the rest of it
/// within `head` of the first.
pub async fn opening<S: AsyncRead + Unpin>(io: &mut S, idle: Duration, head: Duration) -> Opening {
    let mut read = [0u8; H2_PREFACE.len()];
    let mut seen = 0;
    let mut deadline = Instant::now() + idle;
    loop {
        match tokio::time::timeout_at(deadline, io.read(&mut read[seen..])).await {
            Ok(Ok(0) | Err(_)) | Err(_) => return Opening::Closed,
            Ok(Ok(count)) => {
                if seen == 0 {
                    deadline = Instant::now() + head;
                }
                seen += count;
            }
        }
        if read[..seen] != H2_PREFACE[..seen] {
            return Opening::Other(BytesMut::from(&read[..seen]));
        }
        if seen == H2_PREFACE.len() {
            return Opening::Preface;
        }
    }
}

/// `io` rewound after its preface, when it opened with one within the limits of [`opening`]; `None` when it did not
/// (it is closed).
pub async fn after_preface<S: AsyncRead + Unpin>(mut io: S, idle: Duration, head: Duration) -> Option<Rewound<S>> {
    (opening(&mut io, idle, head).await == Opening::Preface).then(|| Rewound::after_preface(io))
}

/// A DATA frame with less payload than this, not ending its stream, is a short one.
const SHORT_DATA: u32 = 64;
/// A read holding more short DATA frames than this puts the connection in short steps.
const SHORT_FRAMES_A_READ: u32 = 32;
/// A read in short steps takes at most this much.
const SHORT_STEP: usize = 4096;

/// A stream whose preface the gateway has read, read again by hyper before the rest; and whose HTTP/2 frames are
/// counted as they pass. hyper reads and keeps every frame it can before the tasks it has woken run, a few hundred
/// bytes of bookkeeping each: a client sending a flood of tiny DATA frames is read in short steps, yielding between
/// them, so the frames are taken off hyper's queues as fast as they are put there.
#[derive(Debug)]
pub struct Rewound<S> {
    preface: &'static [u8],
    io: S,
    frames: FrameCount,
    /// Reads are short and yield between them.
    short_steps: bool,
    /// The next read yields first.
    yield_next: bool,
}

/// Where the inbound frames stand: the header being read, or the payload being passed.
#[derive(Debug, Default)]
struct FrameCount {
    header: [u8; 9],
    header_read: usize,
    payload_left: u32,
}

impl FrameCount {
    /// Passes `bytes` of the frame stream; the short DATA frames whose headers were among them.
    fn pass(&mut self, mut bytes: &[u8]) -> u32 {
        let mut short = 0;
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let skipped = u32::try_from(bytes.len()).unwrap_or(u32::MAX).min(self.payload_left);
                bytes = &bytes[skipped as usize..];
                self.payload_left -= skipped;
                continue;
            }
            let taken = bytes.len().min(9 - self.header_read);
            self.header[self.header_read..self.header_read + taken].copy_from_slice(&bytes[..taken]);
            self.header_read += taken;
            bytes = &bytes[taken..];
            if self.header_read == 9 {
                self.header_read = 0;
                let length = u32::from_be_bytes([0, self.header[0], self.header[1], self.header[2]]);
                let (kind, flags) = (self.header[3], self.header[4]);
                // DATA (0) without END_STREAM (1).
                if kind == 0 && flags & 1 == 0 && length < SHORT_DATA {
                    short += 1;
                }
                self.payload_left = length;
            }
        }
        short
    }
}

impl<S> Rewound<S> {
    /// `io`, whose [`H2_PREFACE`] has been read off it.
    pub fn after_preface(io: S) -> Rewound<S> {
        Rewound {
            preface: H2_PREFACE,
            io,
            frames: FrameCount::default(),
            short_steps: false,
            yield_next: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewound<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if !self.preface.is_empty() {
            let taken = self.preface.len().min(buf.remaining());
            buf.put_slice(&self.preface[..taken]);
            self.preface = &self.preface[taken..];
            return Poll::Ready(Ok(()));
        }
        if self.yield_next {
            self.yield_next = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let this = &mut *self;
        let short = if this.short_steps {
            let mut step = [0u8; SHORT_STEP];
            let mut limited = ReadBuf::new(&mut step[..SHORT_STEP.min(buf.remaining())]);
            std::task::ready!(Pin::new(&mut this.io).poll_read(cx, &mut limited))?;
            buf.put_slice(limited.filled());
            this.frames.pass(limited.filled())
        } else {
            let before = buf.filled().len();
            std::task::ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
            this.frames.pass(&buf.filled()[before..])
        };
        this.short_steps = short > SHORT_FRAMES_A_READ;
        this.yield_next = this.short_steps;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewound<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test(start_paused = true)]
    async fn a_preface_begun_and_never_finished_is_closed_at_the_head_time_limit() {
        let (mut client, mut server) = tokio::io::duplex(64);
        client.write_all(&H2_PREFACE[..10]).await.unwrap();
        let started = Instant::now();
        let opened = opening(&mut server, Duration::from_secs(60), Duration::from_secs(3)).await;
        assert_eq!(opened, Opening::Closed);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(3),
            "closed at the head's limit, not the idle one"
        );
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_is_closed_at_the_idle_time() {
        let (_client, mut server) = tokio::io::duplex(64);
        let started = Instant::now();
        assert_eq!(
            opening(&mut server, Duration::from_secs(60), Duration::from_secs(3)).await,
            Opening::Closed
        );
        assert_eq!(started.elapsed(), Duration::from_secs(60));
    }

    #[tokio::test]
    async fn a_preface_in_pieces_is_read_whole_and_rewound_and_anything_else_is_handed_on() {
        let (mut client, mut server) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            for piece in H2_PREFACE.chunks(5) {
                client.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
            client.write_all(b"SETTINGS").await.unwrap();
            client
        });
        assert_eq!(
            opening(&mut server, Duration::from_secs(60), Duration::from_secs(3)).await,
            Opening::Preface
        );
        let _client = writer.await.unwrap();
        let mut rewound = Rewound::after_preface(server);
        let mut again = vec![0u8; H2_PREFACE.len() + 8];
        rewound.read_exact(&mut again).await.unwrap();
        assert_eq!(&again[..H2_PREFACE.len()], H2_PREFACE);
        assert_eq!(&again[H2_PREFACE.len()..], b"SETTINGS");

        let (mut client, mut server) = tokio::io::duplex(64);
        client.write_all(b"PRI / HTTP/1.1\r\n").await.unwrap();
        assert_eq!(
            opening(&mut server, Duration::from_secs(60), Duration::from_secs(3)).await,
            Opening::Other(BytesMut::from(&b"PRI / HTTP/1.1\r\n"[..]))
        );
    }

    #[test]
    fn short_data_frames_are_counted_however_the_stream_is_cut() {
        let frame = |kind: u8, flags: u8, payload: u16| {
            let [high, low] = payload.to_be_bytes();
            let mut bytes = vec![0, high, low, kind, flags, 0, 0, 0, 1];
            bytes.extend(std::iter::repeat_n(7u8, usize::from(payload)));
            bytes
        };
        let mut stream = Vec::new();
        for _ in 0..10 {
            stream.extend(frame(0, 0, 1));
        }
        // Long data, a short last frame of its stream, and a short frame of another kind: none is short data.
        stream.extend(frame(0, 0, 300));
        stream.extend(frame(0, 1, 1));
        stream.extend(frame(6, 0, 8));
        for size in 1..stream.len() {
            let mut count = FrameCount::default();
            let short: u32 = stream.chunks(size).map(|piece| count.pass(piece)).sum();
            assert_eq!(short, 10, "pieces of {size}");
            assert_eq!((count.header_read, count.payload_left), (0, 0));
        }
    }
}

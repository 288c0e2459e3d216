//! The front doors: thin adapters from REST and gRPC onto the one dispatch call.

pub mod budget;
pub mod epp;
pub mod flood;
pub mod grpc;
pub mod preface;
pub mod rest;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc;

pub use crate::headers::REQUEST_ID;

/// Connections waiting to be accepted, as pingora's listeners have it.
const BACKLOG: i32 = 65_535;

/// Binds a front door's listening socket (non-blocking, to be shared by the door's threads); fails with the OS's
/// reason.
pub fn bind(address: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(address),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if address.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.bind(&address.into())?;
    socket.listen(BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// A listening socket handed over by the previous process in a binary upgrade, taken by its descriptor.
#[allow(unsafe_code)]
pub fn inherited(fd: std::os::fd::RawFd) -> std::io::Result<std::net::TcpListener> {
    // SAFETY: pingora received this descriptor from the previous process over the upgrade socket; it is open and
    // nothing else in this process owns it. The socket is kept until the process ends (it stays registered with
    // pingora, which hands the same descriptor to the next process), so it is never closed twice.
    let socket = unsafe { <std::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// Runs `door` on a thread of its own with a single-threaded runtime. A front door runs one such thread per worker,
/// all accepting from one socket, so each connection lives on one thread from accept to close (after at most one
/// hand-over, see [`DoorThread`]) and no request wakes another thread. The runtime is built here, so a failure to build it
/// is the caller's to report.
pub fn spawn_door_thread<F>(name: String, door: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new().name(name).spawn(move || {
        // The thread's calls' deadlines share one timer (see `crate::deadlines`).
        crate::deadlines::install();
        runtime.spawn(crate::deadlines::keep());
        runtime.block_on(door)
    })?;
    Ok(())
}

/// A connection handed from the thread that accepted it to another, already counted as the other's.
type HandedConnection = (std::net::TcpStream, std::net::SocketAddr, Occupied);

/// How many connections each of a door's threads serves, and where to hand one to each of them.
#[derive(Debug)]
struct Spread {
    open: Vec<AtomicUsize>,
    inboxes: Vec<mpsc::UnboundedSender<HandedConnection>>,
    cap: ConnectionCap,
}

/// The most connections a listener holds open at once (`[limits] max_connections`), and the count of those closed
/// as they were accepted past it.
#[derive(Debug, Clone)]
pub struct ConnectionCap {
    pub most: usize,
    pub refused: Option<crate::telemetry::metrics::Counter>,
}

impl ConnectionCap {
    /// No cap (tests and tools).
    pub fn none() -> ConnectionCap {
        ConnectionCap {
            most: usize::MAX,
            refused: None,
        }
    }
}

impl Spread {
    /// Whether the listener holds as many connections as it may.
    fn full(&self) -> bool {
        self.open.iter().map(|open| open.load(Ordering::Relaxed)).sum::<usize>() >= self.cap.most
    }

    /// The thread serving fewest connections, when it serves fewer than `me`.
    fn fewer_than(&self, me: usize) -> Option<usize> {
        let mine = self.open[me].load(Ordering::Relaxed);
        (0..self.open.len())
            .filter(|&other| other != me && !self.inboxes[other].is_closed())
            .map(|other| (self.open[other].load(Ordering::Relaxed), other))
            .min()
            .filter(|&(theirs, _)| theirs < mine)
            .map(|(_, other)| other)
    }
}

/// One of a door's threads' places at its listening socket.
///
/// All of a door's threads accept from one socket, and the kernel gives a new connection to whichever thread asks
/// first: under a burst of new connections one thread can take nearly all of them while the other idles (measured:
/// 32 wrk connections opened at once, all 32 on one of two threads). So a thread that accepts a connection while it
/// serves more than another hands it, once, to the thread serving fewest, and connections stay spread within one of
/// each other across the threads. The hand-over is one wake-up of the other thread per connection, never per request.
#[derive(Debug)]
pub struct DoorThread {
    listener: std::net::TcpListener,
    place: ThreadPosition,
    inbox: mpsc::UnboundedReceiver<HandedConnection>,
}

/// Which of a door's threads this is, among the others.
#[derive(Debug)]
struct ThreadPosition {
    spread: Arc<Spread>,
    index: usize,
}

impl DoorThread {
    /// A place at `socket` for each of `threads` threads, which together hold at most `cap` connections.
    pub fn all(socket: &std::net::TcpListener, threads: usize, cap: ConnectionCap) -> std::io::Result<Vec<DoorThread>> {
        let (inboxes, receivers): (Vec<_>, Vec<_>) = (0..threads).map(|_| mpsc::unbounded_channel()).unzip();
        let spread = Arc::new(Spread {
            open: (0..threads).map(|_| AtomicUsize::new(0)).collect(),
            inboxes,
            cap,
        });
        receivers
            .into_iter()
            .enumerate()
            .map(|(index, inbox)| {
                Ok(DoorThread {
                    listener: socket.try_clone()?,
                    place: ThreadPosition {
                        spread: spread.clone(),
                        index,
                    },
                    inbox,
                })
            })
            .collect()
    }
}

impl ThreadPosition {
    /// A connection the thread `index` serves from now on, counted until it is dropped.
    fn occupy(&self, index: usize) -> Occupied {
        self.spread.open[index].fetch_add(1, Ordering::Relaxed);
        Occupied {
            spread: self.spread.clone(),
            index,
        }
    }

    /// Hands `stream` to a thread serving fewer connections (counted as its at once, so a burst of connections is
    /// spread as it comes); gives it back when none does, or none can take it.
    fn hand_over(&self, stream: tokio::net::TcpStream, peer: std::net::SocketAddr) -> Option<tokio::net::TcpStream> {
        let Some(other) = self.spread.fewer_than(self.index) else {
            return Some(stream);
        };
        let plain = stream.into_std().ok()?;
        match self.spread.inboxes[other].send((plain, peer, self.occupy(other))) {
            Ok(()) => None,
            Err(mpsc::error::SendError((plain, ..))) => tokio::net::TcpStream::from_std(plain).ok(),
        }
    }
}

/// A connection counted as served by its thread while it lives.
#[derive(Debug)]
pub struct Occupied {
    spread: Arc<Spread>,
    index: usize,
}

impl Drop for Occupied {
    fn drop(&mut self) {
        self.spread.open[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts connections at `seat` until `stop` resolves, handing each to `serve` (which spawns its task on this
/// thread, holding the connection's [`Occupied`] until it ends), or to another thread of the door serving fewer;
/// then closes the listening socket (connections still open are served on) and returns.
pub async fn accept_loop<F, S>(seat: DoorThread, door: &'static str, stop: S, mut serve: F)
where
    S: Future<Output = ()>,
    F: FnMut(tokio::net::TcpStream, std::net::SocketAddr, Occupied),
{
    let DoorThread {
        listener,
        place,
        mut inbox,
    } = seat;
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(door, %error, "cannot accept connections");
            return;
        }
    };
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some((stream, peer, occupied)) = inbox.recv() => {
                match tokio::net::TcpStream::from_std(stream) {
                    Ok(stream) => serve(stream, peer, occupied),
                    Err(error) => tracing::warn!(door, %error, "taking a connection from another thread failed"),
                }
                continue;
            }
            () = &mut stop => break,
        };
        match accepted {
            Ok((stream, _)) if place.spread.full() => {
                // Closed at once, before any of it is read: the client is told, where a backlog would keep it waiting.
                drop(stream);
                if let Some(refused) = &place.spread.cap.refused {
                    refused.inc();
                }
            }
            Ok((stream, peer)) => {
                if let Some(stream) = place.hand_over(stream, peer) {
                    serve(stream, peer, place.occupy(place.index));
                }
            }
            Err(error) => {
                tracing::warn!(door, %error, "accepting a connection failed");
                // Out of file descriptors and the like: accepting again at once would only spin.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
    // Connections handed here and not yet taken are served; no more can come.
    inbox.close();
    while let Ok((stream, peer, occupied)) = inbox.try_recv() {
        if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
            serve(stream, peer, occupied);
        }
    }
}

/// The largest request head (request line and headers, or an HTTP/2 header list) read; beyond it the answer is 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Streams a client may reset before the door has taken them up, after which its connection is closed with GOAWAY
/// (the HTTP/2 rapid-reset flood, CVE-2023-44487).
const MAX_PENDING_ACCEPT_RESETS: usize = 20;
/// Streams the door may reset for a client's protocol errors before closing its connection (the "MadeYouReset"
/// flood, CVE-2025-8671).
const MAX_LOCAL_ERROR_RESETS: usize = 256;

/// How often an HTTP/2 client connection is pinged, and how long its answer may take before the connection is
/// closed: a client that stops reading stops answering, and the answers waiting for it are let go.
/// How long the calls under way on an HTTP/2 door's connections get to finish once it stops (the process's grace
/// period bounds it too).
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);
const HTTP2_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(60);
const HTTP2_KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// The HTTP/2 settings both doors hold every client connection to: streams open at once, the header list's size,
/// the bounds on resets that close a flooding connection, and a keep-alive ping that a client which no longer reads
/// fails. HTTP/2's PING and SETTINGS are answered one at a time (h2 reads no further frame while an acknowledgement
/// waits), so a flood of them holds no memory.
pub fn http2_limits(
    builder: &mut hyper::server::conn::http2::Builder<hyper_util::rt::TokioExecutor>,
    max_streams: u32,
) {
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Some(HTTP2_KEEPALIVE))
        .keep_alive_timeout(HTTP2_KEEPALIVE_TIMEOUT)
        .max_concurrent_streams(max_streams)
        .max_header_list_size(u32::try_from(MAX_HEAD_BYTES).unwrap_or(u32::MAX))
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESETS)
        .max_local_error_reset_streams(MAX_LOCAL_ERROR_RESETS);
}

/// Resolves once the gateway is shutting down (never, if the signal's sender is gone).
pub async fn stopping(shutdown: &mut pingora::server::ShutdownWatch) {
    while !*shutdown.borrow_and_update() {
        if shutdown.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_one_thread_accepts_are_spread_over_the_door_threads() {
        let socket = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let address = socket.local_addr().unwrap();
        let (served, taken) = std::sync::mpsc::channel();
        for (index, seat) in DoorThread::all(&socket, 2, ConnectionCap::none())
            .unwrap()
            .into_iter()
            .enumerate()
        {
            let served = served.clone();
            spawn_door_thread(format!("spread-{index}"), async move {
                if index == 1 {
                    // Busy while the connections arrive: the other thread accepts them all.
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
                accept_loop(seat, "test", std::future::pending(), |stream, _, occupied| {
                    let _ = served.send((index, stream.into_std().unwrap(), occupied));
                })
                .await;
            })
            .unwrap();
        }
        let clients: Vec<_> = (0..16)
            .map(|_| std::net::TcpStream::connect(address).unwrap())
            .collect();
        let mut per_thread = [0; 2];
        let mut kept = Vec::new();
        for _ in &clients {
            let (index, stream, occupied) = taken.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
            per_thread[index] += 1;
            kept.push((stream, occupied));
        }
        assert_eq!(per_thread, [8, 8]);
    }
}

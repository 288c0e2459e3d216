//! The front doors: thin adapters from REST and gRPC onto the one dispatch call.

pub mod budget;
pub mod flood;
pub mod grpc;
pub mod paths;
pub mod rest;

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
/// all accepting from one socket (the kernel hands a new connection to a thread that is waiting for one), so each
/// connection lives on one thread from accept to close and no request wakes another thread. The runtime is built
/// here, so a failure to build it is the caller's to report.
pub fn spawn_door_thread<F>(name: String, door: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new()
        .name(name)
        .spawn(move || runtime.block_on(door))?;
    Ok(())
}

/// Accepts connections on `listener` until `stop` resolves, handing each to `serve` (which spawns its task on this
/// thread); then closes the listening socket (connections still open are served on) and returns.
pub async fn accept_loop<F, S>(listener: tokio::net::TcpListener, door: &'static str, stop: S, mut serve: F)
where
    S: Future<Output = ()>,
    F: FnMut(tokio::net::TcpStream, std::net::SocketAddr),
{
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        match accepted {
            Ok((stream, peer)) => serve(stream, peer),
            Err(error) => {
                tracing::warn!(door, %error, "accepting a connection failed");
                // Out of file descriptors and the like: accepting again at once would only spin.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
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

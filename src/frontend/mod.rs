//! The front doors: thin adapters from REST and gRPC onto the one dispatch call.

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

/// Resolves once the gateway is shutting down (never, if the signal's sender is gone).
pub async fn stopping(shutdown: &mut pingora::server::ShutdownWatch) {
    while !*shutdown.borrow_and_update() {
        if shutdown.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

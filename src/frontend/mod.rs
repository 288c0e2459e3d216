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

/// Runs `door` on a thread of its own with a single-threaded runtime. A front door runs one such thread per worker,
/// all accepting from one socket (the kernel hands a new connection to a thread that is waiting for one), so each
/// connection lives on one thread from accept to close and no request wakes another thread.
pub fn spawn_door_thread<F>(name: String, door: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    std::thread::Builder::new().name(name).spawn(move || {
        match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(runtime) => runtime.block_on(door),
            Err(error) => {
                tracing::error!(%error, "cannot start a front door thread");
                std::process::exit(1);
            }
        }
    })?;
    Ok(())
}

/// Resolves once the gateway is shutting down (never, if the signal's sender is gone).
pub async fn stopping(shutdown: &mut pingora::server::ShutdownWatch) {
    while !*shutdown.borrow_and_update() {
        if shutdown.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

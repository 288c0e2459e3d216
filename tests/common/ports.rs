//! Ports a test holds for as long as it needs them, so that no test running beside it can be given the same one.
//!
//! A socket bound to a port and never listening keeps the port: the kernel gives no other `bind` to port 0 a port that
//! a socket is bound to, and it refuses connections to it (there is nothing to accept them).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};

/// A socket bound to `address`, never listening; with `reuse`, a server that binds the same address with
/// SO_REUSEADDR may still take it (and listen on it) while this socket stays.
fn bound(address: SocketAddr, reuse: bool) -> std::io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(address), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(reuse)?;
    socket.bind(&address.into())?;
    Ok(socket)
}

fn port_of(socket: &Socket) -> u16 {
    socket.local_addr().unwrap().as_socket().expect("an IP socket").port()
}

/// A port held for a server the test starts on it later, and may stop and start again on it: a socket bound with
/// SO_REUSEADDR, never listening, kept while this lives. While no server listens there, connections to it are
/// refused; oipgate's listeners and model servers bind with SO_REUSEADDR, so they can take the port meanwhile.
#[derive(Debug)]
pub struct HeldPort {
    _sockets: Vec<Socket>,
    addresses: Vec<SocketAddr>,
}

/// A [`HeldPort`] on 127.0.0.1.
pub fn hold_port() -> HeldPort {
    hold_port_on(&[IpAddr::V4(Ipv4Addr::LOCALHOST)])
}

/// A [`HeldPort`]: one port, the same number on each of `ips`.
pub fn hold_port_on(ips: &[IpAddr]) -> HeldPort {
    let (first, others) = ips.split_first().expect("at least one address");
    for _ in 0..100 {
        let socket = bound(SocketAddr::new(*first, 0), true).expect("a port on the first address");
        let port = port_of(&socket);
        let mut sockets = vec![socket];
        // Another process may have the same number on one of the other addresses: then try another port.
        for ip in others {
            match bound(SocketAddr::new(*ip, port), true) {
                Ok(socket) => sockets.push(socket),
                Err(_) => break,
            }
        }
        if sockets.len() == ips.len() {
            let addresses = ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect();
            return HeldPort {
                _sockets: sockets,
                addresses,
            };
        }
    }
    panic!("no port free on all of {ips:?}");
}

impl HeldPort {
    /// The port number.
    pub fn port(&self) -> u16 {
        self.addresses[0].port()
    }

    /// The held port on the first address.
    pub fn address(&self) -> SocketAddr {
        self.addresses[0]
    }
}

impl fmt::Display for HeldPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.address())
    }
}

/// An address that refuses connections at once, for as long as this lives: a port on 127.0.0.1 bound without
/// SO_REUSEADDR and never listening, so that no server (of this test or another) can take it.
#[derive(Debug)]
pub struct DeadEndpoint {
    _socket: Socket,
    address: SocketAddr,
}

/// A [`DeadEndpoint`], refusing until it is dropped.
pub fn dead_endpoint() -> DeadEndpoint {
    let socket = bound(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), false).expect("a port");
    let address = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port_of(&socket));
    DeadEndpoint {
        _socket: socket,
        address,
    }
}

impl DeadEndpoint {
    /// The address (on 127.0.0.1).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The address as an upstream client's endpoint.
    pub fn endpoint(&self) -> oipgate::config::Endpoint {
        super::endpoint(self.address)
    }
}

impl fmt::Display for DeadEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.address)
    }
}

//! A replica's address as the configuration names it (`host:port`), read by the backends and the load sections alike.

use std::fmt;
use std::net::SocketAddr;

/// A replica's address: an IP address or a DNS name, and a port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Endpoint {
    /// Parses `host:port` (`[v6]:port` for IPv6); the host is an IP address or a DNS name.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(Endpoint {
                host: addr.ip().to_string(),
                port: addr.port(),
            });
        }
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| format!("\"{text}\" is not host:port"))?;
        let port: u16 = port.parse().map_err(|_| format!("\"{text}\" has no valid port"))?;
        let valid_name = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !valid_name || port == 0 {
            return Err(format!(
                "\"{text}\" is not host:port with an IP address or DNS name and a non-zero port"
            ));
        }
        Ok(Endpoint {
            host: host.to_owned(),
            port,
        })
    }
}

//! The `[listen]` and `[tls]` sections: where the front doors and the metrics listener bind, and the front doors'
//! TLS.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{Problems, file};

/// Default REST front door.
pub const DEFAULT_REST: &str = "127.0.0.1:8000";
/// The endpoint picker's address: the port the Gateway API Inference Extension's pickers serve on.
pub const DEFAULT_EPP: &str = "127.0.0.1:9002";
/// Default gRPC front door.
pub const DEFAULT_GRPC: &str = "127.0.0.1:8001";

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListen {
    /// REST front door, HTTP/1.1 and h2c on one port.
    pub rest: Option<String>,
    /// gRPC front door.
    pub grpc: Option<String>,
    /// Prometheus metrics.
    pub metrics: Option<String>,
    /// The endpoint picker's ext_proc service (`oipgate epp`).
    pub epp: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listen {
    pub rest: SocketAddr,
    pub grpc: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// Where `oipgate epp` serves Envoy's external processing and its gRPC health services.
    pub epp: SocketAddr,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerTls {
    /// PEM certificate chain, leaf first.
    pub cert: String,
    /// PEM private key.
    pub key: String,
    /// PEM CA bundle: when set, callers must present a certificate it signed (mTLS).
    pub client_ca: Option<String>,
    /// Whether the REST door speaks TLS (default true).
    pub rest: Option<bool>,
    /// Whether the gRPC door speaks TLS (default true).
    pub grpc: Option<bool>,
}

/// Certificate and key of the front doors, and the CA callers' certificates must chain to when mTLS is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub rest: bool,
    pub grpc: bool,
}

/// An `ip:port` address, or the default when none is given.
pub(super) fn address(
    problems: &mut Problems,
    path: &str,
    value: Option<&str>,
    default: Option<&str>,
) -> Option<SocketAddr> {
    let text = value.or(default)?;
    match text.parse() {
        Ok(addr) => Some(addr),
        Err(_) => {
            problems.add(path, format!("\"{text}\" is not an address (ip:port)"));
            None
        }
    }
}

/// The three listening addresses (REST and gRPC have defaults; they may not be the same); `None` when one of the
/// doors' addresses is wrong (the problem is recorded).
pub(super) fn validate_listen(problems: &mut Problems, listen: &RawListen) -> Option<Listen> {
    let rest = address(problems, "listen.rest", listen.rest.as_deref(), Some(DEFAULT_REST));
    let grpc = address(problems, "listen.grpc", listen.grpc.as_deref(), Some(DEFAULT_GRPC));
    let metrics = address(problems, "listen.metrics", listen.metrics.as_deref(), None);
    let epp = address(problems, "listen.epp", listen.epp.as_deref(), Some(DEFAULT_EPP));
    if rest.is_some() && rest == grpc && rest.is_some_and(|a| a.port() != 0) {
        problems.add("listen.grpc", "the gRPC address is the same as the REST address");
    }
    Some(Listen {
        rest: rest?,
        grpc: grpc?,
        metrics,
        epp: epp?,
    })
}

/// The front doors' certificate, key and client CA, relative paths taken from `base`.
pub(super) fn validate_tls(problems: &mut Problems, tls: Option<&RawServerTls>, base: &Path) -> Option<ServerTls> {
    tls.map(|tls| ServerTls {
        cert: file(problems, "tls.cert", &tls.cert, base),
        key: file(problems, "tls.key", &tls.key, base),
        client_ca: tls
            .client_ca
            .as_ref()
            .map(|ca| file(problems, "tls.client_ca", ca, base)),
        rest: tls.rest.unwrap_or(true),
        grpc: tls.grpc.unwrap_or(true),
    })
}

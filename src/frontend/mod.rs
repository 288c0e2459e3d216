//! The front doors: thin adapters from REST and gRPC onto the one dispatch call.

pub mod grpc;
pub mod paths;
pub mod rest;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue};

/// The header that identifies a request end to end.
pub const REQUEST_ID: &str = "x-request-id";
/// Headers passed on to backends unchanged: request identity and W3C trace context.
pub const FORWARDED: [&str; 3] = [REQUEST_ID, "traceparent", "tracestate"];

/// A request id unique within this process and unlikely to repeat across processes: start time and a counter.
pub fn new_request_id() -> HeaderValue {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = *START.get_or_init(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos() & u128::from(u64::MAX)).unwrap_or(0))
    });
    let id = format!("{start:016x}-{:08x}", NEXT.fetch_add(1, Ordering::Relaxed));
    HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("oipgate"))
}

/// The headers to forward from `incoming`, with a request id generated when the client sent none.
pub fn forwarded_headers(incoming: &HeaderMap) -> HeaderMap {
    let mut forward = HeaderMap::with_capacity(FORWARDED.len());
    for name in FORWARDED {
        if let Some(value) = incoming.get(name) {
            forward.insert(name, value.clone());
        }
    }
    if !forward.contains_key(REQUEST_ID) {
        forward.insert(REQUEST_ID, new_request_id());
    }
    forward
}

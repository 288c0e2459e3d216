//! Wire codecs: pure functions between bytes and the protocol model, with no I/O and no async runtime.

pub mod chunked;
pub mod compression;
pub mod decthings;
pub mod exposition;
pub mod http1;
pub mod model_config;
pub mod protobuf;
pub mod rest;
pub mod splice;

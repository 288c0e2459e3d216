//! The front doors: thin adapters from REST and gRPC onto the one dispatch call.

pub mod grpc;
pub mod paths;
pub mod rest;

pub use crate::headers::REQUEST_ID;

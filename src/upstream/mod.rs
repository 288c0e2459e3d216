//! Calls to backends: connection pools per endpoint, and the REST and gRPC clients the data paths use.

pub mod grpc;
pub mod rest;

pub use grpc::GrpcUpstream;
pub use rest::RestUpstream;

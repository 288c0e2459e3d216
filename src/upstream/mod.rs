//! Calls to backends: connection pools per endpoint, and the REST and gRPC clients the data paths use.

pub mod grpc;

pub use grpc::GrpcUpstream;

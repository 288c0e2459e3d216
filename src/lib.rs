//! oipgate: an inference gateway for the Open Inference Protocol (KServe V2).

pub mod app;
pub mod body;
pub mod cli;
pub mod codec;
pub mod config;
pub mod deadlines;
pub mod dispatch;
pub mod error;
pub mod frontend;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod guard;
pub mod headers;
pub mod live;
pub mod modelserver;
pub mod protocol;
pub mod routing;
pub mod runtime;
pub mod telemetry;
pub mod tls;
pub mod upstream;

pub mod proto {
    //! Generated protobuf types and gRPC service stubs for `package inference`.
    #![allow(clippy::all, missing_debug_implementations, unused_qualifications)]
    tonic::include_proto!("inference");

    /// The encoded descriptors of `proto/grpc_predict_v2.proto`, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/inference_descriptor.bin"));
}

pub mod envoy_api {
    //! Generated types and service stubs of Envoy's external processing API (`envoy.service.ext_proc.v3`), the
    //! protocol `oipgate epp` serves to a gateway's Envoy.
    #![allow(clippy::all, missing_debug_implementations, unused_qualifications, rustdoc::all)]
    include!(concat!(env!("OUT_DIR"), "/envoy_api.rs"));
}

pub use error::{Error, ErrorKind, Origin, Result};

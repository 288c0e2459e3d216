//! Triton's reserved parameters that the gateway acts on, whichever door a request came in by: the sequence a request
//! belongs to (`sequence_id`...), its `timeout`, and shared memory, which cannot cross a gateway. Every other
//! parameter (`priority`, `triton_*`, ...) passes to the backend untouched.

use std::time::Duration;

use super::{ParamValue, Parameters, Sequence};
use crate::error::{Error, Result};

/// Request parameter: the longest time, in microseconds, the request may take; it bounds the backend call as
/// `grpc-timeout` does (and still reaches the backend, which applies it too).
pub const TIMEOUT: &str = "timeout";
/// Request parameter: the request's priority, 1 the highest (Triton's); a model's `max_queue` never refuses a call of
/// priority 1 to its `shed_priority_below`.
pub const PRIORITY: &str = "priority";
/// Tensor parameters that point at a shared-memory region registered with one server: they mean nothing to another.
pub const SHARED_MEMORY: [&str; 3] = [
    "shared_memory_region",
    "shared_memory_byte_size",
    "shared_memory_offset",
];
/// What every shared-memory parameter begins with, for a quick look before any decoding.
pub const SHARED_MEMORY_PREFIX: &str = "shared_memory_";
/// The response parameter Triton sets on each response of a stream: whether it is its request's last.
pub const FINAL_RESPONSE: &str = "triton_final_response";
/// The request parameter that asks a decoupled model for an empty last response carrying the final flag.
pub const EMPTY_FINAL_RESPONSE: &str = "triton_enable_empty_final_response";

/// What a request's parameters ask of the gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reserved {
    pub sequence: Option<Sequence>,
    /// The request's own bound on its time, from `timeout`.
    pub timeout: Option<Duration>,
    /// Its `priority`, when it set one (0 is Triton's "the model's default": none).
    pub priority: Option<u64>,
}

impl Reserved {
    /// Reads the request-level parameters; a malformed reserved one is refused, naming it.
    pub fn from_parameters(parameters: &Parameters) -> Result<Reserved> {
        let timeout = match parameters.get(TIMEOUT) {
            None => None,
            Some(ParamValue::Int64(micros)) if *micros >= 0 => Some(Duration::from_micros(micros.unsigned_abs())),
            Some(ParamValue::Uint64(micros)) => Some(Duration::from_micros(*micros)),
            Some(other) => {
                return Err(Error::invalid(format!(
                    "parameter {TIMEOUT} must be a number of microseconds (an unsigned integer), not {}",
                    describe(other)
                )));
            }
        };
        let priority = match parameters.get(PRIORITY) {
            None => None,
            Some(ParamValue::Int64(level)) if *level >= 0 => Some(level.unsigned_abs()),
            Some(ParamValue::Uint64(level)) => Some(*level),
            Some(other) => {
                return Err(Error::invalid(format!(
                    "parameter {PRIORITY} must be an unsigned integer (1 is the highest), not {}",
                    describe(other)
                )));
            }
        };
        Ok(Reserved {
            sequence: Sequence::from_parameters(parameters)?,
            timeout: timeout.filter(|t| !t.is_zero()),
            priority: priority.filter(|level| *level > 0),
        })
    }
}

/// Refuses a tensor whose parameters point at shared memory: `kind` is "input" or "output".
pub fn refuse_shared_memory<'a>(kind: &str, name: &str, mut names: impl Iterator<Item = &'a str>) -> Result<()> {
    match names.find(|parameter| SHARED_MEMORY.contains(parameter)) {
        None => Ok(()),
        Some(parameter) => Err(shared_memory_error(kind, name, parameter)),
    }
}

/// The refusal of a tensor in shared memory.
pub fn shared_memory_error(kind: &str, name: &str, parameter: &str) -> Error {
    Error::invalid(format!(
        "{kind} '{name}' sets {parameter}: shared memory cannot cross a gateway (the region is registered with one \
         server, and the gateway may send the request to another); send the tensor's data in the request"
    ))
}

/// The refusal of a shared-memory parameter wherever it stands in a request (one read as it passes, before its
/// tensor is known).
pub fn shared_memory_anywhere(parameter: &str) -> Error {
    Error::invalid(format!(
        "the request sets {parameter}: shared memory cannot cross a gateway (the region is registered with one \
         server, and the gateway may send the request to another); send the tensor's data in the request"
    ))
}

/// The refusal of a shared-memory region's registration: the region is memory on the client's host.
pub fn shared_memory_registration_refused(kind: &str, name: &str) -> Error {
    Error::invalid(format!(
        "{kind} shared-memory region '{name}' cannot be registered through a gateway: the region is memory on the \
         client's host, and the gateway may send each request to another server; send the tensors' data in the \
         requests"
    ))
}

/// The shared-memory RPCs of a server that holds no regions (a gateway, whose requests go to other hosts): status
/// lists none, unregistering succeeds (a client's clean-up), registering is refused with `$refused(kind, name)`.
#[macro_export]
macro_rules! no_shared_memory_rpcs {
    ($refused:path) => {
        $crate::no_shared_memory_rpcs!(@ok system_shared_memory_status, SystemSharedMemoryStatusRequest, SystemSharedMemoryStatusResponse);
        $crate::no_shared_memory_rpcs!(@refused $refused, "system", system_shared_memory_register, SystemSharedMemoryRegisterRequest, SystemSharedMemoryRegisterResponse);
        $crate::no_shared_memory_rpcs!(@ok system_shared_memory_unregister, SystemSharedMemoryUnregisterRequest, SystemSharedMemoryUnregisterResponse);
        $crate::no_shared_memory_rpcs!(@ok cuda_shared_memory_status, CudaSharedMemoryStatusRequest, CudaSharedMemoryStatusResponse);
        $crate::no_shared_memory_rpcs!(@refused $refused, "CUDA", cuda_shared_memory_register, CudaSharedMemoryRegisterRequest, CudaSharedMemoryRegisterResponse);
        $crate::no_shared_memory_rpcs!(@ok cuda_shared_memory_unregister, CudaSharedMemoryUnregisterRequest, CudaSharedMemoryUnregisterResponse);
    };
    (@ok $method:ident, $request:ident, $response:ident) => {
        $crate::no_shared_memory_rpcs!(@rpc $method, $request, $response, _request => {
            Ok(tonic::Response::new($crate::proto::$response::default()))
        });
    };
    (@refused $refused:path, $kind:literal, $method:ident, $request:ident, $response:ident) => {
        $crate::no_shared_memory_rpcs!(@rpc $method, $request, $response, request => {
            Err($refused($kind, &request.get_ref().name).into())
        });
    };
    // Written as `#[async_trait]` writes an `async fn`: the attribute does not see into this macro's output.
    (@rpc $method:ident, $request:ident, $response:ident, $argument:ident => $answer:block) => {
        fn $method<'life0, 'async_trait>(
            &'life0 self,
            $argument: tonic::Request<$crate::proto::$request>,
        ) -> std::pin::Pin<
            Box<
                dyn std::future::Future<Output = Result<tonic::Response<$crate::proto::$response>, tonic::Status>>
                    + Send
                    + 'async_trait,
            >,
        >
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            let answer: Result<tonic::Response<$crate::proto::$response>, tonic::Status> = $answer;
            Box::pin(async move { answer })
        }
    };
}

fn describe(value: &ParamValue) -> String {
    match value {
        ParamValue::Int64(v) => format!("the negative number {v}"),
        other => format!("a {}", other.type_name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_is_microseconds() {
        let read = |value: ParamValue| Reserved::from_parameters(&[(TIMEOUT.to_owned(), value)].into_iter().collect());
        assert_eq!(
            read(ParamValue::Int64(1500)).unwrap().timeout,
            Some(Duration::from_micros(1500))
        );
        assert_eq!(
            read(ParamValue::Uint64(7)).unwrap().timeout,
            Some(Duration::from_micros(7))
        );
        assert_eq!(read(ParamValue::Int64(0)).unwrap().timeout, None);
        for bad in [
            ParamValue::Int64(-1),
            ParamValue::Double(1.0),
            ParamValue::String("5".into()),
        ] {
            assert!(read(bad).unwrap_err().message().contains("parameter timeout"));
        }
    }

    #[test]
    fn shared_memory_is_refused_by_name() {
        assert!(refuse_shared_memory("input", "x", ["priority"].into_iter()).is_ok());
        let refused = refuse_shared_memory("output", "y", ["shared_memory_region"].into_iter()).unwrap_err();
        assert!(refused.message().contains("output 'y' sets shared_memory_region"));
    }
}

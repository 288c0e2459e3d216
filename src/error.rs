//! The one error type: every failure carries its HTTP status, its gRPC code, where it came from and whether a retry
//! is safe, so REST and gRPC front doors answer the same condition the same way.

use std::fmt;

use http::StatusCode;
use tonic::Code;

/// What went wrong, as a class. Each class has exactly one HTTP status and one gRPC code ([`ErrorKind::faces`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Malformed or invalid request: 400 / INVALID_ARGUMENT.
    InvalidArgument,
    /// Unknown model, version or path: 404 / NOT_FOUND.
    NotFound,
    /// The path exists but not for this method: 405 / UNIMPLEMENTED.
    MethodNotAllowed,
    /// Request larger than the configured limit: 413 / RESOURCE_EXHAUSTED.
    PayloadTooLarge,
    /// Request target longer than the limit: 414 / INVALID_ARGUMENT.
    UriTooLong,
    /// A request body in a content coding the gateway does not read: 415 / UNIMPLEMENTED.
    UnsupportedEncoding,
    /// Overloaded or concurrency limit reached: 429 / RESOURCE_EXHAUSTED.
    Overloaded,
    /// Not implemented: 501 / UNIMPLEMENTED.
    Unimplemented,
    /// Backend unreachable, reset, or answered something unreadable: 502 / UNAVAILABLE.
    BadGateway,
    /// No healthy backend, or the backend says it is unavailable: 503 / UNAVAILABLE.
    Unavailable,
    /// Backend timed out: 504 / DEADLINE_EXCEEDED.
    Timeout,
    /// Internal fault: 500 / INTERNAL.
    Internal,
    /// Caller not authenticated: 401 / UNAUTHENTICATED.
    Unauthenticated,
    /// Caller not allowed: 403 / PERMISSION_DENIED.
    PermissionDenied,
    /// Conflicting state (already exists, aborted): 409 / ABORTED.
    Conflict,
    /// The system is not in a state to serve this: 400 / FAILED_PRECONDITION.
    FailedPrecondition,
    /// The caller went away: 499 / CANCELLED.
    Cancelled,
    /// The caller was too slow sending its request: 408 / DEADLINE_EXCEEDED.
    RequestTimeout,
}

/// The status nginx and others use for "client closed request"; no standard status exists.
pub const CLIENT_CLOSED_REQUEST: u16 = 499;

/// Whether `error`, or what caused it, is a connection that closed under a message: hyper's incomplete message, an
/// end of file inside a body, or a reset or broken pipe.
pub fn is_closed_connection(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(cause) = next {
        if cause
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
        {
            return true;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        next = cause.source();
    }
    false
}

impl ErrorKind {
    /// The HTTP status and gRPC code of this class. Exhaustive with no wildcard: a new class cannot forget a face.
    pub const fn faces(self) -> (u16, Code) {
        match self {
            ErrorKind::InvalidArgument => (400, Code::InvalidArgument),
            ErrorKind::NotFound => (404, Code::NotFound),
            ErrorKind::MethodNotAllowed => (405, Code::Unimplemented),
            ErrorKind::PayloadTooLarge => (413, Code::ResourceExhausted),
            ErrorKind::UriTooLong => (414, Code::InvalidArgument),
            ErrorKind::UnsupportedEncoding => (415, Code::Unimplemented),
            ErrorKind::Overloaded => (429, Code::ResourceExhausted),
            ErrorKind::Unimplemented => (501, Code::Unimplemented),
            ErrorKind::BadGateway => (502, Code::Unavailable),
            ErrorKind::Unavailable => (503, Code::Unavailable),
            ErrorKind::Timeout => (504, Code::DeadlineExceeded),
            ErrorKind::Internal => (500, Code::Internal),
            ErrorKind::Unauthenticated => (401, Code::Unauthenticated),
            ErrorKind::PermissionDenied => (403, Code::PermissionDenied),
            ErrorKind::Conflict => (409, Code::Aborted),
            ErrorKind::FailedPrecondition => (400, Code::FailedPrecondition),
            ErrorKind::Cancelled => (CLIENT_CLOSED_REQUEST, Code::Cancelled),
            ErrorKind::RequestTimeout => (408, Code::DeadlineExceeded),
        }
    }

    /// Whether sending the same request again may succeed without any change by the caller.
    pub const fn retryable_by_default(self) -> bool {
        match self {
            ErrorKind::BadGateway | ErrorKind::Unavailable | ErrorKind::Overloaded => true,
            ErrorKind::InvalidArgument
            | ErrorKind::NotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::PayloadTooLarge
            | ErrorKind::UriTooLong
            | ErrorKind::UnsupportedEncoding
            | ErrorKind::Unimplemented
            | ErrorKind::Timeout
            | ErrorKind::Internal
            | ErrorKind::Unauthenticated
            | ErrorKind::PermissionDenied
            | ErrorKind::Conflict
            | ErrorKind::FailedPrecondition
            | ErrorKind::Cancelled
            | ErrorKind::RequestTimeout => false,
        }
    }

    /// The class of an HTTP error status, by the same table read backwards.
    pub fn from_http_status(status: u16) -> ErrorKind {
        match status {
            400 => ErrorKind::InvalidArgument,
            401 => ErrorKind::Unauthenticated,
            403 => ErrorKind::PermissionDenied,
            404 => ErrorKind::NotFound,
            405 => ErrorKind::MethodNotAllowed,
            409 => ErrorKind::Conflict,
            413 => ErrorKind::PayloadTooLarge,
            414 => ErrorKind::UriTooLong,
            415 => ErrorKind::UnsupportedEncoding,
            429 => ErrorKind::Overloaded,
            CLIENT_CLOSED_REQUEST => ErrorKind::Cancelled,
            501 => ErrorKind::Unimplemented,
            502 => ErrorKind::BadGateway,
            503 => ErrorKind::Unavailable,
            504 => ErrorKind::Timeout,
            408 => ErrorKind::RequestTimeout,
            s if (400..500).contains(&s) => ErrorKind::InvalidArgument,
            _ => ErrorKind::Internal,
        }
    }

    /// The class of a gRPC status code, by the same table read backwards.
    pub fn from_grpc_code(code: Code) -> ErrorKind {
        match code {
            Code::InvalidArgument | Code::OutOfRange => ErrorKind::InvalidArgument,
            Code::NotFound => ErrorKind::NotFound,
            Code::ResourceExhausted => ErrorKind::Overloaded,
            Code::Unimplemented => ErrorKind::Unimplemented,
            Code::Unavailable => ErrorKind::Unavailable,
            Code::DeadlineExceeded => ErrorKind::Timeout,
            Code::Unauthenticated => ErrorKind::Unauthenticated,
            Code::PermissionDenied => ErrorKind::PermissionDenied,
            Code::AlreadyExists | Code::Aborted => ErrorKind::Conflict,
            Code::FailedPrecondition => ErrorKind::FailedPrecondition,
            Code::Cancelled => ErrorKind::Cancelled,
            Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => ErrorKind::Internal,
        }
    }
}

/// Who caused an error: the caller, a backend, or the gateway itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    Client,
    Upstream,
    Gateway,
}

/// A failure with both faces. A backend's own error keeps its exact status or code for callers of the same
/// protocol and crosses to the other protocol by the table in [`ErrorKind::faces`].
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    origin: Origin,
    retryable: bool,
    /// The request never reached the backend (refused or failed connection), so sending it elsewhere is safe.
    unsent: bool,
    message: String,
    upstream_http_status: Option<u16>,
    upstream_grpc_code: Option<Code>,
    /// When a call refused for a rate or a bound would be let in again (`Retry-After`).
    retry_after: Option<std::time::Duration>,
    /// What caused it, when another error did (an I/O error, a client library's error).
    cause: Option<std::sync::Arc<dyn std::error::Error + Send + Sync>>,
}

/// Two errors are equal when they say the same; their causes are not compared.
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        (
            self.kind,
            self.origin,
            self.retryable,
            self.unsent,
            &self.message,
            self.upstream_http_status,
            self.upstream_grpc_code,
            self.retry_after,
        ) == (
            other.kind,
            other.origin,
            other.retryable,
            other.unsent,
            &other.message,
            other.upstream_http_status,
            other.upstream_grpc_code,
            other.retry_after,
        )
    }
}

impl Eq for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, origin: Origin, message: impl Into<String>) -> Error {
        Error {
            kind,
            origin,
            retryable: kind.retryable_by_default(),
            unsent: false,
            message: message.into(),
            upstream_http_status: None,
            upstream_grpc_code: None,
            retry_after: None,
            cause: None,
        }
    }

    /// The same error, telling the client when to come back.
    pub fn with_retry_after(mut self, wait: std::time::Duration) -> Error {
        self.retry_after = Some(wait);
        self
    }

    /// `Retry-After` in whole seconds, at least 1 (HTTP has no finer unit).
    pub fn retry_after_seconds(&self) -> Option<u64> {
        self.retry_after
            .map(|wait| (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1))
    }

    /// The same error, caused by `cause` (kept for [`std::error::Error::source`], not shown in the message).
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Error {
        self.cause = Some(std::sync::Arc::new(cause));
        self
    }

    /// A malformed or invalid request from the caller.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, Origin::Client, message)
    }

    pub fn not_found(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::NotFound, Origin::Client, message)
    }

    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, Origin::Gateway, message)
    }

    /// A backend answered with an HTTP error status; REST callers get the same status back.
    pub fn from_upstream_http(status: u16, message: impl Into<String>) -> Error {
        let mut error = Error::new(ErrorKind::from_http_status(status), Origin::Upstream, message);
        error.upstream_http_status = Some(status);
        error
    }

    /// A backend answered with a gRPC error code; gRPC callers get the same code back.
    pub fn from_upstream_grpc(code: Code, message: impl Into<String>) -> Error {
        let mut error = Error::new(ErrorKind::from_grpc_code(code), Origin::Upstream, message);
        error.upstream_grpc_code = Some(code);
        error
    }

    /// Reclassifies a decoding failure of something a backend sent: the backend is at fault, not the caller.
    pub fn into_upstream_protocol_error(self) -> Error {
        let message = format!("backend sent an invalid response: {}", self.message);
        Error::new(ErrorKind::BadGateway, Origin::Upstream, message)
            .with_retryable(false)
            .caused_by(self)
    }

    /// Marks a failure that happened before any byte of the request reached the backend.
    pub fn unsent(mut self) -> Error {
        self.unsent = true;
        self
    }

    pub fn is_unsent(&self) -> bool {
        self.unsent
    }

    /// Whether the failure counts against the endpoint's health: it could not be reached, failed itself (5xx), or
    /// said it is unavailable. A request's own faults (4xx) do not, nor do timeouts, which a client's short deadline
    /// or a slow model cause as often as a sick endpoint.
    pub fn is_endpoint_failure(&self) -> bool {
        self.origin == Origin::Upstream
            && matches!(
                self.kind,
                ErrorKind::BadGateway | ErrorKind::Unavailable | ErrorKind::Internal
            )
    }

    pub fn with_retryable(mut self, retryable: bool) -> Error {
        self.retryable = retryable;
        self
    }

    /// Prefixes the message with context, such as which tensor or which field.
    pub fn context(mut self, context: impl fmt::Display) -> Error {
        self.message = format!("{context}: {}", self.message);
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn origin(&self) -> Origin {
        self.origin
    }

    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The HTTP status REST callers see.
    pub fn http_status(&self) -> StatusCode {
        let code = self.upstream_http_status.unwrap_or(self.kind.faces().0);
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The gRPC code gRPC callers see.
    pub fn grpc_code(&self) -> Code {
        self.upstream_grpc_code.unwrap_or(self.kind.faces().1)
    }

    pub fn to_grpc_status(&self) -> tonic::Status {
        let mut status = tonic::Status::new(self.grpc_code(), self.message.clone());
        if let Some(seconds) = self.retry_after_seconds() {
            status.metadata_mut().insert(RETRY_AFTER, seconds.into());
        }
        status
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|cause| cause as &(dyn std::error::Error + 'static))
    }
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> tonic::Status {
        error.to_grpc_status()
    }
}

/// gRPC metadata with `Retry-After`'s meaning, on a RESOURCE_EXHAUSTED from a rate limit.
pub const RETRY_AFTER: &str = "retry-after";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_keeps_its_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let error = Error::new(ErrorKind::BadGateway, Origin::Upstream, "backend b broke off").caused_by(io);
        let cause = std::error::Error::source(&error).expect("a cause");
        assert_eq!(cause.to_string(), "reset by peer");
        let wrapped = Error::invalid("bad JSON").into_upstream_protocol_error();
        assert_eq!(std::error::Error::source(&wrapped).unwrap().to_string(), "bad JSON");
    }

    #[test]
    fn table_of_the_protocol_core_issue() {
        let table = [
            (ErrorKind::InvalidArgument, 400, Code::InvalidArgument),
            (ErrorKind::NotFound, 404, Code::NotFound),
            (ErrorKind::PayloadTooLarge, 413, Code::ResourceExhausted),
            (ErrorKind::Overloaded, 429, Code::ResourceExhausted),
            (ErrorKind::Unimplemented, 501, Code::Unimplemented),
            (ErrorKind::BadGateway, 502, Code::Unavailable),
            (ErrorKind::Unavailable, 503, Code::Unavailable),
            (ErrorKind::Timeout, 504, Code::DeadlineExceeded),
            (ErrorKind::Internal, 500, Code::Internal),
        ];
        for (kind, status, code) in table {
            let error = Error::new(kind, Origin::Gateway, "x");
            assert_eq!(error.http_status().as_u16(), status, "{kind:?}");
            assert_eq!(error.grpc_code(), code, "{kind:?}");
        }
    }

    #[test]
    fn upstream_http_error_keeps_status_and_crosses_to_grpc() {
        let error = Error::from_upstream_http(404, "model 'x' not found");
        assert_eq!(error.http_status(), StatusCode::NOT_FOUND);
        assert_eq!(error.grpc_code(), Code::NotFound);
        assert_eq!(error.origin(), Origin::Upstream);
        let unusual = Error::from_upstream_http(422, "unprocessable");
        assert_eq!(unusual.http_status().as_u16(), 422);
        assert_eq!(unusual.grpc_code(), Code::InvalidArgument);
        assert_eq!(Error::from_upstream_http(503, "busy").grpc_code(), Code::Unavailable);
        assert_eq!(
            Error::from_upstream_http(504, "slow").grpc_code(),
            Code::DeadlineExceeded
        );
        assert_eq!(Error::from_upstream_http(500, "boom").grpc_code(), Code::Internal);
    }

    #[test]
    fn upstream_grpc_error_keeps_code_and_crosses_to_http() {
        let error = Error::from_upstream_grpc(Code::OutOfRange, "index out of range");
        assert_eq!(error.grpc_code(), Code::OutOfRange);
        assert_eq!(error.http_status(), StatusCode::BAD_REQUEST);
        let cases = [
            (Code::InvalidArgument, 400),
            (Code::NotFound, 404),
            (Code::ResourceExhausted, 429),
            (Code::Unimplemented, 501),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
            (Code::Internal, 500),
            (Code::Unknown, 500),
        ];
        for (code, status) in cases {
            let error = Error::from_upstream_grpc(code, "m");
            assert_eq!(error.http_status().as_u16(), status, "{code:?}");
            assert_eq!(error.grpc_code(), code);
            assert_eq!(error.message(), "m");
        }
    }

    #[test]
    fn retry_safety_and_origin() {
        assert!(Error::new(ErrorKind::BadGateway, Origin::Upstream, "reset").is_retryable());
        assert!(!Error::invalid("bad").is_retryable());
        assert_eq!(Error::invalid("bad").origin(), Origin::Client);
        let reclassified = Error::invalid("truncated").into_upstream_protocol_error();
        assert_eq!(reclassified.http_status(), StatusCode::BAD_GATEWAY);
        assert_eq!(reclassified.origin(), Origin::Upstream);
        assert!(reclassified.message().contains("truncated"));
    }

    #[test]
    fn grpc_status_carries_message() {
        let status: tonic::Status = Error::not_found("unknown model 'm'").into();
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(status.message(), "unknown model 'm'");
    }
}

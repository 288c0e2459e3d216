//! The protocol's REST paths: which endpoint a path names, and the one method each answers.

use http::Method;

use crate::protocol::StreamCall;

/// Which endpoint a path names.
#[derive(Debug, PartialEq, Eq)]
pub enum Route<'a> {
    ServerMetadata,
    Live,
    Ready,
    ModelMetadata(&'a str, Option<&'a str>),
    ModelReady(&'a str, Option<&'a str>),
    Infer(&'a str, Option<&'a str>),
    /// Triton's generate extension (`generate`, `generate_stream`) and MLServer's `infer_stream`.
    Generate(&'a str, Option<&'a str>, StreamCall),
    /// Triton's configuration of a model.
    ModelConfig(&'a str, Option<&'a str>),
    /// Triton's statistics of one model (at one version) or, without a model, of every model.
    ModelStatistics(Option<&'a str>, Option<&'a str>),
    RepositoryIndex,
    RepositoryLoad(&'a str),
    RepositoryUnload(&'a str),
    /// Triton's shared-memory extensions: the regions registered (of one region, or all), a region's registration,
    /// and its (or every region's) unregistration.
    SharedMemoryStatus(SharedMemory),
    SharedMemoryRegister(SharedMemory, &'a str),
    SharedMemoryUnregister(SharedMemory),
}

/// Which of Triton's shared-memory extensions an endpoint belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedMemory {
    System,
    Cuda,
}

impl SharedMemory {
    /// How the extension names the regions, in messages.
    pub fn kind(self) -> &'static str {
        match self {
            SharedMemory::System => "system",
            SharedMemory::Cuda => "CUDA",
        }
    }

    fn from_segment(segment: &str) -> Option<SharedMemory> {
        match segment {
            "systemsharedmemory" => Some(SharedMemory::System),
            "cudasharedmemory" => Some(SharedMemory::Cuda),
            _ => None,
        }
    }
}

impl Route<'_> {
    /// The one method each endpoint answers.
    pub fn method(&self) -> Method {
        match self {
            Route::ServerMetadata
            | Route::Live
            | Route::Ready
            | Route::ModelMetadata(..)
            | Route::ModelReady(..)
            | Route::ModelConfig(..)
            | Route::ModelStatistics(..)
            | Route::SharedMemoryStatus(_) => Method::GET,
            Route::Infer(..)
            | Route::Generate(..)
            | Route::RepositoryIndex
            | Route::RepositoryLoad(_)
            | Route::RepositoryUnload(_)
            | Route::SharedMemoryRegister(..)
            | Route::SharedMemoryUnregister(_) => Method::POST,
        }
    }
}

impl<'a> Route<'a> {
    /// The endpoint's path with its model and version left as placeholders: a request's span name, the same for
    /// every model.
    pub fn template(&self) -> &'static str {
        match self {
            Route::ServerMetadata => "GET /v2",
            Route::Live => "GET /v2/health/live",
            Route::Ready => "GET /v2/health/ready",
            Route::ModelMetadata(..) => "GET /v2/models/{model}",
            Route::ModelReady(..) => "GET /v2/models/{model}/ready",
            Route::Infer(..) => "POST /v2/models/{model}/infer",
            Route::Generate(.., StreamCall::Generate) => "POST /v2/models/{model}/generate",
            Route::Generate(.., StreamCall::GenerateStream) => "POST /v2/models/{model}/generate_stream",
            Route::Generate(.., StreamCall::InferStream) => "POST /v2/models/{model}/infer_stream",
            Route::ModelConfig(..) => "GET /v2/models/{model}/config",
            Route::ModelStatistics(..) => "GET /v2/models/{model}/stats",
            Route::RepositoryIndex => "POST /v2/repository/index",
            Route::RepositoryLoad(_) => "POST /v2/repository/models/{model}/load",
            Route::RepositoryUnload(_) => "POST /v2/repository/models/{model}/unload",
            Route::SharedMemoryStatus(SharedMemory::System) => "GET /v2/systemsharedmemory/status",
            Route::SharedMemoryStatus(SharedMemory::Cuda) => "GET /v2/cudasharedmemory/status",
            Route::SharedMemoryRegister(SharedMemory::System, _) => {
                "POST /v2/systemsharedmemory/region/{region}/register"
            }
            Route::SharedMemoryRegister(SharedMemory::Cuda, _) => "POST /v2/cudasharedmemory/region/{region}/register",
            Route::SharedMemoryUnregister(SharedMemory::System) => "POST /v2/systemsharedmemory/unregister",
            Route::SharedMemoryUnregister(SharedMemory::Cuda) => "POST /v2/cudasharedmemory/unregister",
        }
    }

    /// The public model the endpoint is about, if one.
    pub fn model(&self) -> Option<&'a str> {
        match *self {
            Route::ModelMetadata(model, _)
            | Route::ModelReady(model, _)
            | Route::Infer(model, _)
            | Route::Generate(model, _, _)
            | Route::ModelConfig(model, _)
            | Route::ModelStatistics(Some(model), _)
            | Route::RepositoryLoad(model)
            | Route::RepositoryUnload(model) => Some(model),
            Route::ServerMetadata
            | Route::Live
            | Route::Ready
            | Route::ModelStatistics(None, _)
            | Route::RepositoryIndex
            | Route::SharedMemoryStatus(_)
            | Route::SharedMemoryRegister(..)
            | Route::SharedMemoryUnregister(_) => None,
        }
    }
}

pub fn route(path: &str) -> Option<Route<'_>> {
    let rest = path.strip_prefix("/v2")?;
    if !rest.is_empty() && !rest.starts_with('/') {
        return None;
    }
    // No route has more than five segments: they are gathered without an allocation. The slashes are found byte by
    // byte: segments are short, and `split`'s search costs more to set up than the few bytes it would skip.
    let mut gathered = [""; 5];
    let mut count = 0;
    let mut start = 1;
    for end in (1..=rest.len()).filter(|&at| at == rest.len() || rest.as_bytes()[at] == b'/') {
        *gathered.get_mut(count)? = rest.get(start..end)?;
        count += 1;
        start = end + 1;
    }
    Some(match &gathered[..count] {
        [] | [""] => Route::ServerMetadata,
        ["health", "live"] => Route::Live,
        ["health", "ready"] => Route::Ready,
        ["repository", "index"] => Route::RepositoryIndex,
        ["repository", "models", model, "load"] => Route::RepositoryLoad(model),
        ["repository", "models", model, "unload"] => Route::RepositoryUnload(model),
        // As Triton reads it: statistics of every model, not the metadata of a model called "stats".
        ["models", "stats"] => Route::ModelStatistics(None, None),
        ["models", model] => Route::ModelMetadata(model, None),
        ["models", model, "stats"] => Route::ModelStatistics(Some(model), None),
        ["models", model, "config"] => Route::ModelConfig(model, None),
        ["models", model, "versions", version, "config"] => Route::ModelConfig(model, Some(version)),
        ["models", model, "versions", version, "stats"] => Route::ModelStatistics(Some(model), Some(version)),
        ["models", model, "ready"] => Route::ModelReady(model, None),
        ["models", model, "infer"] => Route::Infer(model, None),
        ["models", model, call] if stream_call(call).is_some() => Route::Generate(model, None, stream_call(call)?),
        ["models", model, "versions", version, call] if stream_call(call).is_some() => {
            Route::Generate(model, Some(version), stream_call(call)?)
        }
        ["models", model, "versions", version] => Route::ModelMetadata(model, Some(version)),
        ["models", model, "versions", version, "ready"] => Route::ModelReady(model, Some(version)),
        ["models", model, "versions", version, "infer"] => Route::Infer(model, Some(version)),
        [memory, "status"] => Route::SharedMemoryStatus(SharedMemory::from_segment(memory)?),
        [memory, "region", _, "status"] => Route::SharedMemoryStatus(SharedMemory::from_segment(memory)?),
        [memory, "region", region, "register"] => {
            Route::SharedMemoryRegister(SharedMemory::from_segment(memory)?, region)
        }
        [memory, "unregister"] | [memory, "region", _, "unregister"] => {
            Route::SharedMemoryUnregister(SharedMemory::from_segment(memory)?)
        }
        _ => return None,
    })
}

/// The streaming call a path's last segment names.
fn stream_call(segment: &str) -> Option<StreamCall> {
    [
        StreamCall::Generate,
        StreamCall::GenerateStream,
        StreamCall::InferStream,
    ]
    .into_iter()
    .find(|call| call.path_segment() == segment)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route("/v2"), Some(Route::ServerMetadata));
        assert_eq!(route("/v2/"), Some(Route::ServerMetadata));
        assert_eq!(
            route("/v2/models/m/versions/2/generate_stream"),
            Some(Route::Generate("m", Some("2"), StreamCall::GenerateStream))
        );
        assert_eq!(
            route("/v2/models/m/generate"),
            Some(Route::Generate("m", None, StreamCall::Generate))
        );
        assert_eq!(
            route("/v2/models/m/infer_stream"),
            Some(Route::Generate("m", None, StreamCall::InferStream))
        );
        assert_eq!(
            route("/v2/models/m/versions/2/infer"),
            Some(Route::Infer("m", Some("2")))
        );
        assert_eq!(route("/v2/models/m/ready"), Some(Route::ModelReady("m", None)));
        assert_eq!(
            route("/v2/repository/models/m/unload"),
            Some(Route::RepositoryUnload("m"))
        );
        assert_eq!(route("/v2/models/stats"), Some(Route::ModelStatistics(None, None)));
        assert_eq!(
            route("/v2/models/m/versions/3/stats"),
            Some(Route::ModelStatistics(Some("m"), Some("3")))
        );
        assert_eq!(
            route("/v2/systemsharedmemory/region/r/status"),
            Some(Route::SharedMemoryStatus(SharedMemory::System))
        );
        assert_eq!(
            route("/v2/cudasharedmemory/region/r/register"),
            Some(Route::SharedMemoryRegister(SharedMemory::Cuda, "r"))
        );
        assert_eq!(
            route("/v2/systemsharedmemory/unregister"),
            Some(Route::SharedMemoryUnregister(SharedMemory::System))
        );
        assert_eq!(route("/v2/othersharedmemory/status"), None);
        assert_eq!(route("/v2/models/m/versions"), None);
        assert_eq!(route("/v2/models/m/versions/2/infer/more"), None);
        assert_eq!(route("/v1/models/m"), None);
        assert_eq!(route("/v2x"), None);
    }
}

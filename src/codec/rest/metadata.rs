//! JSON objects of the health, metadata and error answers.

use serde::{Deserialize, Serialize};

use super::json_error;
use crate::error::Error;
use crate::error::Result;
use crate::protocol::{
    ModelIndexEntry, ModelMetadata, ModelReady, RepositoryParameters, RepositoryValue, ServerLive, ServerMetadata,
    ServerReady, TensorMetadata,
};

#[derive(Serialize, Deserialize)]
struct TensorMetadataJson {
    name: String,
    datatype: String,
    shape: Vec<i64>,
}

/// KServe answers `null` for members it has no value for (`"versions": null`, `"inputs": null`); read as empty.
fn null_as_default<'de, D, T>(deserializer: D) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

#[derive(Serialize, Deserialize)]
struct ModelMetadataJson {
    name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_default")]
    versions: Vec<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    platform: String,
    #[serde(default, deserialize_with = "null_as_default")]
    inputs: Vec<TensorMetadataJson>,
    #[serde(default, deserialize_with = "null_as_default")]
    outputs: Vec<TensorMetadataJson>,
}

#[derive(Serialize, Deserialize)]
struct ServerMetadataJson {
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    version: String,
    #[serde(default, deserialize_with = "null_as_default")]
    extensions: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct ErrorJson<'a> {
    error: &'a str,
}

#[derive(Deserialize)]
struct HealthJson {
    live: Option<bool>,
    ready: Option<bool>,
    name: Option<String>,
}

fn to_vec<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain structs into a Vec cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

fn tensors_to_doc(tensors: &[TensorMetadata]) -> Vec<TensorMetadataJson> {
    tensors
        .iter()
        .map(|t| TensorMetadataJson {
            name: t.name.clone(),
            datatype: t.datatype.clone(),
            shape: t.shape.clone(),
        })
        .collect()
}

fn tensors_from_doc(tensors: Vec<TensorMetadataJson>) -> Vec<TensorMetadata> {
    tensors
        .into_iter()
        .map(|t| TensorMetadata {
            name: t.name,
            datatype: t.datatype,
            shape: t.shape,
        })
        .collect()
}

pub fn encode_model_metadata(metadata: &ModelMetadata) -> Vec<u8> {
    to_vec(&ModelMetadataJson {
        name: metadata.name.clone(),
        versions: metadata.versions.clone(),
        platform: metadata.platform.clone(),
        inputs: tensors_to_doc(&metadata.inputs),
        outputs: tensors_to_doc(&metadata.outputs),
    })
}

pub fn decode_model_metadata(body: &[u8]) -> Result<ModelMetadata> {
    let doc: ModelMetadataJson = serde_json::from_slice(body).map_err(|e| json_error("model metadata", &e))?;
    Ok(ModelMetadata {
        name: doc.name,
        versions: doc.versions,
        platform: doc.platform,
        inputs: tensors_from_doc(doc.inputs),
        outputs: tensors_from_doc(doc.outputs),
    })
}

pub fn encode_server_metadata(metadata: &ServerMetadata) -> Vec<u8> {
    to_vec(&ServerMetadataJson {
        name: metadata.name.clone(),
        version: metadata.version.clone(),
        extensions: metadata.extensions.clone(),
    })
}

pub fn decode_server_metadata(body: &[u8]) -> Result<ServerMetadata> {
    let doc: ServerMetadataJson = serde_json::from_slice(body).map_err(|e| json_error("server metadata", &e))?;
    Ok(ServerMetadata {
        name: doc.name,
        version: doc.version,
        extensions: doc.extensions,
    })
}

pub fn encode_server_live(live: ServerLive) -> Vec<u8> {
    if live.live {
        b"{\"live\":true}".to_vec()
    } else {
        b"{\"live\":false}".to_vec()
    }
}

/// The protocol's text shows `"live"` in the server-ready object, a slip; servers answer `"ready"`. Both are read.
pub fn encode_server_ready(ready: ServerReady) -> Vec<u8> {
    if ready.ready {
        b"{\"ready\":true}".to_vec()
    } else {
        b"{\"ready\":false}".to_vec()
    }
}

pub fn encode_model_ready(ready: &ModelReady) -> Vec<u8> {
    #[derive(Serialize)]
    struct ModelReadyJson<'a> {
        name: &'a str,
        ready: bool,
    }
    to_vec(&ModelReadyJson {
        name: &ready.name,
        ready: ready.ready,
    })
}

fn decode_health(status_ok: bool, body: &[u8], what: &str) -> Result<HealthJson> {
    if body.iter().all(u8::is_ascii_whitespace) {
        // Triton answers health checks with an empty body: the status alone tells.
        return Ok(HealthJson {
            live: Some(status_ok),
            ready: Some(status_ok),
            name: None,
        });
    }
    serde_json::from_slice(body).map_err(|e| json_error(what, &e))
}

/// Reads a server-live answer; `status_ok` is whether the HTTP status was 2xx.
pub fn decode_server_live(status_ok: bool, body: &[u8]) -> Result<ServerLive> {
    let doc = decode_health(status_ok, body, "server live")?;
    Ok(ServerLive {
        live: status_ok && doc.live.or(doc.ready).unwrap_or(status_ok),
    })
}

/// Reads a server-ready answer; `status_ok` is whether the HTTP status was 2xx.
pub fn decode_server_ready(status_ok: bool, body: &[u8]) -> Result<ServerReady> {
    let doc = decode_health(status_ok, body, "server ready")?;
    Ok(ServerReady {
        ready: status_ok && doc.ready.or(doc.live).unwrap_or(status_ok),
    })
}

/// Reads a model-ready answer; `status_ok` is whether the HTTP status was 2xx.
pub fn decode_model_ready(status_ok: bool, body: &[u8], model: &str) -> Result<ModelReady> {
    let doc = decode_health(status_ok, body, "model ready")?;
    Ok(ModelReady {
        name: doc.name.unwrap_or_else(|| model.to_owned()),
        ready: status_ok && doc.ready.unwrap_or(status_ok),
    })
}

/// The body of a repository index answer: a JSON array of `{name, version, state, reason}`, as Triton answers.
pub fn encode_repository_index(entries: &[ModelIndexEntry]) -> Vec<u8> {
    #[derive(Serialize)]
    struct IndexEntryJson<'a> {
        name: &'a str,
        version: &'a str,
        state: &'a str,
        reason: &'a str,
    }
    let docs: Vec<IndexEntryJson<'_>> = entries
        .iter()
        .map(|e| IndexEntryJson {
            name: &e.name,
            version: &e.version,
            state: e.state.as_str(),
            reason: &e.reason,
        })
        .collect();
    to_vec(&docs)
}

/// Reads a repository index request body: empty, or `{"ready": bool}` (with Triton's optional
/// `repository_name`, which names no repository the gateway could pick). Gives whether only ready models are wanted.
pub fn decode_repository_index_request(body: &[u8]) -> Result<bool> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct IndexRequestJson {
        #[serde(default)]
        ready: bool,
        #[serde(default, rename = "repository_name")]
        _repository_name: Option<String>,
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(false);
    }
    let doc: IndexRequestJson =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("invalid repository index request: {e}")))?;
    Ok(doc.ready)
}

/// `{"error": "<message>"}`, the body of every REST error.
pub fn encode_error(message: &str) -> Vec<u8> {
    to_vec(&ErrorJson { error: message })
}

/// The message of an error body: the protocol's `{"error": ...}`, KServe's `{"code": N, "message": ...}`, FastAPI's
/// `{"detail": ...}`, or else the body's text.
pub fn decode_error(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct AnyError {
        error: Option<serde_json::Value>,
        message: Option<serde_json::Value>,
        detail: Option<serde_json::Value>,
    }
    let text = || String::from_utf8_lossy(body).trim().to_owned();
    match serde_json::from_slice::<AnyError>(body) {
        Ok(doc) => match doc.error.or(doc.message).or(doc.detail) {
            Some(serde_json::Value::String(s)) => s,
            Some(other) => other.to_string(),
            None => text(),
        },
        Err(_) => text(),
    }
}

/// Triton's prefix of a load parameter that carries a file's contents, in base64 over REST.
const FILE_PARAMETER: &str = "file:";

/// Reads a repository load or unload request body: empty, or `{"parameters": {...}}` whose values are strings,
/// booleans or integers (a `file:<path>` value is the file's contents in base64).
pub fn decode_repository_request(body: &[u8]) -> Result<RepositoryParameters> {
    use base64::Engine as _;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(RepositoryParameters::new());
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct RepositoryRequestJson {
        #[serde(default)]
        parameters: serde_json::Map<String, serde_json::Value>,
    }
    let doc: RepositoryRequestJson =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("invalid repository request: {e}")))?;
    let mut parameters = RepositoryParameters::new();
    for (name, value) in doc.parameters {
        let value = match value {
            serde_json::Value::String(text) if name.starts_with(FILE_PARAMETER) => RepositoryValue::Bytes(
                base64::engine::general_purpose::STANDARD
                    .decode(text.as_bytes())
                    .map_err(|e| Error::invalid(format!("repository parameter \"{name}\" is not base64: {e}")))?
                    .into(),
            ),
            serde_json::Value::String(text) => RepositoryValue::String(text),
            serde_json::Value::Bool(flag) => RepositoryValue::Bool(flag),
            serde_json::Value::Number(number) if number.is_i64() => {
                RepositoryValue::Int64(number.as_i64().unwrap_or_default())
            }
            _ => {
                return Err(Error::invalid(format!(
                    "repository parameter \"{name}\" must be a string, a bool or an integer"
                )));
            }
        };
        parameters.insert(name, value);
    }
    Ok(parameters)
}

/// Writes a repository load or unload request body (bytes values in base64).
pub fn encode_repository_request(parameters: &RepositoryParameters) -> Vec<u8> {
    use base64::Engine as _;
    let values: serde_json::Map<String, serde_json::Value> = parameters
        .iter()
        .map(|(name, value)| {
            let value = match value {
                RepositoryValue::Bool(flag) => serde_json::Value::Bool(*flag),
                RepositoryValue::Int64(number) => serde_json::Value::from(*number),
                RepositoryValue::String(text) => serde_json::Value::String(text.clone()),
                RepositoryValue::Bytes(bytes) => {
                    serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            (name.clone(), value)
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({ "parameters": values })).unwrap_or_default()
}

/// The body of a statistics answer: `{"model_stats": [...]}` with the protobuf messages' field names, as Triton
/// writes it.
pub fn encode_model_statistics(statistics: Vec<crate::proto::ModelStatistics>) -> Vec<u8> {
    let response = crate::proto::ModelStatisticsResponse {
        model_stats: statistics,
    };
    serde_json::to_vec(&response).unwrap_or_default()
}

/// Reads a statistics answer.
pub fn decode_model_statistics(body: &[u8]) -> Result<crate::proto::ModelStatisticsResponse> {
    serde_json::from_slice(body).map_err(|e| Error::invalid(format!("invalid model statistics: {e}")))
}

/// A backend's REST model configuration with its `name` replaced; every other member kept as it came.
pub fn rename_model_config(body: &[u8], name: &str) -> Result<Vec<u8>> {
    let mut document: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("invalid model configuration: {e}")))?;
    document.insert("name".to_owned(), serde_json::Value::String(name.to_owned()));
    serde_json::to_vec(&document).map_err(|e| Error::internal(format!("model configuration: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_members_read_as_empty() {
        let metadata =
            decode_model_metadata(br#"{"name":"m","versions":null,"platform":null,"inputs":null,"outputs":null}"#)
                .unwrap();
        assert_eq!((metadata.versions.len(), metadata.inputs.len()), (0, 0));
    }

    #[test]
    fn metadata_round_trips() {
        let metadata = ModelMetadata {
            name: "add_sub".into(),
            versions: vec!["1".into(), "2".into()],
            platform: "oipgate".into(),
            inputs: vec![TensorMetadata {
                name: "INPUT0".into(),
                datatype: "INT32".into(),
                shape: vec![-1, 16],
            }],
            outputs: vec![],
        };
        assert_eq!(
            decode_model_metadata(&encode_model_metadata(&metadata)).unwrap(),
            metadata
        );
        let server = ServerMetadata {
            name: "s".into(),
            version: "1".into(),
            extensions: vec!["binary_tensor_data".into()],
        };
        assert_eq!(
            decode_server_metadata(&encode_server_metadata(&server)).unwrap(),
            server
        );
        assert!(
            decode_model_metadata(b"{")
                .unwrap_err()
                .to_string()
                .contains("invalid model metadata JSON")
        );
    }

    #[test]
    fn health_answers_with_and_without_bodies() {
        assert!(
            decode_server_ready(true, &encode_server_ready(ServerReady { ready: true }))
                .unwrap()
                .ready
        );
        assert!(!decode_server_ready(true, b"{\"ready\":false}").unwrap().ready);
        assert!(decode_server_ready(true, b"{\"live\":true}").unwrap().ready);
        assert!(decode_server_ready(true, b"").unwrap().ready);
        assert!(!decode_server_ready(false, b"").unwrap().ready);
        assert!(
            decode_server_live(true, &encode_server_live(ServerLive { live: true }))
                .unwrap()
                .live
        );
        let ready = ModelReady {
            name: "m".into(),
            ready: true,
        };
        assert_eq!(
            decode_model_ready(true, &encode_model_ready(&ready), "m").unwrap(),
            ready
        );
        assert_eq!(
            decode_model_ready(false, b"", "m").unwrap(),
            ModelReady {
                name: "m".into(),
                ready: false
            }
        );
    }

    #[test]
    fn error_bodies_of_every_dialect() {
        assert_eq!(encode_error("bad \"x\""), br#"{"error":"bad \"x\""}"#);
        assert_eq!(decode_error(br#"{"error":"boom"}"#), "boom");
        assert_eq!(decode_error(br#"{"code":3,"message":"kserve says"}"#), "kserve says");
        assert_eq!(decode_error(br#"{"detail":"fastapi says"}"#), "fastapi says");
        assert_eq!(decode_error(b"plain text\n"), "plain text");
    }
}

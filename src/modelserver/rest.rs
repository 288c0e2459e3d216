//! The model server's REST endpoints (HTTP/1.1 and h2c on one port): health, metadata, inference with JSON and the
//! binary tensor data extension, and Triton's repository extension.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{ALLOW, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};

use super::ModelServerState;
use crate::body::{ChannelBody, ChunksBody, OutBody};
use crate::codec::compression;
use crate::codec::rest::generate as generate_codec;
use crate::codec::rest::{self, EncodedBody, RestRequest};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::headers::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::protocol::paths::{Route, route};
use crate::protocol::{ModelReady, ServerLive, ServerReady, StreamCall};

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<ChunksBody> {
    let mut response = Response::new(ChunksBody::new(vec![Bytes::from(body)]));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The protocol's error answer: the error's status and `{"error": "<message>"}`.
pub fn error_response(error: &Error) -> Response<ChunksBody> {
    json_response(error.http_status(), rest::encode_error(error.message()))
}

fn encoded_response(body: EncodedBody) -> Response<ChunksBody> {
    let mut response = Response::new(ChunksBody::new(Vec::new()));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(body.content_type()));
    if let Some(length) = body.header_length {
        headers.insert(INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(length));
    }
    *response.body_mut() = ChunksBody::new(body.chunks);
    response
}

/// Answers one REST request.
pub async fn handle<B>(state: Arc<ModelServerState>, request: Request<B>) -> Result<Response<OutBody>, Infallible>
where
    B: Body<Data = Bytes> + Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    state.saw(request.headers());
    let echo = super::Echo::of(request.headers(), &state.metadata.name);
    let path = request.uri().path().to_owned();
    let generating = match route(&path) {
        Some(Route::Generate(model, version, call)) if request.method() == Method::POST => {
            Some((model.to_owned(), version.map(str::to_owned), call))
        }
        _ => None,
    };
    let answered = match generating {
        // Triton's streams, not MLServer's.
        Some((_, _, StreamCall::InferStream)) => Err(Error::not_found(format!("no endpoint at {path}"))),
        Some((model, version, call)) => generate(&state, &model, version.as_deref(), request, call.streams()).await,
        None => answer(&state, request)
            .await
            .map(|response| response.map(OutBody::from)),
    };
    let mut response = match answered {
        Ok(response) => response,
        Err(error) => error_response(&error).map(OutBody::from),
    };
    echo.onto(response.headers_mut());
    Ok(response)
}

async fn answer<B>(state: &ModelServerState, request: Request<B>) -> Result<Response<ChunksBody>>
where
    B: Body<Data = Bytes> + Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let path = request.uri().path().to_owned();
    if path == "/metrics" && request.method() == Method::GET {
        let mut response = Response::new(ChunksBody::new(vec![Bytes::from(
            state.repository.pending_exposition(),
        )]));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        return Ok(response);
    }
    let route = route(&path).ok_or_else(|| Error::not_found(format!("no endpoint at {path}")))?;
    if request.method() != route.method() {
        let mut response = error_response(&Error::new(
            ErrorKind::MethodNotAllowed,
            Origin::Client,
            format!("{path} answers {} only, not {}", route.method(), request.method()),
        ));
        let allow = if route.method() == Method::GET { "GET" } else { "POST" };
        response.headers_mut().insert(ALLOW, HeaderValue::from_static(allow));
        return Ok(response);
    }
    let repository = &state.repository;
    Ok(match route {
        Route::ServerMetadata => json_response(StatusCode::OK, rest::encode_server_metadata(&state.metadata)),
        Route::Live => json_response(StatusCode::OK, rest::encode_server_live(ServerLive { live: true })),
        Route::Ready => {
            let ready = repository.all_ready();
            json_response(health_status(ready), rest::encode_server_ready(ServerReady { ready }))
        }
        Route::ModelMetadata(model, version) => json_response(
            StatusCode::OK,
            rest::encode_model_metadata(&repository.metadata(model, version)?),
        ),
        Route::ModelReady(model, version) => {
            let ready = repository.model_ready(model, version)?;
            json_response(
                health_status(ready),
                rest::encode_model_ready(&ModelReady {
                    name: model.to_owned(),
                    ready,
                }),
            )
        }
        Route::Infer(model, version) => infer(state, model, version, request).await?,
        Route::Generate(..) => return Err(Error::internal("generate is answered before this")),
        Route::ModelConfig(model, version) => json_response(
            StatusCode::OK,
            crate::codec::model_config::json(&repository.model_config(model, version)?),
        ),
        Route::ModelStatistics(model, version) => json_response(
            StatusCode::OK,
            rest::encode_model_statistics(repository.statistics(model, version)?),
        ),
        Route::RepositoryIndex => {
            let body = read_body(request, state.max_request_bytes).await?;
            let ready_only = rest::decode_repository_index_request(&body)?;
            json_response(
                StatusCode::OK,
                rest::encode_repository_index(&repository.index(ready_only)),
            )
        }
        Route::RepositoryLoad(model) | Route::RepositoryUnload(model) => {
            let load = matches!(route, Route::RepositoryLoad(_));
            repository.set_ready(model, load)?;
            Response::new(ChunksBody::default())
        }
        Route::SharedMemoryStatus(_) => json_response(StatusCode::OK, b"[]".to_vec()),
        Route::SharedMemoryUnregister(_) => Response::new(ChunksBody::default()),
        Route::SharedMemoryRegister(memory, region) => {
            return Err(super::grpc::no_shared_memory(memory.kind(), region));
        }
    })
}

/// Healthy answers are 200; unhealthy ones 503, so HTTP-only probes (Kubernetes, load balancers) see them too.
fn health_status(healthy: bool) -> StatusCode {
    if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn read_body<B>(request: Request<B>, limit: usize) -> Result<Bytes>
where
    B: Body<Data = Bytes> + Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    match Limited::new(request.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(Error::new(
            ErrorKind::PayloadTooLarge,
            Origin::Client,
            format!("request body is larger than the limit of {limit} bytes"),
        )),
        Err(error) => Err(Error::invalid(format!("could not read the request body: {error}"))),
    }
}

async fn infer<B>(
    state: &ModelServerState,
    model: &str,
    version: Option<&str>,
    request: Request<B>,
) -> Result<Response<ChunksBody>>
where
    B: Body<Data = Bytes> + Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let header_length = rest::inference_header_length(request.headers().get(INFERENCE_HEADER_CONTENT_LENGTH))?;
    let coding = compression::request_coding(request.headers())?;
    let body = read_body(request, state.max_request_bytes).await?;
    // Compressed bodies are read as Triton reads them: gzip or deflate, bounded by the same limit once expanded.
    let body = match coding {
        Some(coding) => compression::decompress(coding, &body, state.max_request_bytes as u64, "request body")?,
        None => body,
    };
    let (infer_request, binary_outputs) = match rest::decode_request(body, header_length)? {
        RestRequest::Request {
            request,
            binary_outputs,
        } => (request, binary_outputs),
        RestRequest::RawBinary(body) => {
            let metadata = state.repository.metadata(model, version)?;
            let [input] = metadata.inputs.as_slice() else {
                return Err(Error::invalid(format!(
                    "a raw binary request (Inference-Header-Content-Length: 0) needs a model with exactly one \
                     input; '{model}' has {}",
                    metadata.inputs.len()
                )));
            };
            rest::raw_binary_request(body, input)?
        }
    };
    let response = state.repository.infer(model, version, infer_request).await?;
    Ok(encoded_response(rest::encode_response(&response, &binary_outputs)?))
}

/// Triton's generate extension: `generate` answers the request's one response as JSON, `generate_stream` each
/// response as a server-sent event as it is made. An error before the first response is the answer's status; one
/// after it (none happens with the built-in models) would be an error event.
async fn generate<B>(
    state: &Arc<ModelServerState>,
    model: &str,
    version: Option<&str>,
    request: Request<B>,
    stream: bool,
) -> Result<Response<OutBody>>
where
    B: Body<Data = Bytes> + Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let body = read_body(request, state.max_request_bytes).await?;
    let metadata = state.repository.metadata(model, version)?;
    let infer_request = generate_codec::decode_generate(&body, &metadata)?;
    let (events, mut made) = tokio::sync::mpsc::channel::<Result<Option<Vec<u8>>>>(EVENTS);
    let running = state.clone();
    let (model, version) = (model.to_owned(), version.map(str::to_owned));
    tokio::spawn(async move {
        let (responses, mut ready) = tokio::sync::mpsc::channel(1);
        let forwarded = events.clone();
        let forward = async move {
            while let Some(response) = ready.recv().await {
                if forwarded
                    .send(generate_codec::encode_generate(&response))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        };
        let run = running
            .repository
            .infer_stream(&model, version.as_deref(), infer_request, responses);
        let (ran, ()) = tokio::join!(run, forward);
        if let Err(error) = ran {
            let _ = events.send(Err(error)).await;
        }
    });
    if !stream {
        let mut only = None;
        while let Some(made) = made.recv().await {
            if let Some(json) = made?
                && only.replace(json).is_some()
            {
                return Err(Error::invalid(
                    "generate expects model to produce exactly 1 response, use generate stream for model that \
                     generates various number of responses",
                ));
            }
        }
        let json = only.ok_or_else(|| Error::invalid("the model gave no response"))?;
        return Ok(json_response(StatusCode::OK, json).map(OutBody::from));
    }
    let first = loop {
        match made.recv().await {
            None => break None,
            Some(Err(error)) => return Err(error),
            Some(Ok(None)) => continue,
            Some(Ok(Some(json))) => break Some(json),
        }
    };
    let (chunks, body) = tokio::sync::mpsc::channel(EVENTS);
    tokio::spawn(async move {
        let event = |json: &[u8]| Bytes::from([&b"data: "[..], json, b"\n\n"].concat());
        if let Some(json) = first
            && chunks.send(event(&json)).await.is_err()
        {
            return;
        }
        while let Some(made) = made.recv().await {
            let json = match made {
                Ok(Some(json)) => json,
                Ok(None) => continue,
                Err(error) => rest::encode_error(error.message()),
            };
            if chunks.send(event(&json)).await.is_err() {
                return;
            }
        }
    });
    let mut response = Response::new(OutBody::Channel(ChannelBody::new(body)));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    Ok(response)
}

/// Events a stream holds for a client that is slow to read them.
const EVENTS: usize = 16;

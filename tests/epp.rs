//! `oipgate epp` spoken to as Envoy speaks to it (ext_proc, full-duplex streamed bodies), by tonic's client of
//! Envoy's own protos: what it reads of REST and gRPC requests, what it names, how it relays bodies, renames, refuses,
//! counts the served endpoint, and that a sequence lands where the gateway would send it. The same picker behind a
//! real Envoy is tests/interop/test_epp.py's.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::{GatewayProcess, ModelServerProcess};
use oipgate::envoy_api::envoy::config::core::v3 as core;
use oipgate::envoy_api::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use oipgate::envoy_api::envoy::service::ext_proc::v3 as ext_proc;
use oipgate::envoy_api::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use oipgate::proto::{InferParameter, ModelInferRequest, infer_parameter::ParameterChoice};
use prost::Message as _;
use prost_types::value::Kind;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use ext_proc::processing_request::Request;
use ext_proc::processing_response::Response;

/// Two replicas, each serving REST and gRPC, and a picker over both.
struct Pool {
    replicas: Vec<ModelServerProcess>,
    epp: GatewayProcess,
}

fn pool() -> Pool {
    let replicas: Vec<ModelServerProcess> = (0..2)
        .map(|_| ModelServerProcess::start(&["--rest", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]))
        .collect();
    let epp = GatewayProcess::start_epp(&pool_config(&replicas), &["--fallbacks", "1"]);
    Pool { replicas, epp }
}

fn pool_config(replicas: &[ModelServerProcess]) -> String {
    let list = |pick: fn(&ModelServerProcess) -> std::net::SocketAddr| {
        replicas
            .iter()
            .map(|r| format!("\"{}\"", pick(r)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        r#"
[[backends]]
name = "pool-rest"
protocol = "rest"
endpoints = [{rest}]
[[backends]]
name = "pool-grpc"
protocol = "grpc"
endpoints = [{grpc}]
[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
[[models]]
name = "renamed_rest"
versions = [ {{ version = "1", backend = "pool-rest", upstream_name = "add_sub", upstream_version = "1" }} ]
[[models]]
name = "add_sub_grpc"
versions = [ {{ version = "1", backend = "pool-grpc", upstream_name = "add_sub", upstream_version = "1" }} ]
[[models]]
name = "accumulate"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
[[models]]
name = "count"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
rate = {{ tokens_per_minute = 10 }}
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "pool-rest" }} ]
rate = {{ tokens_per_minute = 10 }}
"#,
        rest = list(|r| r.rest.unwrap()),
        grpc = list(|r| r.grpc.unwrap()),
    )
}

/// One ext_proc stream: messages sent as Envoy sends them, answers read one at a time.
struct Stream {
    sender: mpsc::Sender<ext_proc::ProcessingRequest>,
    answers: tonic::Streaming<ext_proc::ProcessingResponse>,
}

impl Stream {
    async fn open(pool: &Pool) -> Stream {
        let address = pool.epp.epp.unwrap();
        let mut client = ExternalProcessorClient::connect(format!("http://{address}"))
            .await
            .unwrap()
            .max_decoding_message_size(usize::MAX);
        let (sender, receiver) = mpsc::channel(16);
        let answers = client
            .process(ReceiverStream::new(receiver))
            .await
            .unwrap()
            .into_inner();
        Stream { sender, answers }
    }

    async fn send(&self, request: Request, metadata: Option<core::Metadata>) {
        let mut sent = message(request);
        sent.metadata_context = metadata;
        self.sender.send(sent).await.unwrap();
    }

    async fn answer(&mut self) -> Response {
        tokio::time::timeout(Duration::from_secs(10), self.answers.message())
            .await
            .expect("an answer within 10 s")
            .unwrap()
            .expect("the stream is open")
            .response
            .unwrap()
    }

    /// The answer to the request's headers, with the dynamic metadata it came with.
    async fn picked(&mut self) -> (ext_proc::HeadersResponse, Option<prost_types::Struct>) {
        let message = tokio::time::timeout(Duration::from_secs(10), self.answers.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        match message.response.unwrap() {
            Response::RequestHeaders(headers) => (headers, message.dynamic_metadata),
            other => panic!("expected the headers' answer, got {other:?}"),
        }
    }
}

/// One message as Envoy sends it in full-duplex mode (its processing mode named, as Envoy names it).
fn message(request: Request) -> ext_proc::ProcessingRequest {
    ext_proc::ProcessingRequest {
        request: Some(request),
        protocol_config: Some(ext_proc::ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        ..Default::default()
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> Request {
    Request::RequestHeaders(ext_proc::HttpHeaders {
        headers: Some(core::HeaderMap {
            headers: pairs
                .iter()
                .map(|(key, value)| core::HeaderValue {
                    key: (*key).to_owned(),
                    value: String::new(),
                    raw_value: value.as_bytes().to_vec(),
                })
                .collect(),
        }),
        end_of_stream,
        ..Default::default()
    })
}

fn body(bytes: impl Into<Bytes>, end_of_stream: bool) -> Request {
    Request::RequestBody(ext_proc::HttpBody {
        body: bytes.into(),
        end_of_stream,
    })
}

fn rest_headers(path: &str) -> Request {
    headers(
        &[
            (":method", "POST"),
            (":path", path),
            ("content-type", "application/json"),
        ],
        false,
    )
}

/// The header values set by a headers' answer, by name.
fn set_headers(answer: &ext_proc::HeadersResponse) -> HashMap<String, String> {
    let common = answer.response.as_ref().unwrap();
    common
        .header_mutation
        .as_ref()
        .map(|mutation| {
            mutation
                .set_headers
                .iter()
                .map(|option| {
                    let header = option.header.as_ref().unwrap();
                    (header.key.clone(), String::from_utf8(header.raw_value.clone()).unwrap())
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The `envoy.lb` destination in the dynamic metadata.
fn lb_destination(metadata: &Option<prost_types::Struct>) -> String {
    let lb = metadata.as_ref().unwrap().fields.get("envoy.lb").unwrap();
    let Some(Kind::StructValue(lb)) = &lb.kind else {
        panic!("envoy.lb is not a struct")
    };
    match &lb.fields.get("x-gateway-destination-endpoint").unwrap().kind {
        Some(Kind::StringValue(value)) => value.clone(),
        other => panic!("the destination is {other:?}"),
    }
}

fn streamed(answer: Response) -> (Bytes, bool) {
    let Response::RequestBody(body) = answer else {
        panic!("expected a body chunk, got {answer:?}")
    };
    match body.response.unwrap().body_mutation.unwrap().mutation.unwrap() {
        ext_proc::body_mutation::Mutation::StreamedResponse(chunk) => (chunk.body, chunk.end_of_stream),
        other => panic!("expected a streamed chunk, got {other:?}"),
    }
}

fn immediate(answer: Response) -> ext_proc::ImmediateResponse {
    match answer {
        Response::ImmediateResponse(immediate) => immediate,
        other => panic!("expected an immediate response, got {other:?}"),
    }
}

const ADD_SUB: &str = r#"{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]},{"name":"INPUT1","datatype":"INT32","shape":[1,16],"data":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}]}"#;

#[tokio::test]
async fn a_rest_call_is_picked_once_its_inputs_begin_and_its_body_relayed_as_it_comes() {
    let pool = pool();
    let mut stream = Stream::open(&pool).await;
    stream.send(rest_headers("/v2/models/add_sub/infer"), None).await;
    let (first, rest) = ADD_SUB.split_at(30);
    stream.send(body(first.to_owned(), false), None).await;
    // Picked on the first chunk: the inputs began, and no routing parameter came before them.
    let (answer, metadata) = stream.picked().await;
    let named = set_headers(&answer);
    let destination = &named["x-gateway-destination-endpoint"];
    let endpoints: Vec<String> = pool.replicas.iter().map(|r| r.rest.unwrap().to_string()).collect();
    let list: Vec<&str> = destination.split(',').collect();
    assert_eq!(list.len(), 2, "the picked endpoint and one fallback: {destination}");
    assert!(list.iter().all(|e| endpoints.contains(&(*e).to_owned())) && list[0] != list[1]);
    assert_eq!(
        &lb_destination(&metadata),
        destination,
        "the header and the metadata name the same"
    );
    assert!(answer.response.as_ref().unwrap().clear_route_cache);
    assert_eq!(streamed(stream.answer().await), (Bytes::from(first.to_owned()), false));
    stream.send(body(rest.to_owned(), false), None).await;
    assert_eq!(streamed(stream.answer().await), (Bytes::from(rest.to_owned()), false));
    stream.send(body(Bytes::new(), true), None).await;
    assert_eq!(streamed(stream.answer().await), (Bytes::new(), true));
    assert_eq!(
        pool.epp
            .metric(&format!(
                "oipgate_epp_picks_total{{endpoint=\"{}\",model=\"add_sub\",result=\"picked\",version=\"1\"}}",
                list[0]
            ))
            .await,
        1.0
    );
    // One access-log line for the call, once its stream has closed.
    drop(stream);
    let expected = format!("endpoints=\"{destination}\"");
    let lines = pool
        .epp
        .logged("the pick's access line", |lines| {
            lines
                .iter()
                .any(|line| line.contains("oipgate::access: pick") && line.contains(&expected))
        })
        .await;
    let line = lines.iter().find(|line| line.contains(&expected)).unwrap();
    for field in [
        "protocol=\"rest\"",
        "path=\"/v2/models/add_sub/infer\"",
        "model=add_sub",
        "version=1",
        "result=\"picked\"",
    ] {
        assert!(line.contains(field), "{field} in {line}");
    }
}

#[tokio::test]
async fn request_trailers_end_the_body_and_the_served_endpoint_is_counted() {
    let pool = pool();
    let mut stream = Stream::open(&pool).await;
    let sequence = r#"{"parameters":{"sequence_id":42,"sequence_start":true},"inputs":[]}"#;
    stream.send(rest_headers("/v2/models/accumulate/infer"), None).await;
    stream.send(body(sequence.to_owned(), false), None).await;
    stream
        .send(
            Request::RequestTrailers(ext_proc::HttpTrailers { trailers: None }),
            None,
        )
        .await;
    let (answer, _) = stream.picked().await;
    let picked = set_headers(&answer)["x-gateway-destination-endpoint"].clone();
    assert!(!picked.contains(','), "a sequence has no fallbacks: {picked}");
    // The body's end was the trailers: the chunk goes back as it came, not marked as the last.
    assert_eq!(
        streamed(stream.answer().await),
        (Bytes::from(sequence.to_owned()), false)
    );
    assert!(matches!(stream.answer().await, Response::RequestTrailers(_)));

    // Envoy reports the other endpoint served it (a retry after the picked one failed).
    let other = pool
        .replicas
        .iter()
        .map(|r| r.rest.unwrap().to_string())
        .find(|e| *e != picked)
        .unwrap();
    let served = core::Metadata {
        filter_metadata: [(
            "envoy.lb".to_owned(),
            prost_types::Struct {
                fields: [(
                    "x-gateway-destination-endpoint-served".to_owned(),
                    prost_types::Value {
                        kind: Some(Kind::StringValue(other.clone())),
                    },
                )]
                .into(),
            },
        )]
        .into(),
        ..Default::default()
    };
    let Request::RequestHeaders(answered) = headers(&[(":status", "200")], true) else {
        unreachable!()
    };
    stream.send(Request::ResponseHeaders(answered), Some(served)).await;
    let response = stream.answer().await;
    assert!(matches!(response, Response::ResponseHeaders(_)), "{response:?}");
    assert_eq!(
        pool.epp
            .metric(&format!(
                "oipgate_epp_served_total{{endpoint=\"{other}\",result=\"fallback\"}}"
            ))
            .await,
        1.0
    );
}

#[tokio::test]
async fn a_sequence_is_picked_where_the_gateway_sends_it() {
    let pool = pool();
    let gateway = GatewayProcess::start(&pool_config(&pool.replicas));
    for id in [7u64, 19, 1234, 98765] {
        let mut stream = Stream::open(&pool).await;
        let request = format!(
            r#"{{"parameters":{{"sequence_id":{id},"sequence_start":true}},"inputs":[{{"name":"INPUT0","datatype":"INT32","shape":[1],"data":[5]}}]}}"#
        );
        stream.send(rest_headers("/v2/models/accumulate/infer"), None).await;
        stream.send(body(request.clone(), true), None).await;
        let (answer, _) = stream.picked().await;
        let picked = set_headers(&answer)["x-gateway-destination-endpoint"].clone();

        let before: Vec<u64> = common::inference_counts(&pool.replicas.iter().collect::<Vec<_>>(), "accumulate").await;
        let answer = common::post(&gateway.rest_url("/v2/models/accumulate/infer"), request).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        let after: Vec<u64> = common::inference_counts(&pool.replicas.iter().collect::<Vec<_>>(), "accumulate").await;
        let served = (0..2).find(|&i| after[i] > before[i]).unwrap();
        assert_eq!(
            pool.replicas[served].rest.unwrap().to_string(),
            picked,
            "sequence {id}: the picker and the gateway agree"
        );
    }
}

fn grpc_headers(method: &str) -> Request {
    headers(
        &[
            (":method", "POST"),
            (":path", &format!("/inference.GRPCInferenceService/{method}")),
            ("content-type", "application/grpc"),
            ("content-length", "999"),
        ],
        false,
    )
}

fn infer_request(model: &str) -> ModelInferRequest {
    ModelInferRequest {
        model_name: model.to_owned(),
        model_version: "1".to_owned(),
        id: "call-1".to_owned(),
        parameters: [(
            "note".to_owned(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::StringParam("kept".to_owned())),
            },
        )]
        .into(),
        raw_input_contents: vec![Bytes::from(vec![7u8; 4096])],
        ..Default::default()
    }
}

#[tokio::test]
async fn a_grpc_message_is_read_from_its_leading_fields_and_renamed_for_its_backend() {
    let pool = pool();
    let mut stream = Stream::open(&pool).await;
    let message = infer_request("add_sub_grpc").encode_to_vec();
    let framed = common::grpc_frame(&message, false);
    stream.send(grpc_headers("ModelInfer"), None).await;
    // The frame's prefix and its leading fields arrive in pieces; the tensor bytes after.
    stream.send(body(framed[..3].to_vec(), false), None).await;
    stream.send(body(framed[3..100].to_vec(), false), None).await;
    let (answer, _) = stream.picked().await;
    let named = set_headers(&answer);
    let endpoints: Vec<String> = pool.replicas.iter().map(|r| r.grpc.unwrap().to_string()).collect();
    assert!(
        endpoints.contains(
            &named["x-gateway-destination-endpoint"]
                .split(',')
                .next()
                .unwrap()
                .to_owned()
        )
    );
    let removed = &answer
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .remove_headers;
    assert!(
        removed.contains(&"content-length".to_owned()),
        "the length changed: {removed:?}"
    );
    stream.send(body(framed[100..].to_vec(), true), None).await;
    let mut relayed = Vec::new();
    loop {
        let (chunk, end) = streamed(stream.answer().await);
        relayed.extend_from_slice(&chunk);
        if end {
            break;
        }
    }
    let length = u32::from_be_bytes(relayed[1..5].try_into().unwrap()) as usize;
    assert_eq!(length, relayed.len() - 5, "the frame's length is the renamed message's");
    let renamed = ModelInferRequest::decode(&relayed[5..]).unwrap();
    let mut expected = infer_request("add_sub");
    expected.model_version = "1".to_owned();
    assert_eq!(renamed, expected, "only the name changed");
}

/// One generate call through the picker, answered as Envoy relays a backend's answer: its head, then `chunks` of its
/// body, the last ending the answer or, with `trailers`, followed by trailers that do; returns the headers' answer to
/// the request (the pick).
async fn generate_answered(
    pool: &Pool,
    path: &str,
    content_type: &str,
    chunks: &[&str],
    trailers: bool,
) -> ext_proc::HeadersResponse {
    let mut stream = Stream::open(pool).await;
    stream.send(rest_headers(path), None).await;
    stream.send(body(r#"{"INPUT0": 12}"#, true), None).await;
    let (picked, _) = stream.picked().await;
    assert!(matches!(stream.answer().await, Response::RequestBody(_)));
    let head = headers(&[(":status", "200"), ("content-type", content_type)], false);
    let Request::RequestHeaders(head) = head else {
        unreachable!()
    };
    stream.send(Request::ResponseHeaders(head), None).await;
    assert!(matches!(stream.answer().await, Response::ResponseHeaders(_)));
    for (index, chunk) in chunks.iter().enumerate() {
        let last = index + 1 == chunks.len() && !trailers;
        let chunk = ext_proc::HttpBody {
            body: Bytes::copy_from_slice(chunk.as_bytes()),
            end_of_stream: last,
        };
        stream.send(Request::ResponseBody(chunk), None).await;
        assert!(matches!(stream.answer().await, Response::ResponseBody(_)));
    }
    if trailers {
        let ending = ext_proc::HttpTrailers {
            trailers: Some(core::HeaderMap::default()),
        };
        stream.send(Request::ResponseTrailers(ending), None).await;
        assert!(matches!(stream.answer().await, Response::ResponseTrailers(_)));
    }
    picked
}

/// A generate call under a token budget is charged what its answer carries, read from the answer's body as the
/// proxy relays it (the answer asked for uncompressed): a stream's events counted across the chunks' seams, a whole
/// answer at its end (here its trailers). The spent budget refuses the model's next generate call, 429, before any endpoint is picked.
#[tokio::test]
async fn generate_answers_are_charged_to_their_token_budget_as_they_pass() {
    let pool = pool();
    let events = [
        "data: {\"OUTPUT0\":[1,2,3,4,5],\"model_name\":\"count\"}\n\nda",
        "ta: {\"OUTPUT0\":[6,7,8,9,10,11,12]}\n",
        "\n",
    ];
    let picked = generate_answered(
        &pool,
        "/v2/models/count/generate_stream",
        "text/event-stream",
        &events,
        false,
    )
    .await;
    let mutation = picked.response.unwrap().header_mutation.unwrap();
    assert_eq!(mutation.remove_headers, ["accept-encoding"]);
    let whole = ["{\"OUTPUT0\":[1,2,3,4,5,", "6,7,8,9,10,11]}"];
    generate_answered(&pool, "/v2/models/identity/generate", "application/json", &whole, true).await;

    // Twelve tokens and eleven, against budgets of ten a minute: both spent.
    for model in ["count", "identity"] {
        let mut stream = Stream::open(&pool).await;
        stream
            .send(rest_headers(&format!("/v2/models/{model}/generate")), None)
            .await;
        stream.send(body(r#"{"INPUT0": 1}"#, true), None).await;
        let refused = immediate(stream.answer().await);
        assert_eq!(refused.status.unwrap().code, 429, "{model}: {refused:?}");
        // Counted as the caller's limit, not as the fleet shedding load.
        let series = format!(
            "oipgate_epp_picks_total{{endpoint=\"_none\",model=\"{model}\",result=\"rate_limited\",version=\"_unknown\"}}"
        );
        assert_eq!(pool.epp.metric(&series).await, 1.0, "{series}");
    }
    // An infer call of the same model is not held to the budget of generated tokens.
    let mut stream = Stream::open(&pool).await;
    stream.send(rest_headers("/v2/models/count/infer"), None).await;
    stream.send(body(r#"{"inputs":[]}"#, true), None).await;
    let (picked, _) = stream.picked().await;
    assert!(!set_headers(&picked).is_empty());
}

#[tokio::test]
async fn calls_the_picker_cannot_serve_are_refused_clearly() {
    let pool = pool();
    let cases: Vec<(Vec<Request>, u32, Option<u32>, &str)> = vec![
        // A model the configuration does not have.
        (
            vec![rest_headers("/v2/models/nope/infer"), body(ADD_SUB, true)],
            404,
            None,
            "nope",
        ),
        // A REST call of a model served by gRPC endpoints: the proxy does not translate.
        (
            vec![rest_headers("/v2/models/add_sub_grpc/infer"), body(ADD_SUB, true)],
            501,
            None,
            "served by gRPC endpoints",
        ),
        // A stream's every message names the model: the picker cannot rename them all.
        (
            vec![
                grpc_headers("ModelStreamInfer"),
                body(
                    common::grpc_frame(&infer_request("add_sub_grpc").encode_to_vec(), false),
                    false,
                ),
            ],
            501,
            Some(12),
            "cannot rename",
        ),
        // A compressed first message cannot be read.
        (
            vec![
                grpc_headers("ModelInfer"),
                body(
                    common::grpc_frame(&infer_request("add_sub_grpc").encode_to_vec(), true),
                    true,
                ),
            ],
            501,
            Some(12),
            "compressed",
        ),
    ];
    for (requests, status, grpc_status, says) in cases {
        let mut stream = Stream::open(&pool).await;
        for request in requests {
            stream.send(request, None).await;
        }
        let refused = immediate(stream.answer().await);
        assert_eq!(
            refused.status.unwrap().code,
            i32::try_from(status).unwrap(),
            "{refused:?}"
        );
        assert_eq!(refused.grpc_status.map(|s| s.status), grpc_status, "{refused:?}");
        let text = String::from_utf8_lossy(&refused.body);
        assert!(text.contains(says), "{says:?} not in {text}");
    }
    // An empty subset hint, and one naming no endpoint of the pool: 503.
    for subset in [vec![], vec!["10.1.1.1:80".to_owned()]] {
        let mut stream = Stream::open(&pool).await;
        let hint = subset_hint(&subset);
        stream.send(rest_headers("/v2/models/add_sub/infer"), Some(hint)).await;
        stream.send(body(ADD_SUB, true), None).await;
        let refused = immediate(stream.answer().await);
        assert_eq!(refused.status.unwrap().code, 503, "{refused:?}");
    }
    assert_eq!(
        pool.epp
            .metric(
                "oipgate_epp_picks_total{endpoint=\"_none\",model=\"_unknown\",result=\"refused\",version=\"_unknown\"}"
            )
            .await,
        2.0,
        "the unknown model and the compressed message, whose model was not read"
    );
}

#[tokio::test]
async fn a_renamed_rest_model_has_its_path_rewritten_and_a_call_naming_no_model_any_endpoint() {
    let pool = pool();
    let mut stream = Stream::open(&pool).await;
    stream
        .send(rest_headers("/v2/models/renamed_rest/versions/1/infer?x=1"), None)
        .await;
    stream.send(body(ADD_SUB, true), None).await;
    let (answer, _) = stream.picked().await;
    assert_eq!(set_headers(&answer)[":path"], "/v2/models/add_sub/versions/1/infer?x=1");

    // A call naming no model goes to any endpoint the subset hint allows.
    for replica in &pool.replicas {
        let only = replica.rest.unwrap().to_string();
        let mut stream = Stream::open(&pool).await;
        stream
            .send(
                headers(&[(":method", "GET"), (":path", "/v2/health/ready")], true),
                Some(subset_hint(std::slice::from_ref(&only))),
            )
            .await;
        let (answer, _) = stream.picked().await;
        assert_eq!(set_headers(&answer)["x-gateway-destination-endpoint"], only);
    }
}

/// Filter metadata carrying a subset hint of `endpoints`.
fn subset_hint(endpoints: &[String]) -> core::Metadata {
    core::Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_owned(),
            prost_types::Struct {
                fields: [(
                    "x-gateway-destination-endpoint-subset".to_owned(),
                    prost_types::Value {
                        kind: Some(Kind::ListValue(prost_types::ListValue {
                            values: endpoints
                                .iter()
                                .map(|e| prost_types::Value {
                                    kind: Some(Kind::StringValue(e.clone())),
                                })
                                .collect(),
                        })),
                    },
                )]
                .into(),
            },
        )]
        .into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_json_body_longer_than_what_is_read_is_picked_by_its_start() {
    let pool = pool();
    let mut stream = Stream::open(&pool).await;
    let padding = "x".repeat(80 * 1024);
    let request = format!(
        r#"{{"parameters":{{"priority":1}},"inputs":[{{"name":"INPUT0","datatype":"BYTES","shape":[1],"data":["{padding}"]}}]}}"#
    );
    let (first, rest) = request.split_at(60 * 1024);
    stream.send(rest_headers("/v2/models/add_sub/infer"), None).await;
    // Sent a few bytes at a time, then the rest with the body's end.
    let sender = stream.sender.clone();
    let pieces: Vec<Vec<u8>> = first.as_bytes().chunks(7).map(<[u8]>::to_vec).collect();
    let last = rest.to_owned();
    let feeding = tokio::spawn(async move {
        for piece in pieces {
            sender.send(message(body(piece, false))).await.unwrap();
        }
        sender.send(message(body(last, true))).await.unwrap();
    });
    let (answer, _) = stream.picked().await;
    assert!(set_headers(&answer).contains_key("x-gateway-destination-endpoint"));
    let mut relayed = Vec::new();
    loop {
        let (chunk, end) = streamed(stream.answer().await);
        relayed.extend_from_slice(&chunk);
        if end {
            break;
        }
    }
    feeding.await.unwrap();
    assert_eq!(relayed, request.as_bytes(), "every byte relayed once, in order");
}

/// The picker's health with a real gRPC health client: `liveness` serving from the start; `readiness` and the
/// ext_proc service not serving while its endpoints are unknown (an endpoints file not written yet), serving once they
/// are.
#[tokio::test]
async fn readiness_waits_for_the_endpoints() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let replica = ModelServerProcess::start(&["--rest", "127.0.0.1:0"]);
    let dir = common::unique_temp_dir("oipgate-epp-health");
    let file = dir.join("endpoints.json");
    let epp = GatewayProcess::start_epp(
        &format!(
            "[[backends]]\nname = \"pool\"\nprotocol = \"rest\"\nendpoints_file = \"{}\"\nendpoints_file_interval_ms = 100\n\
             [[models]]\nname = \"add_sub\"\nversions = [ {{ version = \"1\", backend = \"pool\" }} ]\n",
            file.display()
        ),
        &[],
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", epp.epp.unwrap()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut status = async |service: &str| {
        let answer = health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .unwrap()
            .into_inner();
        ServingStatus::try_from(answer.status).unwrap()
    };
    assert_eq!(status("liveness").await, ServingStatus::Serving);
    assert_eq!(status("readiness").await, ServingStatus::NotServing);
    assert_eq!(
        status("envoy.service.ext_proc.v3.ExternalProcessor").await,
        ServingStatus::NotServing
    );

    let address = replica.rest.unwrap();
    std::fs::write(
        &file,
        format!(
            r#"{{"endpoints": [{{"name": "r", "address": "{}", "port": "{}"}}]}}"#,
            address.ip(),
            address.port()
        ),
    )
    .unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(15);
    while status("readiness").await != ServingStatus::Serving {
        assert!(std::time::Instant::now() < until, "readiness never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        status("envoy.service.ext_proc.v3.ExternalProcessor").await,
        ServingStatus::Serving
    );
    assert_eq!(status("liveness").await, ServingStatus::Serving);
    let _ = std::fs::remove_dir_all(&dir);
}

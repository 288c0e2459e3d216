//! Joining the platform's observability: spans exported to a real OTLP receiver (the collector's own service, served
//! by tonic here) with the `traceparent` the backends saw, and inference payloads sent as KServe's CloudEvents to a
//! sink that records them.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::config::{ADD_SUB_ON_BOTH, fleet_backends};
use common::{GatewayProcess, eventually, grpc_add_sub_request, in_process_backends, post_with_headers};
use http_body_util::{BodyExt, Full};
use oipgate::protocol::{DataType, Tensor};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;

/// Spans as the collector received them, and the resource each export named for its spans.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Span>>>, Arc<Mutex<Vec<Vec<KeyValue>>>>);

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for resource_spans in request.into_inner().resource_spans {
            let resource = resource_spans
                .resource
                .map(|resource| resource.attributes)
                .unwrap_or_default();
            self.1.lock().unwrap().push(resource);
            let spans = resource_spans.scope_spans.into_iter().flat_map(|scope| scope.spans);
            self.0.lock().unwrap().extend(spans);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Received {
    fn of_trace(&self, trace: &str) -> Vec<Span> {
        let id = hex(trace);
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|span| span.trace_id == id)
            .cloned()
            .collect()
    }

    fn all(&self) -> Vec<Span> {
        self.0.lock().unwrap().clone()
    }
}

/// An OTLP/gRPC receiver on a port of its own.
async fn otlp_receiver() -> (SocketAddr, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let received = Received::default();
    let service = TraceServiceServer::new(received.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (address, received)
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute(span: &Span, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone())
        .and_then(|value| value.value)
}

fn text(span: &Span, key: &str) -> String {
    match attribute(span, key) {
        Some(Value::StringValue(text)) => text,
        other => panic!("span {} has {key} = {other:?}, not text", span.name),
    }
}

fn number(span: &Span, key: &str) -> i64 {
    match attribute(span, key) {
        Some(Value::IntValue(number)) => number,
        other => panic!("span {} has {key} = {other:?}, not a number", span.name),
    }
}

fn named<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    let found: Vec<&Span> = spans.iter().filter(|span| span.name == name).collect();
    assert_eq!(found.len(), 1, "one span {name} among {:?}", names(spans));
    found[0]
}

fn names(spans: &[Span]) -> Vec<&str> {
    spans.iter().map(|span| span.name.as_str()).collect()
}

/// A client's sampled `traceparent` in trace `trace`, from span `parent`.
fn traceparent(trace: &str, parent: &str) -> String {
    format!("00-{trace}-{parent}-01")
}

const SERVER: i32 = 2;
const CLIENT: i32 = 3;

/// Waits until the spans of `trace` include every one of `expected`.
async fn spans_of(received: &Received, trace: &str, expected: &[&str]) -> Vec<Span> {
    eventually(Duration::from_secs(15), "the spans to be exported", || async {
        let spans = received.of_trace(trace);
        expected.iter().all(|name| spans.iter().any(|span| span.name == *name))
    })
    .await;
    received.of_trace(trace)
}

/// A gateway tracing at ratio 0 (only the traces the clients sampled are followed) in front of two in-process model
/// servers, its spans sent to a real OTLP receiver.
struct TraceSetup {
    gateway: GatewayProcess,
    received: Received,
    collector: SocketAddr,
    rest_backend: oipgate::modelserver::RunningModelServer,
    grpc_backend: oipgate::modelserver::RunningModelServer,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_real_otlp_receiver_and_the_backends_join_their_trace() {
    let (rest_backend, grpc_backend) = in_process_backends().await;
    let (collector, received) = otlp_receiver().await;
    let gateway = GatewayProcess::start(&format!(
        "[tracing]\notlp_endpoint = \"http://{collector}\"\nsample_ratio = 0.0\nservice_name = \"gateway-under-test\"\n\
         {}{ADD_SUB_ON_BOTH}",
        fleet_backends(rest_backend.rest_addr.unwrap(), grpc_backend.grpc_addr.unwrap())
    ));
    let setup = TraceSetup {
        gateway,
        received,
        collector,
        rest_backend,
        grpc_backend,
    };
    let rest_trace = rest_to_grpc_is_one_trace(&setup).await;
    spans_carry_the_service_resource(&setup.received);
    let grpc_trace = grpc_to_rest_is_one_trace(&setup).await;
    let stream_trace = a_stream_is_one_span(&setup).await;
    unsampled_requests_record_nothing(&setup, [rest_trace, grpc_trace, stream_trace]).await;
    a_full_export_queue_drops_spans(&setup).await;
}

/// Every export names the service the spans come from: Jaeger and Tempo group spans by it.
fn spans_carry_the_service_resource(received: &Received) {
    let resources = received.1.lock().unwrap().clone();
    assert!(!resources.is_empty());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    for resource in resources {
        let text = |key: &str| match resource.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.clone()) {
            Some(AnyValue {
                value: Some(Value::StringValue(text)),
            }) => text,
            other => panic!("the resource has {key} = {other:?}: {resource:?}"),
        };
        assert_eq!(text("service.name"), "gateway-under-test");
        assert_eq!(text("service.version"), env!("CARGO_PKG_VERSION"));
        assert_eq!(text("service.instance.id"), host.trim());
    }
}

/// REST -> gRPC: decoded, sent to the gRPC backend, encoded back; the trace's id.
async fn rest_to_grpc_is_one_trace(setup: &TraceSetup) -> &'static str {
    let TraceSetup {
        gateway,
        received,
        grpc_backend,
        ..
    } = setup;
    let grpc_address = grpc_backend.grpc_addr.unwrap();
    // REST -> gRPC: decoded, sent to the gRPC backend, encoded back.
    let rest_trace = "0af7651916cd43dd8448eb211c80319c";
    let answer = post_with_headers(
        &gateway.rest_url("/v2/models/add_sub/versions/2/infer"),
        &[("traceparent", traceparent(rest_trace, "b7ad6b7169203331"))],
        common::add_sub_json("INT32"),
    )
    .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let spans = spans_of(
        received,
        rest_trace,
        &[
            "POST /v2/models/{model}/infer",
            "route",
            "decode",
            "encode",
            "backend attempt",
        ],
    )
    .await;
    let root = named(&spans, "POST /v2/models/{model}/infer");
    assert_eq!(root.kind, SERVER);
    assert_eq!(
        to_hex(&root.parent_span_id),
        "b7ad6b7169203331",
        "a child of the client's span"
    );
    assert_eq!(number(root, "http.response.status_code"), 200);
    assert_eq!(text(root, "oip.model"), "add_sub");
    assert_eq!(text(root, "oip.version"), "2");
    for step in ["route", "decode", "encode", "backend attempt"] {
        assert_eq!(
            named(&spans, step).parent_span_id,
            root.span_id,
            "{step} is a step of the request"
        );
    }
    assert_eq!(text(named(&spans, "route"), "oip.backend"), "fleet-b");
    assert!(number(named(&spans, "decode"), "oip.bytes") > 0);
    assert!(number(named(&spans, "encode"), "oip.bytes") > 0);
    let attempt = named(&spans, "backend attempt");
    assert_eq!(attempt.kind, CLIENT);
    assert_eq!(text(attempt, "server.address"), grpc_address.to_string());
    assert_eq!(number(attempt, "oip.retry"), 0);
    assert!(
        grpc_backend
            .state
            .traceparents()
            .contains(&traceparent(rest_trace, &to_hex(&attempt.span_id))),
        "the gRPC backend saw the attempt's span as its parent: {:?}",
        grpc_backend.state.traceparents()
    );
    rest_trace
}

/// gRPC -> REST: the message decoded and sent to the REST backend; the trace's id.
async fn grpc_to_rest_is_one_trace(setup: &TraceSetup) -> &'static str {
    let TraceSetup {
        gateway,
        received,
        rest_backend,
        ..
    } = setup;
    let rest_address = rest_backend.rest_addr.unwrap();
    // gRPC -> REST: the message decoded and sent to the REST backend.
    let grpc_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut client = gateway.grpc_client().await;
    let mut request = tonic::Request::new(grpc_add_sub_request("1", 3, 4));
    request.metadata_mut().insert(
        "traceparent",
        traceparent(grpc_trace, "00f067aa0ba902b7").parse().unwrap(),
    );
    client.model_infer(request).await.unwrap();
    let spans = spans_of(
        received,
        grpc_trace,
        &[
            "inference.GRPCInferenceService/ModelInfer",
            "route",
            "decode",
            "encode",
            "backend attempt",
        ],
    )
    .await;
    let root = named(&spans, "inference.GRPCInferenceService/ModelInfer");
    assert_eq!(root.kind, SERVER);
    assert_eq!(to_hex(&root.parent_span_id), "00f067aa0ba902b7");
    assert_eq!(number(root, "rpc.grpc.status_code"), 0);
    assert_eq!(text(root, "rpc.method"), "ModelInfer");
    assert_eq!(text(root, "oip.version"), "1");
    let attempt = named(&spans, "backend attempt");
    assert_eq!(attempt.parent_span_id, root.span_id);
    assert_eq!(text(attempt, "server.address"), rest_address.to_string());
    assert!(
        rest_backend
            .state
            .traceparents()
            .contains(&traceparent(grpc_trace, &to_hex(&attempt.span_id))),
        "the REST backend saw the attempt's span as its parent: {:?}",
        rest_backend.state.traceparents()
    );
    grpc_trace
}

/// A stream: one span, an event per message either way, its backend stream a child of it; the trace's id.
async fn a_stream_is_one_span(setup: &TraceSetup) -> &'static str {
    let TraceSetup {
        gateway,
        received,
        grpc_backend,
        ..
    } = setup;
    let mut client = gateway.grpc_client().await;
    // A stream: one span, an event per message either way, its backend stream a child of it.
    let stream_trace = "5b8aa5a2d2c872e8321cf37308d69df2";
    let messages = (0..3).map(|i| grpc_add_sub_request("2", i, 1));
    let mut request = tonic::Request::new(tokio_stream::iter(messages));
    request.metadata_mut().insert(
        "traceparent",
        traceparent(stream_trace, "051581bf3cb55c13").parse().unwrap(),
    );
    let mut answers = client.model_stream_infer(request).await.unwrap().into_inner();
    let mut count = 0;
    while let Some(answer) = answers.message().await.unwrap() {
        assert!(answer.error_message.is_empty(), "{}", answer.error_message);
        count += 1;
    }
    assert_eq!(count, 3);
    let spans = spans_of(
        received,
        stream_trace,
        &["inference.GRPCInferenceService/ModelStreamInfer"],
    )
    .await;
    let root = named(&spans, "inference.GRPCInferenceService/ModelStreamInfer");
    let events: Vec<&str> = root.events.iter().map(|event| event.name.as_str()).collect();
    assert_eq!(
        events.iter().filter(|name| **name == "request").count(),
        3,
        "{events:?}"
    );
    assert_eq!(
        events.iter().filter(|name| **name == "response").count(),
        3,
        "{events:?}"
    );
    assert_eq!(number(root, "oip.requests"), 3);
    assert_eq!(number(root, "rpc.grpc.status_code"), 0);
    assert!(
        grpc_backend
            .state
            .traceparents()
            .contains(&traceparent(stream_trace, &to_hex(&root.span_id))),
        "the backend's stream carries the stream's span"
    );
    stream_trace
}

/// Not sampled (no parent, ratio 0): nothing recorded, nothing added for the backend; only `sampled` are there.
async fn unsampled_requests_record_nothing(setup: &TraceSetup, sampled: [&str; 3]) {
    let TraceSetup {
        gateway,
        received,
        rest_backend,
        ..
    } = setup;
    // Not sampled (no parent, ratio 0): nothing recorded, nothing added for the backend.
    let before = rest_backend.state.traceparents().len();
    let answer = common::post(
        &gateway.rest_url("/v2/models/add_sub/versions/1/infer"),
        common::add_sub_json("INT32"),
    )
    .await;
    assert_eq!(answer.status, 200);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let traces: std::collections::HashSet<String> = received.all().iter().map(|s| to_hex(&s.trace_id)).collect();
    assert_eq!(traces, sampled.map(str::to_owned).into(), "only the sampled traces");
    assert_eq!(rest_backend.state.traceparents().len(), before);
    assert!(
        gateway
            .metric_if_present("oipgate_spans_total{result=\"exported\"}")
            .await
            .is_some_and(|value| value >= 11.0)
    );
}

/// An export queue of one span: what does not fit is dropped and counted, and no request waits for it.
async fn a_full_export_queue_drops_spans(setup: &TraceSetup) {
    let TraceSetup {
        collector,
        rest_backend,
        grpc_backend,
        ..
    } = setup;
    let (rest_address, grpc_address) = (rest_backend.rest_addr.unwrap(), grpc_backend.grpc_addr.unwrap());
    let small = GatewayProcess::start(&format!(
        "[tracing]\notlp_endpoint = \"http://{collector}\"\nsample_ratio = 1.0\nmax_queue = 1\n{}{ADD_SUB_ON_BOTH}",
        fleet_backends(rest_address, grpc_address)
    ));
    let client = common::http_client(false);
    let url = small.rest_url("/v2/models/add_sub/versions/2/infer");
    let calls = (0..20).map(|_| common::send(&client, "POST", &url, &[], common::add_sub_json("INT32")));
    for answer in futures_util::future::join_all(calls).await {
        assert_eq!(answer.status, 200);
    }
    eventually(Duration::from_secs(10), "dropped spans counted", || async {
        small
            .metric_if_present("oipgate_spans_total{result=\"dropped\"}")
            .await
            .is_some_and(|value| value > 0.0)
    })
    .await;
}

/// A CloudEvent as the sink received it.
#[derive(Debug, Clone)]
struct Event {
    headers: http::HeaderMap,
    body: Bytes,
}

impl Event {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_else(|| panic!("the event has no {name}: {:?}", self.headers))
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }
}

/// A CloudEvents sink that records every event POSTed to it.
async fn event_sink() -> (SocketAddr, Arc<Mutex<Vec<Event>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let kept = events.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let kept = kept.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let kept = kept.clone();
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await.unwrap().to_bytes();
                        kept.lock().unwrap().push(Event {
                            headers: parts.headers,
                            body,
                        });
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    (address, events)
}

/// The events of request `id`, by type.
fn events_of(events: &Mutex<Vec<Event>>, id: &str) -> HashMap<String, Event> {
    events
        .lock()
        .unwrap()
        .iter()
        .filter(|event| event.headers.get("ce-id").is_some_and(|v| v == id))
        .map(|event| (event.header("ce-type").to_owned(), event.clone()))
        .collect()
}

const REQUEST: &str = "org.kubeflow.serving.inference.request";
const RESPONSE: &str = "org.kubeflow.serving.inference.response";

/// Waits for both events of request `id` and checks what they say of it.
async fn logged(events: &Mutex<Vec<Event>>, id: &str, model: &str, version: &str) -> (Event, Event) {
    eventually(Duration::from_secs(10), "both events", || async {
        events_of(events, id).len() == 2
    })
    .await;
    let both = events_of(events, id);
    // JSON, but a stream's answer: its events as the client received them.
    assert!(both[REQUEST].header("content-type").starts_with("application/json"));
    for event in both.values() {
        assert_eq!(event.header("ce-specversion"), "1.0");
        assert_eq!(event.header("ce-inferenceservicename"), model);
        assert_eq!(event.header("ce-endpoint"), version);
        assert_eq!(event.header("ce-source"), "oipgate-under-test");
        assert_eq!(event.header("ce-namespace"), "models");
        assert!(event.header("ce-time").ends_with('Z'));
        let content_type = event.header("content-type");
        assert!(
            content_type.starts_with("application/json") || content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
    }
    (both[REQUEST].clone(), both[RESPONSE].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_logs_its_request_and_answer_as_kserve_cloudevents() {
    let (rest_backend, grpc_backend) = in_process_backends().await;
    let (sink, events) = event_sink().await;
    let gateway = GatewayProcess::start(&format!(
        "[payload_log]\nurl = \"http://{sink}/\"\nsource = \"oipgate-under-test\"\nnamespace = \"models\"\n{}{ADD_SUB_ON_BOTH}\
         [[models]]\nname = \"private\"\npayload_log = false\nversions = [ {{ version = \"1\", backend = \"fleet-a\", \
         upstream_name = \"add_sub\" }} ]\n\
         [[models]]\nname = \"count\"\nversions = [ {{ version = \"1\", backend = \"fleet-a\" }}, \
         {{ version = \"2\", backend = \"fleet-b\", upstream_version = \"1\" }} ]\n",
        fleet_backends(rest_backend.rest_addr.unwrap(), grpc_backend.grpc_addr.unwrap())
    ));
    let json = common::add_sub_json("INT32");
    // REST -> REST (proxied as it came) and REST -> gRPC (translated).
    for version in ["1", "2"] {
        let id = format!("rest-to-{version}");
        let answer = post_with_headers(
            &gateway.rest_url(&format!("/v2/models/add_sub/versions/{version}/infer")),
            &[("x-request-id", id.clone())],
            json.clone(),
        )
        .await;
        assert_eq!(answer.status, 200);
        let (request, response) = logged(&events, &id, "add_sub", version).await;
        assert_eq!(
            request.body,
            Bytes::from(json.clone()),
            "the request as the client sent it"
        );
        assert_eq!(response.body, answer.body, "the answer as the client received it");
    }
    // gRPC -> gRPC (spliced) and gRPC -> REST (translated): the messages as V2 JSON.
    let mut client = gateway.grpc_client().await;
    for version in ["2", "1"] {
        let id = format!("grpc-to-{version}");
        let mut request = tonic::Request::new(grpc_add_sub_request(version, 5, 2));
        request.metadata_mut().insert("x-request-id", id.parse().unwrap());
        client.model_infer(request).await.unwrap();
        let (request, response) = logged(&events, &id, "add_sub", version).await;
        let request = request.json();
        assert_eq!(request["inputs"][0]["name"], "INPUT0");
        assert_eq!(
            request["inputs"][0]["data"],
            serde_json::json!([5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])
        );
        let response = response.json();
        assert_eq!(response["model_name"], "add_sub");
        assert_eq!(response["outputs"][0]["data"][0], 7);
    }
    // A gRPC stream's requests, each under its own id, to both backends: their requests logged, as V2 JSON.
    let mut messages = Vec::new();
    for version in ["2", "1"] {
        let mut message = grpc_add_sub_request(version, 4, 1);
        message.id = format!("stream-to-{version}");
        messages.push(message);
    }
    let mut answers = client
        .model_stream_infer(tokio_stream::iter(messages))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        let answer = answers.message().await.unwrap().unwrap();
        assert!(answer.error_message.is_empty(), "{answer:?}");
    }
    for version in ["2", "1"] {
        let id = format!("stream-to-{version}");
        eventually(Duration::from_secs(10), "the stream request's event", || async {
            events_of(&events, &id).contains_key(REQUEST)
        })
        .await;
        let request = events_of(&events, &id)[REQUEST].clone();
        assert_eq!(request.header("ce-endpoint"), version);
        assert_eq!(request.json()["inputs"][0]["data"][0], 4, "{:?}", request.body);
    }
    // The binary extension, both ways: translated to JSON for the sink.
    let (_, _, answer) = post_binary_add_sub(&gateway, "binary").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert!(answer.header("inference-header-content-length").is_some());
    let (request, response) = logged(&events, "binary", "add_sub", "1").await;
    assert_eq!(request.json()["inputs"][1]["data"][0], 1);
    assert_eq!(response.json()["outputs"][0]["data"][0], 4);
    // generate, to a REST backend (relayed) and a gRPC one (translated): the request as sent, the answer as received,
    // under the request id the answer carries.
    let ones = vec![1; 16];
    let ones = serde_json::json!({ "INPUT0": ones, "INPUT1": ones }).to_string();
    for version in ["1", "2"] {
        let id = format!("generate-{version}");
        let answer = post_with_headers(
            &gateway.rest_url(&format!("/v2/models/add_sub/versions/{version}/generate")),
            &[("x-request-id", id.clone())],
            ones.clone(),
        )
        .await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.header("x-request-id"), Some(id.as_str()));
        let (request, response) = logged(&events, &id, "add_sub", version).await;
        assert_eq!(request.body, Bytes::from(ones.clone()));
        assert_eq!(response.body, answer.body);
        assert_eq!(response.json()["OUTPUT0"][0], 2, "{:?}", response.body);
    }
    streams_log_the_events_the_client_received(&gateway, &events).await;
    an_opted_out_model_and_a_refused_call(&gateway, &events, &json).await;
    assert_eq!(
        gateway
            .metric("oipgate_payload_log_events_total{result=\"sent\"}")
            .await,
        21.0
    );
}

/// `generate_stream` of the decoupled `count` (three events), relayed from a REST backend and translated from a
/// gRPC one: the answer is logged once the stream ends, as the events the client received.
async fn streams_log_the_events_the_client_received(gateway: &GatewayProcess, events: &Mutex<Vec<Event>>) {
    for version in ["1", "2"] {
        let id = format!("generate-stream-{version}");
        let body = r#"{"INPUT0": 3}"#;
        let answer = post_with_headers(
            &gateway.rest_url(&format!("/v2/models/count/versions/{version}/generate_stream")),
            &[("x-request-id", id.clone())],
            body.to_owned(),
        )
        .await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        let (request, response) = logged(events, &id, "count", version).await;
        assert_eq!(request.body, Bytes::from(body));
        assert!(response.header("content-type").starts_with("text/event-stream"));
        assert_eq!(response.body, answer.body, "the events as the client received them");
        let text = String::from_utf8_lossy(&response.body).into_owned();
        assert_eq!(text.matches("data: ").count(), 3, "{text}");
    }
}

/// Posts add_sub's inputs (all 3s and all 1s) to its version 1 in the binary extension, with request id `id`; gives
/// the body sent, its Inference-Header-Content-Length and the answer.
async fn post_binary_add_sub(gateway: &GatewayProcess, id: &str) -> (Bytes, String, common::HttpAnswer) {
    let tensor = |name: &str, value: i32| {
        Tensor::new(
            name.to_owned(),
            DataType::Int32,
            vec![1, 16],
            common::int32s([value; 16]),
        )
        .unwrap()
    };
    let (body, [(name, length)]) = common::binary_request(vec![tensor("INPUT0", 3), tensor("INPUT1", 1)]);
    let answer = post_with_headers(
        &gateway.rest_url("/v2/models/add_sub/versions/1/infer"),
        &[("x-request-id", id.to_owned()), (name, length.clone())],
        body.to_bytes(),
    )
    .await;
    (body.to_bytes(), length, answer)
}

/// A model that opts out is never logged; a failed inference logs its request only.
async fn an_opted_out_model_and_a_refused_call(gateway: &GatewayProcess, events: &Mutex<Vec<Event>>, json: &str) {
    let answer = post_with_headers(
        &gateway.rest_url("/v2/models/private/infer"),
        &[("x-request-id", "private".to_owned())],
        json.to_owned(),
    )
    .await;
    assert_eq!(answer.status, 200);
    let answer = post_with_headers(
        &gateway.rest_url("/v2/models/add_sub/versions/1/infer"),
        &[("x-request-id", "refused".to_owned())],
        r#"{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"INT32","data":[1]}]}"#,
    )
    .await;
    assert_eq!(answer.status, 400);
    eventually(Duration::from_secs(10), "the refused request's event", || async {
        events_of(events, "refused").contains_key(REQUEST)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        events_of(events, "private").is_empty(),
        "an opted-out model is not logged"
    );
    assert!(
        !events_of(events, "refused").contains_key(RESPONSE),
        "only answers that succeeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_logging_samples_its_share_and_a_dead_sink_costs_the_clients_nothing() {
    let (rest_backend, grpc_backend) = in_process_backends().await;
    let (sink, events) = event_sink().await;
    let backends = fleet_backends(rest_backend.rest_addr.unwrap(), grpc_backend.grpc_addr.unwrap());
    let gateway = GatewayProcess::start(&format!(
        "[payload_log]\nurl = \"http://{sink}/\"\nmode = \"request\"\nsample_ratio = 0.25\n{backends}{ADD_SUB_ON_BOTH}"
    ));
    let url = gateway.rest_url("/v2/models/add_sub/versions/1/infer");
    let json = Bytes::from(common::add_sub_json("INT32"));
    let client = common::http_client(false);
    let calls = 2000;
    let mut under_way = tokio::task::JoinSet::new();
    for worker in 0..8 {
        let (client, url, json) = (client.clone(), url.clone(), json.clone());
        under_way.spawn(async move {
            for _ in (worker..calls).step_by(8) {
                let answer = common::send(&client, "POST", &url, &[], json.clone()).await;
                assert_eq!(answer.status, 200);
            }
        });
    }
    while let Some(done) = under_way.join_next().await {
        done.unwrap();
    }
    eventually(Duration::from_secs(10), "the sampled events", || async {
        gateway
            .metric("oipgate_payload_log_events_total{result=\"sent\"}")
            .await
            == events.lock().unwrap().len() as f64
    })
    .await;
    let logged = events.lock().unwrap().len();
    // 2,000 draws at 0.25: 500 expected, sd 19.4; the bounds are over 5 sd away.
    assert!((400..=600).contains(&logged), "{logged} of {calls} logged at 0.25");
    assert!(
        events.lock().unwrap().iter().all(|e| e.header("ce-type") == REQUEST),
        "mode = request"
    );

    // A sink that takes connections and never answers, behind a queue of 8: clients are answered as fast as ever,
    // and what cannot be queued is dropped and counted.
    let black_hole = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole = black_hole.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let holding = held.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = black_hole.accept().await {
            holding.lock().unwrap().push(tcp);
        }
    });
    let gateway = GatewayProcess::start(&format!(
        "[payload_log]\nurl = \"http://{hole}/\"\nmax_queue = 8\ntimeout_ms = 30000\n{backends}{ADD_SUB_ON_BOTH}"
    ));
    let url = gateway.rest_url("/v2/models/add_sub/versions/1/infer");
    for _ in 0..200 {
        let started = Instant::now();
        let answer = common::send(&client, "POST", &url, &[], json.clone()).await;
        assert_eq!(answer.status, 200);
        // Waiting on the sink, a request would wait its 30 s delivery timeout.
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "a request waited on the sink: {:?}",
            started.elapsed()
        );
    }
    eventually(Duration::from_secs(10), "dropped events counted", || async {
        gateway
            .metric("oipgate_payload_log_events_total{result=\"dropped\"}")
            .await
            > 300.0
    })
    .await;
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_as_sent_keep_the_binary_extension_and_the_grpc_message() {
    let (rest_backend, grpc_backend) = in_process_backends().await;
    let (sink, events) = event_sink().await;
    let gateway = GatewayProcess::start(&format!(
        "[payload_log]\nurl = \"http://{sink}/\"\ntensors = \"as_sent\"\n{}{ADD_SUB_ON_BOTH}",
        fleet_backends(rest_backend.rest_addr.unwrap(), grpc_backend.grpc_addr.unwrap())
    ));
    let (body, length, answer) = post_binary_add_sub(&gateway, "binary").await;
    assert_eq!(answer.status, 200);
    eventually(Duration::from_secs(10), "both events", || async {
        events_of(&events, "binary").len() == 2
    })
    .await;
    let both = events_of(&events, "binary");
    let request = &both[REQUEST];
    assert_eq!(request.body, body, "the body as the client sent it");
    assert_eq!(request.header("inference-header-content-length"), length);
    assert_eq!(request.header("content-type"), "application/octet-stream");
    let response = &both[RESPONSE];
    assert_eq!(response.body, answer.body, "the answer as the client received it");
    assert_eq!(
        Some(response.header("inference-header-content-length")),
        answer.header("inference-header-content-length")
    );

    let mut client = gateway.grpc_client().await;
    let message = grpc_add_sub_request("2", 5, 2);
    let mut request = tonic::Request::new(message.clone());
    request.metadata_mut().insert("x-request-id", "grpc".parse().unwrap());
    client.model_infer(request).await.unwrap();
    eventually(Duration::from_secs(10), "both events", || async {
        events_of(&events, "grpc").len() == 2
    })
    .await;
    let both = events_of(&events, "grpc");
    assert_eq!(both[REQUEST].header("content-type"), "application/x-protobuf");
    let logged = oipgate::proto::ModelInferRequest::decode(both[REQUEST].body.clone()).unwrap();
    assert_eq!(logged, message, "the message as the client sent it");
    let answered = oipgate::proto::ModelInferResponse::decode(both[RESPONSE].body.clone()).unwrap();
    assert_eq!(answered.model_name, "add_sub");
}

/// The endpoint picker's span joins the trace of the request Envoy asks it about (its `traceparent`), with the
/// routing and picking steps as its children.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pickers_span_joins_the_requests_trace() {
    use oipgate::envoy_api::envoy::config::core::v3 as core;
    use oipgate::envoy_api::envoy::service::ext_proc::v3 as ext_proc;
    use oipgate::envoy_api::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;

    let (rest_backend, grpc_backend) = in_process_backends().await;
    let (collector, received) = otlp_receiver().await;
    let picker = GatewayProcess::start_epp(
        &format!(
            "[tracing]\notlp_endpoint = \"http://{collector}\"\nsample_ratio = 0.0\n{}{ADD_SUB_ON_BOTH}",
            fleet_backends(rest_backend.rest_addr.unwrap(), grpc_backend.grpc_addr.unwrap())
        ),
        &[],
    );
    let trace = "5b8efff798038103d269b633813fc60c";
    let header = |key: &str, value: &str| core::HeaderValue {
        key: key.to_owned(),
        value: String::new(),
        raw_value: value.as_bytes().to_vec(),
    };
    let request = ext_proc::ProcessingRequest {
        request: Some(ext_proc::processing_request::Request::RequestHeaders(
            ext_proc::HttpHeaders {
                headers: Some(core::HeaderMap {
                    headers: vec![
                        header(":method", "GET"),
                        header(":path", "/v2/models/add_sub/versions/1/ready"),
                        header("traceparent", &traceparent(trace, "eee19b7ec3c1b174")),
                    ],
                }),
                end_of_stream: true,
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let mut client = ExternalProcessorClient::connect(format!("http://{}", picker.epp.unwrap()))
        .await
        .unwrap();
    let mut answers = client
        .process(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    assert!(
        matches!(
            answer.response,
            Some(ext_proc::processing_response::Response::RequestHeaders(_))
        ),
        "{answer:?}"
    );
    drop(answers);
    let spans = spans_of(&received, trace, &["epp pick", "route", "pick"]).await;
    let root = named(&spans, "epp pick");
    assert_eq!(
        to_hex(&root.parent_span_id),
        "eee19b7ec3c1b174",
        "a child of Envoy's span"
    );
    assert_eq!(root.kind, SERVER);
    for step in ["route", "pick"] {
        assert_eq!(
            named(&spans, step).parent_span_id,
            root.span_id,
            "{step} is a step of the pick"
        );
    }
    assert_eq!(text(root, "oip.model"), "add_sub");
}

//! The smallest hyper 1.x reverse proxies, HTTP/1.1 and HTTP/2: reference rows of the load harness
//! (`scripts/bench`), the floors the REST and gRPC doors are measured against. A current-thread runtime per thread on
//! one shared listener and a pooled `hyper_util` legacy client per thread, with TCP_NODELAY on both sides. HTTP/1.1:
//! `http1::Builder::serve_connection`, bodies collected whole. HTTP/2 (`--http2`): `http2::Builder::serve_connection`
//! and an `http2_only` client, bodies and trailers streamed through untouched.
//! `floor_hyper --listen ADDR --upstream ADDR --threads N [--http2]`; without arguments (as `cargo test` runs it) it
//! runs both proxies briefly in front of a model server of its own, and checks their answers.

#[path = "support/arguments.rs"]
mod arguments;
#[path = "support/self_check.rs"]
mod self_check;
use arguments::argument;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Failure = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Failure> {
    let (Some(listen), Some(upstream)) = (argument("--listen"), argument("--upstream")) else {
        return checked();
    };
    let threads: usize = argument("--threads").map_or(Ok(2), |t| t.parse())?;
    let http2 = std::env::args().any(|a| a == "--http2");
    let listener = std::net::TcpListener::bind(&listen)?;
    proxy(listener, upstream, threads, http2)?;
    loop {
        std::thread::park();
    }
}

/// Both proxies, briefly, in front of a model server: an inference through each (a gRPC call through HTTP/2's).
fn checked() -> Result<(), Failure> {
    let (rest, grpc) = self_check::model_server()?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?.to_string();
    proxy(listener, rest.to_string(), 1, false)?;
    self_check::check_http1(&address)?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    proxy(listener, grpc.to_string(), 1, true)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let mut client = oipgate::proto::grpc_inference_service_client::GrpcInferenceServiceClient::connect(format!(
            "http://{address}"
        ))
        .await?;
        let request = oipgate::proto::ModelInferRequest {
            model_name: "identity".into(),
            inputs: vec![oipgate::proto::model_infer_request::InferInputTensor {
                name: "x".into(),
                datatype: "INT32".into(),
                shape: vec![2],
                contents: Some(oipgate::proto::InferTensorContents {
                    int_contents: vec![7, 8],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let answer = client.model_infer(request).await?.into_inner();
        let raw = answer
            .raw_output_contents
            .first()
            .ok_or("an answer without raw contents")?;
        if raw[..] != [7, 0, 0, 0, 8, 0, 0, 0] {
            return Err(format!("unexpected answer through the HTTP/2 proxy: {answer:?}").into());
        }
        Ok::<_, Failure>(())
    })
}

/// Serves the proxy on `listener` from `threads` threads of their own.
fn proxy(listener: std::net::TcpListener, upstream: String, threads: usize, http2: bool) -> Result<(), Failure> {
    listener.set_nonblocking(true)?;
    for _ in 0..threads {
        let listener = listener.try_clone()?;
        let upstream = upstream.clone();
        std::thread::spawn(move || -> Result<(), Failure> {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let listener = runtime.block_on(async { tokio::net::TcpListener::from_std(listener) })?;
            runtime.block_on(serve(listener, upstream, http2))
        });
    }
    Ok(())
}

/// The request's target at the upstream.
fn at_upstream(head: &http::request::Parts, upstream: &str) -> Result<http::Uri, Failure> {
    let target = head.uri.path_and_query().map_or("/", |p| p.as_str());
    Ok(format!("http://{upstream}{target}").parse()?)
}

async fn serve(listener: tokio::net::TcpListener, upstream: String, http2: bool) -> Result<(), Failure> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let whole: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector.clone());
    let streamed: Client<_, Incoming> = Client::builder(TokioExecutor::new()).http2_only(true).build(connector);
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let io = TokioIo::new(stream);
        let upstream = upstream.clone();
        if http2 {
            let client = streamed.clone();
            let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                let (client, upstream) = (client.clone(), upstream.clone());
                async move {
                    let (mut head, body) = request.into_parts();
                    head.uri = at_upstream(&head, &upstream)?;
                    Ok::<_, Failure>(client.request(http::Request::from_parts(head, body)).await?)
                }
            });
            tokio::spawn(http2::Builder::new(TokioExecutor::new()).serve_connection(io, service));
        } else {
            let client = whole.clone();
            let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                let (client, upstream) = (client.clone(), upstream.clone());
                async move {
                    let (mut head, body) = request.into_parts();
                    let body = body.collect().await?.to_bytes();
                    head.uri = at_upstream(&head, &upstream)?;
                    Ok::<_, Failure>(client.request(http::Request::from_parts(head, Full::new(body))).await?)
                }
            });
            tokio::spawn(http1::Builder::new().serve_connection(io, service));
        }
    }
}

//! The smallest hyper 1.x reverse proxy: a reference row of the load harness (`scripts/bench`), the floor the REST
//! door is measured against. A current-thread runtime per thread on one shared listener,
//! `http1::Builder::serve_connection`, a pooled `hyper_util` legacy client per thread, bodies collected whole.
//! `floor_hyper --listen ADDR --upstream ADDR --threads N`; without arguments (as `cargo test` runs it) it does
//! nothing.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Failure = Box<dyn std::error::Error + Send + Sync>;

fn argument(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn main() -> Result<(), Failure> {
    let (Some(listen), Some(upstream)) = (argument("--listen"), argument("--upstream")) else {
        return Ok(());
    };
    let threads: usize = argument("--threads").map_or(Ok(2), |t| t.parse())?;
    let listener = std::net::TcpListener::bind(&listen)?;
    listener.set_nonblocking(true)?;
    for _ in 0..threads {
        let listener = listener.try_clone()?;
        let upstream = upstream.clone();
        std::thread::spawn(move || -> Result<(), Failure> {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let mut connector = HttpConnector::new();
                connector.set_nodelay(true);
                let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
                loop {
                    let (stream, _) = listener.accept().await?;
                    stream.set_nodelay(true)?;
                    let (client, upstream) = (client.clone(), upstream.clone());
                    let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                        let (client, upstream) = (client.clone(), upstream.clone());
                        async move {
                            let (mut head, body) = request.into_parts();
                            let body = body.collect().await?.to_bytes();
                            let target = head.uri.path_and_query().map_or("/", |p| p.as_str());
                            head.uri = format!("http://{upstream}{target}").parse()?;
                            let answer = client.request(http::Request::from_parts(head, Full::new(body))).await?;
                            Ok::<_, Failure>(answer)
                        }
                    });
                    tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
                }
            })
        });
    }
    loop {
        std::thread::park();
    }
}

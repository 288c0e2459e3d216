//! The short real run each harness helper makes when `cargo test` runs it with no arguments: a model server of
//! oipgate's in this process, requests through the helper, their answers checked.
#![allow(dead_code, reason = "each helper program that includes this uses the part it needs")]

use std::net::SocketAddr;

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// The JSON request the checks send to the model server's `identity`, and what its answer carries.
pub const BODY: &str = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}]}"#;
pub const ANSWERED: &str = r#""data":[7,8]"#;

/// A model server (REST and gRPC on ports of their own) on a runtime of its own, for as long as the process runs.
pub fn model_server() -> Result<(SocketAddr, SocketAddr), Failure> {
    let (sender, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let any = Some("127.0.0.1:0".parse().unwrap());
            let server = oipgate::modelserver::start(oipgate::modelserver::ModelServerConfig {
                rest: any,
                grpc: any,
                ..Default::default()
            })
            .await
            .unwrap();
            sender
                .send((server.rest_addr.unwrap(), server.grpc_addr.unwrap()))
                .unwrap();
            std::future::pending::<()>().await;
        });
    });
    Ok(received.recv()?)
}

/// A port free now, for a helper that binds its address itself.
pub fn free_port() -> Result<u16, Failure> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Sends the identity request to `address` over HTTP/1.1 (within a few seconds, while the helper starts); fails
/// unless its answer carries the tensor.
pub fn check_http1(address: &str) -> Result<(), Failure> {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let attempt = (|| -> Result<String, Failure> {
            let mut stream = std::net::TcpStream::connect(address)?;
            stream.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
            write!(
                stream,
                "POST /v2/models/identity/infer HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{BODY}",
                BODY.len()
            )?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer)?;
            Ok(answer)
        })();
        match attempt {
            Ok(answer) if answer.starts_with("HTTP/1.1 200") && answer.contains(ANSWERED) => return Ok(()),
            Ok(answer) => return Err(format!("unexpected answer through {address}: {answer}").into()),
            Err(_) if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_millis(50)),
            Err(error) => return Err(error),
        }
    }
}

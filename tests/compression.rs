//! Compressed requests and answers through the gateway, as Triton's REST API takes them: gzip and deflate bodies on
//! every path, answers compressed for clients that accept it, a body that expands without bound stopped at the
//! limit, and codings the gateway does not read refused; gzip and deflate gRPC messages.

mod common;

use std::io::{Read, Write};

use common::config::backend;
use common::{GatewayProcess, ModelServerProcess, grpc_add_sub_request, http_client, int32s, send};
use tonic::codec::CompressionEncoding;

/// The gateway over one model server: `add_sub` version 1 on its REST listener (proxied as it is), version 2 on its
/// gRPC one (translated); `compression` says whether both backends get requests that came compressed compressed.
fn gateway(server: &ModelServerProcess, compression: bool, max_request_bytes: u64) -> GatewayProcess {
    GatewayProcess::start(&format!(
        "[limits]\nmax_request_bytes = {max_request_bytes}\n{}binary_data = true\ncompression = {compression}\n\
         {}compression = {compression}\n{}",
        backend("fleet-a", "rest", [server.rest.unwrap()]),
        backend("fleet-b", "grpc", [server.grpc.unwrap()]),
        common::config::ADD_SUB_ON_BOTH,
    ))
}

fn gzip(body: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(body).unwrap();
    encoder.finish().unwrap()
}

fn deflate(body: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(body).unwrap();
    encoder.finish().unwrap()
}

fn gunzip(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(body).read_to_end(&mut out).unwrap();
    out
}

/// An add_sub JSON request of `rows` rows of 16.
fn add_sub_rows(rows: usize) -> String {
    let row: Vec<String> = (0..16 * rows).map(|i| (i % 100).to_string()).collect();
    let data = row.join(",");
    format!(
        r#"{{"inputs":[{{"name":"INPUT0","datatype":"INT32","shape":[{rows},16],"data":[{data}]}},{{"name":"INPUT1","datatype":"INT32","shape":[{rows},16],"data":[{data}]}}]}}"#
    )
}

/// The outputs of an add_sub answer, without the names that differ between versions.
fn outputs(answer: &[u8]) -> serde_json::Value {
    let answer: serde_json::Value = serde_json::from_slice(answer).unwrap();
    answer["outputs"].clone()
}

#[tokio::test]
async fn compressed_bodies_reach_every_path_and_answers_come_compressed_when_asked() {
    let server = ModelServerProcess::both();
    let client = http_client(false);
    // 64 rows: an answer long enough to be worth compressing.
    let body = add_sub_rows(64);
    for compression in [false, true] {
        let gateway = gateway(&server, compression, 64 << 20);
        for version in ["1", "2"] {
            let url = gateway.rest_url(&format!("/v2/models/add_sub/versions/{version}/infer"));
            let plain = send(&client, "POST", &url, &[], body.clone()).await;
            assert_eq!(plain.status, 200);
            for (coding, compressed) in [("gzip", gzip(body.as_bytes())), ("deflate", deflate(body.as_bytes()))] {
                let headers = [
                    ("content-encoding", coding.to_owned()),
                    ("x-echo-probe", "1".to_owned()),
                ];
                let answer = send(&client, "POST", &url, &headers, compressed).await;
                assert_eq!(answer.status, 200, "{coding} to version {version}: {:?}", answer.body);
                assert_eq!(
                    outputs(&answer.body),
                    outputs(&plain.body),
                    "{coding} to version {version}"
                );
                // Compressed on only to a backend that reads it: proxied as it is to the REST one, as a compressed
                // message to the gRPC one.
                let received = answer.header("x-echo-received").unwrap_or_default();
                let told = if version == "1" {
                    "content-encoding"
                } else {
                    "grpc-encoding"
                };
                assert_eq!(
                    received.contains(told),
                    compression,
                    "{coding} to {version}: {received}"
                );
            }
            // Asked for gzip, the answer comes compressed and decodes to the same JSON.
            let headers = [("accept-encoding", "deflate;q=0.5, gzip".to_owned())];
            let answer = send(&client, "POST", &url, &headers, body.clone()).await;
            assert_eq!(answer.status, 200);
            assert_eq!(answer.header("content-encoding"), Some("gzip"), "version {version}");
            assert_eq!(
                outputs(&gunzip(&answer.body)),
                outputs(&plain.body),
                "version {version}"
            );
        }
    }
}

/// A MiB of zeros as raw deflate blocks ending in a full flush; a bomb repeats it.
fn zeros_mebibyte() -> Vec<u8> {
    let mut compress = flate2::Compress::new(flate2::Compression::best(), false);
    let mut out = Vec::with_capacity(1 << 16);
    compress
        .compress_vec(&vec![0u8; 1 << 20], &mut out, flate2::FlushCompress::Full)
        .unwrap();
    out
}

/// A gzip body of 1024 members of a MiB of zeros each (readers take every member).
fn gzip_gibibyte_of_zeros() -> Vec<u8> {
    let member = {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(&vec![0u8; 1 << 20]).unwrap();
        encoder.finish().unwrap()
    };
    member.repeat(1024)
}

/// A zlib body of a GiB of zeros: one block compressed after a full flush (which forgets what came before, so the
/// same block may follow itself), repeated, then the final block and the checksum.
fn deflate_gibibyte_of_zeros() -> Vec<u8> {
    let block = zeros_mebibyte();
    let mut body = vec![0x78, 0xda];
    for _ in 0..1024 {
        body.extend_from_slice(&block);
    }
    let mut last = Vec::with_capacity(64);
    flate2::Compress::new(flate2::Compression::best(), false)
        .compress_vec(&[], &mut last, flate2::FlushCompress::Finish)
        .unwrap();
    body.extend_from_slice(&last);
    // Adler-32 of n zeros: a stays 1, b is n.
    let b = (1u32 << 30) % 65521;
    body.extend_from_slice(&((b << 16) | 1).to_be_bytes());
    body
}

#[tokio::test]
async fn a_body_that_expands_past_the_limit_is_refused_without_the_memory() {
    let server = ModelServerProcess::both();
    let limit: u64 = 8 << 20;
    let gateway = gateway(&server, false, limit);
    let client = http_client(false);
    // One GiB of zeros, about a MiB compressed; the deflate one has no size in its trailer to give it away.
    let bombs = [
        ("gzip", gzip_gibibyte_of_zeros()),
        ("deflate", deflate_gibibyte_of_zeros()),
    ];
    let peak = || gateway.peak_rss();
    // Warmed up first: the threads' allocators and buffers are not what is measured.
    for version in ["1", "2"] {
        let url = gateway.rest_url(&format!("/v2/models/add_sub/versions/{version}/infer"));
        for _ in 0..4 {
            assert_eq!(send(&client, "POST", &url, &[], add_sub_rows(64)).await.status, 200);
        }
    }
    let before = peak();
    for (coding, bomb) in &bombs {
        for version in ["1", "2"] {
            let url = gateway.rest_url(&format!("/v2/models/add_sub/versions/{version}/infer"));
            let headers = [("content-encoding", (*coding).to_owned())];
            let answer = send(&client, "POST", &url, &headers, bomb.clone()).await;
            assert_eq!(answer.status, 413, "{:?}", answer.body);
            assert!(String::from_utf8_lossy(&answer.body).contains("decompresses to more than the limit"));
            // The limit, the compressed body and a few MiB of buffers; never the gibibyte it expands to.
            let grown = peak().saturating_sub(before);
            assert!(
                grown < limit + (6 << 20),
                "after {coding} to version {version}, the peak memory grew by {grown} bytes"
            );
            // Memory freed on one door thread returns to the system at the gateway's next purge (each second);
            // the next bomb may land on the other thread.
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        }
    }
}

#[tokio::test]
async fn codings_the_gateway_does_not_read_and_broken_bodies_are_refused() {
    let server = ModelServerProcess::both();
    let gateway = gateway(&server, false, 64 << 20);
    let client = http_client(false);
    let url = gateway.rest_url("/v2/models/add_sub/versions/1/infer");
    let body = add_sub_rows(1);
    let answer = send(
        &client,
        "POST",
        &url,
        &[("content-encoding", "br".to_owned())],
        body.clone(),
    )
    .await;
    assert_eq!(answer.status, 415);
    assert_eq!(answer.header("accept-encoding"), Some("gzip, deflate"));
    assert!(String::from_utf8_lossy(&answer.body).contains("Content-Encoding 'br' is not supported"));
    for version in ["1", "2"] {
        let url = gateway.rest_url(&format!("/v2/models/add_sub/versions/{version}/infer"));
        let answer = send(
            &client,
            "POST",
            &url,
            &[("content-encoding", "gzip".to_owned())],
            body.clone(),
        )
        .await;
        assert_eq!(answer.status, 400);
        assert!(String::from_utf8_lossy(&answer.body).contains("does not decompress as gzip"));
    }
}

#[tokio::test]
async fn compressed_grpc_messages_reach_both_backends() {
    let server = ModelServerProcess::both();
    for (compression, encoding) in [false, true].into_iter().flat_map(|compression| {
        [CompressionEncoding::Gzip, CompressionEncoding::Deflate].map(|encoding| (compression, encoding))
    }) {
        let gateway = gateway(&server, compression, 64 << 20);
        let mut client = gateway
            .grpc_client()
            .await
            .send_compressed(encoding)
            .accept_compressed(encoding);
        // Version 1 is translated to the REST backend, version 2 passes through to the gRPC one.
        for version in ["1", "2"] {
            let mut request = tonic::Request::new(grpc_add_sub_request(version, 1, 2));
            request.metadata_mut().insert("x-echo-probe", "1".parse().unwrap());
            let answer = client.model_infer(request).await;
            let answer = answer.unwrap_or_else(|status| panic!("{encoding:?} version {version}: {status:?}"));
            if version == "2" {
                // Sent on compressed only to a backend configured to take it (whose answer, asked for compressed,
                // comes compressed and is read).
                let received = answer.metadata().get("x-echo-received").unwrap().to_str().unwrap();
                assert_eq!(
                    received.contains("grpc-encoding"),
                    compression,
                    "{encoding:?}: {received}"
                );
            }
            // A client that compressed its request and accepts the same back gets its answer compressed.
            let coding = answer
                .metadata()
                .get("grpc-encoding")
                .map(|v| v.to_str().unwrap().to_owned());
            assert_eq!(
                coding.as_deref(),
                Some(encoding.to_string().as_str()),
                "{encoding:?} version {version}"
            );
            let sums = &answer.into_inner().raw_output_contents[0];
            assert_eq!(sums, &int32s([3; 16]), "{encoding:?} version {version}");
        }
    }
}

/// A REST "backend" that answers every inference with one binary-extension answer compressed with gzip, whatever
/// the request asked for (Triton compresses for a client's `Accept-Encoding`; this one always does).
fn compressing_backend() -> (std::net::SocketAddr, Vec<u8>, usize) {
    // A long id, so the compressed answer is shorter than its JSON header alone (the case Triton's answers hit).
    let header = format!(
        r#"{{"id":"{}","model_name":"up","model_version":"1","outputs":[{{"name":"y","datatype":"INT32","shape":[2],"parameters":{{"binary_data_size":8}}}}]}}"#,
        "a".repeat(400)
    );
    let header = header.as_bytes();
    let mut decoded = header.to_vec();
    decoded.extend_from_slice(&int32s([7, 8]));
    let compressed = gzip(&decoded);
    assert!(compressed.len() < header.len());
    let mut answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-encoding: gzip\r\n\
         inference-header-content-length: {}\r\ncontent-length: {}\r\n\r\n",
        header.len(),
        compressed.len()
    )
    .into_bytes();
    answer.extend_from_slice(&compressed);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let answer = answer.clone();
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut buffer = [0u8; 4096];
                loop {
                    // A request's head, then as much body as it says.
                    let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match stream.read(&mut buffer) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buffer[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|line| line.strip_prefix("content-length:"))
                        .and_then(|value| value.trim().parse().ok())
                        .unwrap_or(0);
                    while seen.len() < end + 4 + length {
                        match stream.read(&mut buffer) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buffer[..n]),
                        }
                    }
                    seen.drain(..end + 4 + length);
                    if stream.write_all(&answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (address, decoded, header.len())
}

#[tokio::test]
async fn a_compressed_backend_answer_passes_untouched_or_is_read_and_renamed_on_its_decoded_bytes() {
    let (address, decoded, header_length) = compressing_backend();
    let gateway = GatewayProcess::start(&format!(
        r#"{}binary_data = true
[[models]]
name = "plain"
versions = [ {{ version = "1", backend = "zipped", upstream_name = "up" , upstream_version = "1" }} ]
[[models]]
name = "up"
versions = [ {{ version = "1", backend = "zipped" }} ]
"#,
        backend("zipped", "rest", [address]),
    ));
    let client = http_client(false);
    let body = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]}"#;
    // Passed on as it came: the lengths are of the decoded body, and the client decodes it.
    let answer = send(
        &client,
        "POST",
        &gateway.rest_url("/v2/models/up/infer"),
        &[("accept-encoding", "gzip".to_owned())],
        body,
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.header("content-encoding"), Some("gzip"));
    assert_eq!(gunzip(&answer.body), decoded);
    // An aliased model's answer, compressed though it was not asked to be: read, and its names restored.
    let answer = send(&client, "POST", &gateway.rest_url("/v2/models/plain/infer"), &[], body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let renamed_length: usize = answer
        .header("inference-header-content-length")
        .unwrap()
        .parse()
        .unwrap();
    let header: serde_json::Value = serde_json::from_slice(&answer.body[..renamed_length]).unwrap();
    assert_eq!(
        (header["model_name"].as_str(), header["model_version"].as_str()),
        (Some("plain"), Some("1"))
    );
    assert_eq!(&answer.body[renamed_length..], &decoded[header_length..]);
    // Translated (gRPC to a REST backend): decoded before it is read.
    let mut grpc = gateway.grpc_client().await;
    let mut request = common::grpc_int32_request("up", "1");
    request.inputs[0].name = "x".into();
    let reply = grpc.model_infer(request).await.unwrap().into_inner();
    assert_eq!(reply.outputs[0].name, "y");
    assert_eq!(reply.raw_output_contents[0], int32s([7, 8]));
}

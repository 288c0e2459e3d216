//! Hostile input at the REST door, from both sides: clients that send malformed or oversized heads, ambiguous or
//! broken framing, or dribble their headers; and a backend whose answer claims lengths it does not have. Each is
//! refused with the right status, and nothing a client sends that way reaches a backend. A client that reads its
//! answer slowly still gets all of it.

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::config::{backend, model};
use common::{GatewayProcess, ModelServerProcess, http_client, post, send};

/// A REST "backend" on a bound listener that counts the inference requests it receives and answers every request
/// with `answer`.
struct LyingBackend {
    address: std::net::SocketAddr,
    requests: Arc<AtomicUsize>,
}

impl LyingBackend {
    fn start(answer: &'static [u8]) -> LyingBackend {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let requests = Arc::new(AtomicUsize::new(0));
        let counted = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let counted = counted.clone();
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    let mut buffer = [0u8; 4096];
                    // One request per connection: its head, then whatever body came with it.
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buffer) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buffer[..n]),
                        }
                    }
                    // Health probes come too; only inferences are counted.
                    if seen.starts_with(b"POST") && String::from_utf8_lossy(&seen).contains("/infer ") {
                        counted.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
                    let _ = stream.read(&mut buffer);
                    let _ = stream.write_all(answer);
                });
            }
        });
        LyingBackend { address, requests }
    }
}

/// An answer whose JSON header is said to be 999 bytes long in a body of 10.
const HEADER_LONGER_THAN_BODY: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\
inference-header-content-length: 999\r\ncontent-length: 10\r\nconnection: close\r\n\r\n0123456789";
/// An answer whose JSON header length is near the top of a 64-bit number.
const HEADER_NEAR_USIZE_MAX: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\
inference-header-content-length: 18446744073709551610\r\nconnection: close\r\n\r\n0123456789";

/// An answer framed by two different lengths: which is its end cannot be told.
const TWO_LENGTHS: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\
content-length: 12\r\n\r\n{}";

/// An answer whose one length is given as a list, and again on a line of its own.
const LISTED_LENGTH: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2, 2\r\n\
content-length: 2\r\n\r\n{}";

/// A gateway in front of three lying backends (one whose JSON header is longer than its body, one whose header length
/// is near the top of a 64-bit number, one whose answer gives two lengths) and a real model server serving `identity`.
struct Setup {
    liar: LyingBackend,
    huge: LyingBackend,
    framed: LyingBackend,
    _listed: LyingBackend,
    _real: ModelServerProcess,
    gateway: GatewayProcess,
}

fn setup() -> Setup {
    let liar = LyingBackend::start(HEADER_LONGER_THAN_BODY);
    let huge = LyingBackend::start(HEADER_NEAR_USIZE_MAX);
    let framed = LyingBackend::start(TWO_LENGTHS);
    let listed = LyingBackend::start(LISTED_LENGTH);
    let real = ModelServerProcess::rest_only(&["--models", "identity"]);
    let gateway = GatewayProcess::start(&format!(
        r#"
        [limits]
        header_read_timeout_ms = 500
        {}
        {}
        {}
        {}
        {}
        {}
        {}
        {}
        [[models]]
        name = "liar_alias"
        versions = [ {{ version = "1", backend = "liar", upstream_name = "other" }} ]
        [[models]]
        name = "huge_alias"
        versions = [ {{ version = "1", backend = "huge", upstream_name = "other" }} ]
        {}
        "#,
        backend("liar", "rest", [liar.address]),
        backend("huge", "rest", [huge.address]),
        backend("framed", "rest", [framed.address]),
        backend("listed", "rest", [listed.address]),
        backend("real", "rest", [real.rest.unwrap()]),
        model("liar", "liar"),
        model("two_lengths", "framed"),
        model("listed_length", "listed"),
        model("identity", "real"),
    ));
    Setup {
        liar,
        huge,
        framed,
        _listed: listed,
        _real: real,
        gateway,
    }
}

/// Sends `parts` (pausing `pause` between them) on one connection while reading what comes back, until the gateway
/// closes it.
fn exchange(address: std::net::SocketAddr, parts: &[&[u8]], pause: Duration) -> String {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let parts: Vec<Vec<u8>> = parts.iter().map(|part| part.to_vec()).collect();
    let writing = std::thread::spawn(move || {
        for part in parts {
            if writer.write_all(&part).is_err() {
                break;
            }
            std::thread::sleep(pause);
        }
    });
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let _ = writing.join();
    String::from_utf8_lossy(&answer).into_owned()
}

fn status(answer: &str) -> &str {
    answer.split(' ').nth(1).unwrap_or("")
}

/// The status of each answer on a connection, in order.
fn statuses(answers: &str) -> Vec<&str> {
    answers
        .match_indices("HTTP/1.1 ")
        .map(|(at, _)| &answers[at + 9..at + 12])
        .collect()
}

const BODY: &str = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;

#[tokio::test]
async fn a_backend_answer_whose_lengths_do_not_add_up_is_a_bad_gateway_naming_it() {
    let setup = setup();
    let (liar, huge, framed, gateway) = (&setup.liar, &setup.huge, &setup.framed, &setup.gateway);
    for (model, backend, named) in [
        ("liar", liar, "longer than its whole body"),
        ("liar_alias", liar, "longer than its whole body"),
        ("huge_alias", huge, "Inference-Header-Content-Length"),
        ("two_lengths", framed, "two different Content-Length values"),
    ] {
        let answer = post(&gateway.rest_url(&format!("/v2/models/{model}/infer")), BODY).await;
        assert_eq!(answer.status, 502, "{model}: {}", String::from_utf8_lossy(&answer.body));
        let message = answer.json()["error"].as_str().unwrap().to_owned();
        assert!(message.contains(&backend.address.to_string()), "{model}: {message}");
        assert!(message.contains(named), "{model}: {message}");
    }
    // The gateway is unharmed: a well-behaved backend is still served.
    let answer = post(&gateway.rest_url("/v2/models/identity/infer"), BODY).await;
    assert_eq!(answer.status, 200);
}

#[tokio::test]
async fn a_backend_length_given_as_a_list_or_twice_reaches_the_client_once_as_digits() {
    let setup = setup();
    let address = setup.gateway.rest;
    let request = format!(
        "POST /v2/models/listed_length/infer HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: \
         application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let answer = tokio::task::spawn_blocking(move || exchange(address, &[request.as_bytes()], Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(status(&answer), "200", "{answer}");
    let lengths: Vec<&str> = answer
        .lines()
        .filter(|line| line.to_ascii_lowercase().starts_with("content-length:"))
        .collect();
    assert_eq!(lengths, ["content-length: 2"], "{answer}");
    assert!(answer.ends_with("\r\n\r\n{}"), "{answer}");
}

#[tokio::test]
async fn malformed_and_oversized_requests_are_refused_and_never_forwarded() {
    let setup = setup();
    let address = setup.gateway.rest;
    let infer = "POST /v2/models/liar/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "a header block over the limit",
            format!(
                "{infer}x-padding: {}\r\ncontent-length: 2\r\n\r\n{{}}",
                "a".repeat(70 * 1024)
            )
            .into_bytes(),
            "431",
        ),
        (
            "a request line over the limit",
            format!(
                "POST /v2/models/liar/infer?{} HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{{}}",
                "q".repeat(10 * 1024)
            )
            .into_bytes(),
            "414",
        ),
        (
            "both Content-Length and Transfer-Encoding",
            format!("{infer}content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n")
                .into_bytes(),
            "400",
        ),
        (
            "two different Content-Length values",
            format!("{infer}content-length: 2\r\ncontent-length: 3\r\n\r\n{{}}").into_bytes(),
            "400",
        ),
        (
            "a malformed chunk size",
            format!("{infer}transfer-encoding: chunked\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n").into_bytes(),
            "400",
        ),
        // RFC 9112 §3.2: Host once, naming a host.
        (
            "an HTTP/1.1 request without Host",
            b"POST /v2/models/liar/infer HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}".to_vec(),
            "400",
        ),
        (
            "two Host fields",
            format!("{infer}host: y\r\ncontent-length: 2\r\n\r\n{{}}").into_bytes(),
            "400",
        ),
        (
            "a Host that is no host",
            b"POST /v2/models/liar/infer HTTP/1.1\r\nhost: a b\r\ncontent-length: 2\r\n\r\n{}".to_vec(),
            "400",
        ),
        // RFC 9112 §6.1: a coding not implemented is 501; chunked twice frames nothing.
        (
            "a transfer coding the gateway does not implement",
            format!("{infer}transfer-encoding: gzip, chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n").into_bytes(),
            "501",
        ),
        (
            "chunked twice",
            format!("{infer}transfer-encoding: chunked, chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n").into_bytes(),
            "400",
        ),
        // One rule for every line of the framing: CR LF.
        (
            "a trailer line ended by a bare LF",
            format!("{infer}transfer-encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\nx-trailer: 1\n\r\n").into_bytes(),
            "400",
        ),
        (
            "a size line ended by a bare LF",
            format!("{infer}transfer-encoding: chunked\r\n\r\n2\n{{}}\r\n0\r\n\r\n").into_bytes(),
            "400",
        ),
        (
            "a gzip body cut short",
            {
                let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                gzip.write_all(BODY.repeat(100).as_bytes()).unwrap();
                let gzip = gzip.finish().unwrap();
                let cut = &gzip[..gzip.len() - 9];
                let mut request =
                    format!("{infer}content-encoding: gzip\r\ncontent-length: {}\r\n\r\n", cut.len()).into_bytes();
                request.extend_from_slice(cut);
                request
            },
            "400",
        ),
    ];
    const REST_REQUESTS: &str = r#"oipgate_request_duration_seconds_count{protocol="rest"}"#;
    // None yet, or those of the other tests' setups; read present below.
    let counted = setup.gateway.metric_if_present(REST_REQUESTS).await.unwrap_or(0.0);
    let refused = cases.len();
    for (what, request, expected) in cases {
        let answer = tokio::task::spawn_blocking(move || exchange(address, &[&request], Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(status(&answer), expected, "{what}: {answer}");
    }
    assert_eq!(
        setup.liar.requests.load(Ordering::SeqCst),
        0,
        "a refused request reached the backend"
    );
    // Each refusal is reported as a request, those refused at their head (before a request was made) included.
    assert_eq!(
        setup.gateway.metric(REST_REQUESTS).await - counted,
        refused as f64,
        "every refusal is counted"
    );
}

#[tokio::test]
async fn a_request_framed_both_ways_is_refused_when_pipelined_behind_others() {
    let setup = setup();
    let address = setup.gateway.rest;
    let infer = "POST /v2/models/identity/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";
    let ahead = [
        "GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n".to_owned(),
        format!("{infer}content-length: {}\r\n\r\n{BODY}", BODY.len()),
        format!(
            "{infer}transfer-encoding: chunked\r\n\r\n{:x};x=y\r\n{BODY}\r\n0\r\nx-t: 1\r\n\r\n",
            BODY.len()
        ),
    ];
    let smuggled = format!(
        "POST /v2/models/liar/infer HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\ntransfer-encoding: chunked\r\n\r\n\
{:x}\r\n{BODY}\r\n0\r\n\r\n",
        BODY.len() + 7,
        BODY.len()
    );
    // All in one write, and byte by byte: either way the gateway reads the smuggled head in the reads it makes for
    // the requests ahead of it.
    for (how, pieces, pause) in [
        ("in one write", usize::MAX, Duration::ZERO),
        ("byte by byte", 1, Duration::from_micros(50)),
    ] {
        let stream: Vec<u8> = ahead
            .concat()
            .into_bytes()
            .into_iter()
            .chain(smuggled.bytes())
            .collect();
        let answer = tokio::task::spawn_blocking(move || {
            let parts: Vec<&[u8]> = stream.chunks(pieces.min(stream.len())).collect();
            exchange(address, &parts, pause)
        })
        .await
        .unwrap();
        assert_eq!(statuses(&answer), ["200", "200", "200", "400"], "{how}: {answer}");
        assert!(answer.contains("Transfer-Encoding"), "{answer}");
    }
    assert_eq!(
        setup.liar.requests.load(Ordering::SeqCst),
        0,
        "the smuggled request reached the backend"
    );
}

#[tokio::test]
async fn a_client_dribbling_its_headers_gets_408_and_the_connection_closes() {
    let setup = setup();
    let address = setup.gateway.rest;
    let head = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nx-slow: abcdefghijklmnopqrstuvwxyz\r\n\r\n";
    let answer = tokio::task::spawn_blocking(move || {
        let bytes: Vec<&[u8]> = head.chunks(1).collect();
        exchange(address, &bytes, Duration::from_millis(50))
    })
    .await
    .unwrap();
    // The head's time limit answered, where a head let through whole would have been answered 200.
    assert_eq!(status(&answer), "408", "{answer}");
    assert!(answer.contains("did not arrive in time"), "{answer}");

    // The head of a request pipelined behind another is timed as a head once its first bytes have come.
    let answer = tokio::task::spawn_blocking(move || {
        exchange(
            address,
            &[b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nhost: x\r\n"],
            Duration::ZERO,
        )
    })
    .await
    .unwrap();
    assert_eq!(statuses(&answer), ["200", "408"], "{answer}");
    // Also when its first bytes come while the request before it is still under way (its body's last byte with them).
    let post = format!(
        "POST /v2/models/identity/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
content-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let (most, last) = post.split_at(post.len() - 1);
    let (most, rest) = (
        most.to_owned(),
        format!("{last}GET /v2/health/live HTTP/1.1\r\nhost: x\r\n"),
    );
    let answer = tokio::task::spawn_blocking(move || {
        exchange(address, &[most.as_bytes(), rest.as_bytes()], Duration::from_millis(100))
    })
    .await
    .unwrap();
    assert_eq!(statuses(&answer), ["200", "408"], "{answer}");

    // An idle keep-alive connection is not timed as a slow head: it waits past the head's limit and still serves.
    let answer = tokio::task::spawn_blocking(move || {
        exchange(
            address,
            &[
                b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n",
                b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            ],
            Duration::from_millis(900),
        )
    })
    .await
    .unwrap();
    assert_eq!(answer.matches("HTTP/1.1 200").count(), 2, "{answer}");
}

/// A client that reads a large answer slowly gets all of it, and its connection stays open for the next request:
/// the answer's last bytes wait in the gateway long after its body was produced, and the idle clock must not cut them
/// off (it did: a 64 MiB answer was cut short about once in fifty).
#[test]
fn a_slow_reader_gets_a_large_answer_whole_and_keeps_its_connection() {
    let grpc = ModelServerProcess::grpc_only(&["--models", "identity"]);
    let gateway = GatewayProcess::start(&format!(
        "{}\n{}",
        backend("grpc", "grpc", [grpc.grpc.unwrap()]),
        model("identity", "grpc")
    ));
    let values = vec!["7"; 3_000_000].join(",");
    let body = format!(r#"{{"inputs":[{{"name":"x","datatype":"INT32","shape":[3000000],"data":[{values}]}}]}}"#);
    let request = format!(
        "POST /v2/models/identity/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(&gateway.rest.into()).unwrap();
    let mut stream: std::net::TcpStream = socket.into();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for round in 0..2 {
        stream.write_all(request.as_bytes()).unwrap();
        // The answer (6 MB) is more than the kernel buffers on both sides hold, so its last bytes wait in the
        // gateway while the client reads nothing for longer than the gateway's idle hand-off (200 ms).
        std::thread::sleep(Duration::from_millis(700));
        let mut received = Vec::new();
        let mut buffer = [0u8; 65536];
        let expected = loop {
            let n = stream.read(&mut buffer).unwrap();
            assert!(
                n > 0,
                "round {round}: the gateway closed the connection after {} bytes",
                received.len()
            );
            received.extend_from_slice(&buffer[..n]);
            if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&received[..end]).to_lowercase();
                assert!(head.starts_with("http/1.1 200"), "round {round}: {head}");
                let length: usize = head
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length:"))
                    .map(|value| value.trim().parse().unwrap())
                    .expect("a content-length");
                if received.len() >= end + 4 + length {
                    assert_eq!(
                        received.len(),
                        end + 4 + length,
                        "round {round}: bytes after the answer"
                    );
                    break length;
                }
            }
        };
        assert!(
            expected > 6_000_000,
            "round {round}: the answer carries the 3,000,000 values"
        );
    }
}

/// A backend's answer with headers of every kind: its own (`x-backend`, twice), those the gateway sets in its place
/// (request id, serving version), hop-by-hop and framing ones, gRPC's, its `Date` and `Server`, and `more` besides.
fn answer_with_headers(more: &str) -> &'static [u8] {
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\n\
         Server: lying\r\nX-Request-Id: backend-id\r\nOIP-Model-Version: backend-version\r\nX-Backend: one\r\n\
         x-backend: two\r\nKeep-Alive: timeout=5\r\nTrailer: x-checksum\r\ngrpc-status: 0\r\n{more}\
         Content-Length: 2\r\n\r\n{{}}"
    );
    answer.into_bytes().leak()
}

/// An answer's header lines, lower-cased and sorted, and its `Date`.
fn header_lines(answer: &str) -> (Vec<String>, Vec<String>) {
    let head = answer.split("\r\n\r\n").next().unwrap_or("");
    let (dates, mut lines): (Vec<String>, Vec<String>) = head
        .lines()
        .skip(1)
        .map(|line| {
            let (name, value) = line.split_once(':').unwrap_or((line, ""));
            format!("{}: {}", name.to_ascii_lowercase(), value.trim())
        })
        .partition(|line| line.starts_with("date: "));
    lines.sort();
    (lines, dates)
}

#[tokio::test]
async fn a_backend_answer_comes_back_with_its_end_to_end_headers_and_the_gateways() {
    // Passed back as lines in the answer's head; with a `Connection` naming one of them, or more lines than are
    // kept that way, read into a map: the client sees the same either way.
    let plain = LyingBackend::start(answer_with_headers("Connection: close\r\n"));
    let nominating = LyingBackend::start(answer_with_headers("Connection: close, X-Private\r\nX-Private: a\r\n"));
    let many = LyingBackend::start(answer_with_headers(&format!(
        "{}Connection: close\r\n",
        "x-many: 1\r\n".repeat(4)
    )));
    // An answer long enough for the gateway to compress for a client that takes it compressed.
    let long_body = format!(r#"{{"id":"{}"}}"#, "a".repeat(2000));
    let long = LyingBackend::start(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Backend: one\r\nConnection: close\r\n\
             Content-Length: {}\r\n\r\n{long_body}",
            long_body.len()
        )
        .into_bytes()
        .leak(),
    );
    let gateway = GatewayProcess::start(&format!(
        "{}{}{}{}{}{}{}{}",
        backend("plain", "rest", [plain.address]),
        backend("nominating", "rest", [nominating.address]),
        backend("many", "rest", [many.address]),
        backend("long", "rest", [long.address]),
        model("plain", "plain"),
        model("nominating", "nominating"),
        model("many", "many"),
        model("long", "long"),
    ));
    let ours = [
        "content-length: 2",
        "content-type: application/json",
        "oip-model-version: 1",
        "x-backend: one",
        "x-backend: two",
        "x-request-id: rid-9",
    ];
    for (model, more) in [("plain", 0), ("nominating", 0), ("many", 4)] {
        // A client that takes compressed answers (this answer is too short to be compressed for it).
        for accept in ["", "accept-encoding: gzip\r\n"] {
            let request = format!(
                "POST /v2/models/{model}/infer HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-request-id: rid-9\r\n\
                 {accept}content-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
                BODY.len()
            );
            let address = gateway.rest;
            let answer = tokio::task::spawn_blocking(move || exchange(address, &[request.as_bytes()], Duration::ZERO))
                .await
                .unwrap();
            assert_eq!(status(&answer), "200", "{model} {accept}: {answer}");
            assert!(answer.ends_with("\r\n\r\n{}"), "{model} {accept}: {answer}");
            let (lines, dates) = header_lines(&answer);
            let mut expected: Vec<String> = ours.iter().map(|line| (*line).to_owned()).collect();
            expected.extend(std::iter::repeat_n("x-many: 1".to_owned(), more));
            expected.push("connection: close".to_owned());
            expected.sort();
            assert_eq!(lines, expected, "{model} {accept}: {answer}");
            assert_eq!(dates.len(), 1, "{model} {accept}: {answer}");
            assert!(!dates[0].contains("2024"), "the backend's date: {answer}");
        }
        // Over HTTP/2 (h2c), where hyper writes the answer from its map: the same headers.
        let answer = send(
            &http_client(true),
            "POST",
            &gateway.rest_url(&format!("/v2/models/{model}/infer")),
            &[("x-request-id", "rid-9".to_owned())],
            BODY,
        )
        .await;
        assert_eq!(answer.status, 200, "{model} h2c: {answer:?}");
        let (dates, mut lines): (Vec<String>, Vec<String>) = answer
            .headers
            .iter()
            .map(|(name, value)| format!("{name}: {}", value.to_str().unwrap()))
            .partition(|line| line.starts_with("date: "));
        lines.sort();
        assert!(
            dates.len() == 1 && !dates[0].contains("2024"),
            "{model} h2c: {answer:?}"
        );
        let mut expected: Vec<String> = ours.iter().map(|line| (*line).to_owned()).collect();
        expected.extend(std::iter::repeat_n("x-many: 1".to_owned(), more));
        expected.sort();
        assert_eq!(lines, expected, "{model} h2c: {answer:?}");
    }
    // Compressed by the gateway for a client that takes it so, over HTTP/1.1 and HTTP/2: the backend's headers, and
    // the coding's in place of the length.
    for h2 in [false, true] {
        let answer = send(
            &http_client(h2),
            "POST",
            &gateway.rest_url("/v2/models/long/infer"),
            &[("accept-encoding", "gzip".to_owned())],
            BODY,
        )
        .await;
        assert_eq!(answer.status, 200, "h2 {h2}: {answer:?}");
        assert_eq!(answer.header("content-encoding"), Some("gzip"), "h2 {h2}: {answer:?}");
        assert_eq!(answer.header("vary"), Some("accept-encoding"), "h2 {h2}: {answer:?}");
        assert_eq!(answer.header("x-backend"), Some("one"), "h2 {h2}: {answer:?}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/json"),
            "h2 {h2}: {answer:?}"
        );
        assert!(answer.header("content-length").is_none(), "h2 {h2}: {answer:?}");
        let mut decoded = String::new();
        flate2::read::GzDecoder::new(&answer.body[..])
            .read_to_string(&mut decoded)
            .unwrap();
        assert_eq!(decoded, long_body, "h2 {h2}");
    }
}

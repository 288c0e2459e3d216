//! The REST door's HTTP/1.1 as clients use its less common parts: `Expect: 100-continue`, HTTP/1.0 with and without
//! keep-alive, HEAD, pipelined requests, bodies that arrive in pieces, and connections that go quiet and come back.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::config::{backend, model};
use common::{GatewayProcess, ModelServerProcess};

const BODY: &str = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}]}"#;

fn setup() -> (ModelServerProcess, GatewayProcess) {
    let server = ModelServerProcess::rest_only(&["--models", "identity"]);
    let gateway = GatewayProcess::start(&format!(
        "[limits]\nmax_request_bytes = 4096\n{}\n{}",
        backend("real", "rest", [server.rest.unwrap()]),
        model("identity", "real"),
    ));
    (server, gateway)
}

fn connect(address: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream
}

/// Reads one answer (its head, then a body of its Content-Length); `None` when the connection closed first.
fn read_answer(stream: &mut TcpStream) -> Option<(String, String)> {
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !seen.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => seen.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8(seen).unwrap();
    let length: usize = head
        .lines()
        .find_map(|line| {
            line.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_owned())
        })
        .map_or(0, |value| value.parse().unwrap());
    let mut body = vec![0u8; if head.starts_with("HTTP/1.1 100") { 0 } else { length }];
    stream.read_exact(&mut body).ok()?;
    Some((head, String::from_utf8(body).unwrap()))
}

fn closed(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(stream.read(&mut byte), Ok(0) | Err(_))
}

fn infer(version: &str, extra: &str, body: &str) -> String {
    format!(
        "POST /v2/models/identity/infer {version}\r\nhost: x\r\ncontent-type: application/json\r\n{extra}\
content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn a_client_that_expects_100_continue_is_told_to_send_its_body_only_when_it_is_wanted() {
    let (_server, gateway) = setup();
    let mut stream = connect(gateway.rest);
    let request = infer("HTTP/1.1", "expect: 100-continue\r\n", BODY);
    let (head, body) = request.split_at(request.len() - BODY.len());
    stream.write_all(head.as_bytes()).unwrap();
    let (interim, _) = read_answer(&mut stream).unwrap();
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim}");
    stream.write_all(body.as_bytes()).unwrap();
    let (answer, json) = read_answer(&mut stream).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(json.contains(r#""model_name":"identity""#), "{json}");

    // A body declared over the limit is refused at once: the client is never told to send it.
    let mut stream = connect(gateway.rest);
    let too_long = "x".repeat(5000);
    let request = infer("HTTP/1.1", "expect: 100-continue\r\n", &too_long);
    stream
        .write_all(&request.as_bytes()[..request.len() - too_long.len()])
        .unwrap();
    let (answer, json) = read_answer(&mut stream).unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(json.contains("larger than the limit"), "{json}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
}

#[test]
fn http10_clients_keep_their_connection_only_when_they_ask() {
    let (_server, gateway) = setup();
    let mut stream = connect(gateway.rest);
    stream.write_all(infer("HTTP/1.0", "", BODY).as_bytes()).unwrap();
    let (answer, _) = read_answer(&mut stream).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed(&mut stream), "an HTTP/1.0 connection without keep-alive closes");

    let mut stream = connect(gateway.rest);
    for round in 0..3 {
        stream
            .write_all(infer("HTTP/1.0", "connection: keep-alive\r\n", BODY).as_bytes())
            .unwrap();
        let (answer, _) = read_answer(&mut stream).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "round {round}: {answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: keep-alive"),
            "{answer}"
        );
    }
}

/// A connection serves its requests in one state while they keep coming and goes back to waiting small after a
/// second without one: requests before, across and after that change are all answered, on the one connection, and
/// a request that comes in pieces across it is read whole.
#[test]
fn a_connection_that_goes_quiet_and_comes_back_is_served_on() {
    let (_server, gateway) = setup();
    let mut stream = connect(gateway.rest);
    let request = infer("HTTP/1.1", "", BODY);
    for pause in [0, 0, 1300, 50, 1300, 0] {
        std::thread::sleep(Duration::from_millis(pause));
        stream.write_all(request.as_bytes()).unwrap();
        let (answer, json) = read_answer(&mut stream).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "after {pause} ms: {answer}");
        assert!(json.contains(r#""model_name":"identity""#), "{json}");
    }
    // A head whose first bytes come while it waits busy and whose rest comes more than a second later: the head's own
    // time limit applies, not the wait's.
    let (start, rest) = request.split_at(10);
    stream.write_all(start.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    stream.write_all(rest.as_bytes()).unwrap();
    let (answer, _) = read_answer(&mut stream).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[test]
fn pipelined_requests_are_answered_in_order_and_head_answers_carry_no_body() {
    let (_server, gateway) = setup();
    let mut stream = connect(gateway.rest);
    let requests = [
        "GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n".to_owned(),
        infer("HTTP/1.1", "", BODY),
        "HEAD /v2/health/ready HTTP/1.1\r\nhost: x\r\n\r\n".to_owned(),
        "GET /v2/models/nothing HTTP/1.1\r\nhost: x\r\n\r\n".to_owned(),
        "GET /v2/health/ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_owned(),
    ];
    stream.write_all(requests.concat().as_bytes()).unwrap();
    let mut statuses = Vec::new();
    for index in 0..requests.len() {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(stream.read(&mut byte).unwrap(), 1, "answer {index}");
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap();
        statuses.push(head[9..12].to_owned());
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .map_or(0, |value| value.parse().unwrap());
        // A HEAD answer says the length its body would have, and sends none.
        if index != 2 {
            let mut body = vec![0u8; length];
            stream.read_exact(&mut body).unwrap();
        }
    }
    // The HEAD answer is GET's: its status and length, and no body (the next answer's head follows at once).
    assert_eq!(statuses, ["200", "200", "200", "404", "200"]);
    assert!(
        closed(&mut stream),
        "the connection closes after the answer that asked for it"
    );
}

#[test]
fn a_body_that_arrives_in_pieces_is_read_whole() {
    let (_server, gateway) = setup();
    let request = infer("HTTP/1.1", "", BODY);
    for pieces in [1, 7, request.len()] {
        let mut stream = connect(gateway.rest);
        for piece in request.as_bytes().chunks(request.len().div_ceil(pieces)) {
            stream.write_all(piece).unwrap();
            stream.flush().unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
        let (answer, json) = read_answer(&mut stream).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{pieces} pieces: {answer}");
        assert!(json.contains(r#""data":[1]"#), "{pieces} pieces: {json}");
    }
}

//! Reading backend answers: framing, interim answers, broken heads, header limits, lines against the map.

use super::*;

#[tokio::test]
async fn an_answer_framed_both_ways_is_read_by_its_chunks_and_its_connection_not_kept() {
    let (upstream, _, accepted) = scripted(|_, _| {
        answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    })
    .await;
    for _ in 0..2 {
        let answered = get(&upstream, Method::GET).await.unwrap();
        assert_eq!(&answered.body[..], b"hello");
        // The length beside the chunks is not passed on as the answer's.
        assert!(answered.headers.get(CONTENT_LENGTH).is_none());
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "RFC 9112 §6.3: the connection is not kept"
    );
}

#[tokio::test]
async fn a_chunked_answer_in_pieces_is_read_whole_and_its_connection_kept() {
    let (upstream, received, accepted) = scripted(|_, _| Script {
        piece: 3,
        ..answer(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
              5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n",
        )
    })
    .await;
    for _ in 0..2 {
        let answered = get(&upstream, Method::GET).await.unwrap();
        assert_eq!(&answered.body[..], b"hello world");
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "the connection is kept between the two"
    );
    let (head, _) = received.lock().unwrap()[0].clone();
    assert!(
        head.starts_with("get /v2/models/m http/1.1\r\nhost: 127.0.0.1:"),
        "{head}"
    );
    assert!(head.contains("user-agent: oipgate/"), "{head}");
    assert!(
        !head.contains("content-length"),
        "a GET without a body says no length: {head}"
    );
}

#[tokio::test]
async fn interim_answers_are_skipped_and_bodiless_answers_end_at_their_head() {
    let (upstream, _, accepted) = scripted(|_, index| match index {
        0 => answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        1 => answer(b"HTTP/1.1 204 No Content\r\n\r\n"),
        _ => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
    })
    .await;
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"ok");
    let empty = get(&upstream, Method::GET).await.unwrap();
    assert_eq!(empty.status, StatusCode::NO_CONTENT);
    assert!(empty.body.is_empty());
    // A HEAD's answer has no body whatever its length says.
    let head = get(&upstream, Method::HEAD).await.unwrap();
    assert!(head.body.is_empty());
    assert_eq!(head.headers[CONTENT_LENGTH], "5");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_that_closes_its_connection_is_read_and_the_connection_not_kept() {
    let (upstream, _, accepted) = scripted(|connection, _| match connection {
        0 => answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"),
        // No length: the body is what comes until the backend closes.
        _ => Script {
            close: true,
            ..answer(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        },
    })
    .await;
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"ok");
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"all of it");
    assert_eq!(&get(&upstream, Method::GET).await.unwrap().body[..], b"all of it");
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn broken_answers_are_errors_naming_what_is_wrong() {
    let cases: [(&[u8], &str); 10] = [
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed answer head"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
            "two different Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            "invalid Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "malformed chunked framing",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokay\r\n",
            "malformed chunked framing",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
            "closed before the answer's end",
        ),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switching protocols"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            "transfer coding other than chunked",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
            "chunked more than once",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nx-trailer: 1\n\r\n",
            "malformed chunked framing",
        ),
    ];
    for (sent, named) in cases {
        let (upstream, _, _) = scripted(move |_, _| Script {
            close: true,
            ..answer(sent)
        })
        .await;
        let error = get(&upstream, Method::GET).await.unwrap_err();
        assert!(
            error.message().contains(named),
            "{:?}: {}",
            String::from_utf8_lossy(sent),
            error.message()
        );
    }
    // Trailers without end, in a line too long to be let through.
    let endless = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-long: ".as_slice(),
        &vec![b'a'; MOST_CHUNK_FRAMING],
    ]
    .concat();
    let (upstream, _, _) = scripted(move |_, _| answer(&endless)).await;
    let error = get(&upstream, Method::GET).await.unwrap_err();
    assert!(
        error.message().contains("chunk extensions or trailers"),
        "{}",
        error.message()
    );
    let long_head = [
        b"HTTP/1.1 200 OK\r\nx-long: ".as_slice(),
        &vec![b'a'; MOST_HEAD],
        b"\r\n\r\n",
    ]
    .concat();
    let (upstream, _, _) = scripted(move |_, _| answer(&long_head)).await;
    let error = get(&upstream, Method::GET).await.unwrap_err();
    assert!(error.message().contains("answer head over"), "{}", error.message());
}

#[tokio::test]
async fn an_answer_keeps_all_its_headers_up_to_the_limit() {
    let many = |count: usize| {
        let mut head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n".to_vec();
        for index in 1..count {
            head.extend_from_slice(format!("x-header-{index}: value {index}\r\n").as_bytes());
        }
        head.extend_from_slice(b"\r\nok");
        head
    };
    // More than the places noted on the stack: the head is read again for the rest.
    for count in [PLACED, PLACED + 1, MOST_HEADERS] {
        let sent = many(count);
        let (upstream, _, _) = scripted(move |_, _| answer(&sent)).await;
        let answered = get(&upstream, Method::GET).await.unwrap();
        assert_eq!(answered.headers.len(), count);
        assert_eq!(
            answered.headers[format!("x-header-{}", count - 1)],
            format!("value {}", count - 1)
        );
        assert_eq!(&answered.body[..], b"ok");
    }
    let sent = many(MOST_HEADERS + 1);
    let (upstream, _, _) = scripted(move |_, _| answer(&sent)).await;
    let error = get(&upstream, Method::GET).await.unwrap_err();
    assert!(error.message().contains("more than 100 headers"), "{}", error.message());
}

/// Counts the wakes of the task that polls a future through it.

#[test]
fn an_answer_read_as_lines_passes_back_what_its_filtered_map_would() {
    let heads = [
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n",
        // The gateway's own names, its `Date`, hop-by-hop, framing and gRPC ones, a header twice, names in capitals.
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\nServer: s\r\n\
         X-Request-Id: backend\r\nOIP-Model-Version: b\r\nX-Backend: one\r\nx-backend: two\r\nKeep-Alive: 5\r\n\
         Trailer: t\r\ngrpc-status: 0\r\nConnection: close\r\nContent-Length: 2\r\n\r\n",
        // A header named as the connection option is (reserved: RFC 9110), with the option itself.
        "HTTP/1.1 200 OK\r\nconnection: close\r\nclose: x\r\nkeep-alive: 1\r\ncontent-length: 2\r\n\r\n",
        // The binary extension's lengths (one not a length), a coding, a length given as a list.
        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ninference-header-content-length: 12\r\n\
         inference-header-content-length: 7\r\ncontent-encoding: gzip\r\ncontent-length: 40, 40\r\n\r\n",
        "HTTP/1.1 200 OK\r\ninference-header-content-length: 50\u{a0}\r\ncontent-length: 40\r\n\r\n",
        // Chunked (a length beside the chunks says nothing), an empty coding beside a length (the connection's end
        // frames it), HTTP/1.0 to the connection's end, no body at all.
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\nx-a: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: ,\r\ncontent-length: 5\r\n\r\n",
        "HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\nx-a: 1\r\n\r\n",
        "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\nx-a: 1\r\n\r\n",
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 20\r\n\r\n",
    ];
    for head in heads {
        assert!(
            answer::lines_match_map(head.as_bytes(), false),
            "not read as lines: {head}"
        );
    }
    // Read into a map instead: a `Connection` that names a header, more lines to pass back than are kept, more
    // headers than are placed, and the answer to a HEAD request.
    let kept = "x-a: 1\r\n".repeat(crate::codec::http1::KEPT_LINES + 1);
    let placed = "date: d\r\n".repeat(PLACED + 1);
    for (head, asked_head) in [
        (
            "HTTP/1.1 200 OK\r\nconnection: x-a\r\nx-a: 1\r\ncontent-length: 0\r\n\r\n".to_owned(),
            false,
        ),
        (format!("HTTP/1.1 200 OK\r\n{kept}content-length: 0\r\n\r\n"), false),
        (format!("HTTP/1.1 200 OK\r\n{placed}content-length: 0\r\n\r\n"), false),
        ("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n".to_owned(), true),
    ] {
        let Ok(Parsed::Answer(answer)) = read_head(&mut BytesMut::from(head.as_str()), asked_head, true) else {
            panic!("not an answer: {head}");
        };
        assert!(answer.passed.is_none(), "{head}");
        assert!(!answer.headers.is_empty(), "{head}");
    }
}

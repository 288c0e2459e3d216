//! Backends discovered through DNS: a small DNS server in the test answers for a name whose records change; the
//! gateway adds and removes endpoints as they do, under load, without a failed request.

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::config::{dns_backend, model};
use common::ports::hold_port_on;
use common::{
    GatewayProcess, INT32_BODY as BODY, Load, ModelServerProcess, answered_ok, eventually, http_client, post, send,
};
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_proto::serialize::binary::BinEncodable;

/// Answers A queries for `name` with the IPv4 addresses currently in `records` and AAAA queries with the IPv6 ones;
/// NXDOMAIN for other names.
async fn dns_server(name: &str, records: Arc<Mutex<Vec<IpAddr>>>) -> SocketAddr {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let address = socket.local_addr().unwrap();
    let name = Name::from_ascii(name).unwrap();
    tokio::spawn(async move {
        let mut buffer = [0u8; 512];
        loop {
            let Ok((length, from)) = socket.recv_from(&mut buffer).await else {
                continue;
            };
            let Ok(query) = Message::from_vec(&buffer[..length]) else {
                continue;
            };
            let mut answer = Message::new();
            answer
                .set_id(query.id())
                .set_message_type(MessageType::Response)
                .set_op_code(query.op_code())
                .set_recursion_desired(query.recursion_desired())
                .set_recursion_available(true)
                .set_authoritative(true);
            for question in query.queries() {
                answer.add_query(question.clone());
                if question.name() != &name {
                    answer.set_response_code(ResponseCode::NXDomain);
                } else {
                    for ip in records.lock().unwrap().iter() {
                        match (ip, question.query_type()) {
                            (IpAddr::V4(v4), RecordType::A) => {
                                answer.add_answer(Record::from_rdata(name.clone(), 1, RData::A(A(*v4))));
                            }
                            (IpAddr::V6(v6), RecordType::AAAA) => {
                                answer.add_answer(Record::from_rdata(name.clone(), 1, RData::AAAA(AAAA(*v6))));
                            }
                            _ => {}
                        }
                    }
                }
            }
            if let Ok(bytes) = answer.to_bytes() {
                let _ = socket.send_to(&bytes, from).await;
            }
        }
    });
    address
}

fn two_ip() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))
}

fn three_ip() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn endpoints_follow_dns_answers_without_disturbing_the_others() {
    // One port on both addresses, held for the two replicas.
    let held = hold_port_on(&[two_ip(), three_ip()]);
    let port = held.port();
    let mut two = Some(ModelServerProcess::named_at("two", (two_ip(), port).into(), None));
    let _three = ModelServerProcess::named_at("three", (three_ip(), port).into(), None);
    let records = Arc::new(Mutex::new(vec![two_ip()]));
    let dns = dns_server("models.test.", records.clone()).await;
    let gateway = GatewayProcess::start(&format!(
        "{}dns_server = \"{dns}\"\ndns_interval_ms = 100\nlb = \"round_robin\"\n{}",
        dns_backend("fleet", "rest", &format!("models.test:{port}")),
        model("identity", "fleet")
    ));
    let gauge = |ip: &str| format!("oipgate_endpoint_healthy{{backend=\"fleet\",endpoint=\"{ip}:{port}\"}}");
    let exposed = |ip: &'static str| {
        let gateway = &gateway;
        let series = gauge(ip);
        async move { gateway.metrics().await.contains(&series) }
    };
    eventually(Duration::from_secs(10), "the first endpoint", || exposed("127.0.0.2")).await;
    assert!(!exposed("127.0.0.3").await);

    let by_three = Arc::new(AtomicUsize::new(0));
    let by_two = Arc::new(AtomicUsize::new(0));
    let mut load = Load::default();
    for _ in 0..2 {
        let (by_two, by_three) = (by_two.clone(), by_three.clone());
        let url = gateway.rest_url("/v2/models/identity/infer");
        let client = http_client(false);
        load.worker(move || {
            let (client, url, by_two, by_three) = (client.clone(), url.clone(), by_two.clone(), by_three.clone());
            async move {
                let answer = send(&client, "POST", &url, &[("x-echo-probe", "1".to_owned())], BODY).await;
                match (answer.status, answer.header("x-echo-server")) {
                    (200, Some("two")) => by_two.fetch_add(1, Ordering::Relaxed),
                    (200, Some("three")) => by_three.fetch_add(1, Ordering::Relaxed),
                    _ => return answered_ok(&answer).and(Err(format!("no x-echo-server in {answer:?}"))),
                };
                Ok(())
            }
        });
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(by_three.load(Ordering::Relaxed), 0);

    // A second record: a second endpoint, sharing the traffic.
    records.lock().unwrap().push(three_ip());
    eventually(Duration::from_secs(10), "the second endpoint", || exposed("127.0.0.3")).await;
    let before = by_three.load(Ordering::Relaxed);
    eventually(Duration::from_secs(10), "traffic on the second endpoint", || {
        std::future::ready(by_three.load(Ordering::Relaxed) > before + 20)
    })
    .await;

    // The first record goes: its endpoint is dropped (series too); then its server can stop with nothing lost.
    records.lock().unwrap().retain(|ip| *ip != two_ip());
    eventually(Duration::from_secs(10), "the first endpoint to go", || async {
        !exposed("127.0.0.2").await
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(two.take());
    let after_two = by_two.load(Ordering::Relaxed);
    let three_before = by_three.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    load.stop().await;
    assert_eq!(
        by_two.load(Ordering::Relaxed),
        after_two,
        "nothing reached the removed endpoint"
    );
    assert!(by_three.load(Ordering::Relaxed) > three_before + 20);
}

#[tokio::test]
async fn the_system_resolver_serves_names_without_a_dns_server() {
    let replica = ModelServerProcess::both();
    let port = replica.rest.unwrap().port();
    let gateway = GatewayProcess::start(&format!(
        "{}{}",
        dns_backend("local", "rest", &format!("localhost:{port}")),
        model("identity", "local")
    ));
    let series = format!("oipgate_endpoint_healthy{{backend=\"local\",endpoint=\"127.0.0.1:{port}\"}}");
    eventually(Duration::from_secs(10), "localhost resolved", || async {
        gateway.metrics().await.contains(&series)
    })
    .await;
    // The series appears as the configuration with the endpoint is built, a moment before it serves.
    eventually(Duration::from_secs(10), "a call to reach localhost", || async {
        post(&gateway.rest_url("/v2/models/identity/infer"), BODY).await.status == 200
    })
    .await;
}

#[tokio::test]
async fn every_a_and_aaaa_record_is_an_endpoint() {
    // A port that refuses on both IPv4 addresses, held while the test runs (the gateway only has to list them).
    let held = hold_port_on(&[two_ip(), three_ip()]);
    let port = held.port();
    let records = Arc::new(Mutex::new(vec![two_ip(), three_ip(), IpAddr::V6(Ipv6Addr::LOCALHOST)]));
    let dns = dns_server("both.test.", records).await;
    let gateway = GatewayProcess::start(&format!(
        "{}dns_server = \"{dns}\"\n{}",
        dns_backend("both", "grpc", &format!("both.test:{port}")),
        model("identity", "both")
    ));
    for endpoint in [
        format!("127.0.0.2:{port}"),
        format!("127.0.0.3:{port}"),
        format!("[::1]:{port}"),
    ] {
        let series = format!("oipgate_endpoint_healthy{{backend=\"both\",endpoint=\"{endpoint}\"}}");
        eventually(Duration::from_secs(10), &series, || async {
            gateway.metrics().await.contains(&series)
        })
        .await;
    }
}

#[tokio::test]
async fn endpoints_follow_their_file() {
    let (a, b) = (ModelServerProcess::both(), ModelServerProcess::both());
    let dir = common::unique_temp_dir("oipgate-endpoints-file");
    let file = dir.join("endpoints.yaml");
    let write = |replica: &ModelServerProcess| {
        let address = replica.rest.unwrap();
        // Written aside and renamed over, as a ConfigMap update lands; the port a string, as llm-d writes it.
        let aside = dir.join("endpoints.yaml.new");
        std::fs::write(
            &aside,
            format!(
                "endpoints:\n  - name: replica\n    namespace: default\n    address: \"{}\"\n    port: \"{}\"\n  \
                 - name: not-an-ip\n    address: \"replica.example\"\n    port: \"80\"\n",
                address.ip(),
                address.port()
            ),
        )
        .unwrap();
        std::fs::rename(&aside, &file).unwrap();
    };
    write(&a);
    let gateway = GatewayProcess::start(&format!(
        "[[backends]]\nname = \"pool\"\nprotocol = \"rest\"\nendpoints_file = \"{}\"\nendpoints_file_interval_ms = 100\n{}",
        file.display(),
        model("identity", "pool")
    ));
    let url = gateway.rest_url("/v2/models/identity/infer");
    eventually(Duration::from_secs(10), "the file's endpoint to serve", || async {
        post(&url, BODY).await.status == 200
    })
    .await;
    let before = common::inference_counts(&[&a, &b], "identity").await;
    for _ in 0..5 {
        assert_eq!(post(&url, BODY).await.status, 200);
    }
    let after = common::inference_counts(&[&a, &b], "identity").await;
    assert_eq!((after[0] - before[0], after[1] - before[1]), (5, 0));

    write(&b);
    let series = format!(
        "oipgate_endpoint_healthy{{backend=\"pool\",endpoint=\"{}\"}}",
        b.rest.unwrap()
    );
    eventually(Duration::from_secs(10), "the rewritten file to be read", || async {
        gateway.metrics().await.contains(&series)
    })
    .await;
    eventually(Duration::from_secs(10), "the new endpoint to serve", || async {
        let before = common::inference_counts(&[&a, &b], "identity").await;
        let ok = post(&url, BODY).await.status == 200;
        let after = common::inference_counts(&[&a, &b], "identity").await;
        ok && after[1] > before[1]
    })
    .await;
    let before = common::inference_counts(&[&a, &b], "identity").await;
    for _ in 0..5 {
        assert_eq!(post(&url, BODY).await.status, 200);
    }
    let after = common::inference_counts(&[&a, &b], "identity").await;
    assert_eq!(
        (after[0] - before[0], after[1] - before[1]),
        (0, 5),
        "the removed endpoint gets none"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

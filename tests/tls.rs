//! TLS with certificates made in the test: both front doors over TLS with client certificates required (mTLS), the
//! REST door negotiating h2 and http/1.1; backends reached over TLS with a CA bundle, a client certificate and a
//! server name; plaintext and certificate-less clients refused cleanly; a renewed certificate picked up by reload;
//! an expired one refused.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::config::{backend, model};
use common::{GatewayProcess, INT32_BODY as BODY, ModelServerProcess, http_client, send};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A CA and what it signs, written as PEM files in a directory of their own.
struct Pki {
    dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl Pki {
    fn new() -> Pki {
        let dir = common::unique_temp_dir("oipgate-tls");
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "oipgate test CA");
        let ca = params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca, ca_key }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `<name>.pem` and `<name>.key` for a certificate with common name `cn`, valid for localhost and
    /// 127.0.0.1; `expired` dates it in the past.
    fn issue(&self, name: &str, cn: &str, expired: bool) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        if expired {
            params.not_before = rcgen::date_time_ymd(2001, 1, 1);
            params.not_after = rcgen::date_time_ymd(2002, 1, 1);
        }
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        std::fs::write(self.path(&format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(self.path(&format!("{name}.key")), key.serialize_pem()).unwrap();
    }

    fn client_config(&self, with_client_cert: bool, alpn: &[&[u8]]) -> rustls::ClientConfig {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(self.path("ca.pem")).unwrap())
            .unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut config = if with_client_cert {
            let chain = vec![CertificateDer::from_pem_file(self.path("client.pem")).unwrap()];
            let key = PrivateKeyDer::from_pem_file(self.path("client.key")).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        config
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// The gateway in front of one plain model server, its doors over TLS with client certificates required.
fn front_config(pki: &Pki, replica: &ModelServerProcess) -> String {
    format!(
        r#"
        [tls]
        cert = "{}"
        key = "{}"
        client_ca = "{}"
        [reload]
        watch_interval_ms = 50
        {}
        binary_data = true
        {}
        "#,
        p(&pki.path("server.pem")),
        p(&pki.path("server.key")),
        p(&pki.path("ca.pem")),
        backend("plain-rest", "rest", [replica.rest.unwrap()]),
        model("identity", "plain-rest"),
    )
}

async fn tls_post(pki: &Pki, h2: bool, url: &str) -> Result<(http::StatusCode, http::Version), String> {
    let alpn: &[&[u8]] = if h2 { &[b"h2"] } else { &[b"http/1.1"] };
    // hyper-rustls sets the ALPN list itself from the protocols enabled.
    let _ = alpn;
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(pki.client_config(true, &[]))
        .https_only();
    let connector = if h2 {
        builder.enable_http2().build()
    } else {
        builder.enable_http1().build()
    };
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).http2_only(h2).build(connector);
    let request = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap();
    let response = client.request(request).await.map_err(|e| format!("{e:?}"))?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    assert!(
        parts.status != 200 || body.starts_with(b"{"),
        "{:?}",
        String::from_utf8_lossy(&body)
    );
    Ok((parts.status, parts.version))
}

/// The certificate a TLS handshake with `address` presents, as its common name; or the handshake's error.
async fn presented(pki: &Pki, address: SocketAddr, with_client_cert: bool) -> Result<String, String> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(pki.client_config(with_client_cert, &[b"h2"])));
    let tcp = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| e.to_string())?;
    let mut stream = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    // TLS 1.3 reports a refused client certificate only after the handshake: read once to see it.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    let mut first = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(20), stream.read_exact(&mut first))
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| e.to_string())?;
    let (_, connection) = stream.get_ref();
    let leaf = connection
        .peer_certificates()
        .and_then(|c| c.first())
        .ok_or("no certificate")?;
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf).map_err(|e| e.to_string())?;
    let cn = parsed
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or_default()
        .to_owned();
    Ok(cn)
}

#[tokio::test]
async fn tls_front_doors_and_tls_backends_with_mtls() {
    let pki = Pki::new();
    pki.issue("server", "first", false);
    pki.issue("client", "a caller", false);
    let replica = ModelServerProcess::both();
    let front = GatewayProcess::start(&front_config(&pki, &replica));
    let url = format!("https://localhost:{}/v2/models/identity/infer", front.rest.port());

    // Both ALPN protocols on the REST door, with the client certificate.
    assert_eq!(
        tls_post(&pki, true, &url).await.unwrap(),
        (http::StatusCode::OK, http::Version::HTTP_2)
    );
    assert_eq!(
        tls_post(&pki, false, &url).await.unwrap(),
        (http::StatusCode::OK, http::Version::HTTP_11)
    );
    // A plaintext client to the TLS port fails cleanly (and promptly), and so does one without a certificate.
    for door in [front.rest, front.grpc] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tokio::net::TcpStream::connect(door).await.unwrap();
        tcp.write_all(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut answer)).await;
        assert!(
            read.is_ok(),
            "a plaintext client on {door} is answered or closed promptly"
        );
        assert!(!answer.starts_with(b"HTTP/1.1 200"), "{door} served plaintext");
    }
    for door in [front.rest, front.grpc] {
        assert_eq!(presented(&pki, door, true).await.unwrap(), "first");
        let refused = presented(&pki, door, false).await;
        assert!(
            refused.is_err(),
            "no client certificate must be refused on {door}: {refused:?}"
        );
    }

    // A second gateway reaches the first over TLS: REST proxied (pingora), REST translated and gRPC (hyper).
    let tls = |cert: bool| {
        let client = if cert {
            format!(
                ", cert = \"{}\", key = \"{}\"",
                p(&pki.path("client.pem")),
                p(&pki.path("client.key"))
            )
        } else {
            String::new()
        };
        format!(
            "tls = {{ ca = \"{}\", server_name = \"localhost\"{client} }}",
            p(&pki.path("ca.pem"))
        )
    };
    let back = GatewayProcess::start(&format!(
        r#"
        {}
        binary_data = true
        {}
        {}
        {}
        {}
        {}
        [[models]]
        name = "identity"
        versions = [ {{ version = "1", backend = "tls-rest" }}, {{ version = "2", backend = "tls-grpc", upstream_version = "1" }},
                     {{ version = "3", backend = "no-client-cert", upstream_version = "1" }} ]
        default_version = "1"
        "#,
        backend("tls-rest", "rest", [front.rest]),
        tls(true),
        backend("tls-grpc", "grpc", [front.grpc]),
        tls(true),
        backend("no-client-cert", "grpc", [front.grpc]),
        tls(false),
    ));
    let client = http_client(false);
    for version in ["1", "2"] {
        let answer = send(
            &client,
            "POST",
            &back.rest_url(&format!("/v2/models/identity/versions/{version}/infer")),
            &[],
            BODY,
        )
        .await;
        assert_eq!(
            answer.status,
            200,
            "version {version}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.json()["outputs"][0]["data"], serde_json::json!([7, 8]));
    }
    let mut grpc = back.grpc_client().await;
    for version in ["1", "2"] {
        let request = common::grpc_int32_request("identity", version);
        let answer = grpc
            .model_infer(request)
            .await
            .unwrap_or_else(|status| panic!("gRPC version {version}: {status:?}"))
            .into_inner();
        assert_eq!(answer.model_version, version);
        assert_eq!(
            answer.raw_output_contents,
            [common::int32s([7, 8])],
            "gRPC version {version}"
        );
    }
    // Streams to a gRPC backend have connections of their own, with the same TLS.
    let request = common::grpc_int32_request("identity", "2");
    let mut answers = grpc
        .model_stream_infer(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    assert_eq!(answer.error_message, "");
    assert_eq!(answer.infer_response.unwrap().model_version, "2");
    assert!(answers.message().await.unwrap().is_none());
    let refused = send(
        &client,
        "POST",
        &back.rest_url("/v2/models/identity/versions/3/infer"),
        &[],
        BODY,
    )
    .await;
    assert_eq!(refused.status, 502, "{}", String::from_utf8_lossy(&refused.body));
}

#[tokio::test]
async fn a_renewed_certificate_is_served_after_reload_and_an_expired_one_is_refused() {
    let pki = Pki::new();
    pki.issue("server", "first", false);
    pki.issue("client", "a caller", false);
    pki.issue("renewed", "renewed", false);
    pki.issue("expired", "expired", true);
    let replica = ModelServerProcess::both();
    let front = GatewayProcess::start(&front_config(&pki, &replica));
    assert_eq!(presented(&pki, front.grpc, true).await.unwrap(), "first");

    // The files are replaced in place; the watch sees them change.
    std::fs::copy(pki.path("renewed.pem"), pki.path("server.pem")).unwrap();
    std::fs::copy(pki.path("renewed.key"), pki.path("server.key")).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let rest = presented(&pki, front.rest, true).await;
        let grpc = presented(&pki, front.grpc, true).await;
        if rest.as_deref() == Ok("renewed") && grpc.as_deref() == Ok("renewed") {
            break;
        }
        assert!(
            Instant::now() < until,
            "renewed certificate not served: {rest:?} {grpc:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // An expired certificate: check-config says so, and a reload to it is refused while the renewed one stays.
    let expired_config = front_config(&pki, &replica)
        .replace(&p(&pki.path("server.pem")), &p(&pki.path("expired.pem")))
        .replace(&p(&pki.path("server.key")), &p(&pki.path("expired.key")));
    let file = pki.path("expired.toml");
    let listen = "[listen]\nrest = \"127.0.0.1:0\"\ngrpc = \"127.0.0.1:0\"\n";
    std::fs::write(&file, format!("{listen}{expired_config}")).unwrap();
    let check = common::check_config(&file);
    assert!(!check.status.success());
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(
        stderr.contains("tls.cert:") && stderr.contains("the certificate expired on"),
        "{stderr}"
    );
    front.rewrite(&expired_config);
    let until = Instant::now() + Duration::from_secs(5);
    while front
        .metric_if_present("oipgate_config_reloads_total{result=\"error\"}")
        .await
        .is_some_and(|value| value < 1.0)
    {
        assert!(Instant::now() < until, "the expired certificate was not refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(presented(&pki, front.rest, true).await.unwrap(), "renewed");
    // A gateway cannot start on it either.
    let start = common::serve_once(&file);
    assert!(!start.status.success());
    assert!(String::from_utf8_lossy(&start.stderr).contains("the certificate expired on"));
}

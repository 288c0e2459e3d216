//! `[auth]` and the per-model limits, black box: the built gateway in front of the built model server, called on
//! both doors with API keys and with JWTs signed here by keys made here. Who may call what (401, 403, admin, the
//! index filtered), how fast (429 with `Retry-After`, then served again), how many at once, and for how long (504
//! with the backend's call cancelled and not retried).

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use common::config::backend;
use common::{GatewayProcess, HttpAnswer, ModelServerProcess, http_client, send};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use oipgate::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, Ed25519KeyPair, KeyPair};
use serde_json::json;
use tonic::transport::Channel;

const TEAM_KEY: &str = "team-a-key-7f3a91";
const OPS_KEY: &str = "ops-key-55c0de";
const METERED_KEY: &str = "metered-key-0b1e";
const QUICK_KEY: &str = "quick-key-93d2";
const ISSUER: &str = "https://idp.test";
const AUDIENCE: &str = "oipgate";
/// A header the backends are configured to add; the model server echoes every `x-echo-*` header it receives.
const BACKEND_TOKEN: &str = "x-echo-backend-token";

/// The issuer's two signing keys, made for this run, and the JWK set of their public halves.
struct Issuer {
    ec_pkcs8: Vec<u8>,
    ec_public: Vec<u8>,
    ed_pkcs8: Vec<u8>,
    jwks: serde_json::Value,
}

impl Issuer {
    fn new() -> Issuer {
        let rng = ring::rand::SystemRandom::new();
        let ec_pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
            .unwrap()
            .as_ref()
            .to_vec();
        let ec = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &ec_pkcs8, &rng).unwrap();
        let ec_public = ec.public_key().as_ref().to_vec();
        let ed_pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).unwrap().as_ref().to_vec();
        let ed = Ed25519KeyPair::from_pkcs8(&ed_pkcs8).unwrap();
        let b64 = |bytes: &[u8]| URL_SAFE_NO_PAD.encode(bytes);
        let jwks = json!({"keys": [
            {"kty": "EC", "crv": "P-256", "kid": "ec-1", "alg": "ES256", "use": "sig",
             "x": b64(&ec_public[1..33]), "y": b64(&ec_public[33..65])},
            {"kty": "OKP", "crv": "Ed25519", "kid": "ed-1", "alg": "EdDSA", "use": "sig",
             "x": b64(ed.public_key().as_ref())},
        ]});
        Issuer {
            ec_pkcs8,
            ec_public,
            ed_pkcs8,
            jwks,
        }
    }

    /// A token signed by the EC key, with `claims` over valid defaults.
    fn token(&self, claims: serde_json::Value) -> String {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some("ec-1".into());
        jsonwebtoken::encode(
            &header,
            &with_defaults(claims),
            &EncodingKey::from_ec_der(&self.ec_pkcs8),
        )
        .unwrap()
    }

    /// A token signed by the Ed25519 key.
    fn ed_token(&self, claims: serde_json::Value) -> String {
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some("ed-1".into());
        jsonwebtoken::encode(
            &header,
            &with_defaults(claims),
            &EncodingKey::from_ed_der(&self.ed_pkcs8),
        )
        .unwrap()
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// `claims` over a valid principal's: issuer, audience, an hour to live, `identity` only.
fn with_defaults(claims: serde_json::Value) -> serde_json::Value {
    let mut all = json!({"iss": ISSUER, "aud": AUDIENCE, "sub": "carol", "exp": now() + 3600, "models": ["identity"]});
    for (key, value) in claims.as_object().unwrap() {
        all[key] = value.clone();
    }
    all
}

/// A gateway with `[auth]` in front of one model server: `identity` (version 1 over REST, 2 over gRPC), `add_sub`,
/// `slow` (bounded to 300 ms), `capped` (the slow model, one call at a time) and `metered` (identity, one call
/// every twenty seconds across all callers). The metered buckets refill that slowly so that the calls a test counts
/// are its burst whatever the machine's load; `quick` refills twice a second, for calls let in again.
struct Setup {
    gateway: GatewayProcess,
    server: ModelServerProcess,
    issuer: Issuer,
    _jwks_dir: std::path::PathBuf,
}

fn setup() -> Setup {
    let server = ModelServerProcess::both();
    let issuer = Issuer::new();
    let jwks_dir = common::unique_temp_dir("oipgate-jwks");
    let jwks_file = jwks_dir.join("jwks.json");
    std::fs::write(&jwks_file, issuer.jwks.to_string()).unwrap();
    let added = format!("headers = {{ \"{BACKEND_TOKEN}\" = \"s3cret\" }}\n");
    let backends = format!(
        "{}binary_data = true\n{added}{}{added}",
        backend("fleet-a", "rest", [server.rest.unwrap()]),
        backend("fleet-b", "grpc", [server.grpc.unwrap()]),
    );
    let config = format!(
        r#"
[auth]

[[auth.api_keys]]
name = "team-a"
sha256 = "{team}"
models = ["identity", "slow", "capped", "metered"]

[[auth.api_keys]]
name = "ops"
sha256 = "{ops}"
models = ["*"]
admin = true

[[auth.api_keys]]
name = "metered"
sha256 = "{metered}"
models = ["identity"]
rate = {{ per_second = 0.05, burst = 2 }}

[[auth.api_keys]]
name = "quick"
sha256 = "{quick}"
models = ["identity"]
rate = {{ per_second = 2.0, burst = 1 }}

[auth.jwt]
jwks_file = "{jwks}"
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
admin_claim = "oipgate_admin"
rate = {{ per_second = 0.05, burst = 6 }}

{backends}
[[models]]
name = "identity"
versions = [ {{ version = "1", backend = "fleet-a" }}, {{ version = "2", backend = "fleet-b", upstream_version = "1" }} ]
default_version = "1"

[[models]]
name = "add_sub"
versions = [ {{ version = "1", backend = "fleet-a" }} ]

[[models]]
name = "slow"
versions = [ {{ version = "1", backend = "fleet-a" }}, {{ version = "2", backend = "fleet-b", upstream_version = "1" }} ]
default_version = "1"
timeout_ms = 300

[[models]]
name = "capped"
versions = [ {{ version = "1", backend = "fleet-b", upstream_name = "slow" }} ]
max_concurrent = 1

[[models]]
name = "metered"
versions = [ {{ version = "1", backend = "fleet-a", upstream_name = "identity" }} ]
rate = {{ per_second = 0.05, burst = 1 }}

[[models]]
name = "generated"
versions = [ {{ version = "1", backend = "fleet-b", upstream_name = "add_sub" }} ]
rate = {{ per_second = 0.05, burst = 2 }}
max_concurrent = 1
"#,
        team = common::sha256_hex(TEAM_KEY),
        ops = common::sha256_hex(OPS_KEY),
        metered = common::sha256_hex(METERED_KEY),
        quick = common::sha256_hex(QUICK_KEY),
        jwks = jwks_file.display(),
    );
    Setup {
        gateway: GatewayProcess::start(&config),
        server,
        issuer,
        _jwks_dir: jwks_dir,
    }
}

fn bearer(credential: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {credential}"))
}

fn identity_body() -> String {
    json!({"inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [7, 8]}]}).to_string()
}

fn slow_body(delay_ms: u64) -> String {
    json!({"parameters": {"delay_ms": delay_ms},
           "inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1]}]})
    .to_string()
}

async fn rest(
    setup: &Setup,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: impl Into<Bytes>,
) -> HttpAnswer {
    send(
        &http_client(false),
        method,
        &setup.gateway.rest_url(path),
        headers,
        body,
    )
    .await
}

async fn infer(setup: &Setup, model: &str, headers: &[(&str, String)]) -> HttpAnswer {
    rest(
        setup,
        "POST",
        &format!("/v2/models/{model}/infer"),
        headers,
        identity_body(),
    )
    .await
}

/// A gRPC request carrying `credential` as a bearer token, when given.
fn grpc_request<T>(message: T, credential: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(credential) = credential {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {credential}").parse().unwrap());
    }
    request
}

async fn grpc_infer(
    client: &mut GrpcInferenceServiceClient<Channel>,
    model: &str,
    version: &str,
    credential: Option<&str>,
) -> Result<oipgate::proto::ModelInferResponse, tonic::Status> {
    let request = grpc_request(common::grpc_int32_request(model, version), credential);
    client.model_infer(request).await.map(tonic::Response::into_inner)
}

fn error_text(answer: &HttpAnswer) -> String {
    answer.json()["error"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn credentials_are_asked_for_on_both_doors_and_probes_stay_open() {
    let setup = setup();
    // Probes need no credential.
    for path in ["/v2/health/live", "/v2/health/ready"] {
        assert_eq!(rest(&setup, "GET", path, &[], "").await.status, 200, "{path}");
    }
    // Missing, wrong, and right, for every kind of endpoint.
    let missing = infer(&setup, "identity", &[]).await;
    assert_eq!(missing.status, 401);
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    assert!(error_text(&missing).contains("no credential"), "{missing:?}");
    assert_eq!(rest(&setup, "GET", "/v2", &[], "").await.status, 401);
    assert_eq!(
        rest(&setup, "POST", "/v2/repository/index", &[], "{}").await.status,
        401
    );
    let wrong = infer(&setup, "identity", &[bearer("not-a-key-at-all")]).await;
    assert_eq!(wrong.status, 401);
    assert!(
        !String::from_utf8_lossy(&wrong.body).contains("not-a-key-at-all"),
        "the key is echoed: {wrong:?}"
    );
    let answer = infer(&setup, "identity", &[bearer(TEAM_KEY)]).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let answer = infer(&setup, "identity", &[("x-api-key", TEAM_KEY.to_owned())]).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(rest(&setup, "GET", "/v2", &[bearer(TEAM_KEY)], "").await.status, 200);

    // gRPC: probes open (the inference service's and grpc.health.v1), everything else asks.
    let mut client = setup.gateway.grpc_client().await;
    assert!(common::grpc_live(&mut client).await);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", setup.gateway.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let checked = health
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await;
    assert_eq!(checked.unwrap().into_inner().status, 1, "SERVING");
    for version in ["1", "2"] {
        let missing = grpc_infer(&mut client, "identity", version, None).await.unwrap_err();
        assert_eq!(missing.code(), tonic::Code::Unauthenticated, "{missing:?}");
        let wrong = grpc_infer(&mut client, "identity", version, Some("nope"))
            .await
            .unwrap_err();
        assert_eq!(wrong.code(), tonic::Code::Unauthenticated);
        grpc_infer(&mut client, "identity", version, Some(TEAM_KEY))
            .await
            .unwrap();
    }
    let metadata = client
        .model_metadata(grpc_request(
            oipgate::proto::ModelMetadataRequest {
                name: "identity".into(),
                version: String::new(),
            },
            None,
        ))
        .await
        .unwrap_err();
    assert_eq!(metadata.code(), tonic::Code::Unauthenticated);
    let denied = setup
        .gateway
        .metric(r#"oipgate_auth_denied_total{reason="missing"}"#)
        .await;
    assert!(denied >= 6.0, "{denied}");
    let counted = setup
        .gateway
        .metric(r#"oipgate_requests_total{backend="fleet-a",code="200",model="identity",principal="team-a",protocol="rest",version="1"}"#)
        .await;
    assert_eq!(counted, 2.0);
}

#[tokio::test]
async fn a_forbidden_model_is_refused_alike_whether_or_not_it_exists_and_listings_show_only_the_principals() {
    let setup = setup();
    let team = [bearer(TEAM_KEY)];
    for model in ["add_sub", "no_such_model"] {
        let refused = infer(&setup, model, &team).await;
        assert_eq!(refused.status, 403, "{model}: {refused:?}");
        assert_eq!(
            error_text(&refused),
            format!("principal 'team-a' may not use model '{model}'")
        );
        for path in ["", "/ready", "/config", "/stats"] {
            let answer = rest(&setup, "GET", &format!("/v2/models/{model}{path}"), &team, "").await;
            assert_eq!(answer.status, 403, "{model}{path}");
        }
    }
    let mut client = setup.gateway.grpc_client().await;
    for model in ["add_sub", "no_such_model"] {
        let refused = grpc_infer(&mut client, model, "", Some(TEAM_KEY)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{model}");
        let ready = client
            .model_ready(grpc_request(
                oipgate::proto::ModelReadyRequest {
                    name: model.into(),
                    version: String::new(),
                },
                Some(TEAM_KEY),
            ))
            .await
            .unwrap_err();
        assert_eq!(ready.code(), tonic::Code::PermissionDenied);
    }
    // The index and every model's statistics list only the principal's models.
    let listed = |answer: HttpAnswer| -> Vec<String> {
        let names: Vec<String> = match answer.json() {
            serde_json::Value::Array(entries) => {
                entries.iter().map(|e| e["name"].as_str().unwrap().to_owned()).collect()
            }
            other => other["model_stats"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["name"].as_str().unwrap().to_owned())
                .collect(),
        };
        let mut names = names;
        names.sort();
        names.dedup();
        names
    };
    let index = rest(&setup, "POST", "/v2/repository/index", &team, "{}").await;
    let team_models = ["capped", "identity", "metered", "slow"];
    assert_eq!(listed(index), team_models);
    let all = rest(&setup, "POST", "/v2/repository/index", &[bearer(OPS_KEY)], "{}").await;
    assert!(listed(all).contains(&"add_sub".to_owned()));
    let statistics = rest(&setup, "GET", "/v2/models/stats", &team, "").await;
    let listed_statistics = listed(statistics);
    assert!(!listed_statistics.is_empty());
    assert!(
        listed_statistics
            .iter()
            .all(|name| team_models.contains(&name.as_str()))
    );
    let index = client
        .repository_index(grpc_request(
            oipgate::proto::RepositoryIndexRequest::default(),
            Some(TEAM_KEY),
        ))
        .await
        .unwrap()
        .into_inner();
    let mut names: Vec<String> = index.models.into_iter().map(|m| m.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names, team_models);
    assert!(
        setup
            .gateway
            .metric(r#"oipgate_auth_denied_total{reason="forbidden"}"#)
            .await
            >= 12.0
    );
}

#[tokio::test]
async fn loading_and_unloading_need_admin() {
    let setup = setup();
    let unload = "/v2/repository/models/identity/unload";
    let refused = rest(&setup, "POST", unload, &[bearer(TEAM_KEY)], "{}").await;
    assert_eq!(refused.status, 403, "{refused:?}");
    assert!(error_text(&refused).contains("needs admin"));
    let mut client = setup.gateway.grpc_client().await;
    let refused = client
        .repository_model_unload(grpc_request(
            oipgate::proto::RepositoryModelUnloadRequest {
                model_name: "identity".into(),
                ..Default::default()
            },
            Some(TEAM_KEY),
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    // Still served: nothing was unloaded.
    assert_eq!(infer(&setup, "identity", &[bearer(TEAM_KEY)]).await.status, 200);
    let admin = [bearer(OPS_KEY)];
    assert_eq!(rest(&setup, "POST", unload, &admin, "{}").await.status, 200);
    assert_ne!(infer(&setup, "identity", &admin).await.status, 200);
    let load = "/v2/repository/models/identity/load";
    assert_eq!(rest(&setup, "POST", load, &admin, "{}").await.status, 200);
    // An admin token from the identity provider may too.
    let token = setup
        .issuer
        .token(json!({"sub": "root", "models": "*", "oipgate_admin": true}));
    assert_eq!(rest(&setup, "POST", unload, &[bearer(&token)], "{}").await.status, 200);
    assert_eq!(rest(&setup, "POST", load, &[bearer(&token)], "{}").await.status, 200);
    assert_eq!(infer(&setup, "identity", &admin).await.status, 200);
}

#[tokio::test]
async fn jwts_are_verified_against_the_key_they_name_with_its_algorithm_only() {
    let setup = setup();
    let issuer = &setup.issuer;
    let mut client = setup.gateway.grpc_client().await;
    for token in [issuer.token(json!({})), issuer.ed_token(json!({}))] {
        let answer = infer(&setup, "identity", &[bearer(&token)]).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        grpc_infer(&mut client, "identity", "2", Some(&token)).await.unwrap();
        // The token's models claim: identity only.
        assert_eq!(infer(&setup, "slow", &[bearer(&token)]).await.status, 403);
    }
    let hmac_with_the_public_key = {
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("ec-1".into());
        jsonwebtoken::encode(
            &header,
            &with_defaults(json!({})),
            &EncodingKey::from_secret(&issuer.ec_public),
        )
        .unwrap()
    };
    let unsigned = {
        let part = |value: serde_json::Value| URL_SAFE_NO_PAD.encode(value.to_string());
        format!(
            "{}.{}.",
            part(json!({"alg": "none", "typ": "JWT"})),
            part(with_defaults(json!({})))
        )
    };
    let unknown_key = {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some("ec-9".into());
        jsonwebtoken::encode(
            &header,
            &with_defaults(json!({})),
            &EncodingKey::from_ec_der(&issuer.ec_pkcs8),
        )
        .unwrap()
    };
    let tampered = {
        let token = issuer.token(json!({}));
        let mut parts: Vec<String> = token.split('.').map(str::to_owned).collect();
        parts[1] = URL_SAFE_NO_PAD.encode(with_defaults(json!({"models": "*"})).to_string());
        parts.join(".")
    };
    let refused = [
        ("expired", issuer.token(json!({"exp": now() - 3600}))),
        ("not yet valid", issuer.token(json!({"nbf": now() + 3600}))),
        ("wrong audience", issuer.token(json!({"aud": "someone-else"}))),
        ("wrong issuer", issuer.token(json!({"iss": "https://evil.test"}))),
        ("alg none", unsigned),
        ("HS256 keyed with the public key", hmac_with_the_public_key),
        ("unknown kid", unknown_key),
        ("tampered claims", tampered),
    ];
    for (what, token) in &refused {
        let answer = infer(&setup, "identity", &[bearer(token)]).await;
        assert_eq!(answer.status, 401, "{what}: {answer:?}");
        assert!(
            error_text(&answer).starts_with("the token is not valid"),
            "{what}: {answer:?}"
        );
        assert!(
            !String::from_utf8_lossy(&answer.body).contains(token.as_str()),
            "{what}: echoed"
        );
        let status = grpc_infer(&mut client, "identity", "1", Some(token)).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{what}");
    }
    // Token principals are counted under one label; the access log names them.
    let counted = setup
        .gateway
        .metric(r#"oipgate_requests_total{backend="fleet-a",code="200",model="identity",principal="_other",protocol="rest",version="1"}"#)
        .await;
    assert_eq!(counted, 2.0);
}

/// Calls `call` until it is refused; gives how many were let in first.
async fn served_before_refused<F, Fut>(mut call: F) -> usize
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for served in 0..20 {
        if !call().await {
            return served;
        }
    }
    panic!("never refused");
}

#[tokio::test]
async fn rate_limits_answer_429_with_retry_after_then_let_calls_in_again() {
    let setup = setup();
    // The principal's bucket: a burst of two, then one call every two seconds.
    let metered = [bearer(METERED_KEY)];
    let served = served_before_refused(|| async { infer(&setup, "identity", &metered).await.status == 200 }).await;
    assert_eq!(served, 2);
    let refused = infer(&setup, "identity", &metered).await;
    assert_eq!(refused.status, 429);
    // One token every twenty seconds: the next comes within them.
    let wait: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=20).contains(&wait), "{wait}");
    assert!(error_text(&refused).contains("principal 'metered' is over its rate limit"));
    let mut client = setup.gateway.grpc_client().await;
    let status = grpc_infer(&mut client, "identity", "2", Some(METERED_KEY))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(
        status
            .metadata()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|seconds| seconds.parse::<u64>().ok())
            .is_some_and(|seconds| seconds >= 1)
    );
    // Other principals are not held back.
    assert_eq!(infer(&setup, "identity", &[bearer(TEAM_KEY)]).await.status, 200);
    // Each principal a token names has a bucket of its own: dave's six, then 429; erin's untouched.
    let dave = [bearer(&setup.issuer.token(json!({"sub": "dave"})))];
    let served = served_before_refused(|| async { infer(&setup, "identity", &dave).await.status == 200 }).await;
    assert_eq!(served, 6);
    let refused = infer(&setup, "identity", &dave).await;
    assert_eq!(refused.status, 429);
    assert!(error_text(&refused).contains("principal 'dave' is over its rate limit"));
    let erin = setup.issuer.token(json!({"sub": "erin"}));
    assert_eq!(infer(&setup, "identity", &[bearer(&erin)]).await.status, 200);
    let answer = grpc_infer(&mut client, "identity", "2", Some(&erin)).await.unwrap();
    assert_eq!(answer.raw_output_contents, [common::int32s([7, 8])]);
    // Refused, a principal is let in again once its bucket has refilled (quick's, twice a second).
    let quick = [bearer(QUICK_KEY)];
    let served = served_before_refused(|| async { infer(&setup, "identity", &quick).await.status == 200 }).await;
    assert!(served >= 1, "the burst is served first");
    common::eventually(Duration::from_secs(10), "quick let in again", || async {
        infer(&setup, "identity", &quick).await.status == 200
    })
    .await;

    // The model's bucket, across callers: one call, then 429 for anyone.
    let team = [bearer(TEAM_KEY)];
    assert_eq!(infer(&setup, "metered", &team).await.status, 200);
    let refused = infer(&setup, "metered", &[bearer(OPS_KEY)]).await;
    assert_eq!(refused.status, 429);
    assert!(error_text(&refused).contains("model 'metered' is over its rate limit"));
    assert!(
        refused
            .header("retry-after")
            .and_then(|seconds| seconds.parse::<u64>().ok())
            .is_some_and(|seconds| seconds >= 1)
    );
    let status = grpc_infer(&mut client, "metered", "", Some(TEAM_KEY))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(
        setup
            .gateway
            .metric(r#"oipgate_rate_limited_total{scope="principal"}"#)
            .await
            >= 2.0
    );
    assert!(
        setup
            .gateway
            .metric(r#"oipgate_rate_limited_total{scope="model"}"#)
            .await
            >= 2.0
    );
}

#[tokio::test]
async fn max_concurrent_refuses_at_once_beyond_the_bound() {
    let setup = setup();
    let url = setup.gateway.rest_url("/v2/models/capped/infer");
    let team = vec![bearer(TEAM_KEY)];
    let first = {
        let (url, team) = (url.clone(), team.clone());
        tokio::spawn(async move { send(&http_client(false), "POST", &url, &team, slow_body(5000)).await })
    };
    // Refused while the first call runs (admitted once a call is refused): it did not wait for the first's place.
    common::eventually(Duration::from_secs(10), "the first call at its backend", || async {
        setup
            .gateway
            .metric_if_present(r#"oipgate_in_flight{backend="fleet-b"}"#)
            .await
            == Some(1.0)
    })
    .await;
    let refused = send(&http_client(false), "POST", &url, &team, slow_body(0)).await;
    assert!(
        !first.is_finished(),
        "refused at once, not after the first call's five seconds"
    );
    assert!(error_text(&refused).contains("max_concurrent"));
    let mut client = setup.gateway.grpc_client().await;
    let status = grpc_infer(&mut client, "capped", "", Some(TEAM_KEY)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(
        send(&http_client(false), "POST", &url, &team, slow_body(0))
            .await
            .status,
        200
    );
    assert!(
        setup
            .gateway
            .metric(r#"oipgate_rate_limited_total{scope="concurrency"}"#)
            .await
            >= 2.0
    );
}

/// A REST `generate` call translated onto a gRPC backend's inference stream is let in once, by the REST door: the
/// stream's request neither takes the model's rate again nor a second place under its `max_concurrent`.
#[tokio::test]
async fn a_generate_call_translated_for_a_grpc_backend_is_admitted_once() {
    let setup = setup();
    let ops = [bearer(OPS_KEY)];
    let ones = serde_json::json!({ "INPUT0": vec![1; 16], "INPUT1": vec![1; 16] }).to_string();
    let call = |path: &'static str| {
        let (url, ops, ones) = (setup.gateway.rest_url(path), ops.clone(), ones.clone());
        async move { send(&http_client(false), "POST", &url, &ops, ones).await }
    };
    // The model's one place under way and its burst of two: a call each.
    let generated = call("/v2/models/generated/generate").await;
    assert_eq!(generated.status, 200, "{}", error_text(&generated));
    assert_eq!(generated.json()["OUTPUT0"][0], 2);
    let streamed = call("/v2/models/generated/generate_stream").await;
    assert_eq!(streamed.status, 200, "{}", error_text(&streamed));
    assert!(String::from_utf8_lossy(&streamed.body).starts_with("data: "));
    let refused = call("/v2/models/generated/generate").await;
    assert_eq!(refused.status, 429);
    assert!(error_text(&refused).contains("model 'generated' is over its rate limit"));
}

/// The model server's count of `slow`'s inferences at `version`: (succeeded, failed).
async fn slow_counts(server: &ModelServerProcess) -> (u64, u64) {
    let answer = common::get(&server.rest_url("/v2/models/slow/versions/1/stats")).await;
    let stats = &answer.json()["model_stats"][0]["inference_stats"];
    let count = |value: &serde_json::Value| {
        value["count"]
            .as_u64()
            .or_else(|| value["count"].as_str().and_then(|c| c.parse().ok()))
            .unwrap_or(0)
    };
    (count(&stats["success"]), count(&stats["fail"]))
}

#[tokio::test]
async fn a_models_timeout_ends_its_call_with_504_and_cancels_it_at_the_backend() {
    let setup = setup();
    let team = [bearer(TEAM_KEY)];
    for version in ["1", "2"] {
        let path = format!("/v2/models/slow/versions/{version}/infer");
        let answer = rest(&setup, "POST", &path, &team, slow_body(5000)).await;
        assert_eq!(answer.status, 504, "version {version}: {answer:?}");
    }
    let mut client = setup.gateway.grpc_client().await;
    let mut request = common::grpc_int32_request("slow", "2");
    request.parameters.insert(
        "delay_ms".into(),
        oipgate::proto::InferParameter {
            parameter_choice: Some(oipgate::proto::infer_parameter::ParameterChoice::Int64Param(5000)),
        },
    );
    let status = client
        .model_infer(grpc_request(request, Some(TEAM_KEY)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
    // Each call was dropped at the backend when it timed out (counted failed then, before its five seconds were up)
    // and sent once: three calls, three failures, no success, and none completes once the five seconds have passed.
    common::eventually(Duration::from_secs(10), "the backend's calls to end", || async {
        slow_counts(&setup.server).await == (0, 3)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(5200)).await;
    assert_eq!(slow_counts(&setup.server).await, (0, 3));
    // A client's shorter deadline still wins; a quick call is served.
    assert_eq!(
        rest(&setup, "POST", "/v2/models/slow/infer", &team, slow_body(10))
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn credentials_stay_at_the_gateway_and_backends_get_their_configured_headers() {
    let setup = setup();
    for version in ["1", "2"] {
        let answer = rest(
            &setup,
            "POST",
            &format!("/v2/models/identity/versions/{version}/infer"),
            &[
                bearer(TEAM_KEY),
                ("x-api-key", TEAM_KEY.to_owned()),
                ("x-echo-probe", "1".into()),
            ],
            identity_body(),
        )
        .await;
        assert_eq!(answer.status, 200, "{answer:?}");
        let received = answer.header("x-echo-received").unwrap_or_default().to_owned();
        assert!(!received.contains("authorization"), "version {version}: {received}");
        assert!(!received.contains("x-api-key"), "version {version}: {received}");
        assert_eq!(answer.header(BACKEND_TOKEN), Some("s3cret"), "version {version}");
    }
}

#[tokio::test]
async fn a_stream_holds_its_models_place_while_it_runs() {
    let setup = setup();
    let mut client = setup.gateway.grpc_client().await;
    // A stream whose request names `capped` (max_concurrent = 1): the backend stream it opens holds the model's one
    // place for as long as the client keeps its stream open.
    let (requests, receiver) = tokio::sync::mpsc::channel(4);
    requests.send(common::grpc_int32_request("capped", "")).await.unwrap();
    let mut answers = client
        .model_stream_infer(grpc_request(
            tokio_stream::wrappers::ReceiverStream::new(receiver),
            Some(TEAM_KEY),
        ))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    assert_eq!(answer.error_message, "");
    let refused = grpc_infer(&mut client, "capped", "", Some(TEAM_KEY)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(refused.message().contains("max_concurrent"), "{refused:?}");
    let url = setup.gateway.rest_url("/v2/models/capped/infer");
    let team = vec![bearer(TEAM_KEY)];
    let refused = send(&http_client(false), "POST", &url, &team, slow_body(0)).await;
    assert_eq!(refused.status, 429);
    // The client ends its stream: the place is given back once the backend's stream has ended too.
    drop(requests);
    while answers.message().await.unwrap().is_some() {}
    common::eventually(Duration::from_secs(10), "the stream's place given back", || async {
        grpc_infer(&mut setup.gateway.grpc_client().await, "capped", "", Some(TEAM_KEY))
            .await
            .is_ok()
    })
    .await;
}

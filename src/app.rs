//! Wiring: the gateway's two front doors (plain or TLS) over its live state, run by pingora's server until a signal
//! drains and stops them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::apps::HttpServerOptions;
use pingora::server::configuration::ServerConf;
use pingora::server::{ExecutionPhase, RunArgs, Server, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::background::{BackgroundService, background_service};

use crate::config::{Config, Shutdown};
use crate::error::{Error, Result};
use crate::frontend::grpc;
use crate::frontend::rest::{RestFrontDoor, RestListener};
use crate::live::Gateway;
use crate::metrics::{self, Metrics};

/// The gRPC front door (one accept loop per worker thread, each on its own runtime) as one of pingora's background
/// services.
struct GrpcFrontDoor {
    address: SocketAddr,
    threads: usize,
    socket: std::sync::Mutex<Option<std::net::TcpListener>>,
    gateway: Arc<Gateway>,
    max_message_bytes: usize,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

#[async_trait]
impl BackgroundService for GrpcFrontDoor {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(socket) = self.socket.lock().ok().and_then(|mut socket| socket.take()) else {
            return;
        };
        for index in 0..self.threads.max(1) {
            let door = socket.try_clone().and_then(|socket| {
                let gateway = self.gateway.clone();
                let tls = self.tls.clone();
                let max_message_bytes = self.max_message_bytes;
                let mut stop = shutdown.clone();
                crate::frontend::spawn_door_thread(format!("grpc-{index}"), async move {
                    let listener = match tokio::net::TcpListener::from_std(socket) {
                        Ok(listener) => listener,
                        Err(error) => {
                            tracing::error!(%error, "cannot listen for gRPC");
                            std::process::exit(1);
                        }
                    };
                    let stopping = async move { crate::frontend::stopping(&mut stop).await };
                    grpc::serve(listener, gateway, max_message_bytes, tls, stopping).await;
                    // The listening socket is closed; calls still under way finish until the process ends.
                    std::future::pending::<()>().await;
                })
            });
            if let Err(error) = door {
                tracing::error!(address = %self.address, %error, "cannot start the gRPC door");
                std::process::exit(1);
            }
        }
        drop(socket);
        crate::frontend::stopping(&mut shutdown).await;
    }
}

/// The REST front door (its own accept threads) as one of pingora's background services.
struct RestFrontDoorService {
    door: Arc<RestListener>,
    socket: std::sync::Mutex<Option<std::net::TcpListener>>,
}

#[async_trait]
impl BackgroundService for RestFrontDoorService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(socket) = self.socket.lock().ok().and_then(|mut socket| socket.take()) else {
            return;
        };
        if let Err(error) = self.door.clone().run(&socket, &shutdown) {
            tracing::error!(address = %self.door.address, %error, "cannot start the REST door");
            std::process::exit(1);
        }
        // The threads hold their own handles on the socket; it closes when the last of them lets go.
        drop(socket);
        crate::frontend::stopping(&mut shutdown).await;
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
                tracing::error!(address = %self.address, %error, "cannot listen for metrics");
                std::process::exit(1);
            }
        };
        let stop = async move {
            let _ = shutdown.changed().await;
        };
        metrics::serve(listener, self.metrics.clone(), stop).await;
    }
}

/// Health checks, DNS discovery, the configuration watch and SIGHUP, as one of pingora's background services.
struct Control {
    gateway: Arc<Gateway>,
}

#[async_trait]
impl BackgroundService for Control {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        tokio::select! {
            () = self.gateway.clone().run() => {}
            _ = shutdown.changed() => {}
        }
    }
}

/// SIGTERM and SIGINT start a graceful shutdown: readiness says no at once; after the drain delay the listeners
/// close; requests under way get the grace period; the process exits as soon as none is left.
struct Signals {
    gateway: Arc<Gateway>,
    shutdown: Shutdown,
    /// Tells when pingora has closed the listeners.
    phases: std::sync::Mutex<Option<tokio::sync::broadcast::Receiver<ExecutionPhase>>>,
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        let signal = termination().await;
        self.gateway.start_draining();
        tracing::info!(
            signal,
            drain_delay_ms = self.shutdown.drain_delay.as_millis(),
            grace_period_ms = self.shutdown.grace_period.as_millis(),
            in_flight = self.gateway.active(),
            "shutting down: readiness is now false"
        );
        tokio::time::sleep(self.shutdown.drain_delay).await;
        let phases = self.phases.lock().ok().and_then(|mut p| p.take());
        let gateway = self.gateway.clone();
        let grace = self.shutdown.grace_period;
        // pingora waits out its whole grace period; this ends the process as soon as nothing is under way.
        std::thread::spawn(move || exit_when_drained(&gateway, phases, grace));
        ShutdownSignal::GracefulTerminate
    }
}

/// Waits for SIGTERM or SIGINT; gives its name.
async fn termination() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(mut terminate), Ok(mut interrupt)) => tokio::select! {
                _ = terminate.recv() => "SIGTERM",
                _ = interrupt.recv() => "SIGINT",
            },
            _ => {
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

fn exit_when_drained(
    gateway: &Gateway,
    phases: Option<tokio::sync::broadcast::Receiver<ExecutionPhase>>,
    grace: Duration,
) {
    let started = Instant::now();
    if let Some(mut phases) = phases {
        // Once pingora has told the listeners to close, no new request can start.
        while let Ok(phase) = phases.blocking_recv() {
            if matches!(
                phase,
                ExecutionPhase::GracefulTerminate | ExecutionPhase::ShutdownGracePeriod
            ) {
                break;
            }
        }
    }
    // The listeners stop accepting on their next turn of the loop; a moment lets them.
    std::thread::sleep(Duration::from_millis(50));
    while gateway.active() > 0 && started.elapsed() < grace {
        std::thread::sleep(Duration::from_millis(10));
    }
    let left = gateway.active();
    if left > 0 {
        tracing::warn!(
            in_flight = left,
            "grace period over; exiting with requests still under way"
        );
    } else {
        tracing::info!("drained; exiting");
    }
    let _ = std::io::Write::flush(&mut std::io::stdout());
    std::process::exit(0);
}

/// Fails early, with the address named, when a front door's port is taken.
fn check_free(address: SocketAddr, what: &str) -> Result<()> {
    std::net::TcpListener::bind(address)
        .map(drop)
        .map_err(|e| Error::internal(format!("cannot listen for {what} on {address}: {e}")))
}

/// Runs the gateway until SIGTERM or SIGINT (both graceful). `path` is the configuration file reloads read.
pub fn serve(config: Config, name: &str, path: Option<PathBuf>) -> Result<()> {
    let metrics = Metrics::new()?;
    let gateway = Gateway::new(config.clone(), name, path, metrics.clone())
        .map_err(|problems| Error::internal(problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")))?;
    let rest_socket = crate::frontend::bind(config.listen.rest)
        .map_err(|e| Error::internal(format!("cannot listen for REST on {}: {e}", config.listen.rest)))?;
    let grpc_socket = crate::frontend::bind(config.listen.grpc)
        .map_err(|e| Error::internal(format!("cannot listen for gRPC on {}: {e}", config.listen.grpc)))?;
    if let Some(address) = config.listen.metrics {
        check_free(address, "metrics")?;
    }
    let max_request_bytes = config.limits.max_request_bytes;
    let tls_on = |door: fn(&crate::config::ServerTls) -> bool| {
        config
            .tls
            .as_ref()
            .filter(|tls| door(tls))
            .and_then(|_| gateway.identity().cloned())
    };

    let conf = ServerConf {
        threads: config.threads,
        // The exit comes earlier when nothing is left under way (see `Signals`).
        grace_period_seconds: Some(
            config
                .shutdown
                .grace_period
                .as_millis()
                .div_ceil(1000)
                .try_into()
                .unwrap_or(u64::MAX),
        ),
        graceful_shutdown_timeout_seconds: Some(1),
        // One single-threaded runtime per thread, connections pinned to one: no task is woken across threads, which
        // on few cores cost more than the balance it buys.
        work_stealing: false,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let mut proxy = pingora::proxy::http_proxy(
        &server.configuration,
        RestFrontDoor::new(gateway.clone(), max_request_bytes),
    );
    let mut options = HttpServerOptions::default();
    options.h2c = true;
    proxy.server_options = Some(options);
    let rest_tls = tls_on(|tls| tls.rest).map(|identity| {
        Arc::new(pingora::listeners::tls::Acceptor::from_server_config(
            identity.server_config(&[b"h2", b"http/1.1"]),
        ))
    });
    server.add_service(background_service(
        "rest front door",
        RestFrontDoorService {
            door: Arc::new(RestListener {
                address: config.listen.rest,
                threads: config.threads,
                proxy: Arc::new(proxy),
                tls: rest_tls,
                h2c: true,
            }),
            socket: std::sync::Mutex::new(Some(rest_socket)),
        },
    ));
    server.add_service(background_service(
        "control",
        Control {
            gateway: gateway.clone(),
        },
    ));
    server.add_service(background_service(
        "grpc front door",
        GrpcFrontDoor {
            address: config.listen.grpc,
            threads: config.threads,
            socket: std::sync::Mutex::new(Some(grpc_socket)),
            gateway: gateway.clone(),
            max_message_bytes: usize::try_from(max_request_bytes).unwrap_or(usize::MAX),
            tls: tls_on(|tls| tls.grpc)
                .map(|identity| tokio_rustls::TlsAcceptor::from(identity.server_config(&[b"h2"]))),
        },
    ));
    if let Some(address) = config.listen.metrics {
        server.add_service(background_service("metrics", MetricsListener { address, metrics }));
    }
    let metrics_address = config
        .listen
        .metrics
        .map_or_else(|| "off".to_owned(), |address| address.to_string());
    tracing::info!(summary = %config.summary(), "configuration loaded");
    println!(
        "oipgate serving: rest={} grpc={} metrics={metrics_address} ({})",
        config.listen.rest,
        config.listen.grpc,
        config.summary()
    );
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let signals = Signals {
        gateway,
        shutdown: config.shutdown,
        phases: std::sync::Mutex::new(Some(server.watch_execution_phase())),
    };
    server.run(RunArgs {
        shutdown_signal: Box::new(signals),
    });
    Ok(())
}

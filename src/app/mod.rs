//! Wiring: the gateway's two front doors (plain or TLS) and its metrics listener over its live state, run by
//! pingora's server as services on listening sockets that its binary upgrade hands from one process to the next,
//! until a signal drains and stops them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::{ListenFds, RunArgs, Server, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::Service;
use pingora::services::background::{BackgroundService, background_service};

pub mod allocator;
mod metrics_listener;
pub mod status;

use crate::body::BodyLimits;
use crate::config::{Config, Shutdown};
use crate::error::{Error, Result};
use crate::frontend::grpc;
use crate::frontend::rest::RestDoor;
use crate::frontend::rest::connection::RestConnections;
use crate::live::Gateway;
use crate::telemetry::metrics::Metrics;

/// Where a new process started with `--upgrade` waits for the running one's listening sockets.
pub const DEFAULT_UPGRADE_SOCKET: &str = "/tmp/oipgate-upgrade.sock";

/// How the process starts: fresh, or taking over the listening sockets of a running one.
#[derive(Debug, Clone)]
pub struct Process {
    /// Take the listening sockets of the process now running (which hands them over on SIGQUIT).
    pub upgrade: bool,
    /// The Unix socket the handover goes through.
    pub upgrade_socket: PathBuf,
    /// Serve as an inference pool's endpoint picker (`oipgate epp`), instead of the front doors or beside them.
    pub epp: Option<EppOptions>,
}

/// How the endpoint picker runs.
#[derive(Debug, Clone, Copy)]
pub struct EppOptions {
    /// Endpoints named after the picked one, for the proxy's retries.
    pub fallbacks: usize,
    /// The front doors run too, in the same process (the demo); `oipgate epp` runs the picker alone.
    pub with_doors: bool,
}

impl Default for Process {
    fn default() -> Self {
        Process {
            upgrade: false,
            upgrade_socket: PathBuf::from(DEFAULT_UPGRADE_SOCKET),
            epp: None,
        }
    }
}

/// What a listener serves.
enum Serves {
    Rest(RestConnections),
    Grpc {
        gateway: Arc<Gateway>,
        limits: grpc::GrpcLimits,
        tls: Option<tokio_rustls::TlsAcceptor>,
    },
    /// The metrics listener, its heads held to this time limit.
    Metrics(Arc<Gateway>, Duration),
    /// The endpoint picker's ext_proc service.
    Epp {
        gateway: Arc<Gateway>,
        limits: crate::frontend::epp::EppLimits,
    },
}

/// A listening socket and what is served on it, as one of pingora's services: the socket comes from the previous
/// process in an upgrade (or is bound here), and is registered for handing on to the next.
struct Listener {
    name: &'static str,
    address: SocketAddr,
    threads: usize,
    /// Bound before the server started, so a taken port fails the start with its address named.
    bound: Option<std::net::TcpListener>,
    serves: Serves,
    /// The most connections it holds open at once.
    cap: crate::frontend::ConnectionCap,
    failure: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl Service for Listener {
    async fn start_service(&mut self, fds: Option<ListenFds>, mut shutdown: ShutdownWatch, _listeners_per_fd: usize) {
        let socket = match self.socket(fds) {
            Ok(socket) => socket,
            Err(error) => {
                tracing::error!(door = self.name, address = %self.address, %error, "cannot listen");
                self.failure.notify_one();
                return;
            }
        };
        if let Err(error) = self.start(&socket, &shutdown) {
            tracing::error!(door = self.name, address = %self.address, %error, "cannot start");
            self.failure.notify_one();
            return;
        }
        // Held until shutdown: its descriptor is the one the next process is handed (before shutdown starts).
        crate::frontend::stopping(&mut shutdown).await;
        drop(socket);
    }

    fn name(&self) -> &str {
        self.name
    }

    fn threads(&self) -> Option<usize> {
        // The doors run their own threads; pingora's runtime for each only waits.
        Some(1)
    }

    fn listen_addresses(&self) -> Option<Vec<String>> {
        Some(vec![self.handover_key()])
    }
}

impl Listener {
    /// The name the socket is handed over under: the listener and its configured address, so listeners configured
    /// on port 0 are told apart, and a changed address gets a new socket.
    fn handover_key(&self) -> String {
        format!("{}@{}", self.name, self.address)
    }

    /// The listening socket: the one handed over by the previous process, the one bound before start, or a new one;
    /// registered for handing on.
    fn socket(&mut self, fds: Option<ListenFds>) -> std::io::Result<std::net::TcpListener> {
        let key = self.handover_key();
        let Some(fds) = fds else {
            return self
                .bound
                .take()
                .map_or_else(|| crate::frontend::bind(self.address), Ok);
        };
        let mut fds = fds.lock();
        if let Some(fd) = fds.get(&key) {
            let socket = crate::frontend::inherited(*fd)?;
            tracing::info!(door = self.name, address = %self.address, "took over the listening socket");
            return Ok(socket);
        }
        let socket = self
            .bound
            .take()
            .map_or_else(|| crate::frontend::bind(self.address), Ok)?;
        fds.add(key, std::os::fd::AsRawFd::as_raw_fd(&socket));
        Ok(socket)
    }

    /// Starts serving on `socket`: one accept loop per thread, each on its own runtime.
    fn start(&self, socket: &std::net::TcpListener, shutdown: &ShutdownWatch) -> std::io::Result<()> {
        let threads = match self.serves {
            Serves::Metrics(..) => 1,
            _ => self.threads.max(1),
        };
        let seats = crate::frontend::DoorThread::all(socket, threads, self.cap.clone())?;
        for (index, seat) in seats.into_iter().enumerate() {
            let mut stop = shutdown.clone();
            let name = format!("{}-{index}", self.name);
            match &self.serves {
                Serves::Rest(connections) => {
                    let connections = connections.clone();
                    let shutdown = shutdown.clone();
                    crate::frontend::spawn_door_thread(name, async move {
                        let stopping = async move { crate::frontend::stopping(&mut stop).await };
                        crate::frontend::accept_loop(seat, "rest", stopping, |tcp, peer, occupied| {
                            let served = connections.clone().serve(tcp, peer, shutdown.clone());
                            tokio::spawn(async move {
                                served.await;
                                drop(occupied);
                            });
                        })
                        .await;
                        // Connections still open are served until the process ends.
                        std::future::pending::<()>().await;
                    })?;
                }
                Serves::Grpc { gateway, limits, tls } => {
                    let (gateway, limits, tls) = (gateway.clone(), *limits, tls.clone());
                    crate::frontend::spawn_door_thread(name, async move {
                        let stopping = async move { crate::frontend::stopping(&mut stop).await };
                        grpc::serve(seat, gateway, limits, tls, stopping).await;
                        std::future::pending::<()>().await;
                    })?;
                }
                Serves::Epp { gateway, limits } => {
                    let (gateway, limits) = (gateway.clone(), *limits);
                    crate::frontend::spawn_door_thread(name, async move {
                        let stopping = async move { crate::frontend::stopping(&mut stop).await };
                        crate::frontend::epp::serve(seat, gateway, limits, stopping).await;
                        std::future::pending::<()>().await;
                    })?;
                }
                Serves::Metrics(gateway, header_timeout) => {
                    let (gateway, header_timeout) = (gateway.clone(), *header_timeout);
                    crate::frontend::spawn_door_thread(name, async move {
                        let stopping = async move { crate::frontend::stopping(&mut stop).await };
                        metrics_listener::serve(seat, gateway, header_timeout, stopping).await;
                    })?;
                }
            }
        }
        Ok(())
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

/// How long streams ended at the close of a grace period get to send their status.
const STREAMS_END: Duration = Duration::from_millis(500);
/// How long the process waits, once no request is under way, for the last answers' bytes to leave their connections.
const LAST_BYTES: Duration = Duration::from_millis(50);

/// SIGTERM and SIGINT start a graceful shutdown: readiness says no at once; after the drain delay the listeners
/// close; requests under way get the grace period; the process exits as soon as none is left. SIGQUIT hands the
/// listening sockets to a new process started with `--upgrade`, then stops accepting and drains the same way (readiness
/// stays: the new process answers on the same sockets). A listener that cannot start stops the process the same
/// way, with a failing exit status.
struct Signals {
    /// The signals, listened for from the start (before the listeners open), so none is missed or fatal.
    streams: std::sync::Mutex<Option<SignalStreams>>,
    gateway: Arc<Gateway>,
    shutdown: Shutdown,
    failure: Arc<tokio::sync::Notify>,
    /// A listener could not start: the process ends with an error once drained.
    failed: Arc<std::sync::atomic::AtomicBool>,
}

/// Why the process stops.
enum Stop {
    Terminate(&'static str),
    Upgrade,
    Failed,
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        let streams = self.streams.lock().ok().and_then(|mut streams| streams.take());
        let stop = tokio::select! {
            stop = termination(streams) => stop,
            () = self.failure.notified() => Stop::Failed,
        };
        match stop {
            Stop::Upgrade => {
                tracing::info!(
                    in_flight = self.gateway.active(),
                    "SIGQUIT: handing the listening sockets to the new process, then draining"
                );
                ShutdownSignal::GracefulUpgrade
            }
            Stop::Failed => {
                tracing::error!("a listener could not start: shutting down");
                self.failed.store(true, std::sync::atomic::Ordering::Relaxed);
                ShutdownSignal::GracefulTerminate
            }
            Stop::Terminate(signal) => {
                self.gateway.start_draining();
                tracing::info!(
                    signal,
                    drain_delay_ms = self.shutdown.drain_delay.as_millis(),
                    grace_period_ms = self.shutdown.grace_period.as_millis(),
                    in_flight = self.gateway.active(),
                    "shutting down: readiness is now false"
                );
                tokio::time::sleep(self.shutdown.drain_delay).await;
                ShutdownSignal::GracefulTerminate
            }
        }
    }
}

/// SIGTERM, SIGINT and SIGQUIT, listened for.
struct SignalStreams {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

/// The runtime the signals are registered on; kept for the life of the process (pingora's runtime, which waits for
/// them, reads the signals' shared pipe).
static SIGNAL_RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();

impl SignalStreams {
    /// Takes over the three signals now: from here on none of them ends the process by its default action.
    fn listen() -> std::io::Result<SignalStreams> {
        use tokio::signal::unix::{SignalKind, signal};
        let runtime = match SIGNAL_RUNTIME.get() {
            Some(runtime) => runtime,
            None => {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                SIGNAL_RUNTIME.get_or_init(|| runtime)
            }
        };
        let (terminate, interrupt, quit) = {
            let _entered = runtime.enter();
            (
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
                signal(SignalKind::quit())?,
            )
        };
        Ok(SignalStreams {
            terminate,
            interrupt,
            quit,
        })
    }
}

/// Waits for SIGTERM, SIGINT or SIGQUIT.
async fn termination(streams: Option<SignalStreams>) -> Stop {
    let Some(mut streams) = streams else {
        std::future::pending::<()>().await;
        return Stop::Failed;
    };
    tokio::select! {
        _ = streams.terminate.recv() => Stop::Terminate("SIGTERM"),
        _ = streams.interrupt.recv() => Stop::Terminate("SIGINT"),
        _ = streams.quit.recv() => Stop::Upgrade,
    }
}

/// Waits, once the listeners are closed, until no request is under way or `grace` has passed. Streams still open
/// then are ended with UNAVAILABLE, and given a moment to say so.
fn drain(gateway: &Gateway, grace: Duration) {
    let started = Instant::now();
    // The accept loops stop on their next turn; a moment lets them, so no request starts after this.
    std::thread::sleep(Duration::from_millis(50));
    // Woken by the last request's end, not polled.
    if !gateway.wait_idle(grace.saturating_sub(started.elapsed())) {
        gateway.end_streams();
        gateway.wait_idle(STREAMS_END);
    }
    // A request ends as its answer's last bytes are handed to its connection: a moment lets them leave.
    std::thread::sleep(LAST_BYTES);
    let left = gateway.active();
    if left > 0 {
        tracing::warn!(
            in_flight = left,
            "grace period over; exiting with requests still under way"
        );
    } else {
        tracing::info!("drained; exiting");
    }
    // The fleet's budgets get back what this replica held of them, and its place among the replicas.
    if let Some(store) = gateway.dispatcher().guard().shared() {
        store.retire_before_exit();
    }
    crate::telemetry::log_writer::flush();
}

/// Runs the gateway until SIGTERM or SIGINT (both graceful), or until SIGQUIT hands its listening sockets to a new
/// process. `path` is the configuration file reloads read.
pub fn serve(config: Config, name: &str, path: Option<PathBuf>, process: &Process) -> Result<()> {
    let streams = SignalStreams::listen().map_err(|e| Error::internal(format!("cannot listen for signals: {e}")))?;
    let gateway = start_gateway(&config, name, path)?;
    let sockets = Sockets::bind(&config, process)?;
    let bound = sockets.bound();
    let mut server = pingora_server(process);
    let failure = Arc::new(tokio::sync::Notify::new());
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    add_services(&mut server, &config, &gateway, sockets, &failure, process.epp);
    announce(&config, bound, process.epp);
    let signals = Signals {
        streams: std::sync::Mutex::new(Some(streams)),
        gateway: gateway.clone(),
        shutdown: config.shutdown,
        failure,
        failed: failed.clone(),
    };
    server.run(RunArgs {
        shutdown_signal: Box::new(signals),
    });
    drain(&gateway, config.shutdown.grace_period);
    if failed.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(Error::internal("a listener could not start (see the log)"));
    }
    Ok(())
}

/// The gateway's first snapshot, built on the builder thread, counting into the process's metrics.
fn start_gateway(config: &Config, name: &str, path: Option<PathBuf>) -> Result<Arc<Gateway>> {
    let metrics = Metrics::new()?;
    let (built, name) = (config.clone(), name.to_owned());
    crate::runtime::on_builder_thread(move || Gateway::new(built, &name, path, metrics))
        .map_err(|problems| Error::internal(problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")))
}

/// The listening sockets of a fresh start; none in an upgrade, which takes the running process's over.
struct Sockets {
    rest: Option<std::net::TcpListener>,
    grpc: Option<std::net::TcpListener>,
    metrics: Option<std::net::TcpListener>,
    epp: Option<std::net::TcpListener>,
}

impl Sockets {
    /// Binds now, so a taken port fails the start with the address named.
    fn bind(config: &Config, process: &Process) -> Result<Sockets> {
        let bind = |address: Option<SocketAddr>, what: &str| -> Result<Option<std::net::TcpListener>> {
            match address {
                Some(address) if !process.upgrade => crate::frontend::bind(address)
                    .map(Some)
                    .map_err(|e| Error::internal(format!("cannot listen for {what} on {address}: {e}"))),
                _ => Ok(None),
            }
        };
        // The endpoint picker alone serves no front door; the gateway alone no picker.
        let picker = process.epp.is_some();
        let doors = process.epp.is_none_or(|epp| epp.with_doors);
        Ok(Sockets {
            rest: bind(Some(config.listen.rest).filter(|_| doors), "REST")?,
            grpc: bind(Some(config.listen.grpc).filter(|_| doors), "gRPC")?,
            metrics: bind(config.listen.metrics, "metrics")?,
            epp: bind(Some(config.listen.epp).filter(|_| picker), "the endpoint picker")?,
        })
    }

    /// Their bound addresses (a port 0 made real), by REST, gRPC, metrics and the endpoint picker.
    fn bound(&self) -> [Option<SocketAddr>; 4] {
        let local = |socket: &Option<std::net::TcpListener>| socket.as_ref().and_then(|s| s.local_addr().ok());
        [
            local(&self.rest),
            local(&self.grpc),
            local(&self.metrics),
            local(&self.epp),
        ]
    }
}

/// pingora's server, bootstrapped: in an upgrade this waits for the running process's sockets (it sends them on
/// SIGQUIT).
fn pingora_server(process: &Process) -> Server {
    let conf = ServerConf {
        threads: 1,
        // pingora would wait out the whole grace period; the drain is waited for here once it returns, and ends
        // as soon as nothing is under way.
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        upgrade_sock: process.upgrade_socket.to_string_lossy().into_owned(),
        ..Default::default()
    };
    let options = Opt {
        upgrade: process.upgrade,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(Some(options), conf);
    server.bootstrap();
    server
}

/// The two doors, the metrics listener and the control service (health checks, discovery, reloads).
fn add_services(
    server: &mut Server,
    config: &Config,
    gateway: &Arc<Gateway>,
    sockets: Sockets,
    failure: &Arc<tokio::sync::Notify>,
    epp: Option<EppOptions>,
) {
    let listener = |name, address, bound, serves| Listener {
        name,
        address,
        threads: config.threads,
        bound,
        serves,
        cap: crate::frontend::ConnectionCap {
            most: config.limits.max_connections,
            refused: Some(gateway.metrics().connections_refused(name)),
        },
        failure: failure.clone(),
    };
    let tls_on = |door: fn(&crate::config::ServerTls) -> bool| {
        config
            .tls
            .as_ref()
            .filter(|tls| door(tls))
            .and_then(|_| gateway.identity().cloned())
    };
    let limits = &config.limits;
    if let Some(options) = epp {
        let limits = crate::frontend::epp::EppLimits {
            max_message_bytes: usize::try_from(limits.max_request_bytes).unwrap_or(usize::MAX),
            max_concurrent_streams: limits.max_concurrent_streams,
            fallbacks: options.fallbacks,
        };
        let epp = Serves::Epp {
            gateway: gateway.clone(),
            limits,
        };
        server.add_service(listener("epp", config.listen.epp, sockets.epp, epp));
        if !options.with_doors {
            add_metrics_and_control(server, config, gateway, sockets.metrics, &listener);
            return;
        }
    }
    let rest = RestConnections {
        door: Arc::new(RestDoor::new(
            gateway.clone(),
            BodyLimits {
                stall: limits.body_read_timeout,
                total: limits.body_total_timeout,
                bytes: limits.max_request_bytes,
            },
        )),
        tls: tls_on(|tls| tls.rest)
            .map(|identity| tokio_rustls::TlsAcceptor::from(identity.server_config(&[b"h2", b"http/1.1"]))),
        header_timeout: limits.header_read_timeout,
        max_concurrent_streams: limits.max_concurrent_streams,
        max_buffered_answer_bytes: limits.max_buffered_answer_bytes,
    };
    server.add_service(listener("rest", config.listen.rest, sockets.rest, Serves::Rest(rest)));
    let grpc = Serves::Grpc {
        gateway: gateway.clone(),
        limits: grpc::GrpcLimits {
            max_message_bytes: usize::try_from(limits.max_request_bytes).unwrap_or(usize::MAX),
            max_concurrent_streams: limits.max_concurrent_streams,
            max_buffered_answer_bytes: limits.max_buffered_answer_bytes,
            header_timeout: limits.header_read_timeout,
        },
        tls: tls_on(|tls| tls.grpc).map(|identity| tokio_rustls::TlsAcceptor::from(identity.server_config(&[b"h2"]))),
    };
    server.add_service(listener("grpc", config.listen.grpc, sockets.grpc, grpc));
    add_metrics_and_control(server, config, gateway, sockets.metrics, &listener);
}

/// The metrics listener, when configured, and the control service (health checks, discovery, reloads).
fn add_metrics_and_control(
    server: &mut Server,
    config: &Config,
    gateway: &Arc<Gateway>,
    socket: Option<std::net::TcpListener>,
    listener: &dyn Fn(&'static str, SocketAddr, Option<std::net::TcpListener>, Serves) -> Listener,
) {
    if let Some(address) = config.listen.metrics {
        server.add_service(listener(
            "metrics",
            address,
            socket,
            Serves::Metrics(gateway.clone(), config.limits.header_read_timeout),
        ));
    }
    server.add_service(background_service(
        "control",
        Control {
            gateway: gateway.clone(),
        },
    ));
}

/// The log line and the first line on stdout (which tests and scripts read): where each listener is, the bound
/// address (a port 0 made real) or in an upgrade the configured one.
fn announce(config: &Config, [rest, grpc, metrics, epp]: [Option<SocketAddr>; 4], picker: Option<EppOptions>) {
    let shown = |bound: Option<SocketAddr>, configured: Option<SocketAddr>| {
        bound
            .or(configured)
            .map_or_else(|| "off".to_owned(), |address| address.to_string())
    };
    tracing::info!(summary = %config.summary(), pid = std::process::id(), "configuration loaded");
    let epp = shown(epp, Some(config.listen.epp));
    let (pid, summary) = (std::process::id(), config.summary());
    let metrics = shown(metrics, config.listen.metrics);
    match picker {
        Some(options) if !options.with_doors => {
            println!("oipgate epp serving: epp={epp} metrics={metrics} pid={pid} ({summary})");
        }
        _ => {
            let (rest, grpc) = (
                shown(rest, Some(config.listen.rest)),
                shown(grpc, Some(config.listen.grpc)),
            );
            let epp = if picker.is_some() {
                format!(" epp={epp}")
            } else {
                String::new()
            };
            println!("oipgate serving: rest={rest} grpc={grpc} metrics={metrics}{epp} pid={pid} ({summary})");
        }
    }
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

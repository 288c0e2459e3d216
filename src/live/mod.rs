//! The running gateway's live state: the dispatcher requests are served by, swapped whole when the configuration is
//! reloaded (file change or SIGHUP) or DNS answers change; the front doors' TLS identity; and the count of requests
//! under way, which shutdown waits on, kept by each door thread for itself.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::config::{Config, Discovery, Endpoint, Problem};
use crate::dispatch::Dispatcher;
use crate::telemetry::metrics::Metrics;
use crate::tls::{BackendMaterial, Prepared, ServerIdentity};

mod serving;

use serving::Drain;
pub use serving::{Active, Serving};

/// How long one DNS resolution may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often discovery looks for backends whose interval has passed.
const DISCOVERY_TICK: Duration = Duration::from_millis(100);

/// The gateway as it runs.
#[derive(Debug)]
pub struct Gateway {
    name: String,
    /// The configuration file, for reloads; `None` when the configuration came from elsewhere (the demo).
    path: Option<PathBuf>,
    metrics: Arc<Metrics>,
    current: ArcSwap<Dispatcher>,
    identity: Option<Arc<ServerIdentity>>,
    /// Everything a rebuild starts from; held while one is under way, so rebuilds never interleave.
    state: tokio::sync::Mutex<State>,
    draining: AtomicBool,
    /// Set when a shutdown's grace period has run out: streams still open end with UNAVAILABLE.
    streams_ending: tokio::sync::watch::Sender<bool>,
    /// The requests under way, counted by each thread that begins some.
    drain: Arc<Drain>,
    /// Tells this gateway's handles from another's in a thread's [`HELD`] (tests run many in one process).
    id: u64,
    /// Snapshots installed since start (1: the first).
    generation: AtomicU64,
    /// The last reload's outcome: when, and the problems that refused it.
    last_reload: std::sync::Mutex<Option<(std::time::SystemTime, Result<(), String>)>>,
}

#[derive(Debug)]
struct State {
    config: Config,
    backend_tls: Vec<Option<BackendMaterial>>,
    /// Endpoints discovered (DNS, endpoints files), by backend name, and when each backend was last looked up.
    discovered: HashMap<String, Vec<Endpoint>>,
    resolved_at: HashMap<String, Instant>,
    health: Option<tokio::task::JoinHandle<()>>,
    /// The configuration file's and its TLS files' contents when last looked at.
    fingerprint: Vec<u8>,
}

impl Gateway {
    /// Reads the TLS files `config` names and builds the first dispatcher; `path` is the file reloads read.
    pub fn new(
        config: Config,
        name: &str,
        path: Option<PathBuf>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Gateway>, Vec<Problem>> {
        let prepared = Prepared::load(&config)?;
        let dispatcher = Dispatcher::build(&config, name, metrics.clone(), &prepared, &HashMap::new(), None)
            .map_err(|e| vec![problem(e.message())])?;
        let fingerprint = path
            .as_ref()
            .map(|p| fingerprint(p, &config.files()))
            .unwrap_or_default();
        Ok(Arc::new(Gateway {
            name: name.to_owned(),
            path,
            metrics,
            current: ArcSwap::from_pointee(dispatcher),
            identity: prepared.server.map(ServerIdentity::new),
            state: tokio::sync::Mutex::new(State {
                config,
                backend_tls: prepared.backend_tls,
                discovered: HashMap::new(),
                resolved_at: HashMap::new(),
                health: None,
                fingerprint,
            }),
            draining: AtomicBool::new(false),
            streams_ending: tokio::sync::watch::Sender::new(false),
            drain: Arc::default(),
            id: {
                static GATEWAYS: AtomicU64 = AtomicU64::new(0);
                GATEWAYS.fetch_add(1, Ordering::Relaxed)
            },
            generation: AtomicU64::new(1),
            last_reload: std::sync::Mutex::new(None),
        }))
    }

    /// The dispatcher a new request is served by; the request keeps it to its end, whatever is reloaded meanwhile.
    pub fn dispatcher(&self) -> Arc<Dispatcher> {
        self.current.load_full()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Snapshots installed since start: 1 until the first reload or DNS change.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The last reload's time and outcome (the problems that refused it), if there was one.
    pub fn last_reload(&self) -> Option<(std::time::SystemTime, Result<(), String>)> {
        self.last_reload
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The front doors' certificate and client verification, when they speak TLS.
    pub fn identity(&self) -> Option<&Arc<ServerIdentity>> {
        self.identity.as_ref()
    }

    /// From now on readiness says no, so load balancers stop sending.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Ends every stream still open (a shutdown's grace period has run out).
    pub fn end_streams(&self) {
        self.streams_ending.send_replace(true);
    }

    /// Resolves once streams are to end.
    pub async fn streams_ending(&self) {
        let mut ending = self.streams_ending.subscribe();
        let _ = ending.wait_for(|ending| *ending).await;
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Readiness: not while draining; otherwise the dispatcher's view of the fleet.
    pub async fn server_ready(&self) -> bool {
        !self.is_draining() && self.dispatcher().server_ready().await
    }

    /// Runs until the process ends: resolves DNS backends, then keeps health checks, DNS discovery, the
    /// configuration-file watch, SIGHUP and SIGUSR1 going.
    pub async fn run(self: Arc<Self>) {
        {
            let mut state = self.state.lock().await;
            let due = discovered_backends(&state.config);
            if self.resolve(&mut state, &due).await {
                let config = state.config.clone();
                let prepared = Prepared::carried(state.backend_tls.clone());
                if let Err(problems) = self.install(&mut state, config, prepared) {
                    report_refused(&problems);
                }
            }
            self.restart_health(&mut state);
        }
        tokio::join!(
            self.clone().watch(),
            self.clone().on_hangup(),
            self.clone().on_user_signal(),
            self.clone().discover()
        );
    }

    /// Reads the configuration file again and, when it is valid and its TLS files are good, serves by it from now
    /// on; otherwise the running configuration stays and every problem is given (the same messages as
    /// `check-config`).
    pub async fn reload(&self) -> Result<(), Vec<Problem>> {
        let mut state = self.state.lock().await;
        let outcome = self.reload_locked(&mut state).await;
        self.metrics.reloaded(outcome.is_ok());
        let recorded = outcome
            .clone()
            .map_err(|problems| problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "));
        *self
            .last_reload
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((std::time::SystemTime::now(), recorded));
        match &outcome {
            Ok(()) => tracing::info!(summary = %state.config.summary(), "configuration reloaded"),
            Err(problems) => report_refused(problems),
        }
        outcome
    }

    async fn reload_locked(&self, state: &mut State) -> Result<(), Vec<Problem>> {
        let Some(path) = &self.path else {
            return Err(vec![problem("no configuration file to reload")]);
        };
        state.fingerprint = fingerprint(path, &state.config.files());
        let owned = path.clone();
        let (config, prepared) = crate::runtime::on_builder_thread(move || {
            let config = Config::load(&owned, &crate::config::environment_overrides())?;
            let prepared = Prepared::load(&config)?;
            Ok::<_, Vec<Problem>>((config, prepared))
        })?;
        state.fingerprint = fingerprint(path, &config.files());
        for change in restart_only_changes(&state.config, &config) {
            tracing::warn!("{change} takes a restart; the running one stays");
        }
        // Backends found through DNS that are new, or whose name changed, are resolved before the switch, so they
        // do not start out empty.
        let fresh: Vec<_> = discovered_backends(&config)
            .into_iter()
            .filter(|(name, discovery)| {
                !state
                    .config
                    .backends()
                    .iter()
                    .any(|b| &b.name == name && &b.discovery == discovery)
            })
            .collect();
        for (name, _) in &fresh {
            state.discovered.remove(name);
        }
        self.resolve(state, &fresh).await;
        self.install(state, config, prepared)?;
        self.restart_health(state);
        Ok(())
    }

    /// Builds the dispatcher for `config` over the current one and swaps it in. Files `prepared` does not carry
    /// (the server's certificate, the JWT keys) stay as they are.
    fn install(&self, state: &mut State, config: Config, mut prepared: Prepared) -> Result<(), Vec<Problem>> {
        let previous = self.dispatcher();
        let server = prepared.server.take();
        let (name, metrics, discovered) = (self.name.clone(), self.metrics.clone(), state.discovered.clone());
        let (dispatcher, config, prepared) = crate::runtime::on_builder_thread(move || {
            let dispatcher = Dispatcher::build(&config, &name, metrics, &prepared, &discovered, Some(&previous));
            (dispatcher, config, prepared)
        });
        let dispatcher = dispatcher.map_err(|e| vec![problem(e.message())])?;
        // A store the new configuration does not keep hands back its leases and owed charges now, rather than
        // sit on them until the requests still under way on it have ended.
        let replaced_store = self
            .dispatcher()
            .guard()
            .shared()
            .filter(|old| !dispatcher.guard().shared().is_some_and(|kept| Arc::ptr_eq(old, kept)))
            .cloned();
        self.current.store(Arc::new(dispatcher));
        if let Some(store) = replaced_store {
            crate::runtime::limits_runtime().spawn(async move { store.retire().await });
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        if let (Some(identity), Some(server)) = (&self.identity, server) {
            identity.replace(server);
        }
        state
            .discovered
            .retain(|name, _| config.backends().iter().any(|b| &b.name == name));
        state.config = config;
        state.backend_tls = prepared.backend_tls;
        Ok(())
    }

    /// Health checks run on the current dispatcher's backends; endpoints carried over keep their state.
    fn restart_health(&self, state: &mut State) {
        if let Some(task) = state.health.take() {
            task.abort();
        }
        state.health = Some(tokio::spawn(self.dispatcher().run_health_checks()));
    }

    /// Looks at the configuration file, and the TLS files it names, at the configured interval; a change reloads.
    async fn watch(self: Arc<Self>) {
        let Some(path) = self.path.clone() else { return };
        loop {
            let reload = self.state.lock().await.config.reload;
            tokio::time::sleep(reload.interval).await;
            if !reload.watch {
                continue;
            }
            // The names of the files to look at, not the whole configuration (ten thousand models' worth).
            let files = self.state.lock().await.config.files();
            let now = fingerprint(&path, &files);
            let changed = self.state.lock().await.fingerprint != now;
            if changed {
                tracing::info!(file = %path.display(), "configuration or certificate files changed; reloading");
                let _ = self.reload().await;
            }
        }
    }

    /// Reopens the log file on SIGUSR1 (log rotation without a reload).
    async fn on_user_signal(self: Arc<Self>) {
        #[cfg(unix)]
        {
            let Ok(mut signals) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()) else {
                tracing::warn!("cannot listen for SIGUSR1; SIGHUP reopens the log file too");
                return;
            };
            while signals.recv().await.is_some() {
                crate::telemetry::log_writer::reopen();
                tracing::info!("SIGUSR1: log file reopened");
            }
        }
    }

    /// Reopens the log file and reloads on SIGHUP.
    async fn on_hangup(self: Arc<Self>) {
        #[cfg(unix)]
        {
            let Ok(mut hangups) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
                tracing::warn!("cannot listen for SIGHUP; reload by changing the configuration file");
                return;
            };
            while hangups.recv().await.is_some() {
                crate::telemetry::log_writer::reopen();
                tracing::info!("SIGHUP: reloading the configuration");
                let _ = self.reload().await;
            }
        }
    }

    /// Re-resolves each backend found through DNS at its interval; a changed answer rebuilds the dispatcher, adding
    /// and removing endpoints while the others keep their connections and state.
    async fn discover(self: Arc<Self>) {
        loop {
            tokio::time::sleep(DISCOVERY_TICK).await;
            let mut state = self.state.lock().await;
            let due: Vec<_> = discovered_backends(&state.config)
                .into_iter()
                .filter(|(name, discovery)| {
                    discovery
                        .interval()
                        .is_some_and(|interval| state.resolved_at.get(name).is_none_or(|at| at.elapsed() >= interval))
                })
                .collect();
            if due.is_empty() || !self.resolve(&mut state, &due).await {
                continue;
            }
            let config = state.config.clone();
            let prepared = Prepared::carried(state.backend_tls.clone());
            match self.install(&mut state, config, prepared) {
                Ok(()) => self.restart_health(&mut state),
                Err(problems) => report_refused(&problems),
            }
        }
    }

    /// Looks `backends` up (DNS, or their endpoints file); gives whether any backend's endpoints changed. A failed
    /// lookup keeps what was found before (a DNS hiccup or a file caught mid-write must not empty a backend); a name
    /// with no records, or a file listing none, empties it.
    async fn resolve(&self, state: &mut State, backends: &[(String, Discovery)]) -> bool {
        let mut changed = false;
        for (name, discovery) in backends {
            let (source, found) = match discovery {
                Discovery::Dns { host, port, server, .. } => {
                    (format!("dns {host}:{port}"), lookup(host, *port, *server).await)
                }
                Discovery::File { path, .. } => (
                    format!("file {}", path.display()),
                    read_endpoints_file(name, path).await,
                ),
                Discovery::Static => continue,
            };
            state.resolved_at.insert(name.clone(), Instant::now());
            match found {
                Ok(mut endpoints) => {
                    endpoints.sort_by_key(ToString::to_string);
                    endpoints.dedup();
                    let before = state.discovered.get(name);
                    if before != Some(&endpoints) {
                        tracing::info!(
                            backend = %name,
                            %source,
                            endpoints = %endpoints.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                            "endpoints discovered"
                        );
                        state.discovered.insert(name.clone(), endpoints);
                        changed = true;
                    }
                }
                Err(error) => {
                    tracing::warn!(backend = %name, %source, %error, "endpoint lookup failed; keeping the endpoints found before");
                }
            }
        }
        changed
    }
}

/// The endpoints a backend's endpoints file lists; entries that are not an IP address and a port are logged and
/// left out, the others served.
async fn read_endpoints_file(backend: &str, path: &std::path::Path) -> Result<Vec<Endpoint>, String> {
    use crate::config::endpoints_file::{MOST_ENDPOINTS_FILE_BYTES, parse};
    let owned = path.to_owned();
    let text = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let file = std::fs::File::open(&owned).map_err(|e| format!("cannot open it: {e}"))?;
        let mut text = String::new();
        file.take(MOST_ENDPOINTS_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read it: {e}"))?;
        if text.len() as u64 > MOST_ENDPOINTS_FILE_BYTES {
            return Err(format!("it is over {MOST_ENDPOINTS_FILE_BYTES} bytes"));
        }
        Ok(text)
    })
    .await
    .map_err(|e| format!("cannot read it: {e}"))??;
    let (endpoints, skipped) = parse(&text)?;
    for problem in skipped {
        tracing::warn!(%backend, file = %path.display(), %problem, "endpoint left out");
    }
    Ok(endpoints)
}

fn problem(message: &str) -> Problem {
    Problem {
        path: String::new(),
        message: message.to_owned(),
    }
}

fn report_refused(problems: &[Problem]) {
    for problem in problems {
        tracing::error!(%problem, "configuration refused");
    }
    tracing::error!(
        problems = problems.len(),
        "configuration reload refused; the running configuration stays"
    );
}

/// The backends whose endpoints are discovered (DNS, an endpoints file), by name.
fn discovered_backends(config: &Config) -> Vec<(String, Discovery)> {
    config
        .backends()
        .iter()
        .filter(|b| b.discovery.interval().is_some())
        .map(|b| (b.name.clone(), b.discovery.clone()))
        .collect()
}

/// What a reload cannot change on a running process: the listeners.
fn restart_only_changes(running: &Config, new: &Config) -> Vec<&'static str> {
    let mut changes = Vec::new();
    if running.listen != new.listen {
        changes.push("a change of listen addresses");
    }
    let doors = |c: &Config| c.tls.as_ref().map(|t| (t.rest, t.grpc));
    if doors(running) != doors(new) {
        changes.push("turning TLS on or off on a front door");
    }
    if running.limits.max_request_bytes != new.limits.max_request_bytes {
        changes.push("a change of limits.max_request_bytes");
    }
    if running.shutdown != new.shutdown {
        changes.push("a change of [shutdown]");
    }
    if running.threads != new.threads {
        changes.push("a change of runtime.threads");
    }
    changes
}

/// The bytes of the configuration file and of every TLS file it names, to notice a change of any of them.
fn fingerprint(path: &std::path::Path, files: &[PathBuf]) -> Vec<u8> {
    let mut bytes = std::fs::read(path).unwrap_or_default();
    for file in files {
        bytes.extend_from_slice(file.as_os_str().as_encoded_bytes());
        bytes.extend(std::fs::read(file).unwrap_or_default());
    }
    bytes
}

/// Every address `host` resolves to, at `port`: by the system's resolver (`/etc/hosts`, search domains, as a pod
/// expects), or by asking `server`.
async fn lookup(host: &str, port: u16, server: Option<SocketAddr>) -> Result<Vec<Endpoint>, String> {
    let endpoint = |ip: IpAddr| Endpoint {
        host: ip.to_string(),
        port,
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![endpoint(ip)]);
    }
    let Some(server) = server else {
        let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port)))
            .await
            .map_err(|_| format!("no answer within {} ms", RESOLVE_TIMEOUT.as_millis()))?
            .map_err(|e| e.to_string())?;
        return Ok(found.map(|address| endpoint(address.ip())).collect());
    };
    use hickory_resolver::config::{LookupIpStrategy, NameServerConfigGroup, ResolverConfig, ResolverOpts};
    use hickory_resolver::name_server::TokioConnectionProvider;
    let group = NameServerConfigGroup::from_ips_clear(&[server.ip()], server.port(), true);
    let mut options = ResolverOpts::default();
    options.timeout = RESOLVE_TIMEOUT;
    options.attempts = 1;
    options.cache_size = 0;
    // Every A and every AAAA record is an endpoint (the default asks for AAAA only when there is no A).
    options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    let resolver = hickory_resolver::Resolver::builder_with_config(
        ResolverConfig::from_parts(None, Vec::new(), group),
        TokioConnectionProvider::default(),
    )
    .with_options(options)
    .build();
    // A fully qualified name: no search domains are tried against a named server.
    let name = if host.ends_with('.') {
        host.to_owned()
    } else {
        format!("{host}.")
    };
    match resolver.lookup_ip(name).await {
        Ok(found) => Ok(found.iter().map(endpoint).collect()),
        Err(error) if error.is_no_records_found() => Ok(Vec::new()),
        Err(error) => Err(error.to_string()),
    }
}

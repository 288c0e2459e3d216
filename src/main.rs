//! The `oipgate` command line.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::ExitCode;

use bytes::Bytes;
use clap::{Parser, Subcommand};
use oipgate::cli::convert::{Form, convert};
use oipgate::modelserver::{self, ModelServerConfig};
use oipgate::telemetry::logging::LogOptions;

/// glibc's malloc hands every large buffer back to the kernel and faults fresh pages in for the next, which for
/// multi-megabyte tensors costs more than decoding them; mimalloc keeps and reuses them (and the largest are kept
/// for the next ones: see `app::allocator`).
#[global_allocator]
static ALLOCATOR: oipgate::app::allocator::Allocator = oipgate::app::allocator::Allocator;

/// mimalloc returns freed pages to the kernel only when the heap that owns them is next used, so memory freed by a
/// thread that then goes quiet stays resident: a thousand keep-alive connections going idle at once free hyper's
/// buffers (about 12 KiB each) and the door threads then wait; a reload frees the previous snapshot. The gateway's
/// builder thread (which builds every snapshot) asks for the purge once a second.
fn return_freed_memory_periodically() {
    oipgate::runtime::on_release_freed_memory(oipgate::app::allocator::release_freed_memory);
}

#[derive(Parser)]
#[command(
    name = "oipgate",
    version,
    about = "Inference gateway for the Open Inference Protocol (KServe V2)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the gateway in front of two built-in model servers (one REST, one gRPC) and prints examples to try.
    Demo {
        /// The gateway's REST address.
        #[arg(long, default_value = "127.0.0.1:8000")]
        rest: SocketAddr,
        /// The gateway's gRPC address.
        #[arg(long, default_value = "127.0.0.1:8001")]
        grpc: SocketAddr,
        /// The gateway's Prometheus metrics address (`GET /metrics`).
        #[arg(long, default_value = "127.0.0.1:8002")]
        metrics: SocketAddr,
        /// The endpoint picker's address (Envoy's ext_proc), for an Envoy in front of the demo's model servers.
        #[arg(long, default_value = "127.0.0.1:9002")]
        epp: SocketAddr,
        /// The address the printed Envoy configuration listens on.
        #[arg(long, default_value = "127.0.0.1:8010")]
        envoy: SocketAddr,
        #[command(flatten)]
        log: LogOptions,
    },
    /// Serves the built-in models over REST and gRPC (a real Open Inference Protocol backend).
    ModelServer {
        /// REST address (HTTP/1.1 and h2c); port 0 picks a free port.
        #[arg(long)]
        rest: Option<SocketAddr>,
        /// gRPC address; port 0 picks a free port.
        #[arg(long)]
        grpc: Option<SocketAddr>,
        /// Models to serve, e.g. "add_sub:1,2 identity simple_string" (default: every model, every version).
        #[arg(long)]
        models: Option<String>,
        /// Server name reported in server metadata.
        #[arg(long, default_value = "oipgate-model-server")]
        name: String,
        /// Largest REST body or gRPC message accepted, in bytes.
        #[arg(long, default_value_t = 1 << 30)]
        max_request_bytes: usize,
        /// How long the `slow` model sleeps when a request sets no `delay_ms` parameter (a deliberately slow
        /// replica, for trying out load balancing).
        #[arg(long, default_value_t = 0)]
        slow_delay_ms: u64,
    },
    /// Runs the gateway: REST (HTTP/1.1 and h2c) and gRPC front doors in front of the configured backends.
    Serve {
        /// The TOML configuration file; OIPGATE__SECTION__KEY environment variables override its values. It is
        /// watched, and re-read on SIGHUP.
        #[arg(long)]
        config: std::path::PathBuf,
        #[command(flatten)]
        log: LogOptions,
        /// Take over the listening sockets of the gateway now running (zero-downtime binary upgrade): start this,
        /// then send the running process SIGQUIT; it hands its sockets over, stops accepting, finishes what it has
        /// under way and exits.
        #[arg(long)]
        upgrade: bool,
        /// The Unix socket the sockets are handed over through (the same for the old process and the new).
        #[arg(long, default_value = oipgate::app::DEFAULT_UPGRADE_SOCKET)]
        upgrade_socket: std::path::PathBuf,
    },
    /// Runs as the endpoint picker of a Gateway API inference pool: Envoy's external processing service (ext_proc)
    /// on `[listen] epp`, naming for each request the endpoint that serves it, with gRPC health (liveness,
    /// readiness) on the same port and metrics on `[listen] metrics`.
    Epp {
        /// The TOML configuration file (the gateway's: backends are the pool's endpoints, models route to them).
        #[arg(long)]
        config: std::path::PathBuf,
        /// Endpoints named after the picked one, for the proxy's retries. Envoy's ORIGINAL_DST cluster reads one
        /// address only: keep 0 there; a proxy that walks the list (override_host) may take more.
        #[arg(long, default_value_t = 0)]
        fallbacks: usize,
        #[command(flatten)]
        log: LogOptions,
    },
    /// Validates a gateway configuration file (with OIPGATE__SECTION__KEY overrides) and prints every problem.
    CheckConfig {
        /// The TOML configuration file.
        file: std::path::PathBuf,
    },
    /// Converts an inference request read from stdin between wire forms, writing it to stdout.
    Convert {
        #[arg(long, value_enum)]
        from: Form,
        #[arg(long, value_enum)]
        to: Form,
        /// The JSON header's length in a binary-extension body (Inference-Header-Content-Length).
        #[arg(long)]
        header_length: Option<u64>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo {
            rest,
            grpc,
            metrics,
            epp,
            envoy,
            log,
        } => init_logs(&log).and_then(|()| {
            return_freed_memory_periodically();
            let options = oipgate::cli::demo::DemoOptions {
                rest,
                grpc,
                metrics,
                epp,
                envoy,
            };
            oipgate::cli::demo::run(options).map_err(Into::into)
        }),
        Command::Convert {
            from,
            to,
            header_length,
        } => run_convert(from, to, header_length),
        Command::Serve {
            config,
            log,
            upgrade,
            upgrade_socket,
        } => init_logs(&log).and_then(|()| {
            return_freed_memory_periodically();
            run_serve(
                &config,
                &oipgate::app::Process {
                    upgrade,
                    upgrade_socket,
                    epp: None,
                },
            )
        }),
        Command::Epp { config, fallbacks, log } => init_logs(&log).and_then(|()| {
            return_freed_memory_periodically();
            run_serve(
                &config,
                &oipgate::app::Process {
                    epp: Some(oipgate::app::EppOptions {
                        fallbacks,
                        with_doors: false,
                    }),
                    ..Default::default()
                },
            )
        }),
        Command::CheckConfig { file } => return check_config(&file),
        Command::ModelServer {
            rest,
            grpc,
            models,
            name,
            max_request_bytes,
            slow_delay_ms,
        } => run_model_server(ModelServerConfig {
            rest,
            grpc,
            models,
            name,
            max_request_bytes,
            slow_delay: std::time::Duration::from_millis(slow_delay_ms),
        }),
    };
    // Access-log lines still waiting for their batch are written before the process goes.
    oipgate::telemetry::log_writer::flush();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("oipgate: {error}");
            ExitCode::FAILURE
        }
    }
}

fn init_logs(options: &LogOptions) -> Result<(), Box<dyn std::error::Error>> {
    oipgate::telemetry::logging::init(options).map_err(|error| match &options.file {
        Some(file) => format!("cannot open the log file {}: {error}", file.display()).into(),
        None => error.into(),
    })
}

fn run_convert(from: Form, to: Form, header_length: Option<u64>) -> Result<(), Box<dyn std::error::Error>> {
    let mut input = Vec::new();
    std::io::stdin().read_to_end(&mut input)?;
    let converted = convert(Bytes::from(input), from, to, header_length)?;
    if let Some(length) = converted.header_length {
        eprintln!("Inference-Header-Content-Length: {length}");
    }
    std::io::stdout().write_all(&converted.body)?;
    Ok(())
}

fn run_model_server(config: ModelServerConfig) -> Result<(), Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let server = modelserver::start(config).await?;
        // One line with the bound addresses, for people and for scripts that started it on port 0.
        println!("oipgate model-server listening: {}", server.describe());
        std::io::stdout().flush()?;
        shutdown_signal().await;
        server.shutdown().await;
        Ok(())
    })
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(_) => {
                let _ = interrupt.await;
                return;
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

fn check_config(file: &std::path::Path) -> ExitCode {
    // The same checks as a reload: the file, then every certificate and key it names.
    let loaded = oipgate::config::Config::load(file, &oipgate::config::environment_overrides())
        .and_then(|config| oipgate::tls::Prepared::load(&config).map(|_| config));
    match loaded {
        Ok(config) => {
            println!("{}: valid: {}", file.display(), config.summary());
            ExitCode::SUCCESS
        }
        Err(problems) => {
            for problem in &problems {
                eprintln!("{}: {problem}", file.display());
            }
            eprintln!("{}: {} problem(s)", file.display(), problems.len());
            ExitCode::FAILURE
        }
    }
}

fn run_serve(path: &std::path::Path, process: &oipgate::app::Process) -> Result<(), Box<dyn std::error::Error>> {
    let owned = path.to_path_buf();
    let config = oipgate::runtime::on_builder_thread(move || {
        oipgate::config::Config::load(&owned, &oipgate::config::environment_overrides())
    })
    .map_err(|problems| {
        let lines: Vec<String> = problems.iter().map(|p| format!("{}: {p}", path.display())).collect();
        lines.join("\n")
    })?;
    oipgate::app::serve(config, "oipgate", Some(path.to_path_buf()), process)?;
    Ok(())
}

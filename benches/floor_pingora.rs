//! The smallest pingora reverse proxy: a reference row of the load harness (`scripts/bench`), the cost of pingora's
//! HTTP proxy path that the REST door no longer takes. `ProxyHttp` with only `upstream_peer`, one `HttpPeer`.
//! `floor_pingora --listen ADDR --upstream ADDR --threads N`; without arguments (as `cargo test` runs it) it runs
//! briefly in front of a model server of its own, and checks an answer.

#[path = "support/arguments.rs"]
mod arguments;
#[path = "support/self_check.rs"]
mod self_check;
use arguments::argument;

use async_trait::async_trait;
use pingora::prelude::HttpPeer;
use pingora::proxy::{ProxyHttp, Session, http_proxy_service};
use pingora::server::Server;
use pingora::server::configuration::ServerConf;

struct Proxy {
    upstream: String,
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _context: &mut ()) -> pingora::Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream.as_str(), false, String::new())))
    }
}

fn main() {
    let (Some(listen), Some(upstream)) = (argument("--listen"), argument("--upstream")) else {
        checked();
        return;
    };
    let threads = argument("--threads").and_then(|t| t.parse().ok()).unwrap_or(2);
    run(listen, upstream, threads);
}

/// The proxy, briefly, in front of a model server: an inference through it. pingora's server runs until the
/// process ends, which it does once the answer is checked.
fn checked() {
    let (rest, _) = self_check::model_server().expect("a model server");
    let listen = format!("127.0.0.1:{}", self_check::free_port().expect("a free port"));
    let address = listen.clone();
    std::thread::spawn(move || run(listen, rest.to_string(), 1));
    if let Err(error) = self_check::check_http1(&address) {
        eprintln!("floor_pingora: {error}");
        std::process::exit(1);
    }
    std::process::exit(0);
}

fn run(listen: String, upstream: String, threads: usize) {
    let conf = ServerConf {
        threads,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = http_proxy_service(&server.configuration, Proxy { upstream });
    proxy.add_tcp(&listen);
    server.add_service(proxy);
    server.run_forever();
}

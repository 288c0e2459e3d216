//! The fleet status page on the metrics listener: `GET /status`, a page that refreshes itself from
//! `GET /status.json` (no external assets), and that JSON: the configuration's generation and last reload, whether
//! the limits are shared and the state of their Redis, the calls under way of each model held to a `max_concurrent`,
//! every public model version and every endpoint.

use std::time::SystemTime;

use serde::Serialize;

use crate::dispatch::status::FleetStatus;
use crate::live::Gateway;

/// Models listed at most with their calls under way, as the versions are (`dispatch::status::LISTED_VERSIONS`):
/// ten thousand bounded models would be JSON nobody reads every two seconds.
const LISTED_UNDER_WAY: usize = 200;

/// The page: plain HTML and a script that reads `/status.json` every two seconds.
pub const PAGE: &str = include_str!("status.html");

#[derive(Serialize)]
struct Status {
    name: &'static str,
    version: &'static str,
    /// Snapshots installed since start.
    generation: u64,
    last_reload: Option<LastReload>,
    /// Readiness: what load balancers are told.
    ready: bool,
    limits: LimitsStatus,
    #[serde(flatten)]
    fleet: FleetStatus,
}

/// Whether the rate limits and token budgets are each replica's own or shared through Redis, and the state of Redis.
#[derive(Serialize)]
struct LimitsStatus {
    shared: bool,
    /// The Redis URL, its password hidden.
    redis: Option<String>,
    /// `connecting` until Redis first answers, then `reachable`, or `unreachable` while the limits fall back to
    /// `when_unreachable`.
    redis_state: Option<&'static str>,
    when_unreachable: Option<&'static str>,
    /// Replicas seen in Redis recently, this one included.
    replicas: Option<u32>,
    lease: Option<u32>,
    /// The models held to a `max_concurrent` (this replica's own bound), the busiest first and at most
    /// [`LISTED_UNDER_WAY`] of them.
    under_way: Vec<UnderWay>,
}

/// A model's calls under way against its `max_concurrent`.
#[derive(Serialize)]
struct UnderWay {
    model: String,
    calls: u32,
    max_concurrent: u32,
}

impl LimitsStatus {
    fn of(guard: &crate::guard::Guard) -> LimitsStatus {
        let store = guard.shared().map(|store| &**store);
        let mut under_way: Vec<UnderWay> = guard
            .under_way()
            .map(|(model, calls, max)| UnderWay {
                model: model.to_owned(),
                calls,
                max_concurrent: max.get(),
            })
            .collect();
        under_way.sort_unstable_by(|a, b| b.calls.cmp(&a.calls).then_with(|| a.model.cmp(&b.model)));
        under_way.truncate(LISTED_UNDER_WAY);
        LimitsStatus {
            shared: store.is_some(),
            redis: store.map(|store| store.config().shown()),
            redis_state: store.map(crate::guard::shared::SharedStore::state),
            when_unreachable: store.map(|store| store.config().when_unreachable.label()),
            replicas: store.map(crate::guard::shared::SharedStore::replicas),
            lease: store.map(|store| store.config().lease),
            under_way,
        }
    }
}

#[derive(Serialize)]
struct LastReload {
    ok: bool,
    seconds_ago: u64,
    /// The problems that refused it.
    problems: Option<String>,
}

/// `/status.json`.
pub async fn json(gateway: &Gateway) -> Vec<u8> {
    let dispatcher = gateway.dispatcher();
    let status = Status {
        name: "oipgate",
        version: env!("CARGO_PKG_VERSION"),
        generation: gateway.generation(),
        last_reload: gateway.last_reload().map(|(at, outcome)| LastReload {
            ok: outcome.is_ok(),
            seconds_ago: SystemTime::now().duration_since(at).map_or(0, |d| d.as_secs()),
            problems: outcome.err(),
        }),
        ready: gateway.server_ready().await,
        limits: LimitsStatus::of(dispatcher.guard()),
        fleet: dispatcher.fleet_status().await,
    };
    serde_json::to_vec(&status).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes())
}

//! The fleet as the status page shows it: the public model versions with their weight, backend and state
//! (unavailable first, capped, with totals), and every endpoint with its health, queue, calls under way and last
//! minute.

use std::time::Duration;

use serde::Serialize;

use super::Dispatcher;
use super::fleet::EndpointStatus;
use crate::protocol::ModelState;

/// Model versions listed at most: a fleet of ten thousand would make a page nobody reads and a megabyte of JSON
/// every two seconds. The unavailable ones are listed first, so what needs looking at is never left out.
pub const LISTED_VERSIONS: usize = 200;

/// The model versions (unavailable first, at most [`LISTED_VERSIONS`], with the totals) and every backend.
#[derive(Debug, Clone, Serialize)]
pub struct FleetStatus {
    pub models: Vec<VersionStatus>,
    /// Configured public model versions, and how many of them are unavailable.
    pub versions_total: usize,
    pub versions_unavailable: usize,
    pub backends: Vec<BackendStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct VersionStatus {
    pub model: String,
    pub version: String,
    /// Its share of the requests that name no version, relative to the model's other versions.
    pub weight: u32,
    pub backend: String,
    /// READY or UNAVAILABLE, and why not ready.
    pub state: &'static str,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct BackendStatus {
    pub name: String,
    pub protocol: &'static str,
    pub lb: &'static str,
    pub endpoints: Vec<EndpointStatus>,
}

impl Dispatcher {
    /// The fleet now: model states from the kept readiness (as the repository index has them).
    pub async fn fleet_status(&self) -> FleetStatus {
        let index = self.repository_index(false).await;
        let mut models: Vec<VersionStatus> = self
            .routes
            .routes()
            .iter()
            .zip(index)
            .map(|(route, entry)| VersionStatus {
                model: route.model.clone(),
                version: route.version.clone(),
                weight: route.weight,
                backend: self.backend(route).map(|b| b.name.clone()).unwrap_or_default(),
                state: match entry.state {
                    ModelState::Ready => "READY",
                    _ => "UNAVAILABLE",
                },
                reason: entry.reason,
            })
            .collect();
        let versions_total = models.len();
        // Stable: configured order within each state.
        models.sort_by_key(|version| version.state == "READY");
        let versions_unavailable = models.iter().take_while(|version| version.state != "READY").count();
        models.truncate(LISTED_VERSIONS);
        let backends = self
            .backends
            .iter()
            .map(|backend| BackendStatus {
                name: backend.name.clone(),
                protocol: match backend.config.protocol {
                    crate::config::BackendProtocol::Rest => "rest",
                    crate::config::BackendProtocol::Grpc => "grpc",
                },
                lb: match backend.fleet.policy.lb {
                    crate::config::LoadBalancing::RoundRobin => "round_robin",
                    crate::config::LoadBalancing::LeastRequest => "least_request",
                    crate::config::LoadBalancing::LeastLoad => "least_load",
                    crate::config::LoadBalancing::ConsistentHash => "consistent_hash",
                },
                endpoints: {
                    let fresh = backend
                        .fleet
                        .policy
                        .load
                        .as_ref()
                        .map_or(Duration::ZERO, |load| load.interval * 3);
                    backend.fleet.states.iter().map(|state| state.status(fresh)).collect()
                },
            })
            .collect();
        FleetStatus {
            models,
            versions_total,
            versions_unavailable,
            backends,
        }
    }
}

//! Picking endpoints for a call another proxy carries (`oipgate epp`): the same choice the gateway makes for its own
//! calls, given as an ordered list of addresses, with the picked endpoint's place held until the proxy reports the
//! call's end.

use std::sync::Arc;

use super::Dispatcher;
use super::backend::BackendClients;
use super::fleet::Lease;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::routing::{Affinity, Routed};

/// The endpoints picked for one call, and its place held at the one it went to.
#[derive(Debug)]
pub struct Picked {
    /// `ip:port`, the picked endpoint first, then the fallbacks in order.
    pub endpoints: Vec<Arc<str>>,
    backend: Arc<BackendClients>,
    /// The call's place at the endpoint serving it: in its in-flight count (and its slot, when limited).
    lease: Lease,
}

impl Picked {
    /// The endpoint the call was picked for.
    pub fn picked(&self) -> &Arc<str> {
        &self.endpoints[0]
    }

    /// The endpoint holding the call's place now: the picked one, or the one the proxy reported serving it.
    pub fn serving(&self) -> &Arc<str> {
        self.lease.state.authority.shared()
    }

    /// The proxy reported `served` as the endpoint that served the call. When it is not the picked one, the picked
    /// one failed the proxy's try (an outlier observation, as a failed call of the gateway's own is) and the call's
    /// place moves to `served`. Gives whether the report named the picked endpoint; an endpoint the backend does not
    /// have leaves the place where it is.
    pub fn served(&mut self, served: &str) -> bool {
        if *self.lease.state.authority == *served {
            return true;
        }
        let fleet = &self.backend.fleet;
        if let Some(index) = fleet.states.iter().position(|state| *state.authority == *served) {
            self.lease.observed(true, &fleet.policy);
            self.lease = fleet.hold(index);
        }
        false
    }

    /// Records how the call ended at the endpoint serving it (`failed`: a 5xx or an UNAVAILABLE answer, or none).
    pub fn finished(&self, failed: bool) {
        self.lease.observed(failed, &self.backend.fleet.policy);
    }
}

impl Dispatcher {
    /// Picks the endpoints for an admitted call: the one the gateway would send it to (its sequence's, its sticky
    /// key's, or the least loaded, among those with the model ready and not ejected), then up to `fallbacks` others
    /// with the fewest calls under way (none for a sequence, whose state is on its endpoint). `subset`, when given, is the only endpoints the proxy
    /// will use (`ip:port`, or an address alone for every endpoint there): none of them eligible, or an empty one, is
    /// 503.
    pub async fn pick(&self, routed: &Routed, subset: Option<&[String]>, fallbacks: usize) -> Result<Picked> {
        let route = &routed.route;
        let backend = self
            .backends
            .get(route.backend.index())
            .cloned()
            .ok_or_else(|| Error::internal(format!("no backend {} for a route", route.backend.index())))?;
        let fleet = &backend.fleet;
        let excluded: Vec<usize> = match subset {
            None => Vec::new(),
            Some(subset) => {
                let excluded: Vec<usize> = (0..fleet.states.len())
                    .filter(|&i| !subset_allows(subset, &fleet.states[i].authority))
                    .collect();
                if excluded.len() == fleet.states.len() {
                    return Err(Error::new(
                        ErrorKind::Unavailable,
                        Origin::Gateway,
                        format!(
                            "the subset hint names {} endpoints, none of them an endpoint of backend {} (model \
                             '{}')",
                            subset.len(),
                            backend.name,
                            route.model
                        ),
                    ));
                }
                excluded
            }
        };
        let (model, version) = (&route.upstream_name, &route.upstream_version);
        let lease = fleet
            .lease(&backend.name, (model, version), &routed.affinity, &excluded, None)
            .await
            .map_err(|error| match subset {
                Some(subset) if error.kind() == ErrorKind::Unavailable => Error::new(
                    ErrorKind::Unavailable,
                    Origin::Gateway,
                    format!(
                        "no endpoint of the subset hint ({}) can serve model '{}' version '{}' now; backend {}: {}",
                        subset.join(","),
                        route.model,
                        route.version,
                        backend.name,
                        fleet.why_unavailable(model, version)
                    ),
                ),
                _ => error,
            })?;
        let mut endpoints = vec![lease.state.authority.shared().clone()];
        if fallbacks > 0 && !matches!(routed.affinity, Affinity::Sequence(_)) {
            let mut others = fleet.eligible_except(model, version, &excluded, lease.index);
            others.sort_by_key(|&i| fleet.states[i].in_flight());
            endpoints.extend(
                others
                    .into_iter()
                    .take(fallbacks)
                    .map(|i| fleet.states[i].authority.shared().clone()),
            );
        }
        Ok(Picked {
            endpoints,
            lease,
            backend,
        })
    }

    /// Picks any endpoint of any backend that can take a call, for requests that name no model (server health
    /// and metadata): the backend with one first, in configured order.
    pub fn pick_any(&self, subset: Option<&[String]>) -> Result<Picked> {
        for backend in &self.backends {
            let allowed = |authority: &str| subset.is_none_or(|subset| subset_allows(subset, authority));
            if let Some(index) = backend.fleet.any_available(allowed) {
                let lease = backend.fleet.hold(index);
                return Ok(Picked {
                    endpoints: vec![lease.state.authority.shared().clone()],
                    lease,
                    backend: backend.clone(),
                });
            }
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            Origin::Gateway,
            "no backend has an endpoint that can take calls",
        ))
    }
}

/// Whether a subset hint allows the endpoint at `authority`: an entry is `ip:port`, as the protocol gives it; one
/// naming an address alone allows every endpoint there.
fn subset_allows(subset: &[String], authority: &str) -> bool {
    subset.iter().any(|entry| {
        *entry == *authority
            || (entry.parse::<std::net::IpAddr>().is_ok()
                && authority
                    .rsplit_once(':')
                    .is_some_and(|(host, _)| host.trim_matches(['[', ']']) == entry))
    })
}

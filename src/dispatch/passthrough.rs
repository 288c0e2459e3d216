//! REST inferences proxied to a REST backend unchanged but for their path: where one may go, and sending it (to
//! another endpoint while none could be reached, within the backend's retries and budget).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;

use super::Dispatcher;
use super::backend::{Attempt, Replicas, Tries};
use crate::body::{ChunksBody, OutBody, RelaySource, Relayed};
use crate::dispatch::fleet::Lease;
use crate::error::{Error, Result};
use crate::headers::PassedOn;
use crate::routing::Affinity;
use crate::routing::{Routed, VersionRoute};
use crate::telemetry::metrics::InFlight;
use crate::telemetry::traces::Trace;
use crate::upstream::{BackendBody, Deadline};

/// The terms a REST request is proxied on, unchanged but for its path, to the backend of the route it was given
/// (the route itself stays with the request's [`Routed`], borrowed where it is needed, never counted again).
#[derive(Debug, Clone)]
pub struct Passthrough {
    /// Bound on the backend's answer.
    pub timeout: Duration,
    /// Whether the backend's model name or version differs from the public one (to be put back in the answer).
    pub aliased: bool,
    /// Whether the backend reads compressed request bodies (a compressed one goes to it as it came).
    pub compression: bool,
}

/// A proxied request's body: whole at hand, or relayed from the client as it arrives.
#[derive(Debug, Clone)]
pub enum Outgoing {
    Whole(Bytes),
    Relayed(Arc<RelaySource>),
}

impl Outgoing {
    fn body(&self) -> OutBody {
        match self {
            Outgoing::Whole(body) => ChunksBody::new(vec![body.clone()]).into(),
            Outgoing::Relayed(source) => OutBody::Relayed(Box::new(Relayed::new(source.clone()))),
        }
    }

    /// Whether another attempt can still send it all.
    fn resendable(&self) -> bool {
        match self {
            Outgoing::Whole(_) => true,
            Outgoing::Relayed(source) => source.untouched(),
        }
    }
}

impl Dispatcher {
    /// Where a REST client's inference can be proxied as it is: a REST backend that understands the body
    /// (binary-extension bodies only to backends that speak it). Aliased names are renamed on the way back.
    pub fn rest_passthrough(&self, routed: &Routed, binary_body: bool) -> Result<Option<Passthrough>> {
        let route = &routed.route;
        let backend = self.backend(route)?;
        let Replicas::Rest { binary_data, .. } = &backend.replicas else {
            return Ok(None);
        };
        if binary_body && !binary_data {
            return Ok(None);
        }
        Ok(Some(Passthrough {
            timeout: route.timeout,
            aliased: route.upstream_name != route.model || route.upstream_version != route.version,
            compression: backend.config.compression,
        }))
    }

    /// Counts a proxied call in flight at the backend of `route` until the guard is dropped.
    pub fn passthrough_in_flight(&self, route: &VersionRoute) -> Result<InFlight> {
        Ok(self.backend(route)?.metrics.call())
    }

    /// Sends a proxied request to an endpoint of the backend, and to others while it could not reach one (within the
    /// backend's retries and budget, and while the body can still be sent whole), until `until`. Gives the answer's
    /// head with the place held at the endpoint that answered; an answer of 5xx counts against that endpoint.
    pub async fn passthrough_send(
        &self,
        (route, affinity): (&VersionRoute, &Affinity),
        passed: &PassedOn<'_>,
        body: &Outgoing,
        deadline: Deadline,
        trace: &Trace,
    ) -> Result<(http::Response<BackendBody>, Lease)> {
        let backend = self.backend(route)?;
        let Replicas::Rest { endpoints, .. } = &backend.replicas else {
            return Err(Error::internal("no REST client for a proxied request"));
        };
        let path = self
            .rest_paths
            .get(route.id)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::internal("no REST path for a route"))?;
        // The tries' own headers are only the trace context each carries: the request's are written from where they
        // stand.
        let none = HeaderMap::new();
        let tries = Tries {
            upstream: (&route.upstream_name, &route.upstream_version),
            affinity,
            until: deadline.until,
            began: Some(deadline.began()),
            forward: &none,
            trace,
        };
        backend
            .attempt_holding(
                tries,
                || body.resendable(),
                |Attempt { index, forward, .. }| async move {
                    let client = endpoints
                        .get(index)
                        .ok_or_else(|| Error::internal("no REST client for a proxied request"))?;
                    client
                        .forward(path, &forward, Some(passed), body.body(), deadline)
                        .await
                },
                |response, span| {
                    span.set("http.response.status_code", i64::from(response.status().as_u16()));
                    response.status().is_server_error()
                },
            )
            .await
    }
}

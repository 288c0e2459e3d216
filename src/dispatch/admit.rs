//! The one step between a door and a path: an inference call let in under the guard, routed by its version and
//! sequence, shed when its model's queues are full, noted on its trace and sampled for the payload log.

use std::future::Future;
use std::sync::Arc;

use http::HeaderMap;
use opentelemetry::trace::SpanKind;

use super::{CallContext, Dispatcher};
use crate::error::Result;
use crate::guard::{Admission, Principal};
use crate::protocol::Reserved;
use crate::routing::Routed;
use crate::runtime::ThreadArc;
use crate::telemetry::metrics::RouteMetrics;
use crate::telemetry::payload_log::PayloadLogger;
use crate::telemetry::traces::Trace;

/// One inference call as a door describes it, before it is admitted and routed.
#[derive(Debug, Clone, Copy)]
pub struct CallRequest<'a> {
    /// The public model and version the call names.
    pub model: &'a str,
    pub version: Option<&'a str>,
    /// The end-to-end headers or metadata the call carries (the sticky header, `traceparent`, ...).
    pub forward: &'a HeaderMap,
    /// Who is calling, when `[auth]` asks.
    pub principal: Option<&'a Principal>,
    /// What of the call's admission the door took already.
    pub taken: Taken,
    /// A `generate` or `generate_stream` call: held to the token budgets and charged the tokens its answer carries.
    pub generates: bool,
    /// The request's span: routing is a step of it.
    pub trace: &'a Trace,
}

/// What of a call's admission its door took before handing it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// Nothing: the call is let in under every limit here.
    Nothing,
    /// The principal's own rate: the gRPC door takes it before reading the message that names the model.
    PrincipalRate,
    /// The whole admission, which the door holds for the call's life (a REST streaming call translated onto an
    /// inference stream): the call is routed only, neither let in under the limits again nor sampled again for
    /// the payload log.
    Everything,
}

/// A call let in and routed: what every path needs, held for the call's life.
#[derive(Debug)]
pub struct AdmittedCall {
    pub routed: Routed,
    /// The call's place among its model's calls under way, given back when dropped.
    pub admission: Admission,
    /// What the call's own parameters ask of the gateway (its sequence, `timeout` and `priority`).
    pub reserved: Reserved,
    /// Where the call's payloads go, when its model's are logged and this call is sampled.
    pub payload_log: Option<Arc<PayloadLogger>>,
}

impl Dispatcher {
    /// Admits and routes one inference call. The principal is authorised for the model the call names and let in
    /// under the principal's and the model's limits before anything else is read; then `start` gives what the call's
    /// parameters ask (for a REST call it reads the body's start) with whatever else the door needs of it; then the
    /// call is routed, shed past the model's `max_queue`, noted on its trace and sampled for the payload log.
    ///
    /// The counters to record the call under come back whatever the outcome: the served version's, or the fixed
    /// `_unknown` ones for a model or version not configured, so a client cannot create series.
    pub async fn admit<T>(
        &self,
        call: &CallRequest<'_>,
        start: impl Future<Output = Result<(T, Reserved)>>,
    ) -> (Result<(AdmittedCall, T)>, ThreadArc<RouteMetrics>) {
        // Refused by the name it gives, whether or not that model exists.
        let admission = match (self.guard.authorize(call.principal, call.model), call.taken) {
            (Err(error), _) => Err(error),
            (Ok(()), Taken::Everything) => Ok(Admission::held_by_door()),
            (Ok(()), Taken::PrincipalRate) => self.guard.admit_model(call.principal, call.model, call.generates).await,
            (Ok(()), Taken::Nothing) => self.guard.admit(call.principal, call.model, call.generates).await,
        };
        let admission = match admission {
            Ok(admission) => admission,
            Err(error) => return (Err(error), self.route(call.model, call.version, call.forward, None).1),
        };
        let started = start.await;
        let sequence = started
            .as_ref()
            .ok()
            .and_then(|(_, reserved)| reserved.sequence.clone());
        // A call its door admitted was shed, noted on its trace and sampled there: it is only routed here.
        let routing =
            (call.taken != Taken::Everything).then(|| call.trace.child("route", SpanKind::Internal, Vec::new));
        let (routed, metrics) = self.route(call.model, call.version, call.forward, sequence);
        let admitted = routed.and_then(|routed| {
            let (value, reserved) = started?;
            let mut payload_log = None;
            if let Some(routing) = &routing {
                self.shed(&routed.route, reserved.priority)?;
                self.note_route(routing, call.trace, &routed.route);
                payload_log = self.payload_log(&routed.route).cloned();
            }
            let admitted = AdmittedCall {
                routed,
                admission,
                reserved,
                payload_log,
            };
            Ok((admitted, value))
        });
        (admitted, metrics)
    }

    /// [`Self::admit`] for a call whose parameters are at hand, described by its context: the convenience forms of
    /// inference and each request of a stream.
    pub(super) async fn admit_with(
        &self,
        model: &str,
        version: Option<&str>,
        context: &CallContext,
        reserved: Result<Reserved>,
    ) -> Result<AdmittedCall> {
        let call = CallRequest {
            model,
            version,
            forward: &context.forward,
            principal: context.principal.as_deref(),
            taken: if context.admitted_by_door {
                Taken::Everything
            } else {
                Taken::Nothing
            },
            generates: false,
            trace: &context.trace,
        };
        let (admitted, _) = self
            .admit(&call, async { reserved.map(|reserved| ((), reserved)) })
            .await;
        admitted.map(|(admitted, ())| admitted)
    }
}

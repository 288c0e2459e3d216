//! Who may call what, how fast and how many at once: principals from API keys and JWTs, each one's models and admin
//! scope, token buckets per principal and per model, and each model's calls under way. Both doors ask here before
//! reading a request's body; the answer is a principal and an admission that is held until the call is answered.

mod jwt;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};
use http::{HeaderMap, HeaderName};
use subtle::ConstantTimeEq;

pub use jwt::JwtKeys;

use crate::config::{Config, ModelScope, Rate};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::telemetry::ReportedPrincipal;
use crate::telemetry::metrics::{Metrics, OTHER_PRINCIPAL};

/// The header carrying an API key, besides `Authorization: Bearer`.
pub const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

type Limiter = RateLimiter<
    governor::state::NotKeyed,
    governor::state::InMemoryState,
    DefaultClock,
    governor::middleware::NoOpMiddleware<<DefaultClock as Clock>::Instant>,
>;

/// One token bucket per token principal, keyed by the principal's name.
type KeyedLimiter = RateLimiter<
    String,
    governor::state::keyed::HashMapStateStore<String>,
    DefaultClock,
    governor::middleware::NoOpMiddleware<<DefaultClock as Clock>::Instant>,
>;

/// How many checks of the token principals' buckets pass between two sweeps of the buckets that are full again.
const PRINCIPAL_SWEEP_EVERY: u32 = 4096;

/// The quota of `rate`: one token every 1/per_second, `burst` at most.
fn quota(rate: Rate) -> Quota {
    let period = Duration::from_secs_f64(1.0 / rate.per_second).max(Duration::from_nanos(1));
    Quota::with_period(period)
        .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
        .allow_burst(rate.burst)
}

/// A bucket of `[auth.jwt] rate` for each principal the tokens name, made at its first call. Buckets that have
/// filled up again are forgotten now and then (a forgotten bucket is a full one), so the table holds the recent
/// callers only. Kept across reloads that keep the rate.
#[derive(Debug)]
struct PrincipalBuckets {
    rate: Rate,
    limiter: KeyedLimiter,
    checks: AtomicU32,
}

impl PrincipalBuckets {
    fn kept(rate: Rate, previous: Option<&Arc<PrincipalBuckets>>, clock: &DefaultClock) -> Arc<PrincipalBuckets> {
        match previous {
            Some(buckets) if buckets.rate == rate => buckets.clone(),
            _ => Arc::new(PrincipalBuckets {
                rate,
                limiter: RateLimiter::hashmap_with_clock(quota(rate), clock.clone()),
                checks: AtomicU32::new(0),
            }),
        }
    }

    /// Takes a token from `principal`'s bucket, or says how long until one is there.
    fn take(&self, principal: &str, clock: &DefaultClock) -> Result<(), Duration> {
        if self.checks.fetch_add(1, Ordering::Relaxed) % PRINCIPAL_SWEEP_EVERY == PRINCIPAL_SWEEP_EVERY - 1 {
            self.limiter.retain_recent();
        }
        self.limiter
            .check_key(&principal.to_owned())
            .map_err(|not_until| not_until.wait_time_from(clock.now()))
    }
}

/// A token bucket with the rate it was made for, so a reload that keeps the rate keeps the bucket.
#[derive(Debug)]
struct Bucket {
    rate: Rate,
    limiter: Limiter,
}

impl Bucket {
    fn new(rate: Rate, clock: &DefaultClock) -> Arc<Bucket> {
        Arc::new(Bucket {
            rate,
            limiter: RateLimiter::direct_with_clock(quota(rate), clock.clone()),
        })
    }

    /// The bucket for `rate`: the previous one when its rate is the same (its tokens carry over), else a new one.
    fn kept(rate: Rate, previous: Option<&Arc<Bucket>>, clock: &DefaultClock) -> Arc<Bucket> {
        match previous {
            Some(bucket) if bucket.rate == rate => bucket.clone(),
            _ => Bucket::new(rate, clock),
        }
    }

    /// Takes a token, or says how long until one is there.
    fn take(&self, clock: &DefaultClock) -> Result<(), Duration> {
        self.limiter
            .check()
            .map_err(|not_until| not_until.wait_time_from(clock.now()))
    }
}

/// Who is calling: a configured API key's name, or a JWT's principal claim.
#[derive(Debug)]
pub struct Principal {
    name: String,
    /// A configured key's position among the keys: its requests are counted under its own name. The rest (JWT
    /// principals) are counted under one label.
    counted: Option<usize>,
    models: Arc<ModelScope>,
    admin: bool,
    bucket: Option<Arc<Bucket>>,
}

impl Principal {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `principal` label of the request counter: bounded to configured principals.
    pub fn label(&self) -> &str {
        if self.counted.is_some() {
            &self.name
        } else {
            OTHER_PRINCIPAL
        }
    }

    /// The position of its key among the configured keys, when it is counted under its own name.
    pub fn counted(&self) -> Option<usize> {
        self.counted
    }

    /// Whether the principal may use the public model `model`.
    pub fn may_use(&self, model: &str) -> bool {
        self.models.allows(model)
    }
}

impl ReportedPrincipal for Principal {
    fn name(&self) -> &str {
        &self.name
    }

    fn counted(&self) -> Option<usize> {
        self.counted
    }
}

/// A configured API key: its digest and the principal it makes.
#[derive(Debug)]
struct Key {
    sha256: [u8; 32],
    principal: Arc<Principal>,
}

/// A model's limits and the state they count with.
#[derive(Debug)]
struct ModelGate {
    bucket: Option<Arc<Bucket>>,
    max_concurrent: Option<NonZeroU32>,
    /// Calls of this model under way; shared with the previous configuration's gate, so a reload keeps counting the
    /// calls that began before it.
    under_way: Arc<AtomicU32>,
}

/// A call let in: it holds its place among the model's calls under way until dropped.
#[derive(Debug)]
pub struct Admission {
    under_way: Option<Arc<AtomicU32>>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(count) = &self.under_way {
            count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Why a call was refused, as `oipgate_auth_denied_total{reason}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// No credential.
    Missing,
    /// A credential that is no key and no valid token.
    Invalid,
    /// A principal calling a model it may not use, or an admin call without admin.
    Forbidden,
}

impl Denied {
    pub fn label(self) -> &'static str {
        match self {
            Denied::Missing => "missing",
            Denied::Invalid => "invalid",
            Denied::Forbidden => "forbidden",
        }
    }
}

/// Whose bucket refused a call, as `oipgate_rate_limited_total{scope}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    Principal,
    Model,
    Concurrency,
    /// Every endpoint serving the model reports more than its `max_queue` waiting.
    Queue,
}

impl Limited {
    pub fn label(self) -> &'static str {
        match self {
            Limited::Principal => "principal",
            Limited::Model => "model",
            Limited::Concurrency => "concurrency",
            Limited::Queue => "queue",
        }
    }
}

/// The access rules of one configuration.
#[derive(Debug)]
pub struct Guard {
    /// `None`: no `[auth]`, everyone may call everything.
    auth: Option<Authenticator>,
    models: HashMap<String, ModelGate>,
    clock: DefaultClock,
    metrics: Arc<Metrics>,
}

#[derive(Debug)]
struct Authenticator {
    keys: Vec<Key>,
    jwt: Option<(crate::config::Jwt, Arc<JwtKeys>)>,
    /// Each token principal's bucket, when `[auth.jwt] rate` says.
    jwt_buckets: Option<Arc<PrincipalBuckets>>,
    forward_credentials: bool,
}

impl Guard {
    /// The rules of `config`, with the JWT issuer's keys `jwt_keys` (read with the configuration's other files).
    /// Buckets whose principal or model and rate are unchanged from `previous` keep their tokens, and each model
    /// keeps counting its calls under way.
    pub fn new(
        config: &Config,
        jwt_keys: Option<Arc<JwtKeys>>,
        previous: Option<&Guard>,
        metrics: Arc<Metrics>,
    ) -> Guard {
        let clock = previous.map_or_else(DefaultClock::default, |p| p.clock.clone());
        let previous_principal = |name: &str| {
            previous
                .and_then(|p| p.auth.as_ref())
                .and_then(|auth| auth.keys.iter().find(|key| key.principal.name == name))
                .and_then(|key| key.principal.bucket.as_ref())
        };
        let auth = config.auth.as_ref().map(|auth| Authenticator {
            keys: auth
                .api_keys
                .iter()
                .enumerate()
                .map(|(index, key)| Key {
                    sha256: key.sha256,
                    principal: Arc::new(Principal {
                        name: key.name.clone(),
                        counted: Some(index),
                        models: Arc::new(key.models.clone()),
                        admin: key.admin,
                        bucket: key
                            .rate
                            .map(|rate| Bucket::kept(rate, previous_principal(&key.name), &clock)),
                    }),
                })
                .collect(),
            jwt_buckets: auth.jwt.as_ref().and_then(|jwt| jwt.rate).map(|rate| {
                let before = previous
                    .and_then(|p| p.auth.as_ref())
                    .and_then(|auth| auth.jwt_buckets.as_ref());
                PrincipalBuckets::kept(rate, before, &clock)
            }),
            jwt: auth.jwt.clone().zip(jwt_keys),
            forward_credentials: auth.forward_credentials,
        });
        // Only models with limits have a gate: a call of any other model looks in an empty map, which costs nothing.
        let models = config
            .models()
            .iter()
            .filter(|model| model.limits.rate.is_some() || model.limits.max_concurrent.is_some())
            .map(|model| {
                let before = previous.and_then(|p| p.models.get(&model.name));
                let gate = ModelGate {
                    bucket: model
                        .limits
                        .rate
                        .map(|rate| Bucket::kept(rate, before.and_then(|b| b.bucket.as_ref()), &clock)),
                    max_concurrent: model.limits.max_concurrent,
                    under_way: before.map_or_else(Arc::default, |b| b.under_way.clone()),
                };
                (model.name.clone(), gate)
            })
            .collect();
        Guard {
            auth,
            models,
            clock,
            metrics,
        }
    }

    /// The JWT issuer's keys in use, for a rebuild that does not read them again.
    pub fn jwt_keys(&self) -> Option<Arc<JwtKeys>> {
        self.auth.as_ref()?.jwt.as_ref().map(|(_, keys)| keys.clone())
    }

    /// Whether calls need a principal.
    pub fn is_on(&self) -> bool {
        self.auth.is_some()
    }

    /// The caller named by `headers` (`Authorization: Bearer`, or `x-api-key`): `None` when no `[auth]` is
    /// configured; refused when a credential is missing or not valid. The error never repeats the credential.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Arc<Principal>>> {
        self.authenticated(headers)
            .map_err(|(denied, error)| self.denied(denied, error))
    }

    fn authenticated(&self, headers: &HeaderMap) -> Result<Option<Arc<Principal>>, (Denied, Error)> {
        let Some(auth) = &self.auth else {
            return Ok(None);
        };
        let credential = credential(headers).ok_or_else(|| {
            (
                Denied::Missing,
                unauthenticated("no credential: send `Authorization: Bearer <API key or token>` or `x-api-key`"),
            )
        })?;
        if let Some((settings, keys)) = &auth.jwt
            && jwt::looks_like_jwt(credential)
        {
            return keys.verify(credential, settings).map(Some).map_err(|why| {
                (
                    Denied::Invalid,
                    unauthenticated(format!("the token is not valid: {why}")),
                )
            });
        }
        let digest = ring::digest::digest(&ring::digest::SHA256, credential.as_bytes());
        // Every key is compared, in constant time, so the time taken says nothing about which came close.
        let mut found = None;
        for key in &auth.keys {
            if bool::from(key.sha256.ct_eq(digest.as_ref())) {
                found = Some(&key.principal);
            }
        }
        found
            .cloned()
            .map(Some)
            .ok_or_else(|| (Denied::Invalid, unauthenticated("the API key is not valid")))
    }

    /// Refuses a principal that may not use `model`, whether or not the model exists (a caller cannot probe for
    /// names it may not use).
    pub fn authorize(&self, principal: Option<&Principal>, model: &str) -> Result<()> {
        match principal {
            Some(principal) if !principal.may_use(model) => Err(self.denied(
                Denied::Forbidden,
                Error::new(
                    ErrorKind::PermissionDenied,
                    Origin::Client,
                    format!("principal '{}' may not use model '{model}'", principal.name),
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Refuses a principal without admin scope; with no `[auth]` everyone is admin.
    pub fn authorize_admin(&self, principal: Option<&Principal>, what: &str) -> Result<()> {
        match principal {
            Some(principal) if !principal.admin => Err(self.denied(
                Denied::Forbidden,
                Error::new(
                    ErrorKind::PermissionDenied,
                    Origin::Client,
                    format!("{what} needs admin; principal '{}' is not", principal.name),
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Whether a listing shows `model` to `principal`.
    pub fn shows(&self, principal: Option<&Principal>, model: &str) -> bool {
        principal.is_none_or(|p| p.may_use(model))
    }

    /// Lets a call of `model` in under the principal's and the model's buckets and the model's bound on calls
    /// under way; refused with 429 / RESOURCE_EXHAUSTED and when to come back. A model without limits (or one the
    /// configuration does not have) is only held to the principal's.
    pub fn admit(&self, principal: Option<&Principal>, model: &str) -> Result<Admission> {
        self.admit_principal(principal)?;
        self.admit_model(model)
    }

    /// The principal's bucket alone: for a call whose model is not known until its body is read (a gRPC message
    /// names it), so a principal over its rate is refused before that.
    pub fn admit_principal(&self, principal: Option<&Principal>) -> Result<()> {
        let Some(principal) = principal else { return Ok(()) };
        let jwt_buckets = self.auth.as_ref().and_then(|auth| auth.jwt_buckets.as_ref());
        let taken = match (&principal.bucket, principal.counted, jwt_buckets) {
            (Some(bucket), _, _) => bucket.take(&self.clock),
            // A token's principal (not a configured key) takes from its own bucket of `[auth.jwt] rate`.
            (None, None, Some(buckets)) => buckets.take(&principal.name, &self.clock),
            _ => return Ok(()),
        };
        taken.map_err(|wait| {
            self.limited(
                Limited::Principal,
                format!("principal '{}' is over its rate limit", principal.name),
                wait,
            )
        })
    }

    /// The model's bucket and its bound on calls under way.
    pub fn admit_model(&self, model: &str) -> Result<Admission> {
        let Some(gate) = self.models.get(model) else {
            return Ok(Admission { under_way: None });
        };
        if let Some(bucket) = &gate.bucket {
            bucket.take(&self.clock).map_err(|wait| {
                self.limited(Limited::Model, format!("model '{model}' is over its rate limit"), wait)
            })?;
        }
        let Some(max) = gate.max_concurrent else {
            return Ok(Admission { under_way: None });
        };
        let taken = gate.under_way.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max.get()).then_some(n + 1)
        });
        match taken {
            Ok(_) => Ok(Admission {
                under_way: Some(gate.under_way.clone()),
            }),
            Err(_) => Err(self.limited(
                Limited::Concurrency,
                format!("model '{model}' has its {max} calls under way (max_concurrent)"),
                Duration::from_secs(1),
            )),
        }
    }

    /// Counts a call refused by a limit: 429 / RESOURCE_EXHAUSTED, telling the client when to come back.
    fn limited(&self, limited: Limited, message: String, wait: Duration) -> Error {
        self.metrics.rate_limited(limited.label());
        Error::new(ErrorKind::Overloaded, Origin::Client, message).with_retry_after(wait)
    }

    fn denied(&self, denied: Denied, error: Error) -> Error {
        self.metrics.auth_denied(denied.label());
        error
    }

    /// Takes the client's credentials out of what goes to the backend, unless the configuration forwards them.
    pub fn strip_credentials(&self, forward: &mut HeaderMap) {
        if self.auth.as_ref().is_some_and(|auth| !auth.forward_credentials) {
            forward.remove(http::header::AUTHORIZATION);
            forward.remove(API_KEY);
        }
    }
}

/// The credential a request carries: a bearer token, else an `x-api-key`.
fn credential(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| {
            let (scheme, token) = value.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|token| !token.is_empty());
    bearer.or_else(|| {
        headers
            .get(API_KEY)
            .and_then(|value| value.to_str().ok())
            .map(str::trim)
            .filter(|key| !key.is_empty())
    })
}

fn unauthenticated(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Unauthenticated, Origin::Client, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configuration with one key (sha256 of "k") rated at `key_rate` and a model rated at `model_rate`.
    fn config(key_rate: &str, model_rate: &str) -> Config {
        let text = format!(
            r#"
[auth]
[[auth.api_keys]]
name = "team"
sha256 = "8254c329a92850f6d539dd376f4816ee2764517da5e0235514af433164480d7a"
models = ["*"]
rate = {key_rate}
[[backends]]
name = "b"
protocol = "rest"
endpoints = ["127.0.0.1:9000"]
[[models]]
name = "m"
versions = [ {{ version = "1", backend = "b" }} ]
rate = {model_rate}
max_concurrent = 1
"#
        );
        crate::config::validate(crate::config::raw::parse(&text, &[]).unwrap()).unwrap()
    }

    fn headers(key: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(API_KEY, key.parse().unwrap());
        headers
    }

    #[test]
    fn a_reload_keeps_the_buckets_and_the_count_of_calls_under_way_that_did_not_change() {
        let metrics = Metrics::new().unwrap();
        let slow = "{ per_second = 0.001, burst = 1 }";
        let guard = Guard::new(
            &config(slow, "{ per_second = 1000.0, burst = 1000 }"),
            None,
            None,
            metrics.clone(),
        );
        let team = guard.authenticate(&headers("k")).unwrap();
        assert!(guard.authenticate(&headers("not k")).is_err());
        let held = guard.admit(team.as_deref(), "m").unwrap();
        assert_eq!(
            guard.admit(team.as_deref(), "m").unwrap_err().kind(),
            ErrorKind::Overloaded
        );

        // Same rates: the principal's bucket is still empty, and the model's call under way still counts.
        let reloaded = Guard::new(
            &config(slow, "{ per_second = 1000.0, burst = 1000 }"),
            None,
            Some(&guard),
            metrics.clone(),
        );
        let team = reloaded.authenticate(&headers("k")).unwrap();
        let refused = reloaded.admit(team.as_deref(), "m").unwrap_err();
        assert!(refused.message().contains("principal 'team'"), "{refused:?}");
        let other = reloaded.admit(None, "m").unwrap_err();
        assert!(other.message().contains("max_concurrent"), "{other:?}");
        drop(held);
        assert!(reloaded.admit(None, "m").is_ok());

        // A new rate is a new bucket.
        let changed = Guard::new(
            &config(
                "{ per_second = 1.0, burst = 5 }",
                "{ per_second = 1000.0, burst = 1000 }",
            ),
            None,
            Some(&reloaded),
            metrics,
        );
        let team = changed.authenticate(&headers("k")).unwrap();
        assert!(changed.admit(team.as_deref(), "m").is_ok());
    }
}

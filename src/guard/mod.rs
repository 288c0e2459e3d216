//! Who may call what, how fast and how many at once: principals from API keys and JWTs, each one's models and admin
//! scope, token buckets per principal and per model, and each model's calls under way. Both doors ask here before
//! reading a request's body; the answer is a principal and an admission that is held until the call is answered.

mod buckets;
mod gcra;
mod jwt;
pub mod shared;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use governor::clock::DefaultClock;
use http::{HeaderMap, HeaderName};
use subtle::ConstantTimeEq;

pub use buckets::TokenMeter;
use buckets::{Bucket, BucketOf, PrincipalBuckets, PrincipalBudgets, TokenBudget, TokenCharge};
pub use jwt::JwtKeys;
use shared::SharedStore;

use crate::config::{Config, ModelScope, TokenCount};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::protocol::ByName;
use crate::telemetry::ReportedPrincipal;
use crate::telemetry::metrics::{Metrics, OTHER_PRINCIPAL};

/// The header carrying an API key, besides `Authorization: Bearer`.
pub const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

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
    /// Its budget of generated tokens, for a configured key with `tokens_per_minute`.
    tokens: Option<Arc<TokenBudget>>,
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
    tokens: Option<Arc<TokenBudget>>,
    max_concurrent: Option<NonZeroU32>,
    /// Calls of this model under way; shared with the previous configuration's gate, so a reload keeps counting the
    /// calls that began before it.
    under_way: Arc<AtomicU32>,
}

/// A call let in: it holds its place among the model's calls under way until dropped, and charges the tokens its
/// answer carried to the budgets it was let in under.
#[derive(Debug, Default)]
pub struct Admission {
    under_way: Option<Arc<AtomicU32>>,
    tokens: Option<TokenCharge>,
}

impl Admission {
    /// The admission of a call whose door holds the one that counts: it holds nothing and charges nothing.
    pub fn held_by_door() -> Admission {
        Admission {
            under_way: None,
            tokens: None,
        }
    }

    /// Where a `generate` answer's tokens are counted, when the call is under a token budget.
    pub fn token_meter(&self) -> Option<&TokenMeter> {
        self.tokens.as_ref().map(|charge| &charge.meter)
    }
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
    /// A principal's budget of generated tokens is spent.
    PrincipalTokens,
    /// A model's budget of generated tokens is spent.
    ModelTokens,
    Concurrency,
    /// Every endpoint serving the model reports more than its `max_queue` waiting.
    Queue,
}

impl Limited {
    pub fn label(self) -> &'static str {
        match self {
            Limited::Principal => "principal",
            Limited::Model => "model",
            Limited::PrincipalTokens => "principal_tokens",
            Limited::ModelTokens => "model_tokens",
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
    models: ByName<ModelGate>,
    /// How each model's generated tokens are counted, for the models that say.
    token_counts: ByName<Arc<TokenCount>>,
    /// How the other models' tokens are counted (every output's elements), made once.
    default_token_count: Arc<TokenCount>,
    /// The Redis the limits are shared through, with `[limits.shared]`.
    shared: Option<Arc<SharedStore>>,
    clock: DefaultClock,
    metrics: Arc<Metrics>,
}

#[derive(Debug)]
struct Authenticator {
    keys: Vec<Key>,
    jwt: Option<(crate::config::Jwt, Arc<JwtKeys>)>,
    /// Each token principal's bucket, when `[auth.jwt] rate` says.
    jwt_buckets: Option<Arc<PrincipalBuckets>>,
    /// Each token principal's budget of generated tokens, when `[auth.jwt] rate` says.
    jwt_budgets: Option<Arc<PrincipalBudgets>>,
    forward_credentials: bool,
}

impl Guard {
    /// The rules of `config`, with the JWT issuer's keys `jwt_keys` (read with the configuration's other files) and
    /// the Redis its limits are shared through. Buckets whose principal or model, rate and store are unchanged from
    /// `previous` keep their tokens, and each model keeps counting its calls under way.
    pub fn new(
        config: &Config,
        jwt_keys: Option<Arc<JwtKeys>>,
        shared: Option<Arc<SharedStore>>,
        previous: Option<&Guard>,
        metrics: Arc<Metrics>,
    ) -> Guard {
        let clock = previous.map_or_else(DefaultClock::default, |p| p.clock.clone());
        let store = shared.as_ref();
        let previous_auth = previous.and_then(|p| p.auth.as_ref());
        let previous_principal =
            |name: &str| previous_auth.and_then(|auth| auth.keys.iter().find(|key| key.principal.name == name));
        let auth = config.auth.as_ref().map(|auth| Authenticator {
            keys: auth
                .api_keys
                .iter()
                .enumerate()
                .map(|(index, key)| {
                    let before = previous_principal(&key.name).map(|key| &key.principal);
                    let of = |rate| BucketOf {
                        rate,
                        store,
                        scope: "principal",
                        name: &key.name,
                    };
                    Key {
                        sha256: key.sha256,
                        principal: Arc::new(Principal {
                            name: key.name.clone(),
                            counted: Some(index),
                            models: Arc::new(key.models.clone()),
                            admin: key.admin,
                            bucket: key
                                .rate
                                .calls
                                .map(|rate| Bucket::kept(of(rate), before.and_then(|p| p.bucket.as_ref()), &clock)),
                            tokens: key.rate.tokens.map(|rate| {
                                let kept = before.and_then(|p| p.tokens.as_ref());
                                TokenBudget::kept(rate, store, "principal", &key.name, kept)
                            }),
                        }),
                    }
                })
                .collect(),
            jwt_buckets: auth.jwt.as_ref().and_then(|jwt| jwt.rate.calls).map(|rate| {
                let before = previous_auth.and_then(|auth| auth.jwt_buckets.as_ref());
                PrincipalBuckets::kept(rate, store, before, &clock)
            }),
            jwt_budgets: auth.jwt.as_ref().and_then(|jwt| jwt.rate.tokens).map(|rate| {
                let before = previous_auth.and_then(|auth| auth.jwt_budgets.as_ref());
                PrincipalBudgets::kept(rate, store, before)
            }),
            jwt: auth.jwt.clone().zip(jwt_keys),
            forward_credentials: auth.forward_credentials,
        });
        // Only models with limits have a gate: a call of any other model looks in an empty map, which costs nothing.
        let models = config
            .models()
            .iter()
            .filter(|model| {
                let rate = &model.limits.rate;
                rate.calls.is_some() || rate.tokens.is_some() || model.limits.max_concurrent.is_some()
            })
            .map(|model| {
                let before = previous.and_then(|p| p.models.get(&model.name));
                let of = |rate| BucketOf {
                    rate,
                    store,
                    scope: "model",
                    name: &model.name,
                };
                let gate = ModelGate {
                    bucket: model
                        .limits
                        .rate
                        .calls
                        .map(|rate| Bucket::kept(of(rate), before.and_then(|b| b.bucket.as_ref()), &clock)),
                    tokens: model.limits.rate.tokens.map(|rate| {
                        let kept = before.and_then(|b| b.tokens.as_ref());
                        TokenBudget::kept(rate, store, "model", &model.name, kept)
                    }),
                    max_concurrent: model.limits.max_concurrent,
                    under_way: before.map_or_else(Arc::default, |b| b.under_way.clone()),
                };
                (model.name.clone(), gate)
            })
            .collect();
        let token_counts = config
            .models()
            .iter()
            .filter(|model| model.tokens != TokenCount::default())
            .map(|model| (model.name.clone(), Arc::new(model.tokens.clone())))
            .collect();
        Guard {
            auth,
            models,
            token_counts,
            default_token_count: Arc::default(),
            shared,
            clock,
            metrics,
        }
    }

    /// The Redis the limits are shared through, for a rebuild that keeps it.
    pub fn shared(&self) -> Option<&Arc<SharedStore>> {
        self.shared.as_ref()
    }

    /// The JWT issuer's keys in use, for a rebuild that does not read them again.
    pub fn jwt_keys(&self) -> Option<Arc<JwtKeys>> {
        self.auth.as_ref()?.jwt.as_ref().map(|(_, keys)| keys.clone())
    }

    /// The caller named by `headers` (`Authorization: Bearer`, or `x-api-key`): `None` when no `[auth]` is
    /// configured; refused when a credential is missing or not valid. The error never repeats the credential.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Arc<Principal>>> {
        self.authenticated(headers)
            .map_err(|(denied, error)| self.denied(denied, error))
    }

    /// A door's call's caller, as [`Self::authenticate`] names it, its credential then taken out of `headers` (what
    /// goes to the backend) unless the configuration forwards it; `None`, and `headers` left as they are, when no
    /// `[auth]` is configured or the call is `open` (a health probe).
    pub fn caller(&self, headers: &mut HeaderMap, open: bool) -> Result<Option<Arc<Principal>>> {
        if self.auth.is_none() || open {
            return Ok(None);
        }
        let principal = self.authenticate(headers)?;
        self.strip_credentials(headers);
        Ok(principal)
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

    /// The models held to a `max_concurrent`: each one's calls under way, and its bound.
    pub fn under_way(&self) -> impl Iterator<Item = (&str, u32, NonZeroU32)> {
        self.models.iter().filter_map(|(model, gate)| {
            gate.max_concurrent
                .map(|max| (model.as_str(), gate.under_way.load(Ordering::Acquire), max))
        })
    }

    /// Sets the metrics' gauges of calls under way to [`Self::under_way`]'s: read as the metrics are scraped, so a
    /// call pays nothing for them.
    pub fn publish_under_way(&self) {
        self.metrics
            .models_under_way(self.under_way().map(|(model, calls, _)| (model, calls)));
    }

    /// Lets a call of `model` in under the principal's and the model's buckets, their token budgets when the call
    /// `generates` (a budget is charged when the answer ends), and the model's bound on calls under way; refused with
    /// 429 / RESOURCE_EXHAUSTED and when to come back. A model without limits (or one the configuration does not
    /// have) is only held to the principal's.
    pub async fn admit(&self, principal: Option<&Principal>, model: &str, generates: bool) -> Result<Admission> {
        self.admit_principal(principal).await?;
        self.admit_model(principal, model, generates).await
    }

    /// The principal's bucket alone: for a call whose model is not known until its body is read (a gRPC message
    /// names it), so a principal over its rate is refused before that.
    pub async fn admit_principal(&self, principal: Option<&Principal>) -> Result<()> {
        let Some(principal) = principal else { return Ok(()) };
        let jwt_buckets = self.auth.as_ref().and_then(|auth| auth.jwt_buckets.as_ref());
        let taken = match (&principal.bucket, principal.counted, jwt_buckets) {
            (Some(bucket), _, _) => bucket.take(&self.clock).await,
            // A token's principal (not a configured key) takes from its own bucket of `[auth.jwt] rate`.
            (None, None, Some(buckets)) => buckets.take(&principal.name, &self.clock).await,
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

    /// The model's bucket, the token budgets of a call that generates, and the model's bound on calls under way.
    pub async fn admit_model(&self, principal: Option<&Principal>, model: &str, generates: bool) -> Result<Admission> {
        let gate = self.models.get(model);
        if let Some(bucket) = gate.and_then(|gate| gate.bucket.as_ref()) {
            bucket.take(&self.clock).await.map_err(|wait| {
                self.limited(Limited::Model, format!("model '{model}' is over its rate limit"), wait)
            })?;
        }
        let tokens = if generates {
            self.token_charge(principal, gate, model).await?
        } else {
            None
        };
        let Some(max) = gate.and_then(|gate| gate.max_concurrent) else {
            return Ok(Admission {
                under_way: None,
                tokens,
            });
        };
        let under_way = &gate.expect("a gate holds max_concurrent").under_way;
        let taken = under_way.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max.get()).then_some(n + 1)
        });
        match taken {
            Ok(_) => Ok(Admission {
                under_way: Some(under_way.clone()),
                tokens,
            }),
            Err(_) => Err(self.limited(
                Limited::Concurrency,
                format!("model '{model}' has its {max} calls under way (max_concurrent)"),
                Duration::from_secs(1),
            )),
        }
    }

    /// The token budgets a generating call is let in under (refused while one is spent) and will be charged to.
    async fn token_charge(
        &self,
        principal: Option<&Principal>,
        gate: Option<&ModelGate>,
        model: &str,
    ) -> Result<Option<TokenCharge>> {
        let jwt_budgets = self.auth.as_ref().and_then(|auth| auth.jwt_budgets.as_ref());
        let principal_budget =
            principal.and_then(|principal| match (&principal.tokens, principal.counted, jwt_budgets) {
                (Some(budget), _, _) => Some(budget.clone()),
                (None, None, Some(budgets)) => Some(budgets.budget(&principal.name)),
                _ => None,
            });
        if let (Some(budget), Some(principal)) = (&principal_budget, principal) {
            budget.check().await.map_err(|wait| {
                self.limited(
                    Limited::PrincipalTokens,
                    format!(
                        "principal '{}' has spent its token budget (tokens_per_minute)",
                        principal.name
                    ),
                    wait,
                )
            })?;
        }
        let model_budget = gate.and_then(|gate| gate.tokens.clone());
        if let Some(budget) = &model_budget {
            budget.check().await.map_err(|wait| {
                self.limited(
                    Limited::ModelTokens,
                    format!("model '{model}' has spent its token budget (tokens_per_minute)"),
                    wait,
                )
            })?;
        }
        let budgets: Vec<_> = principal_budget.into_iter().chain(model_budget).collect();
        if budgets.is_empty() {
            return Ok(None);
        }
        let count = self
            .token_counts
            .get(model)
            .unwrap_or(&self.default_token_count)
            .clone();
        Ok(Some(TokenCharge::new(budgets, count)))
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

    #[tokio::test]
    async fn a_reload_keeps_the_buckets_and_the_count_of_calls_under_way_that_did_not_change() {
        let metrics = Metrics::new().unwrap();
        let slow = "{ per_second = 0.001, burst = 1 }";
        let guard = Guard::new(
            &config(slow, "{ per_second = 1000.0, burst = 1000 }"),
            None,
            None,
            None,
            metrics.clone(),
        );
        let team = guard.authenticate(&headers("k")).unwrap();
        assert!(guard.authenticate(&headers("not k")).is_err());
        let held = guard.admit(team.as_deref(), "m", false).await.unwrap();
        assert_eq!(
            guard.admit(team.as_deref(), "m", false).await.unwrap_err().kind(),
            ErrorKind::Overloaded
        );
        let under_way = |guard: &Guard| -> Vec<(String, u32, u32)> {
            let listed = guard
                .under_way()
                .map(|(model, calls, max)| (model.to_owned(), calls, max.get()));
            listed.collect()
        };
        assert_eq!(under_way(&guard), [("m".to_owned(), 1, 1)]);

        // Same rates: the principal's bucket is still empty, and the model's call under way still counts.
        let reloaded = Guard::new(
            &config(slow, "{ per_second = 1000.0, burst = 1000 }"),
            None,
            None,
            Some(&guard),
            metrics.clone(),
        );
        let team = reloaded.authenticate(&headers("k")).unwrap();
        let refused = reloaded.admit(team.as_deref(), "m", false).await.unwrap_err();
        assert!(refused.message().contains("principal 'team'"), "{refused:?}");
        let other = reloaded.admit(None, "m", false).await.unwrap_err();
        assert!(other.message().contains("max_concurrent"), "{other:?}");
        assert_eq!(under_way(&reloaded), [("m".to_owned(), 1, 1)]);
        drop(held);
        assert_eq!(under_way(&reloaded), [("m".to_owned(), 0, 1)]);
        assert!(reloaded.admit(None, "m", false).await.is_ok());

        // A new rate is a new bucket.
        let changed = Guard::new(
            &config(
                "{ per_second = 1.0, burst = 5 }",
                "{ per_second = 1000.0, burst = 1000 }",
            ),
            None,
            None,
            Some(&reloaded),
            metrics,
        );
        let team = changed.authenticate(&headers("k")).unwrap();
        assert!(changed.admit(team.as_deref(), "m", false).await.is_ok());
    }
}

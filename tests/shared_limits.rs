//! `[limits.shared]`, black box: several built gateways with one configuration behind one real Redis
//! (`redis-server` on a held port), the built model server behind them. One budget for the whole fleet whatever
//! replica a client reaches, what each `when_unreachable` mode does while Redis is stopped or frozen (and that no call
//! waits on it), sharing resumed once it is back, and a token budget for `generate` charged on one replica and
//! enforced on another; what a replica holds of the budget handed back when a reload replaces its store and when it
//! exits.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::config::backend;
use common::redis::RedisProcess;
use common::{GatewayProcess, ModelServerProcess, http_client, send};
use tokio::sync::Mutex;

const KEY: &str = "fleet-tenant-key-41c2";
const IDENTITY: &str = r#"{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[2],"data":[7,8]}]}"#;

/// The tests run their fleets one at a time: on a machine of two cores, a second fleet (even one only starting
/// up) slows Redis's answers past the 20 ms a load test's replicas wait, and turns its sharing into an outage.
static ONE_FLEET_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// A gateway configuration: the principal `fleet` limited by `rate`, `identity` and `count` on `server`, the limits
/// shared through `redis` with `shared` keys added.
fn config(server: &ModelServerProcess, redis: &RedisProcess, rate: &str, shared: &str) -> String {
    format!(
        "[limits.shared]\nredis = \"{}\"\nprefix = \"test:\"\n{shared}\n\
         [auth]\n[[auth.api_keys]]\nname = \"fleet\"\nsha256 = \"{}\"\nmodels = [\"*\"]\nrate = {rate}\n\
         {}\
         [[models]]\nname = \"identity\"\nversions = [ {{ version = \"1\", backend = \"models\" }} ]\n\
         [[models]]\nname = \"count\"\nversions = [ {{ version = \"1\", backend = \"models\" }} ]\n\
         [[models]]\nname = \"add_sub\"\nversions = [ {{ version = \"1\", backend = \"models\" }} ]\n\
         tokens_output = \"OUTPUT0\"\n",
        redis.url(),
        common::sha256_hex(KEY),
        backend("models", "rest", [server.rest.unwrap()]),
    )
}

/// Calls answered during a load, by replica and status.
#[derive(Debug, Default)]
struct Answered {
    statuses: Vec<HashMap<u16, usize>>,
}

impl Answered {
    fn total(&self, status: u16) -> usize {
        self.statuses.iter().map(|s| s.get(&status).copied().unwrap_or(0)).sum()
    }

    fn on(&self, replica: usize, status: u16) -> usize {
        self.statuses[replica].get(&status).copied().unwrap_or(0)
    }

    fn others(&self) -> Vec<(usize, u16, usize)> {
        let mut others = Vec::new();
        for (replica, statuses) in self.statuses.iter().enumerate() {
            for (&status, &count) in statuses {
                if status != 200 && status != 429 {
                    others.push((replica, status, count));
                }
            }
        }
        others
    }
}

/// `identity` called by four clients on each replica, one call every few milliseconds each, for `span`.
async fn load(replicas: &[GatewayProcess], span: Duration) -> Answered {
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for (index, replica) in replicas.iter().enumerate() {
        for _ in 0..4 {
            let (stop, url) = (stop.clone(), replica.rest_url("/v2/models/identity/infer"));
            workers.push(tokio::spawn(async move {
                let client = http_client(false);
                let mut statuses = HashMap::new();
                let headers = [("x-api-key", KEY.to_owned())];
                while !stop.load(Ordering::Relaxed) {
                    let call = send(&client, "POST", &url, &headers, IDENTITY);
                    let answer = tokio::time::timeout(Duration::from_secs(10), call)
                        .await
                        .expect("every call is answered within 10 s");
                    *statuses.entry(answer.status).or_insert(0) += 1;
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
                (index, statuses)
            }));
        }
    }
    tokio::time::sleep(span).await;
    stop.store(true, Ordering::Relaxed);
    let mut answered = Answered {
        statuses: vec![HashMap::new(); replicas.len()],
    };
    for worker in workers {
        let (index, statuses) = worker.await.unwrap();
        for (status, count) in statuses {
            *answered.statuses[index].entry(status).or_insert(0) += count;
        }
    }
    answered
}

async fn started(count: usize, config: &str) -> Vec<GatewayProcess> {
    let replicas: Vec<GatewayProcess> = (0..count).map(|_| GatewayProcess::start(config)).collect();
    // Each has heard from every other through Redis: the share each takes alone while Redis is away is known.
    for replica in &replicas {
        common::eventually(Duration::from_secs(10), "every replica counted in Redis", || async {
            replica.metric_if_present("oipgate_shared_limits_replicas").await == Some(count as f64)
        })
        .await;
    }
    replicas
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_admit_one_budget() {
    let _alone = ONE_FLEET_AT_A_TIME.lock().await;
    let redis = RedisProcess::start();
    let server = ModelServerProcess::rest_only(&[]);
    // Redis is not away in this test: a wait of 200 ms keeps a busy machine's slow answer from being taken for an
    // outage (whose fallback would admit beyond the one budget).
    let config = config(
        &server,
        &redis,
        "{ per_second = 100.0, burst = 100 }",
        "lease = 20\ntimeout_ms = 200",
    );
    let replicas = started(3, &config).await;
    let status = common::get(&format!("http://{}/status.json", replicas[0].metrics))
        .await
        .json();
    let limits = &status["limits"];
    assert_eq!(
        (
            &limits["shared"],
            &limits["redis_state"],
            &limits["replicas"],
            &limits["lease"]
        ),
        (&true.into(), &"reachable".into(), &3.into(), &20.into()),
        "{status}"
    );
    assert_eq!(limits["redis"], redis.url());

    let answered = load(&replicas, Duration::from_secs(10)).await;
    assert!(answered.others().is_empty(), "{:?}", answered.others());
    // One bucket of 100 calls a second with a burst of 100, over ten seconds: 1,100, whichever replica is called. The
    // leases let a replica spend up to 20 without asking Redis, and hand back what they did not spend.
    let admitted = answered.total(200);
    assert!(
        (990..=1210).contains(&admitted),
        "admitted {admitted} of about 1,100: {answered:?}"
    );
    // Each replica admitted calls, and refused some: the budget was the fleet's, not each replica's.
    for replica in 0..3 {
        assert!(
            answered.on(replica, 200) > 50 && answered.on(replica, 429) > 0,
            "{answered:?}"
        );
    }
    // Most calls were decided without a Redis call: spent from a lease while the budget lasted (the first burst),
    // refused for as long as Redis said the bucket stays empty once it was spent.
    for (index, replica) in replicas.iter().enumerate() {
        let leased = replica
            .metric("oipgate_shared_limit_calls_total{limit=\"calls\",result=\"leased\"}")
            .await;
        assert!(leased > 0.0, "no call spent from a lease");
        let asked = replica
            .metric("oipgate_shared_limit_redis_duration_seconds_count{operation=\"take\"}")
            .await;
        let calls = (answered.on(index, 200) + answered.on(index, 429)) as f64;
        assert!(asked < calls / 2.0, "{asked} Redis calls for {calls} calls");
    }
}

/// What a replica holds of the fleet's budget goes back to it: a reload that changes `[limits.shared]` gives back the
/// old store's lease, and a replica that exits gives back its lease and its place among the replicas before it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_hands_back_its_lease_when_reloaded_off_its_store_and_when_it_exits() {
    let _alone = ONE_FLEET_AT_A_TIME.lock().await;
    let redis = RedisProcess::start();
    let server = ModelServerProcess::rest_only(&[]);
    // A token every ten seconds, twenty at most, taken ten at a time: one call holds nine more.
    let config_with = |timeout: &str| {
        config(
            &server,
            &redis,
            "{ per_second = 0.1, burst = 20 }",
            // Leases held a minute: a lease handed back in this test was handed back by the change, not by
            // expiring.
            &format!("lease = 10\nlease_ms = 60000\ntimeout_ms = {timeout}"),
        )
    };
    let mut replicas = started(1, &config_with("200")).await;
    let replica = &mut replicas[0];
    // Redis keeps the bucket a second past when it is full again: ten seconds for each token out of it.
    let bucket = "test:principal:fleet:calls";
    let out_ms = || {
        redis
            .command(&["PTTL", bucket])
            .and_then(|ttl| ttl.trim_start_matches(':').parse::<i64>().ok())
            .unwrap_or(0)
    };
    let replicas_seen = || redis.command(&["ZCARD", "test:replicas"]);
    let url = replica.rest_url("/v2/models/identity/infer");
    let call = || async {
        let headers = [("x-api-key", KEY.to_owned())];
        send(&http_client(false), "POST", &url, &headers, IDENTITY).await.status
    };

    assert_eq!(call().await, 200);
    assert!(out_ms() > 90_000, "a lease of ten taken: {} ms", out_ms());
    // The replica counts itself before its first heartbeat has reached Redis: the set may not hold it yet.
    common::eventually(Duration::from_secs(10), "the replica in the heartbeat set", || async {
        replicas_seen().as_deref() == Some(":1")
    })
    .await;
    let first_store = redis
        .command(&["ZRANDMEMBER", "test:replicas"])
        .expect("the replica's heartbeat");

    // Another Redis wait is another store: the one replaced leaves the replicas counted, then gives back the nine
    // tokens it held.
    replica.rewrite(&config_with("250"));
    replica.signal("HUP");
    common::eventually(
        Duration::from_secs(10),
        "the replaced store's lease given back",
        || async { out_ms() < 20_000 },
    )
    .await;
    // Gone before the give-back, not three seconds after its last heartbeat (under a second before the reload).
    assert_eq!(
        redis.command(&["ZSCORE", "test:replicas", &first_store]).as_deref(),
        Some("$-1"),
        "the replaced store is still counted"
    );

    // The new store takes a lease of its own, and the replica exits holding it.
    assert_eq!(call().await, 200);
    assert!(out_ms() > 90_000, "a lease of ten taken: {} ms", out_ms());
    replica.signal("TERM");
    let exited = replica.wait_exit(Duration::from_secs(20)).expect("the replica exits");
    assert!(exited.success(), "{exited:?}");
    // Before it went: two tokens spent, nine handed back, and no longer counted among the replicas (it would be
    // for three seconds after its last heartbeat otherwise).
    let out = out_ms();
    assert!(
        (10_000..30_000).contains(&out),
        "two calls' tokens out of the bucket: {out} ms"
    );
    assert_eq!(replicas_seen().as_deref(), Some(":0"));
}

/// How a test takes Redis away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outage {
    /// Killed: connections are refused.
    Stopped,
    /// SIGSTOP: connections stay open and nothing is answered, the case a timeout is for.
    Frozen,
}

/// A restarted Redis has lost the heartbeat set: the first replica to beat again counts only itself. It keeps the
/// count it held until the others have had time to beat (were Redis to go away again meanwhile, each replica alone
/// would take the whole budget), and lets it go once they have not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_does_not_make_a_replica_count_itself_alone() {
    let _alone = ONE_FLEET_AT_A_TIME.lock().await;
    let mut redis = RedisProcess::start();
    let server = ModelServerProcess::rest_only(&[]);
    let config = config(
        &server,
        &redis,
        "{ per_second = 100.0, burst = 100 }",
        "timeout_ms = 50",
    );
    let first = GatewayProcess::start_with(&config, &[], true);
    let second = GatewayProcess::start(&config);
    let replicas = "oipgate_shared_limits_replicas";
    for replica in [&first, &second] {
        common::eventually(Duration::from_secs(10), "both replicas counted in Redis", || async {
            replica.metric_if_present(replicas).await == Some(2.0)
        })
        .await;
    }
    // The second replica frozen: it beats no more, so the first is the only one Redis hears once restarted.
    second.signal("STOP");
    redis.stop();
    first
        .logged("the first replica noticing Redis is away", |lines| {
            lines.iter().any(|line| line.contains("Redis is unreachable"))
        })
        .await;
    redis.resume_after_stop();
    let lines = first
        .logged("the first replica hearing Redis again", |lines| {
            lines.iter().any(|line| line.contains("Redis answers again"))
        })
        .await;
    let back = lines.iter().find(|line| line.contains("Redis answers again")).unwrap();
    assert_eq!(
        redis.command(&["ZCARD", "test:replicas"]).as_deref(),
        Some(":1"),
        "the restarted Redis holds the first replica alone"
    );
    assert!(
        back.contains("replicas=2"),
        "the count held when Redis came back: {back}"
    );
    // The frozen replica does not beat within the time one counts as alive: the first counts itself alone then.
    common::eventually(
        Duration::from_secs(10),
        "the frozen replica no longer counted",
        || async { first.metric(replicas).await == 1.0 },
    )
    .await;
    second.signal("CONT");
    common::eventually(Duration::from_secs(10), "the thawed replica counted again", || async {
        first.metric(replicas).await == 2.0
    })
    .await;
}

/// Redis's calls of `operation` each replica made that were not answered.
async fn unanswered(replicas: &[GatewayProcess], operation: &str) -> Vec<f64> {
    let series = format!("oipgate_shared_limit_redis_unanswered_total{{operation=\"{operation}\"}}");
    let mut counts = Vec::new();
    for replica in replicas {
        counts.push(replica.metric_if_present(&series).await.unwrap_or(0.0));
    }
    counts
}

/// Two replicas falling back to `mode` while Redis is away: returns what a three-second load was answered with
/// meanwhile, once both replicas had noticed; checks that no call asked Redis meanwhile (so none waited on it),
/// that the heartbeat kept asking, and that sharing resumed once Redis was back.
async fn outage(mode: &str, outage: Outage) -> Answered {
    let _alone = ONE_FLEET_AT_A_TIME.lock().await;
    let mut redis = RedisProcess::start();
    let server = ModelServerProcess::rest_only(&[]);
    let shared = format!("lease = 20\nwhen_unreachable = \"{mode}\"\ntimeout_ms = 20");
    let config = config(&server, &redis, "{ per_second = 100.0, burst = 100 }", &shared);
    let replicas = started(2, &config).await;
    let fallback = format!("oipgate_shared_limits_fallback{{when_unreachable=\"{mode}\"}}");

    let before = load(&replicas, Duration::from_secs(1)).await;
    assert!(before.total(200) > 0 && before.others().is_empty(), "{before:?}");
    match outage {
        Outage::Stopped => redis.stop(),
        Outage::Frozen => redis.freeze(),
    }
    for replica in &replicas {
        common::eventually(Duration::from_secs(5), "the replica noticing Redis is away", || async {
            replica.metric(&fallback).await == 1.0
        })
        .await;
    }
    // The status page says so.
    let status = common::get(&format!("http://{}/status.json", replicas[0].metrics))
        .await
        .json();
    assert_eq!(status["limits"]["redis_state"], "unreachable", "{status}");
    assert_eq!(status["limits"]["when_unreachable"], mode, "{status}");
    let (takes_before, beats_before) = (
        unanswered(&replicas, "take").await,
        unanswered(&replicas, "heartbeat").await,
    );
    let during = load(&replicas, Duration::from_secs(3)).await;
    assert!(during.others().is_empty(), "{during:?}");
    // Once a replica knows Redis is away, the fallback decides every call without asking it (a call that did would
    // wait on a frozen Redis up to timeout_ms, and be counted unanswered); the heartbeat alone keeps asking.
    assert_eq!(
        unanswered(&replicas, "take").await,
        takes_before,
        "a call asked Redis while it was away"
    );
    let beats_after = unanswered(&replicas, "heartbeat").await;
    for (after, before) in beats_after.iter().zip(&beats_before) {
        assert!(
            after - before >= 2.0,
            "the heartbeat stopped asking: {beats_before:?} -> {beats_after:?}"
        );
    }

    match outage {
        Outage::Stopped => redis.resume_after_stop(),
        Outage::Frozen => redis.thaw(),
    }
    for replica in &replicas {
        common::eventually(Duration::from_secs(5), "sharing resumed", || async {
            replica.metric(&fallback).await == 0.0
        })
        .await;
    }
    let allowed = "oipgate_shared_limit_calls_total{limit=\"calls\",result=\"allowed\"}";
    let asked_before = replicas[0].metric(allowed).await;
    let after = load(&replicas, Duration::from_millis(500)).await;
    assert!(after.total(200) > 0 && after.others().is_empty(), "{after:?}");
    assert!(
        replicas[0].metric(allowed).await > asked_before,
        "the replica asks Redis again"
    );
    during
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_with_local_fallback_each_replica_keeps_its_share() {
    let during = outage("local", Outage::Frozen).await;
    // Each of the two replicas alone: 50 a second with a burst of 50, for three seconds: 200 each, 400 in all, as the
    // shared budget would have allowed.
    let admitted = during.total(200);
    assert!(
        (320..=480).contains(&admitted),
        "admitted {admitted} of about 400: {during:?}"
    );
    for replica in 0..2 {
        let own = during.on(replica, 200);
        assert!(
            (150..=250).contains(&own),
            "replica {replica} admitted {own} of about 200: {during:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_with_allow_fallback_admits_every_call() {
    let during = outage("allow", Outage::Stopped).await;
    assert_eq!(during.total(429), 0, "{during:?}");
    // More than the 400 the limit would have let in over the three seconds.
    assert!(during.total(200) > 600, "{during:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_with_deny_fallback_refuses_every_call() {
    let during = outage("deny", Outage::Frozen).await;
    assert_eq!(during.total(200), 0, "{during:?}");
    assert!(during.total(429) > 100, "{during:?}");
}

/// Through `replica`: `count` asked for `tokens` responses by `generate_stream` (a token each), or `add_sub` by
/// `generate` (its answer's tokens counted from `OUTPUT0`, 16 elements).
async fn generate(replica: &GatewayProcess, stream: bool, tokens: usize) -> common::HttpAnswer {
    let (url, body) = if stream {
        (
            replica.rest_url("/v2/models/count/generate_stream"),
            format!("{{\"INPUT0\": {tokens}}}"),
        )
    } else {
        let ones = vec![1; 16];
        (
            replica.rest_url("/v2/models/add_sub/generate"),
            serde_json::json!({ "INPUT0": ones, "INPUT1": ones }).to_string(),
        )
    };
    common::post_with_headers(&url, &[("x-api-key", KEY.to_owned())], body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_charged_on_one_replica_is_spent_on_the_other() {
    let _alone = ONE_FLEET_AT_A_TIME.lock().await;
    let redis = RedisProcess::start();
    let server = ModelServerProcess::rest_only(&[]);
    // Twenty tokens a minute: spent after two answers of six and sixteen tokens.
    let config = config(&server, &redis, "{ tokens_per_minute = 20 }", "");
    let replicas = started(2, &config).await;
    let budget = "test:principal:fleet:tokens";

    let streamed = generate(&replicas[0], true, 6).await;
    assert_eq!(streamed.status, 200, "{:?}", streamed.body);
    assert_eq!(String::from_utf8_lossy(&streamed.body).matches("data: ").count(), 6);
    // Charged when the answer ended, in Redis, where the other replica reads it.
    common::eventually(Duration::from_secs(5), "the stream's tokens charged", || async {
        redis.command(&["GET", budget]).is_some_and(|tat| tat != "$-1")
    })
    .await;
    let charged_before = redis.command(&["GET", budget]);
    let answered = generate(&replicas[1], false, 16).await;
    assert_eq!(answered.status, 200, "{:?}", answered.body);
    common::eventually(Duration::from_secs(5), "the answer's tokens charged", || async {
        redis.command(&["GET", budget]) != charged_before
    })
    .await;

    // Twenty-two of twenty spent: both replicas refuse generate calls, by either door's path, until it refills.
    for (replica, stream) in [(0, false), (1, true), (0, true)] {
        let refused = generate(&replicas[replica], stream, 1).await;
        assert_eq!(refused.status, 429, "{:?}", refused.body);
        let message = refused.json()["error"].as_str().unwrap().to_owned();
        assert!(
            message.contains("principal 'fleet' has spent its token budget"),
            "{message}"
        );
        let retry: u64 = refused.header("retry-after").expect("Retry-After").parse().unwrap();
        assert!((1..=60).contains(&retry), "Retry-After {retry}");
    }
    // Calls that generate nothing are not held to the budget.
    let infer = common::post_with_headers(
        &replicas[1].rest_url("/v2/models/identity/infer"),
        &[("x-api-key", KEY.to_owned())],
        IDENTITY,
    )
    .await;
    assert_eq!(infer.status, 200, "{:?}", infer.body);
    assert_eq!(
        replicas[0]
            .metric("oipgate_rate_limited_total{scope=\"principal_tokens\"}")
            .await,
        2.0
    );
    // Replica 0's token checks, counted as the token budget's and not as calls: one let in, two refused. Redis was
    // asked twice: its first refusal said until when the budget stays spent, and the second call was refused on
    // that word, without asking. No rate of calls is set, so no call was decided.
    for (result, count) in [("allowed", 1.0), ("refused", 2.0)] {
        let series = format!("oipgate_shared_limit_calls_total{{limit=\"tokens\",result=\"{result}\"}}");
        assert_eq!(replicas[0].metric(&series).await, count, "{series}");
    }
    let asked = "oipgate_shared_limit_redis_duration_seconds_count{operation=\"check\"}";
    assert_eq!(replicas[0].metric(asked).await, 2.0, "{asked}");
    for result in ["leased", "allowed", "refused"] {
        let series = format!("oipgate_shared_limit_calls_total{{limit=\"calls\",result=\"{result}\"}}");
        assert_eq!(replicas[0].metric_if_present(&series).await, None, "{series}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_generated_while_redis_was_away_are_charged_once_it_answers() {
    tokens_owed_during_an_outage_are_charged(false).await;
}

/// A reload that changes the budget's rate while tokens are owed: the budget it replaces leaves them to be charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_owed_by_a_budget_a_reload_replaced_are_charged_once_redis_answers() {
    tokens_owed_during_an_outage_are_charged(true).await;
}

/// Five tokens generated while Redis is frozen are charged to the shared budget once it answers again; with
/// `reload`, after a reload that changed the budget's rate meanwhile.
async fn tokens_owed_during_an_outage_are_charged(reload: bool) {
    let _alone = ONE_FLEET_AT_A_TIME.lock().await;
    let redis = RedisProcess::start();
    let server = ModelServerProcess::rest_only(&[]);
    let fallback_local = "when_unreachable = \"local\"";
    let config_at = |rate: &str| config(&server, &redis, rate, fallback_local);
    let replica = &started(1, &config_at("{ tokens_per_minute = 20 }")).await[0];
    let budget = "test:principal:fleet:tokens";
    // Redis's theoretical arrival time of the budget, in microseconds.
    let arrival = || redis.command(&["GET", budget]).and_then(|tat| tat.parse::<f64>().ok());

    let streamed = generate(replica, true, 6).await;
    assert_eq!(streamed.status, 200, "{:?}", streamed.body);
    common::eventually(Duration::from_secs(5), "the stream's tokens charged", || async {
        arrival().is_some()
    })
    .await;
    let charged_before = arrival().unwrap();

    redis.freeze();
    let fallback = "oipgate_shared_limits_fallback{when_unreachable=\"local\"}";
    common::eventually(Duration::from_secs(5), "the replica noticing Redis is away", || async {
        replica.metric(fallback).await == 1.0
    })
    .await;
    // Five tokens while Redis is away: let in by the replica's own share, and owed to the shared budget.
    let streamed = generate(replica, true, 5).await;
    assert_eq!(streamed.status, 200, "{:?}", streamed.body);
    if reload {
        let reloads = "oipgate_config_reloads_total{result=\"ok\"}";
        let before = replica.metric_if_present(reloads).await.unwrap_or(0.0);
        replica.rewrite(&config_at("{ tokens_per_minute = 30 }"));
        replica.signal("HUP");
        common::eventually(Duration::from_secs(10), "the new rate applied", || async {
            replica.metric_if_present(reloads).await.unwrap_or(0.0) > before
        })
        .await;
    }
    redis.thaw();
    common::eventually(Duration::from_secs(5), "sharing resumed", || async {
        replica.metric(fallback).await == 0.0
    })
    .await;
    // Paid once Redis answers: the budget's arrival time moves on by five tokens of three seconds each (more, were
    // the budget full again by then, which twenty tokens a minute keep it from within this test).
    common::eventually(Duration::from_secs(5), "the owed tokens charged", || async {
        arrival().is_some_and(|tat| tat - charged_before >= 5.0 * 3e6 - 1.0)
    })
    .await;
}

/// The demo's printed way to share its limits: the environment names a Redis, and the demo's gateway shares its
/// limits through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shares_its_limits_through_the_redis_the_environment_names() {
    use std::process::Stdio;
    let _alone = ONE_FLEET_AT_A_TIME.lock().await;
    let redis = RedisProcess::start();
    let held = [(); 5].map(|()| common::ports::hold_port());
    let (mut command, [_, _, metrics, _, _]) =
        common::demo_command(&held, &[("OIPGATE__LIMITS__SHARED__REDIS", redis.url())]);
    let mut demo = command.stdout(Stdio::null()).spawn().unwrap();
    common::eventually(Duration::from_secs(20), "the demo's metrics listener", || async {
        tokio::net::TcpStream::connect(&metrics).await.is_ok()
    })
    .await;
    let url = format!("http://{metrics}/status.json");
    common::eventually(Duration::from_secs(10), "the demo's limits shared", || async {
        common::get(&url).await.json()["limits"]["redis_state"] == "reachable"
    })
    .await;
    let limits = common::get(&url).await.json()["limits"].clone();
    let _ = demo.kill();
    let _ = demo.wait();
    assert_eq!(limits["shared"], true, "{limits}");
    assert_eq!(limits["redis"], redis.url(), "{limits}");
}

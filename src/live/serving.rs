//! A request's hold on the running gateway, through its door thread's own handles: the dispatcher it is served by,
//! the metrics it reports to, and its place among the requests under way, counted by each thread and added up by a
//! shutdown.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::Gateway;
use crate::dispatch::Dispatcher;
use crate::runtime::{ThreadArc, ThreadWeak};
use crate::telemetry::metrics::Metrics;

/// The counts of requests under way, one a thread, which shutdown adds up.
#[derive(Debug, Default)]
pub(super) struct Drain {
    /// Set while a shutdown waits for the requests under way to end.
    awaiting: AtomicBool,
    /// Every thread's count; shutdown waits on `idle` under this lock, and a count's last request wakes it.
    counts: std::sync::Mutex<Vec<Weak<UnderWay>>>,
    idle: std::sync::Condvar,
}

impl Drain {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Weak<UnderWay>>> {
        self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new count for a thread, added to those shutdown adds up (those of threads gone are let go).
    fn count(self: &Arc<Self>) -> Arc<UnderWay> {
        let count = Arc::new(UnderWay {
            requests: AtomicUsize::new(0),
            drain: self.clone(),
        });
        let mut counts = self.lock();
        counts.retain(|count| count.strong_count() > 0);
        counts.push(Arc::downgrade(&count));
        count
    }
}

/// Requests under way, sum of the threads' counts. A request counted throughout the reading is seen in it: it holds
/// its count above 0 for as long.
fn under_way(counts: &[Weak<UnderWay>]) -> usize {
    counts
        .iter()
        .filter_map(Weak::upgrade)
        .map(|count| count.requests.load(Ordering::SeqCst))
        .sum()
}

/// One thread's count of requests under way. Only requests begun on that thread add to it (one that ends on
/// another thread takes back from the count it added to), so the line it lies on is written by one core nearly
/// always, where one count for all door threads would move between their cores twice a request.
#[derive(Debug)]
struct UnderWay {
    requests: AtomicUsize,
    drain: Arc<Drain>,
}

/// A request under way (or a connection that may still bring one while shutdown lets it); shutdown waits until none
/// is left.
#[derive(Debug)]
pub struct Active(Arc<UnderWay>);

impl Active {
    fn new(count: &Arc<UnderWay>) -> Active {
        // Sequentially consistent with `Drain::awaiting`: either the waiting shutdown sees this request, or the
        // request's end sees the shutdown waiting.
        count.requests.fetch_add(1, Ordering::SeqCst);
        Active(count.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        // A thread's last request wakes a waiting shutdown to add the counts up again; otherwise nothing waits.
        if self.0.requests.fetch_sub(1, Ordering::SeqCst) == 1 && self.0.drain.awaiting.load(Ordering::SeqCst) {
            drop(self.0.drain.lock());
            self.0.drain.idle.notify_all();
        }
    }
}

/// What a request holds of the gateway: the dispatcher it is served by (to its end, whatever is reloaded
/// meanwhile), the metrics it reports to, and its place among the requests under way. All three are clones of the
/// door thread's own handles ([`HELD`]).
#[derive(Debug)]
pub struct Serving {
    pub dispatcher: ThreadArc<Dispatcher>,
    pub metrics: ThreadArc<Metrics>,
    pub active: Active,
}

/// What a thread holds of the gateway it last served: its handle on the dispatcher of `generation`, while a request
/// on the thread holds it (so a dispatcher a reload replaced is let go when its last request ends, as it would be
/// without handles), its handle on the metrics, and its count of requests under way.
struct ThreadHeld {
    gateway: u64,
    generation: u64,
    dispatcher: ThreadWeak<Dispatcher>,
    metrics: ThreadArc<Metrics>,
    count: Arc<UnderWay>,
}

thread_local! {
    static HELD: RefCell<Option<ThreadHeld>> = const { RefCell::new(None) };
}

impl Gateway {
    /// What a new request holds of the gateway: the current dispatcher, the metrics, and its place among the requests
    /// under way, all through this thread's handles.
    pub fn serving(&self) -> Serving {
        self.held(|held| {
            // Read before the dispatcher is: a handle is never older than the generation it is kept for.
            let generation = self.generation.load(Ordering::Acquire);
            let kept = held.dispatcher.upgrade().filter(|_| held.generation == generation);
            let dispatcher = kept.unwrap_or_else(|| {
                let dispatcher = ThreadArc::new(self.current.load_full());
                held.dispatcher = ThreadArc::downgrade(&dispatcher);
                held.generation = generation;
                dispatcher
            });
            Serving {
                dispatcher,
                metrics: held.metrics.clone(),
                active: Active::new(&held.count),
            }
        })
    }

    /// Counts a request (or a connection that may still bring one) as under way until the guard is dropped.
    pub fn begin(&self) -> Active {
        self.held(|held| Active::new(&held.count))
    }

    /// `with` this thread's handles on the gateway, made anew when the thread last served another one.
    fn held<T>(&self, with: impl Fn(&mut ThreadHeld) -> T) -> T {
        let made = HELD.try_with(|cell| {
            let mut cell = cell.borrow_mut();
            let previous = cell.take_if(|held| held.gateway != self.id);
            let answer = with(cell.get_or_insert_with(|| self.thread_held()));
            // Another gateway's handles are let go once the thread's cell is free again.
            drop(cell);
            drop(previous);
            answer
        });
        // A thread that is ending: handles of its own, for this request alone.
        made.unwrap_or_else(|_| with(&mut self.thread_held()))
    }

    /// A thread's handles on this gateway, with its own count of requests under way.
    fn thread_held(&self) -> ThreadHeld {
        ThreadHeld {
            gateway: self.id,
            generation: 0,
            dispatcher: ThreadWeak::none(),
            metrics: ThreadArc::new(self.metrics.clone()),
            count: self.drain.count(),
        }
    }

    /// Requests under way.
    pub fn active(&self) -> usize {
        under_way(&self.drain.lock())
    }

    /// Waits (blocking the thread) until no request is under way or `limit` has passed; whether none is.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        self.drain.awaiting.store(true, Ordering::SeqCst);
        let counts = self.drain.lock();
        let (counts, _) = self
            .drain
            .idle
            .wait_timeout_while(counts, limit, |counts| under_way(counts) > 0)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        under_way(&counts) == 0
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::config::Config;

    const CONFIG: &str = r#"
[[backends]]
name = "b"
protocol = "rest"
endpoints = ["127.0.0.1:9000"]
[[models]]
name = "m"
versions = [ { version = "1", backend = "b" } ]
"#;

    /// A gateway served by a configuration file of its own (`tag` names it), which reloads read.
    fn gateway(tag: &str) -> (Arc<Gateway>, PathBuf) {
        let path = std::env::temp_dir().join(format!("oipgate-live-{}-{tag}.toml", std::process::id()));
        std::fs::write(&path, CONFIG).unwrap();
        let config = Config::load(&path, &[]).unwrap();
        let gateway = Gateway::new(config, "live-test", Some(path.clone()), Metrics::new().unwrap()).unwrap();
        (gateway, path)
    }

    #[test]
    fn a_request_begun_on_one_thread_and_ended_on_another_is_counted_once() {
        let (gateway, path) = gateway("threads");
        let here = gateway.serving();
        let connection = gateway.begin();
        let there = std::thread::scope(|s| s.spawn(|| gateway.serving()).join().unwrap());
        assert_eq!(gateway.active(), 3);
        assert!(!gateway.wait_idle(Duration::ZERO));
        // Each request ends on the other's thread.
        std::thread::scope(|s| {
            s.spawn(move || drop(here));
        });
        drop(there);
        assert_eq!(gateway.active(), 1);
        drop(connection);
        assert_eq!(gateway.active(), 0);
        assert!(gateway.wait_idle(Duration::ZERO));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_waiting_shutdown_is_woken_by_the_last_request_to_end_on_another_thread() {
        let (gateway, path) = gateway("wake");
        let requests: Vec<Serving> = (0..4).map(|_| gateway.serving()).collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                // Ends them once the shutdown waits (or is about to: the shutdown sees them end either way).
                while !gateway.drain.awaiting.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                drop(requests);
            });
            // Well past any test's time: a wake-up missed would show as a test that hangs, not as a wrong answer.
            assert!(gateway.wait_idle(Duration::from_secs(600)));
        });
        assert_eq!(gateway.active(), 0);
        std::fs::remove_file(path).unwrap();
    }

    /// Requests on this thread, to `ours` and `theirs` in turn, each get their own gateway's dispatcher and metrics.
    fn alternate(ours: &Gateway, theirs: &Gateway) {
        for _ in 0..2 {
            for gateway in [ours, theirs] {
                let serving = gateway.serving();
                assert!(Arc::ptr_eq(&serving.dispatcher, &gateway.dispatcher()));
                assert!(Arc::ptr_eq(&serving.metrics, gateway.metrics()));
            }
        }
    }

    #[tokio::test]
    async fn a_reload_serves_new_requests_by_the_new_dispatcher_and_old_ones_by_theirs() {
        let (other, other_path) = gateway("reload-other");
        let (gateway, path) = gateway("reload");
        // Both at their first dispatcher: the gateway, not the generation, tells their handles apart.
        alternate(&gateway, &other);
        // A request on a thread that then idles, and one on this thread, both by the first dispatcher.
        let (sent, received) = std::sync::mpsc::channel();
        let (finish, finished) = std::sync::mpsc::channel::<()>();
        let idle = std::thread::spawn({
            let gateway = gateway.clone();
            move || {
                sent.send(gateway.serving()).unwrap();
                let _ = finished.recv();
            }
        });
        let elsewhere = received.recv().unwrap();
        let before = gateway.serving();
        assert!(Arc::ptr_eq(&before.dispatcher, &gateway.dispatcher()));
        std::fs::write(&path, CONFIG.replace("9000", "9001")).unwrap();
        gateway.reload().await.unwrap();
        // A request after the reload gets the new dispatcher, while one from before still holds the old one.
        let after = gateway.serving();
        assert!(Arc::ptr_eq(&after.dispatcher, &gateway.dispatcher()));
        assert!(!Arc::ptr_eq(&after.dispatcher, &before.dispatcher));
        // The old one goes with its last request, though the idle thread it served is still there.
        let replaced = Arc::downgrade(&before.dispatcher);
        drop((before, elsewhere, after));
        assert!(replaced.upgrade().is_none());
        finish.send(()).unwrap();
        idle.join().unwrap();
        alternate(&gateway, &other);
        assert_eq!(gateway.active(), 0);
        assert_eq!(other.active(), 0);
        std::fs::remove_file(path).unwrap();
        std::fs::remove_file(other_path).unwrap();
    }
}

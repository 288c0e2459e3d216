//! The process's helper threads: the builder thread that builds configurations and returns freed memory, and the
//! small runtime telemetry exports run on; and [`ThreadArc`] and [`ThreadShared`], the handles a thread clones of
//! what its requests share.

use std::sync::{OnceLock, mpsc};
use std::time::Duration;

/// What returns memory freed in the process to the kernel, when the binary's allocator needs asking (mimalloc:
/// `mi_collect`); set by the binary.
static RELEASE_FREED_MEMORY: OnceLock<fn()> = OnceLock::new();
/// The builder thread's queue.
static BUILDER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
type Job = Box<dyn FnOnce() + Send>;
/// How often the builder thread returns freed memory when idle.
const RELEASE_INTERVAL: Duration = Duration::from_secs(1);

/// Sets how freed memory is returned to the kernel, and starts the builder thread, which does it once a second.
pub fn on_release_freed_memory(release: fn()) {
    let _ = RELEASE_FREED_MEMORY.set(release);
    builder();
}

fn release_freed_memory() {
    if let Some(release) = RELEASE_FREED_MEMORY.get() {
        release();
    }
}

/// Runs `work` on the builder thread (inside the caller's tokio runtime, if any) and waits for its result.
///
/// Configurations are loaded and snapshots built there, at start and on every reload. A snapshot of ten thousand
/// models is tens of MiB, allocated and freed (the configuration's parse) or kept until the next reload frees it, from
/// whichever thread drops it last. An allocator with thread-local heaps (mimalloc) returns such memory only when
/// the thread that allocated it comes back to it: the main thread never does, a runtime worker may not for long, and
/// each reload would keep another snapshot's worth. The builder thread comes back to it every second.
pub fn on_builder_thread<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    let runtime = tokio::runtime::Handle::try_current().ok();
    let (answer, answered) = mpsc::sync_channel(1);
    let job: Job = Box::new(move || {
        let _entered = runtime.as_ref().map(tokio::runtime::Handle::enter);
        let _ = answer.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)));
    });
    let sent = builder().send(job);
    match (sent, answered.recv()) {
        (Ok(()), Ok(Ok(value))) => value,
        (Ok(()), Ok(Err(panic))) => std::panic::resume_unwind(panic),
        _ => panic!("the builder thread is gone"),
    }
}

/// The runtime that sends what the gateway reports to others (spans, payload events): one thread of its own, so a
/// slow collector or sink never takes a door's time.
pub fn telemetry_runtime() -> &'static tokio::runtime::Handle {
    static TELEMETRY: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    TELEMETRY.get_or_init(|| thread_runtime("oipgate-telemetry"))
}

/// The runtime that holds the connection to the Redis of `[limits.shared]` and its heartbeat: one thread of its
/// own, apart from telemetry's exports, so a call waiting on Redis is never behind a batch of spans.
pub fn limits_runtime() -> &'static tokio::runtime::Handle {
    static LIMITS: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    LIMITS.get_or_init(|| thread_runtime("oipgate-limits"))
}

/// A current-thread runtime on a thread of its own named `name`.
fn thread_runtime(name: &str) -> tokio::runtime::Handle {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for a helper thread");
    let handle = runtime.handle().clone();
    let started = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()));
    if let Err(error) = started {
        tracing::error!(%error, thread = name, "cannot start a helper thread");
    }
    handle
}

fn builder() -> &'static mpsc::Sender<Job> {
    BUILDER.get_or_init(|| {
        let (queue, jobs) = mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name("oipgate-builder".into())
            .spawn(move || {
                loop {
                    match jobs.recv_timeout(RELEASE_INTERVAL) {
                        Ok(job) => job(),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                    release_freed_memory();
                }
            });
        if let Err(error) = started {
            tracing::error!(%error, "cannot start the builder thread");
        }
        queue
    })
}

/// A shared value as one thread's requests hold it: a clone of a handle that thread made (the outer allocation),
/// whose reference count lies on a line that thread alone writes. Clones of the shared `Arc` itself, one a request on
/// every door thread, would move its count's cache line between the threads' cores twice a request.
#[derive(Debug)]
pub struct ThreadArc<T: ?Sized>(std::sync::Arc<std::sync::Arc<T>>);

impl<T: ?Sized> ThreadArc<T> {
    /// A new handle on `shared`, for one thread to clone.
    pub fn new(shared: std::sync::Arc<T>) -> ThreadArc<T> {
        ThreadArc(std::sync::Arc::new(shared))
    }

    /// A reference to the handle that does not keep it, for the thread to clone again while some clone lives.
    pub fn downgrade(handle: &ThreadArc<T>) -> ThreadWeak<T> {
        ThreadWeak(std::sync::Arc::downgrade(&handle.0))
    }
}

/// How many threads get handles of their own from a [`ThreadShared`] (and sets of counters of their own where a
/// value keeps some for each thread): threads past this many share them, still correctly, only no longer apart.
pub const THREAD_SLOTS: usize = 8;

/// This thread's slot among [`THREAD_SLOTS`]: the threads that ask take them in turn, so the first few (the door
/// threads, which ask at their first request) each have one of their own.
pub fn thread_slot() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % THREAD_SLOTS;
    }
    SLOT.with(|slot| *slot)
}

/// A value the door threads share, which each clones through a [`ThreadArc`] of its own, made at its first clone
/// (so on its own thread, from its own allocator pages): the shared count is written when a handle is made, not by
/// each request.
#[derive(Debug)]
pub struct ThreadShared<T: ?Sized> {
    shared: std::sync::Arc<T>,
    handles: [OnceLock<ThreadArc<T>>; THREAD_SLOTS],
}

impl<T: ?Sized> ThreadShared<T> {
    pub fn new(shared: std::sync::Arc<T>) -> ThreadShared<T> {
        ThreadShared {
            shared,
            handles: [const { OnceLock::new() }; THREAD_SLOTS],
        }
    }

    /// A clone of this thread's handle.
    pub fn handle(&self) -> ThreadArc<T> {
        self.handles[thread_slot()]
            .get_or_init(|| ThreadArc::new(self.shared.clone()))
            .clone()
    }

    /// The shared value itself, for what outlives a request or is made rarely.
    pub fn shared(&self) -> &std::sync::Arc<T> {
        &self.shared
    }
}

impl<T: ?Sized> std::ops::Deref for ThreadShared<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.shared
    }
}

impl<T: ?Sized + std::fmt::Display> std::fmt::Display for ThreadShared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (*self.shared).fmt(f)
    }
}

impl<T: ?Sized + std::fmt::Display> std::fmt::Display for ThreadArc<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self.0).fmt(f)
    }
}

impl From<&str> for ThreadShared<str> {
    fn from(name: &str) -> ThreadShared<str> {
        ThreadShared::new(name.into())
    }
}

/// A [`ThreadArc`] that does not keep the handle (or the shared value) alive.
#[derive(Debug)]
pub struct ThreadWeak<T: ?Sized>(std::sync::Weak<std::sync::Arc<T>>);

impl<T: ?Sized> ThreadWeak<T> {
    /// A reference to no handle.
    pub fn none() -> ThreadWeak<T> {
        ThreadWeak(std::sync::Weak::new())
    }

    /// A clone of the handle, while some clone of it lives.
    pub fn upgrade(&self) -> Option<ThreadArc<T>> {
        self.0.upgrade().map(ThreadArc)
    }
}

impl<T: ?Sized> Clone for ThreadArc<T> {
    fn clone(&self) -> ThreadArc<T> {
        ThreadArc(self.0.clone())
    }
}

impl<T: ?Sized> std::ops::Deref for ThreadArc<T> {
    type Target = std::sync::Arc<T>;

    fn deref(&self) -> &std::sync::Arc<T> {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_shared_value_is_cloned_through_a_handle_of_each_threads_own() {
        let shared = Arc::new(String::from("route"));
        let value = ThreadShared::new(shared.clone());
        let first = value.handle();
        let count = Arc::strong_count(&shared);
        let clones: Vec<_> = (0..100).map(|_| value.handle()).collect();
        // A request's clone writes the thread's handle, not the shared count.
        assert_eq!(Arc::strong_count(&shared), count);
        assert!(clones.iter().all(|clone| Arc::ptr_eq(&clone.0, &first.0)));
        assert_eq!(Arc::strong_count(&first.0), 102);
        let (slot, other) = std::thread::scope(|scope| scope.spawn(|| (thread_slot(), value.handle())).join().unwrap());
        assert_eq!(other.as_str(), "route");
        // Another thread has a handle of its own, unless it came past the slots and shares this one's.
        assert_eq!(Arc::ptr_eq(&other.0, &first.0), slot == thread_slot());
        drop((first, clones, other, value));
        assert_eq!(Arc::strong_count(&shared), 1);
    }
}

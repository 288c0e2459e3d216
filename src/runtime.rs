//! The process's helper threads: the builder thread that builds configurations and returns freed memory, and the
//! small runtime telemetry exports run on; and [`ThreadArc`], the handle a thread clones of what its requests share.

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

/// A shared value as one thread's requests hold it: a clone of a handle that thread made, whose reference count lies
/// on a line that thread alone writes. Clones of the shared `Arc` itself, one a request on every door thread, would
/// move its count's cache line between the threads' cores twice a request.
#[derive(Debug)]
#[expect(
    clippy::redundant_allocation,
    reason = "the outer allocation is the thread's own count"
)]
pub struct ThreadArc<T>(std::sync::Arc<std::sync::Arc<T>>);

impl<T> ThreadArc<T> {
    /// A new handle on `shared`, for one thread to clone.
    pub fn new(shared: std::sync::Arc<T>) -> ThreadArc<T> {
        ThreadArc(std::sync::Arc::new(shared))
    }

    /// A reference to the handle that does not keep it, for the thread to clone again while some clone lives.
    pub fn downgrade(handle: &ThreadArc<T>) -> ThreadWeak<T> {
        ThreadWeak(std::sync::Arc::downgrade(&handle.0))
    }
}

/// A [`ThreadArc`] that does not keep the handle (or the shared value) alive.
#[derive(Debug)]
pub struct ThreadWeak<T>(std::sync::Weak<std::sync::Arc<T>>);

impl<T> ThreadWeak<T> {
    /// A reference to no handle.
    pub fn none() -> ThreadWeak<T> {
        ThreadWeak(std::sync::Weak::new())
    }

    /// A clone of the handle, while some clone of it lives.
    pub fn upgrade(&self) -> Option<ThreadArc<T>> {
        self.0.upgrade().map(ThreadArc)
    }
}

impl<T> Clone for ThreadArc<T> {
    fn clone(&self) -> ThreadArc<T> {
        ThreadArc(self.0.clone())
    }
}

impl<T> std::ops::Deref for ThreadArc<T> {
    type Target = std::sync::Arc<T>;

    fn deref(&self) -> &std::sync::Arc<T> {
        &self.0
    }
}

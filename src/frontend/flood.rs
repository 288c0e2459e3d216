//! HTTP/2 rapid reset (CVE-2023-44487): a client that opens streams and cancels them at once makes the door start
//! work it never gets to finish. Each connection counts its calls that ended cancelled by the client, and one that
//! cancels more than a bound in a second is sent GOAWAY and closed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Calls a connection may see cancelled by its client in one second; a client timing out its calls under load
/// cancels a few, a flood thousands.
const MAX_CANCELLED_PER_SECOND: u32 = 200;
/// How long a flooding connection's GOAWAY is given before the connection is dropped.
const GOAWAY_GRACE: Duration = Duration::from_millis(500);

/// One HTTP/2 connection's count of cancelled calls.
#[derive(Debug)]
pub struct ResetWatch {
    opened: Instant,
    /// Start of the current one-second window, in milliseconds since `opened`.
    window: AtomicU64,
    cancelled: AtomicU32,
    tripped: AtomicBool,
    trip: tokio::sync::Notify,
}

impl ResetWatch {
    pub fn new() -> Arc<ResetWatch> {
        Arc::new(ResetWatch {
            opened: Instant::now(),
            window: AtomicU64::new(0),
            cancelled: AtomicU32::new(0),
            tripped: AtomicBool::new(false),
            trip: tokio::sync::Notify::new(),
        })
    }

    /// A call begun on the connection; counted as cancelled unless [`Call::finish`]ed otherwise.
    pub fn call(self: &Arc<ResetWatch>) -> Call {
        Call {
            watch: self.clone(),
            finished: false,
        }
    }

    fn cancelled(&self) {
        let now = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        let window = self.window.load(Ordering::Relaxed);
        if now.saturating_sub(window) >= 1000 {
            self.window.store(now, Ordering::Relaxed);
            self.cancelled.store(0, Ordering::Relaxed);
        }
        if self.cancelled.fetch_add(1, Ordering::Relaxed) + 1 > MAX_CANCELLED_PER_SECOND
            && !self.tripped.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                "an HTTP/2 client cancelled more than {MAX_CANCELLED_PER_SECOND} calls in a second; closing its connection"
            );
            self.trip.notify_one();
        }
    }

    /// Resolves once the connection has cancelled too many calls.
    pub async fn tripped(&self) {
        self.trip.notified().await;
    }
}

/// Serves an HTTP/2 `connection` until it ends. When `stop` resolves, GOAWAY, and the calls under way finish; when
/// the connection's `watch` trips, GOAWAY, a moment for it to go out, and the connection is dropped.
pub async fn serve<C>(connection: C, watch: &ResetWatch, stop: impl Future<Output = ()>)
where
    C: hyper_util::server::graceful::GracefulConnection,
{
    let mut connection = std::pin::pin!(connection);
    let flooding = tokio::select! {
        _ = connection.as_mut() => return,
        () = watch.tripped() => true,
        () = stop => false,
    };
    connection.as_mut().graceful_shutdown();
    if flooding {
        let _ = tokio::time::timeout(GOAWAY_GRACE, connection).await;
    } else {
        let _ = connection.await;
    }
}

/// One call on a watched connection.
#[derive(Debug)]
pub struct Call {
    watch: Arc<ResetWatch>,
    finished: bool,
}

impl Call {
    /// The call was answered; `cancelled` when the answer says the client went away.
    pub fn finish(mut self, cancelled: bool) {
        self.finished = true;
        if cancelled {
            self.watch.cancelled();
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.finished {
            self.watch.cancelled();
        }
    }
}

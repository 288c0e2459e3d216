//! A future's own waker, for a future polled by the same task as the one it is waiting on: a wake that comes while
//! the future is itself being polled is taken as "poll again", on the spot, rather than a second trip through the
//! scheduler for the whole task.
//!
//! hyper's channels wake the side that waits on them. When both sides are polled by one task (a connection and the
//! request handler reading its body), each hand-over woke the task while it was polling, and the task was then polled
//! whole once more.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, Waker};

/// How many times a poll woken from within is run again on the spot before the wake is left to the scheduler: a
/// future that keeps waking itself must not hold the thread. (tokio's own yields, its cooperative budget running out
/// and `yield_now`, defer their wake until the task's poll has ended, so they reach the task and are never taken
/// here.)
const AGAIN: usize = 8;

/// A waker standing for the task that polls through it. Cheap to clone; clones are the same waker.
#[derive(Debug, Clone, Default)]
pub struct LocalWake(Arc<Waking>);

#[derive(Debug, Default)]
struct Waking {
    task: futures_util::task::AtomicWaker,
    state: AtomicU8,
}

impl Waking {
    const IDLE: u8 = 0;
    const POLLING: u8 = 1;
    const WOKEN: u8 = 2;
}

impl std::task::Wake for Waking {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Err(Waking::IDLE) =
            self.state
                .compare_exchange(Waking::POLLING, Waking::WOKEN, Ordering::AcqRel, Ordering::Acquire)
        {
            self.task.wake();
        }
    }
}

impl LocalWake {
    /// Runs `poll` for the task of `cx`, with this waker: a wake from within it runs it again here. A wake that
    /// comes as `poll` ends ready is dropped: it stands for work that the next poll through this waker does, and the
    /// caller polls through it again before anything waits on what it drives. Any other wake is the task's.
    pub fn poll<T>(&self, cx: &mut Context<'_>, mut poll: impl FnMut(&mut Context<'_>) -> Poll<T>) -> Poll<T> {
        self.0.task.register(cx.waker());
        let waker = Waker::from(self.0.clone());
        let mut local = Context::from_waker(&waker);
        for _ in 0..AGAIN {
            self.0.state.store(Waking::POLLING, Ordering::Release);
            let polled = poll(&mut local);
            let woken = self.0.state.swap(Waking::IDLE, Ordering::AcqRel) == Waking::WOKEN;
            if !woken || polled.is_ready() {
                return polled;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Counts the wakes of the task that polls a future through it.
#[cfg(test)]
#[derive(Debug, Default, Clone)]
pub(crate) struct WakeCount(Arc<Counted>);

#[cfg(test)]
#[derive(Debug, Default)]
struct Counted {
    wakes: std::sync::atomic::AtomicUsize,
    task: std::sync::Mutex<Option<Waker>>,
}

#[cfg(test)]
impl std::task::Wake for Counted {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        if let Some(task) = self.task.lock().unwrap().as_ref() {
            task.wake_by_ref();
        }
    }
}

#[cfg(test)]
impl WakeCount {
    pub(crate) fn wakes(&self) -> usize {
        self.0.wakes.load(Ordering::SeqCst)
    }

    /// Polls `future` to its end, counting its task's wakes.
    pub(crate) async fn polling<F: Future>(&self, future: F) -> F::Output {
        let mut future = std::pin::pin!(future);
        let waker = Waker::from(self.0.clone());
        std::future::poll_fn(|cx| {
            *self.0.task.lock().unwrap() = Some(cx.waker().clone());
            future.as_mut().poll(&mut Context::from_waker(&waker))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Wakes its task while being polled, `times` times, then is ready.
    fn waking_itself(times: usize) -> impl FnMut(&mut Context<'_>) -> Poll<usize> {
        let mut polls = 0;
        move |cx| {
            polls += 1;
            if polls > times {
                return Poll::Ready(polls);
            }
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_wake_from_within_a_poll_runs_it_again_on_the_spot() {
        let count = WakeCount::default();
        let wake = LocalWake::default();
        let mut poll = waking_itself(3);
        let polls = count.polling(std::future::poll_fn(|cx| wake.poll(cx, &mut poll))).await;
        assert_eq!((polls, count.wakes()), (4, 0));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_poll_that_always_wakes_itself_is_left_to_the_scheduler() {
        let count = WakeCount::default();
        let wake = LocalWake::default();
        let mut poll = waking_itself(2 * AGAIN);
        let polls = count.polling(std::future::poll_fn(|cx| wake.poll(cx, &mut poll))).await;
        assert_eq!((polls, count.wakes()), (2 * AGAIN + 1, 2));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_wake_from_elsewhere_wakes_the_task() {
        let count = WakeCount::default();
        let wake = LocalWake::default();
        let (sender, mut receiver) = tokio::sync::oneshot::channel();
        let waiting = count.polling(std::future::poll_fn(|cx| {
            wake.poll(cx, |cx| std::pin::Pin::new(&mut receiver).poll(cx))
        }));
        let sending = async {
            tokio::task::yield_now().await;
            sender.send(7).unwrap();
        };
        let (got, ()) = tokio::join!(waiting, sending);
        assert_eq!((got.unwrap(), count.wakes()), (7, 1));
    }
}

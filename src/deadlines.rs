//! Deadlines of calls on a door's thread: one tokio timer for the thread, set at the earliest deadline it knows,
//! where a tokio timer a call would cost a lock of the runtime's timer wheel to set, another to take out, and a
//! reading of its clock behind a mutex (tokio's `test-util`, which pingora turns on) for each.
//!
//! A call's deadline joins the thread's list when the call first waits, and leaves it when the call ends, neither a
//! lock nor a reading of the clock. The thread's timer is moved only to an earlier deadline: when it runs out, the
//! calls past their deadline are woken, and it is set again at the earliest deadline of those left. A call that
//! answers in time (nearly all) never touches it.
//!
//! Threads without the list (a runtime of many threads, which may move a call between them; tests) use a tokio timer
//! a call, as does a call that finds itself on another thread than the one whose list it joined.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use tokio::time::{Instant, Sleep};

thread_local! {
    static DEADLINES: RefCell<Option<Deadlines>> = const { RefCell::new(None) };
}

/// Distinguishes one thread's list from another's, so a call polled on another thread than its list's leaves it be.
static NEXT_LIST: AtomicU64 = AtomicU64::new(1);

/// The deadlines of a thread's waiting calls.
#[derive(Debug)]
struct Deadlines {
    list: u64,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// When the thread's timer runs out; `None` while it is unset.
    armed: Option<Instant>,
    /// Set when a deadline came before `armed`: the keeper sets its timer again.
    rearm: bool,
    /// The keeper's waker, to have it set its timer again.
    keeper: Option<Waker>,
}

#[derive(Debug)]
struct Slot {
    /// Counts the slot's uses: a call holding an older count was woken and let go by the keeper (its deadline passed).
    generation: u64,
    /// `None` while free.
    waiting: Option<Waiting>,
}

#[derive(Debug)]
struct Waiting {
    until: Instant,
    waker: Waker,
}

/// Starts the current thread's list; `keep` must run on the thread's runtime for its deadlines to run out.
pub fn install() {
    DEADLINES.with(|deadlines| {
        *deadlines.borrow_mut() = Some(Deadlines {
            list: NEXT_LIST.fetch_add(1, Ordering::Relaxed),
            slots: Vec::new(),
            free: Vec::new(),
            armed: None,
            rearm: false,
            keeper: None,
        });
    });
}

/// Runs the current thread's timer, waking the calls whose deadline passed; forever.
pub async fn keep() {
    let mut timer: Pin<Box<Sleep>> = Box::pin(tokio::time::sleep_until(far()));
    loop {
        std::future::poll_fn(|cx| {
            let armed = DEADLINES.with(|deadlines| {
                let mut deadlines = deadlines.borrow_mut();
                let deadlines = deadlines.as_mut()?;
                if !deadlines
                    .keeper
                    .as_ref()
                    .is_some_and(|keeper| keeper.will_wake(cx.waker()))
                {
                    deadlines.keeper = Some(cx.waker().clone());
                }
                Some(std::mem::take(&mut deadlines.rearm).then_some(deadlines.armed))
            });
            match armed {
                None => return Poll::Pending,
                Some(Some(armed)) => timer.as_mut().reset(armed.unwrap_or_else(far)),
                Some(None) => {}
            }
            timer.as_mut().poll(cx)
        })
        .await;
        let now = Instant::now();
        let mut due = Vec::new();
        let next = DEADLINES.with(|deadlines| {
            let mut deadlines = deadlines.borrow_mut();
            deadlines.as_mut().and_then(|deadlines| deadlines.expire(now, &mut due))
        });
        // Woken once the list is let go: a waker may run what it wakes at once, and that may reach for the list.
        due.into_iter().for_each(Waker::wake);
        timer.as_mut().reset(next.unwrap_or_else(far));
    }
}

/// Later than any deadline: where the timer waits while no call does.
fn far() -> Instant {
    Instant::now() + std::time::Duration::from_secs(86_400 * 365)
}

impl Deadlines {
    /// Lets go of the calls due by `now`, their wakers put in `due`; the earliest deadline left, which the timer is
    /// set at.
    fn expire(&mut self, now: Instant, due: &mut Vec<Waker>) -> Option<Instant> {
        let mut earliest: Option<Instant> = None;
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let Some(waiting) = &slot.waiting else { continue };
            if waiting.until <= now {
                if let Some(waiting) = slot.waiting.take() {
                    due.push(waiting.waker);
                }
                slot.generation += 1;
                self.free.push(index);
            } else {
                earliest = Some(earliest.map_or(waiting.until, |e| e.min(waiting.until)));
            }
        }
        self.armed = earliest;
        earliest
    }

    fn join(&mut self, until: Instant, waker: &Waker) -> (usize, u64) {
        let waiting = Some(Waiting {
            until,
            waker: waker.clone(),
        });
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index].waiting = waiting;
                index
            }
            None => {
                self.slots.push(Slot { generation: 0, waiting });
                self.slots.len() - 1
            }
        };
        if self.armed.is_none_or(|armed| until < armed) {
            self.armed = Some(until);
            self.rearm = true;
            // The keeper's waker is its tokio task's, which only schedules it: woken with the list still held.
            if let Some(keeper) = &self.keeper {
                keeper.wake_by_ref();
            }
        }
        (index, self.slots[index].generation)
    }

    /// Whether the call in `index` of `generation` still waits; its waker kept up to date when so.
    fn waits(&mut self, index: usize, generation: u64, waker: &Waker) -> bool {
        match self.slots.get_mut(index) {
            Some(Slot {
                generation: current,
                waiting: Some(waiting),
            }) if *current == generation => {
                if !waiting.waker.will_wake(waker) {
                    waiting.waker = waker.clone();
                }
                true
            }
            _ => false,
        }
    }

    fn leave(&mut self, index: usize, generation: u64) {
        if let Some(slot) = self.slots.get_mut(index)
            && slot.generation == generation
            && slot.waiting.take().is_some()
        {
            slot.generation += 1;
            self.free.push(index);
        }
    }
}

/// A deadline for one call: ready once `until` has passed.
#[derive(Debug)]
struct Due {
    until: Instant,
    state: DueState,
}

#[derive(Debug)]
enum DueState {
    /// Not yet waited for.
    Idle,
    /// In the list `list` of its thread, at `index`.
    Listed {
        list: u64,
        index: usize,
        generation: u64,
    },
    /// On a thread without a list, or another than its list's: a timer of its own.
    Timer(Pin<Box<Sleep>>),
    Passed,
}

impl Due {
    fn at(until: Instant) -> Due {
        Due {
            until,
            state: DueState::Idle,
        }
    }
}

impl Future for Due {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                DueState::Passed => return Poll::Ready(()),
                DueState::Timer(timer) => {
                    std::task::ready!(timer.as_mut().poll(cx));
                    this.state = DueState::Passed;
                }
                DueState::Idle => {
                    let listed = DEADLINES.with(|deadlines| {
                        let mut deadlines = deadlines.borrow_mut();
                        let deadlines = deadlines.as_mut()?;
                        let (index, generation) = deadlines.join(this.until, cx.waker());
                        Some(DueState::Listed {
                            list: deadlines.list,
                            index,
                            generation,
                        })
                    });
                    match listed {
                        Some(listed) => {
                            this.state = listed;
                            return Poll::Pending;
                        }
                        None => this.state = DueState::Timer(Box::pin(tokio::time::sleep_until(this.until))),
                    }
                }
                &mut DueState::Listed {
                    list,
                    index,
                    generation,
                } => {
                    let waits = DEADLINES.with(|deadlines| {
                        let mut deadlines = deadlines.borrow_mut();
                        match deadlines.as_mut() {
                            Some(deadlines) if deadlines.list == list => {
                                Some(deadlines.waits(index, generation, cx.waker()))
                            }
                            _ => None,
                        }
                    });
                    match waits {
                        Some(true) => return Poll::Pending,
                        Some(false) => this.state = DueState::Passed,
                        // Moved to another thread: its slot is let go when the keeper finds it due.
                        None => this.state = DueState::Timer(Box::pin(tokio::time::sleep_until(this.until))),
                    }
                }
            }
        }
    }
}

impl Drop for Due {
    fn drop(&mut self) {
        if let DueState::Listed {
            list,
            index,
            generation,
        } = self.state
        {
            // `try_with`: a call dropped as its thread ends finds the list gone.
            let _ = DEADLINES.try_with(|deadlines| {
                if let Ok(mut deadlines) = deadlines.try_borrow_mut()
                    && let Some(deadlines) = deadlines.as_mut()
                    && deadlines.list == list
                {
                    deadlines.leave(index, generation);
                }
            });
        }
    }
}

/// Runs `call` until `until`: its output, or `Err(Elapsed)` once the deadline passed first.
pub fn timeout_at<F: Future>(until: Instant, call: F) -> Timeout<F> {
    Timeout {
        call,
        due: Due::at(until),
    }
}

/// The deadline passed before the call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

pin_project_lite::pin_project! {
    /// A call with a deadline (see [`timeout_at`]).
    #[derive(Debug)]
    pub struct Timeout<F> {
        #[pin]
        call: F,
        due: Due,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.call.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        Pin::new(this.due).poll(cx).map(|()| Err(Elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A current-thread runtime with the thread's list and its keeper, its clock paused (it moves on when idle).
    fn on_listed_thread<F: Future>(test: F) -> F::Output {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        install();
        runtime.spawn(keep());
        let output = runtime.block_on(test);
        DEADLINES.with(|deadlines| deadlines.borrow_mut().take());
        output
    }

    fn listed_slots() -> (usize, usize) {
        DEADLINES.with(|deadlines| {
            let deadlines = deadlines.borrow();
            let deadlines = deadlines.as_ref().unwrap();
            (
                deadlines.slots.len(),
                deadlines.slots.iter().filter(|slot| slot.waiting.is_some()).count(),
            )
        })
    }

    #[test]
    fn a_call_past_its_deadline_ends_there_and_one_in_time_keeps_its_answer() {
        on_listed_thread(async {
            let start = Instant::now();
            let late = timeout_at(start + Duration::from_secs(5), std::future::pending::<()>()).await;
            assert_eq!(late, Err(Elapsed));
            assert_eq!(Instant::now() - start, Duration::from_secs(5));
            let answer = timeout_at(Instant::now() + Duration::from_secs(5), async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                7
            })
            .await;
            assert_eq!(answer, Ok(7));
            assert_eq!(listed_slots().1, 0, "an answered call leaves the list");
        });
    }

    #[test]
    fn a_deadline_earlier_than_the_timer_moves_it_and_a_later_one_waits_its_turn() {
        on_listed_thread(async {
            let start = Instant::now();
            let ended = |secs: u64| {
                let until = start + Duration::from_secs(secs);
                async move {
                    let _ = timeout_at(until, std::future::pending::<()>()).await;
                    Instant::now() - start
                }
            };
            // The later deadline sets the timer first; the earlier one must move it back.
            let (late, early, middle) = tokio::join!(
                ended(30),
                async {
                    tokio::task::yield_now().await;
                    ended(10).await
                },
                async {
                    tokio::task::yield_now().await;
                    tokio::task::yield_now().await;
                    ended(20).await
                }
            );
            assert_eq!(early, Duration::from_secs(10));
            assert_eq!(middle, Duration::from_secs(20));
            assert_eq!(late, Duration::from_secs(30));
            assert_eq!(listed_slots().1, 0);
        });
    }

    #[test]
    fn slots_are_used_again_once_calls_end() {
        on_listed_thread(async {
            for _ in 0..100 {
                let answers = futures_util::future::join_all((1..=4).map(|n| {
                    timeout_at(Instant::now() + Duration::from_secs(30), async move {
                        tokio::time::sleep(Duration::from_millis(n)).await;
                        n
                    })
                }))
                .await;
                assert_eq!(answers, vec![Ok(1), Ok(2), Ok(3), Ok(4)]);
            }
            assert_eq!(listed_slots(), (4, 0));
        });
    }

    #[test]
    fn a_thread_without_the_list_times_calls_with_a_timer_of_their_own() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let start = Instant::now();
            let late = timeout_at(start + Duration::from_secs(3), std::future::pending::<()>()).await;
            assert_eq!(late, Err(Elapsed));
            assert_eq!(Instant::now() - start, Duration::from_secs(3));
        });
        assert!(DEADLINES.with(|deadlines| deadlines.borrow().is_none()));
    }
}

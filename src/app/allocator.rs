//! The process's allocator: mimalloc, with the last few tensor-sized buffers freed kept for the next ones, and the
//! periodic return of freed memory to the kernel.
//!
//! A large buffer made again soon after one was freed (a request's body, an answer, request after request) should
//! take the freed one's pages, which are still resident: no page faults, no memory added. Given back to mimalloc,
//! it now and then is not: first fit puts small pages made meanwhile into the hole the freed buffer left, or a purge
//! (mimalloc's own, once its delay runs out, or the periodic one below) holds the range while it returns it to the
//! kernel. The next large buffer then goes to fresh memory, faulted in, and what was left stays resident until the
//! next purge: scenario 4 of `scripts/bench` (64 MiB requests) saw that as a 64 MiB step in peak RSS in some rounds,
//! traced to these two causes. A buffer kept here is still in use as far as mimalloc knows, so neither can happen
//! to it, and kept ones not taken again within [`KEPT_FOR`] are given back.

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use libmimalloc_sys as ffi;
use mimalloc::MiMalloc;

/// Buffers of this size or more are kept when freed.
pub const LARGE: usize = 4 << 20;
/// How many freed large buffers are kept at most, and their bytes.
const KEPT_BUFFERS: usize = 4;
const KEPT_BYTES: usize = 512 << 20;
/// A kept buffer not taken again for this long is given back to mimalloc.
pub const KEPT_FOR: Duration = Duration::from_secs(1);

/// The largest alignment asked of mimalloc's plain entry points (`mi_malloc` and its kin): every block mimalloc makes
/// is aligned to a machine word at least. Its aligned entry points, which the `mimalloc` crate calls for every
/// layout, take their fast path only for a block of at most 1 KiB whose page has a free block at hand; otherwise they
/// over-allocate any block whose size is not a power of two, whatever its alignment (about 250 instructions more,
/// where `mi_malloc`'s own slow path takes a few dozen): a few blocks of every request.
const WORD: usize = size_of::<usize>();

/// The global allocator of the `oipgate` binary.
#[derive(Debug)]
pub struct Allocator;

/// A freed large buffer, kept: its address, the bytes mimalloc gave it, and when it was freed.
#[derive(Clone, Copy)]
struct FreedBuffers {
    address: usize,
    size: usize,
    freed: Instant,
}

/// The kept buffers. A lock is fine here: only buffers of [`LARGE`] bytes or more pass through it.
static KEPT: Mutex<[Option<FreedBuffers>; KEPT_BUFFERS]> = Mutex::new([None; KEPT_BUFFERS]);

fn kept() -> std::sync::MutexGuard<'static, [Option<FreedBuffers>; KEPT_BUFFERS]> {
    KEPT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A kept buffer that fits `layout` without wasting more than its size again, the smallest such; taken.
fn take_kept(layout: Layout) -> Option<*mut u8> {
    let mut kept = kept();
    let slot = kept
        .iter_mut()
        .filter(|slot| {
            slot.is_some_and(|buffer| {
                buffer.size >= layout.size() && buffer.size / 2 <= layout.size() && buffer.address % layout.align() == 0
            })
        })
        .min_by_key(|slot| slot.map_or(usize::MAX, |buffer| buffer.size))?;
    slot.take().map(|buffer| buffer.address as *mut u8)
}

/// Keeps a freed large buffer when there is room; `false` when it must be given back.
fn keep(ptr: *mut u8) -> bool {
    // SAFETY: `ptr` is a live mimalloc block (it is being freed).
    let size = unsafe { ffi::mi_usable_size(ptr.cast()) };
    let mut kept = kept();
    let held: usize = kept.iter().flatten().map(|buffer| buffer.size).sum();
    if held + size > KEPT_BYTES {
        return false;
    }
    let Some(slot) = kept.iter_mut().find(|slot| slot.is_none()) else {
        return false;
    };
    *slot = Some(FreedBuffers {
        address: ptr as usize,
        size,
        freed: Instant::now(),
    });
    true
}

/// Gives back to mimalloc the kept buffers freed before `before`.
fn give_back_kept(before: Instant) {
    let mut given = [None; KEPT_BUFFERS];
    {
        let mut kept = kept();
        for (slot, out) in kept.iter_mut().zip(&mut given) {
            if slot.is_some_and(|buffer| buffer.freed < before) {
                *out = slot.take();
            }
        }
    }
    for buffer in given.into_iter().flatten() {
        // SAFETY: a kept buffer is a mimalloc block no one holds.
        unsafe { ffi::mi_free(buffer.address as *mut std::ffi::c_void) }
    }
}

// SAFETY: every block is mimalloc's; a kept one is handed out again only once taken off the list, under its lock.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE
            && let Some(kept) = take_kept(layout)
        {
            return kept;
        }
        if layout.align() <= WORD {
            // SAFETY: any size; a word's alignment is every block's.
            return unsafe { ffi::mi_malloc(layout.size()).cast() };
        }
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { MiMalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // Not from the kept ones: fresh memory comes zeroed, a kept buffer would have to be cleared.
        if layout.align() <= WORD {
            // SAFETY: as `alloc`.
            return unsafe { ffi::mi_zalloc(layout.size()).cast() };
        }
        // SAFETY: as `alloc`.
        unsafe { MiMalloc.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() >= LARGE && keep(ptr) {
            return;
        }
        // SAFETY: `ptr` is a mimalloc block of `layout`.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= WORD {
            // SAFETY: the caller's block (a mimalloc one) and size; the new block is aligned as every block is.
            return unsafe { ffi::mi_realloc(ptr.cast(), new_size).cast() };
        }
        // SAFETY: the caller's block, layout and size, as `GlobalAlloc::realloc` requires.
        unsafe { MiMalloc.realloc(ptr, layout, new_size) }
    }
}

/// Gives back the large buffers kept longer than [`KEPT_FOR`], and returns the memory mimalloc holds freed to the
/// kernel (`mi_collect`).
pub fn release_freed_memory() {
    if let Some(before) = Instant::now().checked_sub(KEPT_FOR) {
        give_back_kept(before);
    }
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread at any time.
    unsafe { ffi::mi_collect(true) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests share the one list of kept buffers.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn kept_count() -> usize {
        kept().iter().flatten().count()
    }

    fn kept_addresses() -> Vec<*mut u8> {
        kept()
            .iter()
            .flatten()
            .map(|buffer| buffer.address as *mut u8)
            .collect()
    }

    /// Takes the tests' turn, with no buffer kept.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        let turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
        give_back_kept(Instant::now() + KEPT_FOR);
        turn
    }

    /// The failure the list is for: a large buffer freed, small allocations made meanwhile, and the next large
    /// buffer made where the last one was, not in fresh memory.
    #[test]
    fn a_large_buffer_is_made_again_where_the_last_one_was_whatever_is_made_between() {
        let _serial = serial();
        let large = Layout::from_size_align(64 << 20, 8).unwrap();
        let small = Layout::from_size_align(64 << 10, 8).unwrap();
        // SAFETY: each block is freed once, with the layout it was made with.
        unsafe {
            let first = Allocator.alloc(large);
            let second = Allocator.alloc(large);
            assert!(!first.is_null() && !second.is_null());
            first.write_bytes(1, large.size());
            Allocator.dealloc(second, large);
            Allocator.dealloc(first, large);
            let between: Vec<*mut u8> = (0..2048).map(|_| Allocator.alloc(small)).collect();
            let again = [Allocator.alloc(large), Allocator.alloc(large)];
            assert!(again.contains(&first), "the next large buffer took fresh memory");
            assert!(again.contains(&second), "the next large buffer took fresh memory");
            for block in again {
                Allocator.dealloc(block, large);
            }
            for block in between {
                Allocator.dealloc(block, small);
            }
            give_back_kept(Instant::now() + KEPT_FOR);
        }
    }

    #[test]
    fn kept_buffers_are_bounded_fitted_and_given_back_once_old() {
        let _serial = serial();
        let large = Layout::from_size_align(LARGE, 8).unwrap();
        let huge = Layout::from_size_align(16 * LARGE, 8).unwrap();
        // SAFETY: each block is freed once, with the layout it was made with.
        unsafe {
            let blocks: Vec<*mut u8> = (0..KEPT_BUFFERS + 2).map(|_| Allocator.alloc(large)).collect();
            for block in &blocks {
                Allocator.dealloc(*block, large);
            }
            assert_eq!(
                kept_count(),
                KEPT_BUFFERS,
                "more freed buffers kept than the list holds"
            );
            // A kept buffer too small, or more than twice too large, is not handed out.
            let kept = kept_addresses();
            let other = Allocator.alloc(huge);
            assert!(!kept.contains(&other));
            give_back_kept(Instant::now() + KEPT_FOR);
            Allocator.dealloc(other, huge);
            assert_eq!(kept_addresses(), [other]);
            let small = Allocator.alloc(large);
            assert_ne!(small, other, "a buffer sixteen times too large was handed out");
            Allocator.dealloc(small, large);
            let fitting = Allocator.alloc(Layout::from_size_align(9 * LARGE, 8).unwrap());
            assert_eq!(fitting, other, "a kept buffer that fits was not handed out");
            Allocator.dealloc(fitting, huge);
            // Zeroed memory is never a kept buffer's.
            let zeroed = Allocator.alloc_zeroed(large);
            assert!(std::slice::from_raw_parts(zeroed, LARGE).iter().all(|byte| *byte == 0));
            Allocator.dealloc(zeroed, large);
            assert_eq!(kept_count(), 3);
            give_back_kept(Instant::now() - KEPT_FOR);
            assert_eq!(kept_count(), 3, "a buffer freed just now was given back");
            give_back_kept(Instant::now() + KEPT_FOR);
            assert_eq!(kept_count(), 0, "an old kept buffer was not given back");
        }
    }

    /// Every block is aligned as its layout asks, whichever entry point made it (the plain ones up to a word, the
    /// aligned ones past it), across the sizes mimalloc sorts differently (small, over 1 KiB, not a power of two,
    /// below their alignment), and keeps its bytes through a reallocation.
    #[test]
    fn every_block_is_aligned_as_asked_and_keeps_its_bytes_when_moved() {
        let _serial = serial();
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for size in [1_usize, 3, 8, 24, 40, 100, 1000, 1025, 4120, 8192, 70_000, 1 << 20] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: each block is freed once, with the layout it was made with.
                unsafe {
                    let block = Allocator.alloc(layout);
                    assert!(!block.is_null());
                    assert_eq!(block as usize % align, 0, "{size} bytes aligned to {align}");
                    block.write_bytes(7, size);
                    let grown = Allocator.realloc(block, layout, size * 3);
                    assert_eq!(grown as usize % align, 0, "{size} bytes grown, aligned to {align}");
                    assert!(std::slice::from_raw_parts(grown, size).iter().all(|byte| *byte == 7));
                    Allocator.dealloc(grown, Layout::from_size_align(size * 3, align).unwrap());
                    let zeroed = Allocator.alloc_zeroed(layout);
                    assert_eq!(zeroed as usize % align, 0, "{size} zeroed bytes aligned to {align}");
                    assert!(std::slice::from_raw_parts(zeroed, size).iter().all(|byte| *byte == 0));
                    Allocator.dealloc(zeroed, layout);
                }
            }
        }
    }
}

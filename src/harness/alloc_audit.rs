//! Marks which code is "the platform" for the zero-allocation proof of the recovery path.
//!
//! In a real deployment the NVMe-oF host sits on a kernel and a NIC: the verbs provider, the
//! device list and the RDMA connection manager are not the host's code and their memory is
//! not the host's to preallocate. Here the soft-HCA plays all three in the same process, so a
//! counting global allocator would see its allocations too. Code that stands in for the
//! platform runs inside [`platform`] (a closure) or [`Platform`] (a future), which raise a
//! thread-local depth; a test allocator asks [`in_platform`] and counts only the host's own
//! allocations. Threads that are entirely somebody else's (the built-in target, which is
//! another machine in a real setup) call [`mark_thread_platform`].
//!
//! The cost outside tests is one thread-local increment and decrement per verbs call.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// True while the current thread runs platform code (the soft-HCA, its CM, its device list,
/// or a thread marked with [`mark_thread_platform`]).
pub fn in_platform() -> bool {
    DEPTH.try_with(|d| d.get() > 0).unwrap_or(true)
}

/// Run `f` as platform code.
pub fn platform<R>(f: impl FnOnce() -> R) -> R {
    let _g = Guard::enter();
    f()
}

/// Run the rest of the current scope as platform code: the returned guard ends it. Not to
/// be held across an `.await` (the depth is the thread's; use [`Platform`] for futures).
#[must_use = "the guard ends the platform section when dropped"]
pub fn enter() -> impl Drop {
    Guard::enter()
}

/// Mark the whole current thread as platform code (for its lifetime).
pub fn mark_thread_platform() {
    let _ = DEPTH.try_with(|d| d.set(d.get() + 1));
}

struct Guard;

impl Guard {
    fn enter() -> Guard {
        let _ = DEPTH.try_with(|d| d.set(d.get() + 1));
        Guard
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
    }
}

pin_project_lite::pin_project! {
    /// A future whose every poll runs as platform code.
    pub struct Platform<F> {
        #[pin]
        inner: F,
    }
}

impl<F> Platform<F> {
    pub fn new(inner: F) -> Platform<F> {
        Platform { inner }
    }
}

impl<F: Future> Future for Platform<F> {
    type Output = F::Output;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _g = Guard::enter();
        self.project().inner.poll(cx)
    }
}

/// Host work that runs once recovery has ended, beside the recovery path and not on it (the
/// namespace rescan each time a controller is LIVE again). A test that stops counting when
/// it sees LIVE may still overlap its first steps, so its polls are counted apart, with the
/// platform's. Not for anything that runs before the held I/O is resubmitted.
pub fn after_recovery<F: Future>(f: F) -> Platform<F> {
    Platform::new(f)
}

/// Spawn a platform task: its creation and every poll count as platform code.
pub fn spawn<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    platform(|| tokio::spawn(Platform::new(f)))
}

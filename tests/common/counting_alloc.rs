//! A counting global allocator for the zero-allocation proofs of the recovery path
//! (`tests/recovery_alloc.rs` on the soft-HCA, `tests/hw_backend.rs` on a kernel device).
//! Allocations of the platform (see `nvmf_rdma::harness::alloc_audit`) are counted apart.
//!
//! Use: `#[global_allocator] static A: counting_alloc::Counting = counting_alloc::Counting;`
//! then [`start`] ... [`stop`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use nvmf_rdma::harness::alloc_audit;

pub struct Counting;

static RECORDING: AtomicBool = AtomicBool::new(false);
static HOST_ALLOCS: AtomicU64 = AtomicU64::new(0);
static PLATFORM_ALLOCS: AtomicU64 = AtomicU64::new(0);
static LIVE_BYTES: AtomicI64 = AtomicI64::new(0);
static TRACES: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// What was counted between [`start`] and [`stop`].
pub struct Counted {
    pub host: u64,
    pub platform: u64,
    /// Backtraces of the first few host allocations.
    pub traces: Vec<String>,
}

/// Count from now on.
pub fn start() {
    HOST_ALLOCS.store(0, Ordering::SeqCst);
    PLATFORM_ALLOCS.store(0, Ordering::SeqCst);
    if let Ok(mut t) = TRACES.lock() {
        t.clear();
    }
    RECORDING.store(true, Ordering::SeqCst);
}

/// Stop counting; what was counted.
pub fn stop() -> Counted {
    RECORDING.store(false, Ordering::SeqCst);
    Counted {
        host: HOST_ALLOCS.load(Ordering::SeqCst),
        platform: PLATFORM_ALLOCS.load(Ordering::SeqCst),
        traces: TRACES.lock().map(|t| t.clone()).unwrap_or_default(),
    }
}

/// Bytes live on the heap now (every allocation, counted or not).
#[allow(dead_code)]
pub fn live_bytes() -> i64 {
    LIVE_BYTES.load(Ordering::SeqCst)
}

fn on_alloc(size: usize) {
    LIVE_BYTES.fetch_add(size as i64, Ordering::Relaxed);
    if !RECORDING.load(Ordering::Relaxed) {
        return;
    }
    if alloc_audit::in_platform() {
        PLATFORM_ALLOCS.fetch_add(1, Ordering::Relaxed);
        return;
    }
    HOST_ALLOCS.fetch_add(1, Ordering::Relaxed);
    // Keep where the first few came from (the capture allocates: not counted, guarded).
    let reentered = IN_HOOK.try_with(|h| h.replace(true)).unwrap_or(true);
    if !reentered {
        let bt = std::backtrace::Backtrace::force_capture().to_string();
        if let Ok(mut t) = TRACES.lock() {
            if t.len() < 4 {
                t.push(bt);
            }
        }
        let _ = IN_HOOK.try_with(|h| h.set(false));
    }
}

fn hooked(size: usize) {
    if !IN_HOOK.try_with(|h| h.get()).unwrap_or(true) {
        on_alloc(size);
    } else {
        LIVE_BYTES.fetch_add(size as i64, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        hooked(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        hooked(l.size());
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE_BYTES.fetch_sub(l.size() as i64, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE_BYTES.fetch_sub(l.size() as i64, Ordering::Relaxed);
        hooked(new);
        unsafe { System.realloc(p, l, new) }
    }
}

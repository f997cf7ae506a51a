//! Who runs the engine's async work.
//!
//! - `runtime_threads=0` (default), inline: a current-thread runtime that the fio job threads
//!   drive themselves while they wait in `getevents`. An I/O then costs the same thread
//!   hand-offs as `nvmf-rdma bench` (host thread <-> target thread) and no more. A keeper
//!   thread drives the runtime only when no fio thread has for a while (fio busy elsewhere,
//!   between jobs, `thinktime`), so keep-alives and timers never stall.
//! - `runtime_threads=N`: the runtime runs on N threads of its own (current-thread for 1,
//!   multi-thread above) and fio threads sleep until completions arrive.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::{Builder, Handle, Runtime};

/// How long the runtime may go undriven before the keeper steps in, and for how long it then
/// drives before letting a fio thread take over again.
const KEEPER_IDLE: Duration = Duration::from_millis(20);
const KEEPER_TURN: Duration = Duration::from_millis(2);

/// Whether fio threads are driving the inline runtime, and since when nobody has.
pub struct Activity {
    epoch: Instant,
    /// Threads inside `block_on` right now.
    inside: AtomicUsize,
    /// When the last one left, in µs since `epoch`.
    last_us: AtomicU64,
    stop: AtomicBool,
}

impl Activity {
    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }
}

/// What job threads use to spawn I/O and to wait.
#[derive(Clone)]
pub enum Driver {
    Inline(Arc<Runtime>, Arc<Activity>),
    Dedicated(Handle),
}

impl Driver {
    pub fn handle(&self) -> Handle {
        match self {
            Driver::Inline(rt, _) => rt.handle().clone(),
            Driver::Dedicated(h) => h.clone(),
        }
    }

    /// Run `f` to completion on this (non-runtime) thread; inline, this thread drives the
    /// runtime meanwhile (or waits for the thread that does).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        match self {
            Driver::Inline(rt, act) => {
                act.inside.fetch_add(1, Ordering::AcqRel);
                let r = rt.block_on(f);
                act.last_us.store(act.now_us(), Ordering::Release);
                act.inside.fetch_sub(1, Ordering::AcqRel);
                r
            }
            Driver::Dedicated(h) => h.block_on(f),
        }
    }
}

/// The runtime and the thread(s) that keep it going.
pub struct EngineRt {
    pub driver: Driver,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EngineRt {
    pub fn start(threads: usize) -> Result<EngineRt, String> {
        let err = |e: std::io::Error| format!("cannot start the async runtime: {e}");
        if threads == 0 {
            let rt = Arc::new(
                Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(err)?,
            );
            let act = Arc::new(Activity {
                epoch: Instant::now(),
                inside: AtomicUsize::new(0),
                last_us: AtomicU64::new(0),
                stop: AtomicBool::new(false),
            });
            let (rt2, act2) = (rt.clone(), act.clone());
            let thread = std::thread::Builder::new()
                .name("nvmf-fio-keep".into())
                .spawn(move || keeper(rt2, act2))
                .map_err(err)?;
            return Ok(EngineRt {
                driver: Driver::Inline(rt, act),
                stop: None,
                thread: Some(thread),
            });
        }
        let rt = if threads == 1 {
            Builder::new_current_thread().enable_all().build()
        } else {
            Builder::new_multi_thread()
                .worker_threads(threads - 1)
                .thread_name("nvmf-fio-rt")
                .enable_all()
                .build()
        }
        .map_err(err)?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("nvmf-fio-rt".into())
            .spawn(move || {
                let _ = rt.block_on(stopped);
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(err)?;
        Ok(EngineRt {
            driver: Driver::Dedicated(handle),
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn stop(mut self) {
        if let Driver::Inline(_, act) = &self.driver {
            act.stop.store(true, Ordering::Release);
        }
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Drive the inline runtime whenever no fio thread has for `KEEPER_IDLE`.
fn keeper(rt: Arc<Runtime>, act: Arc<Activity>) {
    while !act.stop.load(Ordering::Acquire) {
        std::thread::park_timeout(KEEPER_IDLE);
        let idle = act
            .now_us()
            .saturating_sub(act.last_us.load(Ordering::Acquire));
        if act.inside.load(Ordering::Acquire) == 0 && idle >= KEEPER_IDLE.as_micros() as u64 {
            // The timer must be made inside the runtime's context, hence the async block.
            rt.block_on(async { tokio::time::sleep(KEEPER_TURN).await });
        }
    }
}

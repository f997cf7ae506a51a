//! One fio job thread's side of the engine: `queue` gathers I/O, `commit` hands it to the
//! runtime as tasks on the shared controller, each task puts its `io_u` into this thread's
//! completion ring, and `getevents` takes from the ring (with fio's timeout) until enough are
//! back, driving the runtime meanwhile when it is the inline kind. Nothing spins: a waiting
//! thread parks in the runtime's epoll or on a futex.
//!
//! Inline, the runtime turns only in `getevents`, and only when the ring cannot answer it:
//! completions already there are handed back at once, and the I/O fio committed meanwhile
//! starts as one batch at the next turn. With fio's defaults (one completion reaped, one I/O
//! submitted per call) this is what keeps the host stack sending commands in batches.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nvmf_rdma::transport::{Controller, HostError};
use tokio::sync::Notify;

use crate::engine::Ctrl;
use crate::runtime::Driver;

/// What fio asked for; numbers shared with the C shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read = 0,
    Write = 1,
    Flush = 2,
    Trim = 3,
}

impl Op {
    pub fn from_raw(op: i32) -> Option<Op> {
        match op {
            0 => Some(Op::Read),
            1 => Some(Op::Write),
            2 => Some(Op::Flush),
            3 => Some(Op::Trim),
            _ => None,
        }
    }
}

/// An opened fio file: a namespace on a shared controller.
pub struct File {
    pub ctrl: Arc<Ctrl>,
    pub nsid: u32,
    pub block_size: u64,
}

/// fio's memory, valid from `queue` until the `io_u` is handed back by `event`.
#[derive(Clone, Copy)]
struct FioBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: fio does not touch an io_u's buffer between queue and event; the one task that owns
// the I/O is the only user of the pointer in that time.
unsafe impl Send for FioBuf {}

impl FioBuf {
    /// SAFETY: see the `Send` impl; the caller is the task that owns the I/O.
    unsafe fn bytes(&self) -> &'static [u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }
    unsafe fn bytes_mut(&self) -> &'static mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// An I/O handed to us by `queue`, not yet committed.
struct Pending {
    io_u: usize,
    op: Op,
    ctrl: Arc<Controller>,
    nsid: u32,
    lba: u64,
    blocks: u64,
    buf: FioBuf,
}

/// A finished I/O: fio's `io_u` and the errno for `io_u->error` (0 = success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub io_u: usize,
    pub error: i32,
}

#[derive(Default)]
struct RingState {
    done: VecDeque<Done>,
    /// How many completions the waiting `getevents` needs (0: nobody waits), so a completion
    /// only wakes it when it can return.
    want: usize,
}

/// Completions from the I/O tasks to the fio thread.
#[derive(Default)]
pub struct Ring {
    st: Mutex<RingState>,
    ready: Notify,
}

impl Ring {
    fn lock(&self) -> MutexGuard<'_, RingState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn complete(&self, d: Done) {
        let mut s = self.lock();
        s.done.push_back(d);
        if s.want > 0 && s.done.len() >= s.want {
            s.want = 0;
            drop(s);
            self.ready.notify_one();
        }
    }

    /// Take up to `max` if at least `min` are there; otherwise say how many are missing.
    fn take(&self, min: usize, max: usize, out: &mut Vec<Done>) -> Option<usize> {
        let mut s = self.lock();
        if s.done.len() < min {
            s.want = min;
            return None;
        }
        s.want = 0;
        let n = s.done.len().min(max);
        out.extend(s.done.drain(..n));
        Some(n)
    }

    /// Take up to `max` if at least `min` (at least one) are there already, without waiting.
    pub fn take_ready(&self, min: usize, max: usize, out: &mut Vec<Done>) -> Option<usize> {
        let mut s = self.lock();
        if s.done.is_empty() || s.done.len() < min {
            return None;
        }
        let n = s.done.len().min(max);
        out.extend(s.done.drain(..n));
        Some(n)
    }

    /// Wait until `min` completions are there or `timeout` passes; take up to `max`.
    ///
    /// `outstanding` is how many I/Os are out. Once `min` are in and more are still out, the
    /// runtime gets a few more non-blocking turns (one `epoll_wait(0)` each) while they keep
    /// bringing completions, so a batching fio (`iodepth_batch_complete_max`) reaps a batch
    /// rather than the first completion of one.
    pub async fn wait(
        &self,
        min: usize,
        max: usize,
        outstanding: usize,
        timeout: Option<Duration>,
        out: &mut Vec<Done>,
    ) -> usize {
        // Let the runtime turn once even when nothing needs waiting for (min = 0), so a
        // polling fio still makes progress when its own thread drives the runtime.
        tokio::task::yield_now().await;
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let mut n = loop {
            let ready = self.ready.notified();
            if let Some(n) = self.take(min, max, out) {
                break n;
            }
            match deadline {
                None => ready.await,
                Some(d) => {
                    if tokio::time::timeout_at(d, ready).await.is_err() {
                        return self.take(0, max, out).unwrap_or(0);
                    }
                }
            }
        };
        if min == 0 {
            return n;
        }
        for _ in 0..COLLECT_TURNS {
            if n >= max || n >= outstanding {
                break;
            }
            tokio::task::yield_now().await;
            match self.take(0, max - n, out) {
                Some(m) if m > 0 => n += m,
                _ => break,
            }
        }
        n
    }
}

/// At most this many extra runtime turns to gather completions once `min` are in.
const COLLECT_TURNS: usize = 4;

/// I/O errors one job saw: how many, and the first one's text.
#[derive(Default)]
pub struct ErrorLog {
    count: AtomicU64,
    first: Mutex<Option<String>>,
}

impl ErrorLog {
    fn record(&self, job: &str, what: &str, e: &HostError) {
        let n = self.count.fetch_add(1, Ordering::Relaxed);
        if n == 0 {
            let msg = format!("{what}: {e}");
            eprintln!("nvmf-rdma: {job}: I/O error: {msg}");
            *self.first.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
        }
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// The errno fio reports for a failed request.
pub fn errno(e: &HostError) -> i32 {
    match e {
        HostError::Invalid(_) => libc::EINVAL,
        HostError::Timeout(_) => libc::ETIMEDOUT,
        _ => libc::EIO,
    }
}

/// One fio job (thread or process) using the engine.
pub struct Thread {
    pub job: Arc<str>,
    pub driver: Driver,
    pub rt: tokio::runtime::Handle,
    ring: Arc<Ring>,
    pending: Vec<Pending>,
    events: Vec<Done>,
    /// Committed and not yet handed back to fio.
    inflight: usize,
    /// Inline: how many of `pending` are committed, to be started by the next `getevents`.
    staged: usize,
    pub errors: Arc<ErrorLog>,
}

impl Thread {
    pub fn new(job: &str, driver: Driver, iodepth: usize) -> Thread {
        Thread {
            job: job.into(),
            rt: driver.handle(),
            driver,
            ring: Arc::default(),
            pending: Vec::with_capacity(iodepth),
            events: Vec::with_capacity(iodepth),
            inflight: 0,
            staged: 0,
            errors: Arc::default(),
        }
    }

    /// Check and keep one I/O for the next commit. `Err` is an errno for fio, now.
    pub fn queue(
        &mut self,
        f: &File,
        io_u: usize,
        op: Op,
        offset: u64,
        buf: *mut u8,
        len: u64,
    ) -> Result<(), i32> {
        let (lba, blocks) = match op {
            Op::Flush => (0, 0),
            _ => {
                if offset % f.block_size != 0 || len % f.block_size != 0 || len == 0 {
                    self.errors.record(
                        &self.job,
                        &format!("{op:?} at {offset}+{len}"),
                        &HostError::Invalid(format!(
                            "not aligned to the {}-byte block size (set bs and offsets to \
                             multiples of it)",
                            f.block_size
                        )),
                    );
                    return Err(libc::EINVAL);
                }
                (offset / f.block_size, len / f.block_size)
            }
        };
        if op == Op::Trim && blocks > u32::MAX as u64 {
            return Err(libc::EINVAL);
        }
        let len = usize::try_from(len).map_err(|_| libc::EINVAL)?;
        self.pending.push(Pending {
            io_u,
            op,
            ctrl: f.ctrl.ctrl.clone(),
            nsid: f.nsid,
            lba,
            blocks,
            buf: FioBuf { ptr: buf, len },
        });
        Ok(())
    }

    /// Start everything queued since the last commit.
    ///
    /// Inline, nothing runs the host stack until a fio thread's next `getevents`, so the
    /// I/O is only marked committed here and starts there, as one batch spawned on the
    /// runtime's own queue: no cross-thread wakeup (eventfd write) per I/O, and the queue
    /// task sends the whole batch in one turn (one datagram run).
    pub fn commit(&mut self) {
        if matches!(self.driver, Driver::Inline(..)) {
            self.inflight += self.pending.len() - self.staged;
            self.staged = self.pending.len();
            return;
        }
        if self.pending.is_empty() {
            return;
        }
        self.inflight += self.pending.len();
        let ring = self.ring.clone();
        let errors = self.errors.clone();
        let job = self.job.clone();
        if self.pending.len() == 1 {
            let p = self.pending.pop().expect("one pending I/O");
            self.rt.spawn(run(p, ring, errors, job));
        } else {
            // One hand-off to the runtime for the whole batch; the tasks then start on the
            // worker's local queue.
            let batch = std::mem::take(&mut self.pending);
            self.pending.reserve(batch.len());
            self.rt.spawn(async move {
                for p in batch {
                    tokio::spawn(run(p, ring.clone(), errors.clone(), job.clone()));
                }
            });
        }
    }

    /// fio's getevents: at least `min` (never more than are in flight), at most `max`.
    ///
    /// Completions already in the ring are handed back without turning the runtime: with
    /// fio's defaults (`iodepth_batch_complete_max` = 1) fio reaps one I/O per call, and a
    /// runtime turn per call would send the I/O it queues in between one at a time. This
    /// way the runtime turns only once the ring is empty, with everything fio queued since
    /// then to send at once.
    pub fn getevents(&mut self, min: usize, max: usize, timeout: Option<Duration>) -> usize {
        self.commit();
        self.events.clear();
        let min = min.min(self.inflight);
        if min > 0 {
            if let Some(n) = self.ring.take_ready(min, max, &mut self.events) {
                self.inflight -= n;
                return n;
            }
        }
        let (ring, events, pending) = (&self.ring, &mut self.events, &mut self.pending);
        let (errors, job) = (&self.errors, &self.job);
        let outstanding = self.inflight;
        self.staged = 0;
        let n = self.driver.block_on(async {
            // Inline: what commit staged starts now, from inside the runtime.
            for p in pending.drain(..) {
                tokio::spawn(run(p, ring.clone(), errors.clone(), job.clone()));
            }
            ring.wait(min, max, outstanding, timeout, events).await
        });
        self.inflight -= n;
        n
    }

    pub fn event(&self, i: usize) -> Option<Done> {
        self.events.get(i).copied()
    }

    /// Wait for every I/O still out: their tasks write into fio's buffers, which fio frees
    /// after cleanup.
    pub fn drain(&mut self) {
        self.commit();
        while self.inflight > 0 {
            let n = self.getevents(self.inflight, usize::MAX, Some(Duration::from_secs(10)));
            if n == 0 {
                eprintln!(
                    "nvmf-rdma: {}: waiting for {} I/Os still out",
                    self.job, self.inflight
                );
            }
        }
    }
}

async fn run(p: Pending, ring: Arc<Ring>, errors: Arc<ErrorLog>, job: Arc<str>) {
    let c = &p.ctrl;
    let r = match p.op {
        // SAFETY (both): the task owns the I/O until it completes it below.
        // The data is copied once, from the command's response straight into fio's buffer.
        Op::Read => {
            c.read_into(p.nsid, p.lba, unsafe { p.buf.bytes_mut() })
                .await
        }
        Op::Write => c.write(p.nsid, p.lba, unsafe { p.buf.bytes() }).await,
        Op::Flush => c.flush(p.nsid).await,
        Op::Trim => c.deallocate(p.nsid, &[(p.lba, p.blocks as u32)]).await,
    };
    let error = match r {
        Ok(()) => 0,
        Err(e) => {
            errors.record(
                &job,
                &format!("{:?} of {} blocks at LBA {}", p.op, p.blocks, p.lba),
                &e,
            );
            errno(&e)
        }
    };
    ring.complete(Done {
        io_u: p.io_u,
        error,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn ring_wakes_only_when_enough_are_done() {
        let ring = Arc::new(Ring::default());
        let r2 = ring.clone();
        let t = std::thread::spawn(move || {
            let mut out = Vec::new();
            let n = rt().block_on(r2.wait(3, 8, 3, None, &mut out));
            (n, out)
        });
        for i in 0..3 {
            ring.complete(Done { io_u: i, error: 0 });
        }
        let (n, out) = t.join().unwrap();
        assert_eq!(n, 3);
        assert_eq!(out.iter().map(|d| d.io_u).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn ring_timeout_returns_what_is_there() {
        let ring = Ring::default();
        ring.complete(Done { io_u: 7, error: 5 });
        let mut out = Vec::new();
        let rt = rt();
        let n = rt.block_on(ring.wait(2, 8, 2, Some(Duration::from_millis(20)), &mut out));
        assert_eq!((n, &out[..]), (1, &[Done { io_u: 7, error: 5 }][..]));
        let n = rt.block_on(ring.wait(0, 8, 0, Some(Duration::ZERO), &mut out));
        assert_eq!(n, 0);
    }

    #[test]
    fn take_ready_only_takes_what_is_there() {
        let ring = Ring::default();
        let mut out = Vec::new();
        assert_eq!(ring.take_ready(1, 8, &mut out), None, "empty");
        ring.complete(Done { io_u: 1, error: 0 });
        assert_eq!(ring.take_ready(2, 8, &mut out), None, "fewer than min");
        assert!(out.is_empty());
        ring.complete(Done { io_u: 2, error: 0 });
        ring.complete(Done { io_u: 3, error: 0 });
        assert_eq!(ring.take_ready(1, 2, &mut out), Some(2), "at most max");
        assert_eq!(ring.take_ready(1, 2, &mut out), Some(1));
        assert_eq!(out.iter().map(|d| d.io_u).collect::<Vec<_>>(), [1, 2, 3]);
    }

    #[test]
    fn wait_gathers_completions_that_arrive_in_the_next_turns() {
        let rt = rt();
        let ring = Arc::new(Ring::default());
        ring.complete(Done { io_u: 1, error: 0 });
        let r2 = ring.clone();
        let mut out = Vec::new();
        let n = rt.block_on(async {
            // Completes a second I/O a couple of runtime turns later, as a reply that arrives
            // just after the first would.
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                r2.complete(Done { io_u: 2, error: 0 });
            });
            ring.wait(1, 8, 2, None, &mut out).await
        });
        assert_eq!(
            n, 2,
            "min was 1, but the second completion came while gathering"
        );
        assert_eq!(out.iter().map(|d| d.io_u).collect::<Vec<_>>(), [1, 2]);
        // Nothing more out: it returns with what it has instead of waiting for more turns.
        ring.complete(Done { io_u: 3, error: 0 });
        out.clear();
        assert_eq!(rt.block_on(ring.wait(1, 8, 1, None, &mut out)), 1);
    }

    #[test]
    fn ring_respects_max() {
        let ring = Ring::default();
        for i in 0..5 {
            ring.complete(Done { io_u: i, error: 0 });
        }
        let mut out = Vec::new();
        let rt = rt();
        assert_eq!(rt.block_on(ring.wait(1, 2, 5, None, &mut out)), 2);
        out.clear();
        assert_eq!(rt.block_on(ring.wait(1, 8, 3, None, &mut out)), 3);
        assert_eq!(out[0].io_u, 2);
    }
}

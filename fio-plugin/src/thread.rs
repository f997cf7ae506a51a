//! One fio job thread's side of the engine: `queue` gathers I/O, `commit` marks it
//! committed, and `getevents` starts what was committed and polls the job's I/O futures
//! (with fio's timeout) until enough are done, driving the runtime meanwhile when it is the
//! inline kind. Nothing spins: a waiting thread parks in the runtime's epoll or on a futex.
//!
//! The runtime turns only in `getevents`: when no finished I/O is left to hand back, or
//! when what fio committed since the last turn has grown to half of what is in flight
//! ([`start_early`]). Completions already taken are returned at once, and the I/O fio
//! committed meanwhile starts as one batch at the next turn. With fio's defaults (one
//! completion reaped, one I/O submitted per call) this is what keeps the host stack sending
//! commands in batches, two half-depth batches at a time rather than one of the whole depth.
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use nvmf_rdma::multipath::MpNamespace;
use nvmf_rdma::transport::{Controller, HostError, IoBuffer};

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

/// An opened fio file: a namespace on a shared controller, or on every path of a subsystem.
pub struct File {
    pub io: FileIo,
    pub nsid: u32,
    pub block_size: u64,
}

/// What a file's I/O goes to.
pub enum FileIo {
    /// One controller: the command goes on it, from fio's buffer when that is registered.
    Ctrl(Arc<Ctrl>),
    /// A namespace over several paths: the library's multipath chooses the path of each
    /// command and moves it when its path fails.
    Multipath(Arc<MpNamespace>),
}

/// Where one I/O goes.
enum Target {
    Ctrl(Arc<Controller>),
    Multipath(Arc<MpNamespace>),
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
// SAFETY: shared only by reference within that one task.
unsafe impl Sync for FioBuf {}

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
    target: Target,
    nsid: u32,
    lba: u64,
    blocks: u64,
    buf: FioBuf,
    /// fio's buffer is this chunk of the job's registered memory: no copy.
    registered: Option<(Arc<IoBuffer>, usize)>,
}

/// A finished I/O: fio's `io_u` and the errno for `io_u->error` (0 = success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub io_u: usize,
    pub error: i32,
}

/// How one I/O ended, before it is handed to fio.
struct Finished {
    io_u: usize,
    op: Op,
    lba: u64,
    blocks: u64,
    result: Result<(), HostError>,
}

/// The I/O one fio job has started, and its completions not yet handed to fio.
///
/// The I/O futures belong to the job and are polled by its own thread in `getevents`, not
/// spawned as tasks: a command is posted by the first poll, and its completion (data copied
/// into fio's buffer) is taken by the poll that finds its response in. No task, channel or
/// lock stands between the response and fio.
pub struct Reaper<T> {
    running: FuturesUnordered<Pin<Box<dyn Future<Output = T> + Send>>>,
    done: VecDeque<T>,
    stall: StallMeter,
}

impl<T> Default for Reaper<T> {
    fn default() -> Self {
        Reaper {
            running: FuturesUnordered::new(),
            done: VecDeque::new(),
            stall: StallMeter::default(),
        }
    }
}

/// The longest time I/O was out with nothing completing: from the moment I/O started with
/// none out, or from the last completion while more stayed out, to the next completion. A
/// path failing under I/O shows here as the time its commands took to finish elsewhere.
#[derive(Debug, Default)]
pub struct StallMeter {
    /// Since when the I/O out has seen no completion; `None` with nothing out.
    since: Option<Instant>,
    longest: Duration,
}

impl StallMeter {
    /// I/O started at `now`; with none out before, the wait for a completion starts.
    pub fn on_start(&mut self, now: Instant) {
        self.since.get_or_insert(now);
    }

    /// An I/O completed at `now`; `more_out`: others are still out, so the next wait starts.
    pub fn on_complete(&mut self, now: Instant, more_out: bool) {
        if let Some(s) = self.since {
            self.longest = self.longest.max(now.saturating_duration_since(s));
        }
        self.since = more_out.then_some(now);
    }

    pub fn longest(&self) -> Duration {
        self.longest
    }
}

impl<T> Reaper<T> {
    /// Take `fut` in; it starts at the next poll (the next `wait`).
    pub fn start(&mut self, fut: Pin<Box<dyn Future<Output = T> + Send>>) {
        self.stall.on_start(Instant::now());
        self.running.push(fut);
    }

    /// The longest stall so far ([`StallMeter`]).
    pub fn longest_stall(&self) -> Duration {
        self.stall.longest()
    }

    /// Started and not yet taken.
    pub fn outstanding(&self) -> usize {
        self.running.len() + self.done.len()
    }

    /// Hand out up to `max` if at least `min` (and at least one) are done already, without
    /// polling anything.
    pub fn take_ready(&mut self, min: usize, max: usize, out: &mut Vec<T>) -> Option<usize> {
        if self.done.is_empty() || self.done.len() < min {
            return None;
        }
        Some(self.take(max, out))
    }

    fn take(&mut self, max: usize, out: &mut Vec<T>) -> usize {
        let n = self.done.len().min(max);
        out.extend(self.done.drain(..n));
        n
    }

    /// Poll what is running once; what finished moves to `done`.
    fn poll_some(&mut self, cx: &mut Context<'_>) {
        // One clock read per poll: completions found by the same poll finished together.
        let mut now = None;
        while let Poll::Ready(Some(d)) = self.running.poll_next_unpin(cx) {
            self.done.push_back(d);
            let t = *now.get_or_insert_with(Instant::now);
            self.stall.on_complete(t, !self.running.is_empty());
        }
    }

    /// Poll what is running once, from inside the runtime, without waiting.
    async fn poll_now(&mut self) {
        poll_fn(|cx| {
            self.poll_some(cx);
            Poll::Ready(())
        })
        .await
    }

    /// Run until `min` are done or `timeout` passes; hand out up to `max`.
    ///
    /// New I/O is polled (its commands posted) first, then the runtime gets a turn to send
    /// them. Once `min` are in and more are still out, the runtime gets a few more
    /// non-blocking turns while they keep finishing, so a batching fio
    /// (`iodepth_batch_complete_max`) reaps a batch rather than the first completion of one.
    pub async fn wait(
        &mut self,
        min: usize,
        max: usize,
        timeout: Option<Duration>,
        out: &mut Vec<T>,
    ) -> usize {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        self.poll_now().await;
        if min == 0 {
            // Let the runtime turn once even though nothing needs waiting for, so a polling
            // fio still makes progress when its own thread drives the runtime. With something
            // to wait for, the runtime turns anyway.
            tokio::task::yield_now().await;
        }
        let enough = poll_fn(|cx| {
            self.poll_some(cx);
            if self.done.len() >= min || self.running.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        match deadline {
            None => enough.await,
            Some(d) => {
                if tokio::time::timeout_at(d, enough).await.is_err() {
                    return self.take(max, out);
                }
            }
        }
        if min > 0 {
            for _ in 0..COLLECT_TURNS {
                if self.done.len() >= max || self.running.is_empty() {
                    break;
                }
                tokio::task::yield_now().await;
                let before = self.done.len();
                self.poll_now().await;
                if self.done.len() == before {
                    break;
                }
            }
        }
        self.take(max, out)
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
    /// Queued by fio since the last `getevents`: committed or not, they start there.
    pending: Vec<Pending>,
    /// Of `pending`, how many fio has committed.
    committed: usize,
    reaper: Reaper<Finished>,
    finished: Vec<Finished>,
    events: Vec<Done>,
    pub errors: ErrorLog,
    /// fio's I/O buffers, when they are registered memory of a queue of this controller
    /// (fio's `iomem_alloc`): one chunk per `io_u`.
    pub iobuf: Option<(Arc<Controller>, Arc<IoBuffer>)>,
}

impl Thread {
    pub fn new(job: &str, driver: Driver, iodepth: usize) -> Thread {
        Thread {
            job: job.into(),
            rt: driver.handle(),
            driver,
            pending: Vec::with_capacity(iodepth),
            committed: 0,
            reaper: Reaper::default(),
            finished: Vec::with_capacity(iodepth),
            events: Vec::with_capacity(iodepth),
            errors: ErrorLog::default(),
            iobuf: None,
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
        let target = match &f.io {
            FileIo::Ctrl(c) => Target::Ctrl(c.ctrl.clone()),
            FileIo::Multipath(ns) => Target::Multipath(ns.clone()),
        };
        let registered = match (&self.iobuf, &target, op) {
            (Some((c, b)), Target::Ctrl(fc), Op::Read | Op::Write) if Arc::ptr_eq(c, fc) => {
                b.chunk_at(buf, len).map(|k| (b.clone(), k))
            }
            _ => None,
        };
        self.pending.push(Pending {
            io_u,
            op,
            target,
            nsid: f.nsid,
            lba,
            blocks,
            buf: FioBuf { ptr: buf, len },
            registered,
        });
        Ok(())
    }

    /// fio's commit: everything queued since the last one is committed.
    ///
    /// It starts at this thread's next `getevents`, as one batch: the I/O futures are polled
    /// (their commands posted) together, and the host stack sends them in one datagram run.
    /// fio always reaps after committing, so nothing waits long: at QD1 `getevents` follows
    /// at once, and at depth the batch is what fio queued between two reaps.
    pub fn commit(&mut self) {
        self.committed = self.pending.len();
    }

    /// Committed and not yet handed back to fio.
    fn inflight(&self) -> usize {
        self.committed + self.reaper.outstanding()
    }

    /// Start what fio committed: its futures are polled (commands posted) at the next turn.
    fn start_committed(&mut self) {
        for p in self.pending.drain(..self.committed) {
            self.reaper.start(Box::pin(run(p)));
        }
        self.committed = 0;
    }

    /// fio's getevents: at least `min` (never more than are in flight), at most `max`.
    ///
    /// Completions already taken are handed back without turning the runtime: with fio's
    /// defaults (`iodepth_batch_complete_max` = 1) fio reaps one I/O per call, and a
    /// runtime turn per call would send the I/O it queues in between one at a time. This
    /// way the runtime turns once none are left, with everything fio queued since then to
    /// send at once; or, without waiting, once that batch is half of what is in flight
    /// ([`start_early`]), so the target has the next half to work on while fio takes the
    /// completions of the last.
    pub fn getevents(&mut self, min: usize, max: usize, timeout: Option<Duration>) -> usize {
        let min = min.min(self.inflight());
        self.finished.clear();
        let reaped = self.reaper.take_ready(min.max(1), max, &mut self.finished);
        if reaped.is_none() {
            self.start_committed();
            let (reaper, finished) = (&mut self.reaper, &mut self.finished);
            self.driver
                .block_on(reaper.wait(min, max, timeout, finished));
        } else if start_early(self.committed, self.inflight()) {
            self.start_committed();
            // One turn to post and send them; what it finds done stays for the next calls.
            let (reaper, finished) = (&mut self.reaper, &mut self.finished);
            self.driver
                .block_on(reaper.wait(0, 0, Some(Duration::ZERO), finished));
        }
        self.events.clear();
        for f in self.finished.drain(..) {
            let error = match &f.result {
                Ok(()) => 0,
                Err(e) => {
                    self.errors.record(
                        &self.job,
                        &format!("{:?} of {} blocks at LBA {}", f.op, f.blocks, f.lba),
                        e,
                    );
                    errno(e)
                }
            };
            self.events.push(Done {
                io_u: f.io_u,
                error,
            });
        }
        self.events.len()
    }

    /// The longest time this job's I/O was out with none completing ([`StallMeter`]).
    pub fn longest_stall(&self) -> Duration {
        self.reaper.longest_stall()
    }

    pub fn event(&self, i: usize) -> Option<Done> {
        self.events.get(i).copied()
    }

    /// Wait for every I/O still out: they write into fio's buffers, which fio frees after
    /// cleanup.
    pub fn drain(&mut self) {
        self.commit();
        while self.inflight() > 0 {
            let n = self.getevents(self.inflight(), usize::MAX, Some(Duration::from_secs(10)));
            if n == 0 {
                eprintln!(
                    "nvmf-rdma: {}: waiting for {} I/Os still out",
                    self.job,
                    self.inflight()
                );
            }
        }
    }
}

/// Whether the I/O fio committed since the runtime last turned should start now, although
/// completions are still waiting to be handed back: once it is half of what is in flight.
///
/// Started only when the completions ran out, a queue's whole depth went out as one batch:
/// the target answered all of it while the host waited, then the host reaped all of it and
/// fio queued the next while the target waited, the two threads taking turns (at 4 KiB QD32
/// reads, 50-100 µs waits on each side, both spinning through them). Two half-depth
/// batches keep both busy: the target answers one while fio takes the other's completions
/// (docs/performance.md, "Two halves in flight").
fn start_early(committed: usize, in_flight: usize) -> bool {
    committed >= 2 && committed * 2 >= in_flight
}

async fn run(p: Pending) -> Finished {
    let result = match &p.target {
        Target::Ctrl(c) => on_ctrl(c, &p).await,
        Target::Multipath(ns) => on_multipath(ns, &p).await,
    };
    Finished {
        io_u: p.io_u,
        op: p.op,
        lba: p.lba,
        blocks: p.blocks,
        result,
    }
}

async fn on_ctrl(c: &Controller, p: &Pending) -> Result<(), HostError> {
    match (p.op, &p.registered) {
        // fio's buffer is registered memory: the target writes into it or reads from it.
        (Op::Read, Some((b, k))) => c.read_to(b, *k, p.nsid, p.lba, p.buf.len).await,
        (Op::Write, Some((b, k))) => c.write_from(b, *k, p.nsid, p.lba, p.buf.len).await,
        // SAFETY (both): this future owns the I/O until it returns.
        (Op::Read, None) => {
            c.read_into(p.nsid, p.lba, unsafe { p.buf.bytes_mut() })
                .await
        }
        (Op::Write, None) => c.write(p.nsid, p.lba, unsafe { p.buf.bytes() }).await,
        (Op::Flush, _) => c.flush(p.nsid).await,
        (Op::Trim, _) => c.deallocate(p.nsid, &[(p.lba, p.blocks as u32)]).await,
    }
}

/// The namespace is the file's, so the I/O names no NSID; multipath picks its path.
async fn on_multipath(ns: &MpNamespace, p: &Pending) -> Result<(), HostError> {
    match p.op {
        // SAFETY (both): this future owns the I/O until it returns.
        Op::Read => ns.read_into(p.lba, unsafe { p.buf.bytes_mut() }).await,
        Op::Write => ns.write(p.lba, unsafe { p.buf.bytes() }).await,
        Op::Flush => ns.flush().await,
        Op::Trim => ns.deallocate(&[(p.lba, p.blocks as u32)]).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::oneshot;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// An I/O that finishes as `id` when its sender fires (or is dropped: id + 1000).
    fn io(
        id: usize,
    ) -> (
        oneshot::Sender<()>,
        Pin<Box<dyn Future<Output = usize> + Send>>,
    ) {
        let (tx, rx) = oneshot::channel::<()>();
        (
            tx,
            Box::pin(async move { rx.await.map_or(id + 1000, |_| id) }),
        )
    }

    fn done(id: usize) -> Pin<Box<dyn Future<Output = usize> + Send>> {
        Box::pin(async move { id })
    }

    #[test]
    fn wait_returns_once_min_are_done_from_another_thread() {
        let rt = rt();
        let mut r = Reaper::default();
        let mut txs = Vec::new();
        for i in 0..4 {
            let (tx, f) = io(i);
            r.start(f);
            txs.push(tx);
        }
        let last = txs.pop().unwrap();
        let t = std::thread::spawn(move || {
            for tx in txs {
                tx.send(()).unwrap();
            }
        });
        let mut out = Vec::new();
        let n = rt.block_on(r.wait(3, 8, None, &mut out));
        t.join().unwrap();
        assert_eq!(n, 3);
        out.sort();
        assert_eq!(out, [0, 1, 2]);
        assert_eq!(r.outstanding(), 1, "the fourth is still out");
        last.send(()).unwrap();
        out.clear();
        assert_eq!(rt.block_on(r.wait(1, 8, None, &mut out)), 1);
        assert_eq!(out, [3]);
        assert_eq!(r.outstanding(), 0);
    }

    #[test]
    fn started_io_runs_only_when_waited_on_and_all_together() {
        let rt = rt();
        let polled = Arc::new(AtomicUsize::new(0));
        let mut r = Reaper::default();
        let mut txs = Vec::new();
        for i in 0..3 {
            let (tx, rx) = oneshot::channel::<()>();
            let p = polled.clone();
            r.start(Box::pin(async move {
                p.fetch_add(1, Ordering::SeqCst);
                let _ = rx.await;
                i
            }));
            txs.push(tx);
        }
        assert_eq!(polled.load(Ordering::SeqCst), 0, "start does not poll");
        let mut out = Vec::new();
        let n = rt.block_on(r.wait(0, 8, Some(Duration::ZERO), &mut out));
        assert_eq!(n, 0);
        assert_eq!(
            polled.load(Ordering::SeqCst),
            3,
            "one wait starts the whole batch"
        );
        drop(txs);
        assert_eq!(rt.block_on(r.wait(3, 8, None, &mut out)), 3);
    }

    #[test]
    fn timeout_returns_what_is_there() {
        let rt = rt();
        let mut r = Reaper::default();
        r.start(done(7));
        let (_keep, f) = io(8);
        r.start(f);
        let mut out = Vec::new();
        let n = rt.block_on(r.wait(2, 8, Some(Duration::from_millis(20)), &mut out));
        assert_eq!((n, &out[..]), (1, &[7][..]));
        out.clear();
        let n = rt.block_on(r.wait(0, 8, Some(Duration::ZERO), &mut out));
        assert_eq!(n, 0);
        assert_eq!(r.outstanding(), 1);
    }

    #[test]
    fn a_batch_starts_early_once_it_is_half_of_what_is_in_flight() {
        // QD32: the 16th I/O queued while completions are still being handed back goes.
        assert!(!start_early(15, 32));
        assert!(start_early(16, 32));
        // QD8 (128 KiB jobs): after 4.
        assert!(!start_early(3, 8));
        assert!(start_early(4, 8));
        // QD1 and QD2 never start early: one I/O is no batch.
        assert!(!start_early(1, 1));
        assert!(!start_early(1, 2));
        assert!(!start_early(0, 0));
    }

    #[test]
    fn an_early_turn_starts_new_io_and_leaves_completions_for_later() {
        let rt = rt();
        let polled = Arc::new(AtomicUsize::new(0));
        let mut r = Reaper::default();
        r.start(done(1));
        r.start(done(2));
        let mut out = Vec::new();
        // The getevents that found these ready takes one ...
        assert_eq!(rt.block_on(r.wait(1, 1, None, &mut out)), 1);
        // ... and a batch started early is polled (posted) by a turn that takes nothing.
        let p = polled.clone();
        r.start(Box::pin(async move {
            p.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<usize>().await
        }));
        assert_eq!(rt.block_on(r.wait(0, 0, Some(Duration::ZERO), &mut out)), 0);
        assert_eq!(polled.load(Ordering::SeqCst), 1, "the new I/O was posted");
        assert_eq!(out, [1], "no completion taken by the early turn");
        assert_eq!(
            r.take_ready(1, 8, &mut out),
            Some(1),
            "the other is still there"
        );
    }

    #[test]
    fn stall_is_the_longest_wait_for_a_completion_with_io_out() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut m = StallMeter::default();
        m.on_start(ms(0));
        m.on_start(ms(5)); // more I/O while some is out: the wait began at 0
        m.on_complete(ms(30), true);
        m.on_complete(ms(40), false);
        assert_eq!(m.longest(), Duration::from_millis(30));
        // Idle time with nothing out is no stall.
        m.on_start(ms(1000));
        m.on_complete(ms(1010), true);
        // A path failing under the I/O: 120 ms without a completion.
        m.on_complete(ms(1130), false);
        assert_eq!(m.longest(), Duration::from_millis(120));
    }

    #[test]
    fn the_reaper_measures_stalls_between_completions() {
        let rt = rt();
        let mut r = Reaper::default();
        let (tx, f) = io(1);
        r.start(f);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            tx.send(()).unwrap();
        });
        let mut out = Vec::new();
        assert_eq!(rt.block_on(r.wait(1, 8, None, &mut out)), 1);
        t.join().unwrap();
        assert!(
            r.longest_stall() >= Duration::from_millis(50),
            "{:?}",
            r.longest_stall()
        );
    }

    #[test]
    fn take_ready_only_takes_what_is_done() {
        let rt = rt();
        let mut r = Reaper::default();
        let mut out = Vec::new();
        assert_eq!(r.take_ready(1, 8, &mut out), None, "nothing done");
        r.start(done(1));
        assert_eq!(r.take_ready(1, 8, &mut out), None, "not polled yet");
        // Collect it without handing it out (max 0), then add two more.
        assert_eq!(rt.block_on(r.wait(1, 0, None, &mut out)), 0);
        assert_eq!(r.take_ready(2, 8, &mut out), None, "fewer than min");
        r.start(done(2));
        r.start(done(3));
        assert_eq!(rt.block_on(r.wait(3, 0, None, &mut out)), 0);
        assert_eq!(r.take_ready(1, 2, &mut out), Some(2), "at most max");
        assert_eq!(r.take_ready(1, 2, &mut out), Some(1));
        assert_eq!(r.take_ready(1, 2, &mut out), None);
        out.sort();
        assert_eq!(out, [1, 2, 3]);
    }

    #[test]
    fn wait_gathers_completions_that_arrive_in_the_next_turns() {
        let rt = rt();
        let mut r = Reaper::default();
        r.start(done(1));
        let (tx, f) = io(2);
        r.start(f);
        let mut out = Vec::new();
        let n = rt.block_on(async {
            // Finishes the second I/O in the runtime's next turn, as a reply that arrives
            // just after the first would.
            tokio::spawn(async move {
                tx.send(()).unwrap();
            });
            r.wait(1, 8, None, &mut out).await
        });
        assert_eq!(
            n, 2,
            "min was 1, but the second completion came while gathering"
        );
        out.sort();
        assert_eq!(out, [1, 2]);
        // Nothing more out: it returns with what it has instead of waiting for more turns.
        r.start(done(3));
        out.clear();
        assert_eq!(rt.block_on(r.wait(1, 8, None, &mut out)), 1);
    }

    #[test]
    fn wait_respects_max_and_keeps_the_rest() {
        let rt = rt();
        let mut r = Reaper::default();
        for i in 0..5 {
            r.start(done(i));
        }
        let mut out = Vec::new();
        assert_eq!(rt.block_on(r.wait(1, 2, None, &mut out)), 2);
        assert_eq!(r.outstanding(), 3);
        assert_eq!(r.take_ready(1, 8, &mut out), Some(3));
        out.sort();
        assert_eq!(out, [0, 1, 2, 3, 4]);
    }
}

//! Namespace I/O off the engine's task: the work whose cost a host chooses (a file
//! namespace's reads, writes and flushes; zeroing whole ranges for Write Zeroes and Dataset
//! Management) runs on a few worker threads, so one host's whole-device TRIM cannot stall
//! another host's 4 KiB read behind the engine's lock (the security review's row 10).
//!
//! Fairness: jobs wait in one lane per queue and the workers take lanes in turn; a long job
//! (zeroing) runs a step of at most [`Namespace::ZERO_STEP`] bytes at a time and then goes
//! to the back of its lane, so another queue's command waits for at most one step per
//! worker, whatever the first queue asked for.
//!
//! Bounds: a queue has at most one job per command slot, so the lanes never hold more jobs
//! than the target has slots. A queue that goes takes its waiting jobs with it
//! ([`Pool::purge`]), and a running one stops at the end of its step.
//!
//! A finished job goes back to the engine through [`Pool::take_done`]; the engine wakes on
//! [`Pool::ready`] and answers the command, checking that its queue is still the one that
//! asked.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::nvme::Status;
use crate::verbs::HostBuffer;

use super::port::QRef;

use super::Namespace;

/// What a job does.
#[derive(Debug)]
pub(super) enum Op {
    /// Read `len` bytes at `off` into the command's staging.
    Read {
        off: u64,
        len: usize,
    },
    /// Write the command's `len` staged bytes at `off`.
    Write {
        off: u64,
        len: usize,
    },
    /// Zero (deallocate) these byte ranges, front first.
    Zero {
        ranges: VecDeque<(u64, usize)>,
    },
    Flush,
}

/// One command's backend work.
pub(super) struct Job<M> {
    pub qpn: QRef,
    /// Which incarnation of the queue asked (QPNs can come back).
    pub token: u64,
    pub slot: usize,
    pub ns: Arc<Namespace>,
    /// The queue's staging ring and where the slot's bytes start in it.
    pub staging: Arc<M>,
    pub at: usize,
    pub op: Op,
    /// Cleared when the queue goes: the job is dropped at its next step.
    pub alive: Arc<AtomicBool>,
}

/// A job's outcome, for the engine to answer with.
pub(super) struct Finished {
    pub qpn: QRef,
    pub token: u64,
    pub slot: usize,
    /// Bytes staged for the host (a read), or the error status.
    pub result: Result<usize, Status>,
    /// Bytes written to the namespace.
    pub written: usize,
}

enum Step {
    More,
    Done(Result<usize, Status>, usize),
}

struct Lane<M> {
    token: u64,
    jobs: VecDeque<Job<M>>,
}

struct State<M> {
    lanes: VecDeque<Lane<M>>,
    spawned: usize,
    idle: usize,
    closed: bool,
}

impl<M> State<M> {
    fn pop(&mut self) -> Option<Job<M>> {
        let mut lane = self.lanes.pop_front()?;
        let job = lane.jobs.pop_front();
        if !lane.jobs.is_empty() {
            self.lanes.push_back(lane);
        }
        job
    }

    fn push(&mut self, job: Job<M>) {
        match self.lanes.iter_mut().find(|l| l.token == job.token) {
            Some(l) => l.jobs.push_back(job),
            None => self.lanes.push_back(Lane {
                token: job.token,
                jobs: VecDeque::from([job]),
            }),
        }
    }
}

/// The workers and the jobs waiting for them.
pub(super) struct Pool<M> {
    state: Mutex<State<M>>,
    work: Condvar,
    done: Mutex<Vec<Finished>>,
    /// Signalled when a job finishes.
    pub ready: tokio::sync::Notify,
    max_workers: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<M: HostBuffer> Pool<M> {
    /// A pool of at most `max_workers` threads, started as jobs first need them.
    pub fn new(max_workers: usize) -> Arc<Pool<M>> {
        Arc::new(Pool {
            state: Mutex::new(State {
                lanes: VecDeque::new(),
                spawned: 0,
                idle: 0,
                closed: false,
            }),
            work: Condvar::new(),
            done: Mutex::new(Vec::new()),
            ready: tokio::sync::Notify::new(),
            max_workers: max_workers.max(1),
        })
    }

    /// Queue `job`. If no worker can be had (the system refuses a thread), the job fails
    /// with Internal Error rather than wait for ever.
    pub fn submit(self: &Arc<Self>, job: Job<M>) {
        let mut s = lock(&self.state);
        if s.closed {
            return;
        }
        if s.idle == 0 && s.spawned < self.max_workers {
            let pool = self.clone();
            // A worker is the target's as much as the thread that started it: where the
            // allocation audit counts that thread as another machine's, it counts this one so.
            let platform = crate::harness::alloc_audit::in_platform();
            let started = std::thread::Builder::new()
                .name("nvmet-io".into())
                .spawn(move || {
                    if platform {
                        crate::harness::alloc_audit::mark_thread_platform();
                    }
                    pool.work()
                });
            match started {
                Ok(_) => s.spawned += 1,
                Err(e) if s.spawned == 0 => {
                    drop(s);
                    tracing::warn!("target: no thread for namespace I/O: {e}");
                    return self.finish(&job, Err(Status::INTERNAL_ERROR), 0);
                }
                Err(_) => {}
            }
        }
        s.push(job);
        drop(s);
        self.work.notify_one();
    }

    /// Take every job of the queue `token` that has not started.
    pub fn purge(&self, token: u64) -> Vec<Job<M>> {
        let mut out = Vec::new();
        lock(&self.state).lanes.retain_mut(|l| {
            if l.token == token {
                out.extend(l.jobs.drain(..));
            }
            l.token != token
        });
        out
    }

    /// Stop the workers (after the step each is in) and drop what waits.
    pub fn close(&self) {
        let mut s = lock(&self.state);
        s.closed = true;
        s.lanes.clear();
        drop(s);
        self.work.notify_all();
    }

    /// Move the finished jobs into `out` (which the engine keeps, so this allocates nothing
    /// once it has grown).
    pub fn take_done(&self, out: &mut Vec<Finished>) {
        out.append(&mut lock(&self.done));
    }

    fn finish(&self, job: &Job<M>, result: Result<usize, Status>, written: usize) {
        lock(&self.done).push(Finished {
            qpn: job.qpn,
            token: job.token,
            slot: job.slot,
            result,
            written,
        });
        self.ready.notify_one();
    }

    fn work(&self) {
        // A worker's bounce buffer for file I/O: the staging ring is the device's memory,
        // which must not be held locked while the file system takes its time.
        let mut scratch = Vec::new();
        loop {
            let mut job = {
                let mut s = lock(&self.state);
                loop {
                    if s.closed {
                        return;
                    }
                    if let Some(j) = s.pop() {
                        break j;
                    }
                    s.idle += 1;
                    s = self.work.wait(s).unwrap_or_else(|e| e.into_inner());
                    s.idle -= 1;
                }
            };
            // A job that stops is reported too: the engine counts a dead controller's
            // started jobs until each has ended.
            if !job.alive.load(Ordering::Acquire) {
                self.finish(&job, Err(Status::ABORTED_SQ_DELETION), 0);
                continue;
            }
            match step(&mut job, &mut scratch) {
                Step::More => {
                    let mut s = lock(&self.state);
                    if !s.closed && job.alive.load(Ordering::Acquire) {
                        s.push(job);
                    } else {
                        drop(s);
                        self.finish(&job, Err(Status::ABORTED_SQ_DELETION), 0);
                    }
                }
                Step::Done(result, written) => self.finish(&job, result, written),
            }
        }
    }
}

/// One step of `job`: all of a read, write or flush; at most [`Namespace::ZERO_STEP`] bytes
/// of zeroing.
fn step<M: HostBuffer>(job: &mut Job<M>, scratch: &mut Vec<u8>) -> Step {
    match &mut job.op {
        Op::Read { off, len } => {
            let len = *len;
            if scratch.len() < len {
                scratch.resize(len, 0);
            }
            match job.ns.read(*off, &mut scratch[..len]) {
                Ok(()) => {
                    job.staging.write(job.at, &scratch[..len]);
                    Step::Done(Ok(len), 0)
                }
                Err(st) => Step::Done(Err(st), 0),
            }
        }
        Op::Write { off, len } => {
            let len = *len;
            if scratch.len() < len {
                scratch.resize(len, 0);
            }
            job.staging.read(job.at, &mut scratch[..len]);
            match job.ns.write(*off, &scratch[..len]) {
                Ok(()) => Step::Done(Ok(0), len),
                Err(st) => Step::Done(Err(st), 0),
            }
        }
        Op::Flush => Step::Done(job.ns.flush().map(|()| 0), 0),
        Op::Zero { ranges } => {
            let Some((off, len)) = ranges.front_mut() else {
                return Step::Done(Ok(0), 0);
            };
            match job.ns.zero_step(*off, *len) {
                Ok(n) => {
                    *off += n as u64;
                    *len -= n;
                    if *len == 0 {
                        ranges.pop_front();
                    }
                    if ranges.is_empty() {
                        Step::Done(Ok(0), 0)
                    } else {
                        Step::More
                    }
                }
                Err(st) => Step::Done(Err(st), 0),
            }
        }
    }
}

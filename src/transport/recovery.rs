//! Recovery: the one entry every cause takes, and the executor behind it.
//!
//! Every cause (a failed work completion or a QP in error, an I/O timeout, the device's death
//! seen on a completion queue, the peer's CM disconnect, a device plugged, reset or removed,
//! keep-alive answers, the user's reset, delete) becomes a [`reconnect::Event`] reported to
//! the controller's [`Inbox`] (in `inbox.rs`), a bounded queue allocated at connect. One task per controller,
//! the [`Supervisor`] (Linux: `nvme_rdma_error_recovery` and its work items), takes them one
//! at a time, feeds them to the [`Machine`] and executes what it answers, the same road
//! whatever the cause: drop every HCA resource, hold in-flight I/O in its own slot, wait for
//! the same device (GUID / PCI address, per policy), register the same buffers under a new
//! PD, reconnect admin then I/O queues, resubmit, LIVE. From the failure to the resubmission
//! the host allocates nothing: every buffer, slot and table was sized at the first connect
//! (`tests/recovery_alloc.rs`).
//!
//! The executor is also where a command in flight on a dead connection is held or sent
//! again: it alone sees the connection end and the next one begin.
//!
//! [`reconnect::Event`]: crate::reconnect::Event

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::cm::ConnId;
use crate::nvme::admin;
use crate::nvme::fabrics;
use crate::nvme::{Cc, FabricsCmd};
use crate::reconnect::{Action, Cause, CtrlState, Event, FailReason, Identity, Machine};
use crate::verbs::{CmPort, DeviceContext, DeviceSource, Instant, Lifecycle, PdId};

use super::inbox::Inbox;
use super::options::ConnectOptions;
use super::queue::{Clock, QueueCtl, QueueStats};
use super::saferetry::SafeExec;
use super::state::{CtrlShared, CtrlStatus, DevShared, RecoveryTrace};

/// The device context the controller currently runs on.
pub(super) struct DevCtx<D: DeviceContext> {
    pub(super) dev: D,
    pub(super) cm: D::Cm,
    pub(super) pd: Option<PdId>,
}

/// Labels are fixed at connect; handles update without allocating.
pub(super) struct CtrlMetrics {
    state: metrics::Gauge,
    attempts: metrics::Counter,
    recoveries: metrics::Counter,
    requeued: metrics::Counter,
    failed: metrics::Counter,
    completed: metrics::Counter,
    copies: metrics::Counter,
    copied_bytes: metrics::Counter,
    recovery_secs: metrics::Histogram,
    reports_dropped: metrics::Counter,
}

impl CtrlMetrics {
    pub(super) fn new(subnqn: &str) -> CtrlMetrics {
        let l = [("subnqn", subnqn.to_string())];
        CtrlMetrics {
            state: metrics::gauge!("nvmf_ctrl_state", &l),
            attempts: metrics::counter!("nvmf_ctrl_reconnect_attempts_total", &l),
            recoveries: metrics::counter!("nvmf_ctrl_recoveries_total", &l),
            requeued: metrics::counter!("nvmf_ctrl_requeued_io_total", &l),
            failed: metrics::counter!("nvmf_ctrl_failed_io_total", &l),
            completed: metrics::counter!("nvmf_ctrl_completed_io_total", &l),
            copies: metrics::counter!("nvmf_ctrl_io_copies_total", &l),
            copied_bytes: metrics::counter!("nvmf_ctrl_io_copied_bytes_total", &l),
            recovery_secs: metrics::histogram!("nvmf_ctrl_recovery_seconds", &l),
            reports_dropped: metrics::counter!("nvmf_ctrl_recovery_reports_dropped_total", &l),
        }
    }
}

/// A small fixed queue of events produced while executing actions.
#[derive(Default)]
pub(super) struct EventQueue {
    buf: [Option<Event>; 16],
    head: usize,
    len: usize,
}

impl EventQueue {
    fn push(&mut self, e: Event) {
        if self.len < self.buf.len() {
            self.buf[(self.head + self.len) % self.buf.len()] = Some(e);
            self.len += 1;
        }
    }
    fn pop(&mut self) -> Option<Event> {
        if self.len == 0 {
            return None;
        }
        let e = self.buf[self.head].take();
        self.head = (self.head + 1) % self.buf.len();
        self.len -= 1;
        e
    }
}

/// The executor of recovery: takes what the [`Inbox`] holds, feeds the state machine and
/// carries out its actions. Owns the machine, the device context and the controller's view
/// of every queue.
pub(super) struct Supervisor<S: DeviceSource> {
    pub(super) sm: Machine,
    pub(super) clock: Clock,
    pub(super) opts: ConnectOptions,
    pub(super) devs: Arc<DevShared<S>>,
    pub(super) dev: Option<DevCtx<S::Device>>,
    pub(super) ours: Identity,
    pub(super) admin: QueueCtl<S::Device>,
    pub(super) io: Vec<QueueCtl<S::Device>>,
    /// CM connection of each queue (admin first), preallocated.
    pub(super) conns: Vec<Option<ConnId>>,
    pub(super) connect_data: [u8; 1024],
    pub(super) shared: Arc<CtrlShared>,
    /// Where the connection manager tells of a torn-down connection; [`report_disconnects`]
    /// passes it on to the inbox.
    pub(super) disc_tx: mpsc::UnboundedSender<ConnId>,
    pub(super) cntlid: u16,
    pub(super) nr_io: usize,
    /// The recovery under way (empty while LIVE).
    pub(super) trace: RecoveryTrace,
    pub(super) last_recovery: Option<Duration>,
    pub(super) last_trace: Option<RecoveryTrace>,
    pub(super) metrics: CtrlMetrics,
    /// Safe retry's hold table and the association the attempt under way identified.
    pub(super) safe: SafeExec,
    /// Identify Controller data of each reconnect, read into memory sized at connect.
    pub(super) ident_buf: Box<[u8; 4096]>,
}

/// How a reconnect attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Connected,
    /// The target refused or did not answer, or a step failed.
    Failed,
    /// The device went away under it, or a deadline of the machine fired while it ran.
    Cut,
    /// Deletion was asked for: the attempt was abandoned.
    Deleted,
}

impl<S: DeviceSource> Supervisor<S> {
    pub(super) fn now(&self) -> Instant {
        self.clock.now()
    }

    pub(super) fn queue(&self, qi: usize) -> QueueCtl<S::Device> {
        if qi == 0 {
            self.admin.clone()
        } else {
            self.io[qi - 1].clone()
        }
    }

    /// Why a connection was torn down under us: the device's death when it died (a removed
    /// device drops its connections, and rdma_cm may say so before anything else does), else
    /// the peer's or the fabric's disconnect.
    fn disconnect_cause(&self) -> Cause {
        match self.dev.as_ref().map(|d| d.dev.lifecycle()) {
            Some(Lifecycle::Removed) => Cause::DeviceRemoved,
            Some(Lifecycle::Fatal) => Cause::DeviceFatal,
            _ => Cause::CmDisconnect,
        }
    }

    /// A report from the inbox as the machine takes it.
    fn refine(&self, ev: Event) -> Event {
        match ev {
            Event::Failed(Cause::CmDisconnect) => Event::Failed(self.disconnect_cause()),
            ev => ev,
        }
    }

    /// Drop every HCA resource, whatever state it is in. In-flight I/O stays held in its
    /// slot. Releases on a zombie device always succeed.
    pub(super) fn teardown(&mut self) {
        // Whatever the old connection's queues still report is about the old connection.
        self.shared.inbox.new_epoch();
        for q in self.io.iter().rev() {
            q.lock().teardown();
            q.poke();
        }
        self.admin.lock().teardown();
        self.admin.poke();
        if let Some(d) = self.dev.take() {
            for c in self.conns.iter_mut() {
                if let Some(id) = c.take() {
                    d.cm.abort(id);
                }
            }
            if let Some(pd) = d.pd {
                d.dev.dealloc_pd(pd);
            }
            // A context that is still live (CM disconnect, keep-alive loss) is reused on
            // the next attempt; a dead one is let go.
            if d.dev.lifecycle() == Lifecycle::Live {
                self.dev = Some(DevCtx { pd: None, ..d });
            }
        }
        for c in self.conns.iter_mut() {
            *c = None;
        }
    }

    /// Orderly shutdown on delete: CC.SHN, then DREQ on every queue.
    async fn shutdown(&mut self) {
        if self.admin.lock().is_live() {
            let shn = Cc::enable_default().with_shn(1).0 as u64;
            let sqe = FabricsCmd::set(fabrics::reg::CC, shn).to_sqe(0);
            let _ = self
                .admin
                .control(sqe, &[], 0, Duration::from_secs(1))
                .await;
        }
        if let Some(d) = &self.dev {
            for c in self.conns.iter_mut() {
                if let Some(id) = c.take() {
                    d.cm.disconnect(id);
                }
            }
        }
    }

    pub(super) fn all_queues(&self) -> impl Iterator<Item = &QueueCtl<S::Device>> {
        std::iter::once(&self.admin).chain(self.io.iter())
    }

    fn sum_stats(&self, f: impl Fn(&QueueStats) -> u64) -> u64 {
        self.all_queues().map(|q| f(&q.lock().stats)).sum()
    }

    pub(super) fn publish(&mut self) {
        let now = self.now();
        let m = self.sm.status(now);
        self.metrics.state.set(m.state.index() as f64);
        self.metrics
            .requeued
            .absolute(self.sum_stats(|s| s.requeued));
        self.metrics.failed.absolute(self.sum_stats(|s| s.failed));
        self.metrics
            .reports_dropped
            .absolute(self.shared.inbox.dropped());
        // The I/O queues' data-path counters (what `Controller::io_copies` reports) are read
        // here, at each event (keep-alive included), not counted per I/O: the hot path
        // stays free of the metrics facade.
        let (mut done, mut copies, mut bytes) = (0, 0, 0);
        for q in &self.io {
            let s = &q.lock().stats;
            (done, copies, bytes) = (
                done + s.completed,
                copies + s.copies,
                bytes + s.copied_bytes,
            );
        }
        self.metrics.completed.absolute(done);
        self.metrics.copies.absolute(copies);
        self.metrics.copied_bytes.absolute(bytes);
        let st = CtrlStatus {
            machine: m,
            cntlid: self.cntlid,
            at: now,
            last_recovery: self.last_recovery,
            last_trace: self.last_trace,
        };
        self.shared.status.send_if_modified(|old| {
            let changed = old.machine != st.machine || old.cntlid != st.cntlid;
            *old = st;
            changed
        });
    }

    /// Execute one action; the events it produces go to `q`.
    pub(super) async fn execute(&mut self, a: Action, q: &mut EventQueue) {
        let now = self.now();
        match a {
            Action::StopKeepAlive => {}
            Action::SendKeepAlive => {
                let _ = self
                    .admin
                    .lock()
                    .post_control(now, admin::keep_alive(0), &[], 0);
                self.admin.poke();
            }
            Action::Shutdown => self.shutdown().await,
            Action::TearDown => {
                if self.trace.failed.is_none() && self.sm.state() == CtrlState::Resetting {
                    self.trace = RecoveryTrace {
                        cause: self.sm.status(now).cause,
                        failed: Some(now),
                        ..RecoveryTrace::default()
                    };
                }
                tracing::info!(
                    subnqn = %self.opts.subnqn,
                    cause = self.sm.status(now).cause.map_or("-", |c| c.name()),
                    "controller resetting: dropping HCA resources"
                );
                self.teardown();
                let kato = self.sm.policy().keep_alive_tmo;
                let reconnecting = self.sm.state() == CtrlState::Resetting;
                self.safe
                    .on_lost(now, kato, &self.admin, &self.io, reconnecting);
                self.trace.torn_down = Some(self.now());
                q.push(Event::TornDown);
                device_report(&self.devs.source, &self.devs.name, |ev| q.push(ev));
            }
            Action::Connect { attempt } => {
                self.metrics.attempts.increment(1);
                // `list` shows the attempt while it runs.
                self.publish();
                tracing::info!(subnqn = %self.opts.subnqn, attempt, "reconnecting");
                match self.attempt().await {
                    Attempt::Connected => q.push(Event::Connected),
                    Attempt::Failed => q.push(Event::ConnectFailed),
                    Attempt::Cut => q.push(Event::ConnectCut),
                    // The turn loop feeds Delete before anything else.
                    Attempt::Deleted => {}
                }
            }
            Action::Resubmit => {
                self.safe.on_live(now, &self.admin, &self.io);
                for c in self.all_queues() {
                    c.lock().resume(now);
                    c.poke();
                }
                self.safe.release(now, &self.admin, &self.io);
                if let Some(t) = self.trace.failed {
                    let d = now.saturating_since(t);
                    self.trace.live = Some(now);
                    self.trace.attempts = self.sm.status(now).attempt;
                    self.last_recovery = Some(d);
                    self.last_trace = Some(self.trace);
                    self.metrics.recovery_secs.record(d.as_secs_f64());
                }
                self.trace = RecoveryTrace::default();
                self.metrics.recoveries.increment(1);
                tracing::info!(subnqn = %self.opts.subnqn, "controller live again");
            }
            Action::FailHeld(why) => {
                for c in self.all_queues() {
                    c.lock().fail_held(why, false);
                    c.poke();
                }
                self.safe.failed_held();
            }
            Action::HandBack => {
                for c in &self.io {
                    c.lock().fail_held(FailReason::Failover, false);
                    c.poke();
                }
                self.safe.handed_back();
            }
            Action::FailAll(why) => {
                self.teardown();
                self.dev = None;
                // The controller is DEAD before anyone hears of it: whoever gets the error
                // and then asks for the status sees the end, not DELETING.
                let more = self.sm.handle(now, Event::Deleted);
                debug_assert!(more.is_empty());
                self.publish();
                for c in self.all_queues() {
                    c.lock().fail_held(why, true);
                    c.poke();
                }
                self.safe.failed_held();
                tracing::warn!(subnqn = %self.opts.subnqn, reason = why.name(), "controller deleted");
            }
        }
    }

    /// Run a reconnect attempt while still honouring the machine's deadlines and deletion.
    /// A deadline or a delete request abandons it.
    async fn attempt(&mut self) -> Attempt {
        // The attempt borrows `self`; deadlines are watched from a copy of the machine's
        // next timeout, and the machine fires them once the attempt is abandoned.
        let deadline = self.sm.poll_timeout();
        let shared = self.shared.clone();
        let clock = self.clock;
        let sleep = async move {
            match deadline {
                Some(t) => {
                    let d = t.saturating_since(clock.now());
                    tokio::time::sleep(d).await
                }
                None => std::future::pending().await,
            }
        };
        let r = {
            let fut = self.reconnect();
            tokio::pin!(fut);
            tokio::select! {
                biased;
                _ = shared.inbox.deleted() => return Attempt::Deleted,
                r = &mut fut => Some(r),
                _ = sleep => None,
            }
        };
        match r {
            Some(Ok(())) => Attempt::Connected,
            Some(Err(e)) => {
                tracing::info!(subnqn = %self.opts.subnqn, error = %e, "reconnect attempt failed");
                // An attempt the device's death cut short says nothing about the target.
                let device_gone = self
                    .dev
                    .as_ref()
                    .is_none_or(|d| d.dev.lifecycle() != Lifecycle::Live);
                if device_gone {
                    Attempt::Cut
                } else {
                    Attempt::Failed
                }
            }
            None => Attempt::Cut,
        }
    }

    /// Take reports from the inbox and act on them until the controller is DEAD.
    pub(super) async fn run(mut self, disc_rx: mpsc::UnboundedReceiver<ConnId>) {
        let inbox = self.shared.inbox.clone();
        let watchers = [
            tokio::spawn(report_device_changes(self.devs.clone(), inbox.clone())),
            tokio::spawn(report_disconnects(disc_rx, inbox.clone())),
        ];
        // Events the executor's own actions produce (resources dropped, an attempt's end,
        // the device list right after a teardown), taken before the next report.
        let mut q = EventQueue::default();
        loop {
            let wake = inbox.wake.notified();
            tokio::pin!(wake);
            wake.as_mut().enable();
            // Feed and act until quiet. A delete goes before anything else, and is looked at
            // again after every action (an attempt with no delay never leaves this loop on
            // its own).
            loop {
                let now = self.now();
                let acts = if let Some(ev) = inbox.pop_delete() {
                    while q.pop().is_some() {}
                    self.sm.handle(now, ev)
                } else if let Some(ev) = q.pop() {
                    self.sm.handle(now, ev)
                } else if let Some(ev) = inbox.pop() {
                    let ev = self.refine(ev);
                    self.sm.handle(now, ev)
                } else {
                    let a = self.sm.handle_timeout(now);
                    if a.is_empty() {
                        break;
                    }
                    a
                };
                // Whoever gets a command back from these actions (given to another path,
                // failed) must not see LIVE any more: a state other than LIVE is told
                // before they run. LIVE is told after them, once the queues take I/O.
                if self.sm.state() != CtrlState::Live {
                    self.publish();
                }
                for a in acts.iter() {
                    self.execute(a, &mut q).await;
                }
                self.publish();
            }
            // Held commands whose rule allows them now (a CCR outcome, the time rule).
            let now = self.now();
            self.safe.release(now, &self.admin, &self.io);
            if self.sm.state() == CtrlState::Dead {
                self.publish();
                for w in watchers {
                    w.abort();
                }
                return;
            }
            let sleep_for = [self.sm.poll_timeout(), self.safe.poll_timeout()]
                .into_iter()
                .flatten()
                .min()
                .map(|t| t.saturating_since(self.now()));
            // Biased, so that a simulated run replays (tokio's unbiased choice is random).
            tokio::select! {
                biased;
                _ = &mut wake => {}
                _ = async {
                    match sleep_for {
                        Some(d) => tokio::time::sleep(d).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

/// What the device list says about device `name` of `source`, as events for the machine.
fn device_report<S: DeviceSource>(source: &S, name: &str, mut report: impl FnMut(Event)) {
    match source.open(name) {
        Some(d) => report(Event::DeviceUp(d.identity)),
        None => report(Event::DeviceDown {
            removed: !source.present(name),
        }),
    }
}

/// Report each change of the device list (a device plugged, reset or removed) to the inbox,
/// as it stands after the change.
async fn report_device_changes<S: DeviceSource>(devs: Arc<DevShared<S>>, inbox: Arc<Inbox>) {
    let changed = devs.source.changed();
    loop {
        let n = changed.notified();
        tokio::pin!(n);
        n.as_mut().enable();
        device_report(&devs.source, &devs.name, |ev| inbox.report(ev));
        n.await;
    }
}

/// Report each CM disconnect of the controller's connections to the inbox.
async fn report_disconnects(mut rx: mpsc::UnboundedReceiver<ConnId>, inbox: Arc<Inbox>) {
    while let Some(id) = rx.recv().await {
        inbox.disconnected(id);
    }
}

//! Safe retry on the host (NVMe TP4129, TP8028): a command that changes state and was in
//! flight on a connection that died is not sent again, on the controller's next association,
//! until the dead association's commands are known finished. The rule is
//! [`crate::reconnect::hold`]'s; this is where the executor applies it.
//!
//! - When a connection dies the executor records the lost controller instance (CNTLID, CIU,
//!   CIRN, CQT, TBKAS from its Identify; the KATO in force) and the last contact with it
//!   (the latest command posted or completion batch taken on any of its queues).
//! - On reconnect, held commands that only read go at once; the others stay held until a
//!   Cross-Controller Reset sent through the new association reports the old one reset, or
//!   `k x KATO + CQT` after the last contact (`k` = 3 with traffic-based keep alive, else 2).
//!   With `--safe-retry off` everything goes at once.
//! - New I/O is never held: an unacknowledged write has no order against a concurrent one.
//! - A write given back to a multipath host (a path that fails with others live,
//!   `fast_io_fail_tmo`, `ctrl_loss_tmo`) waits for [`super::Controller::quiesced_via`],
//!   which sends the CCR through another live controller of the subsystem: the failed one
//!   holds nothing that would make it ask. It waits only for the associations lost up to its
//!   failure ([`Losses`]): a path that keeps failing under new ones must not hold it.
//!
//! The CCR exchange runs in a task of its own beside the executor ([`ccr_task`]), as the
//! namespace rescan does: the executor only hands it an instance and takes back the outcome,
//! so the recovery path itself allocates nothing.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::nvme::ccr::{self, CcrLog, CcrResult, CcrState};
use crate::nvme::{IdentifyController, Status};
use crate::reconnect::hold::{CmdClass, Hold, LostController, QueueKind, CCR_QUEUE};
use crate::verbs::{DeviceContext, Instant};

use super::queue::{Clock, QueueCtl, QueueHandle, Response};
use super::HostError;

pub use crate::nvme::ccr::CtrlInstance;
pub use crate::reconnect::hold::{CcrOutcome, HoldPolicy, SafeRetry};

/// Dead associations of one controller tracked at once (each reconnect adds one); past it
/// the oldest's quiesce deadline merges into one that no CCR shortens, which is safe.
const LOST_MAX: usize = CCR_QUEUE;

/// What safe retry needs of an association, from its Identify Controller data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Assoc {
    pub(super) instance: CtrlInstance,
    pub(super) cqt_ms: u16,
    pub(super) tbkas: bool,
    pub(super) offers_ccr: bool,
}

impl Assoc {
    pub(super) fn of(id: &IdentifyController) -> Assoc {
        Assoc {
            instance: id.instance(),
            cqt_ms: id.cqt,
            tbkas: id.traffic_based_keep_alive(),
            offers_ccr: id.offers_ccr(),
        }
    }
}

/// What lets a hold go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReleasedBy {
    /// A Cross-Controller Reset reported the dead controller reset (or one is under way).
    Ccr,
    /// `k x KATO + CQT` after the last contact passed.
    Time,
}

impl ReleasedBy {
    pub fn name(self) -> &'static str {
        match self {
            ReleasedBy::Ccr => "ccr",
            ReleasedBy::Time => "time",
        }
    }
}

/// One dead association whose commands may still execute in the target, as `list` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldStatus {
    /// The dead controller instance.
    pub instance: CtrlInstance,
    /// Commands of it held back from resending.
    pub held: usize,
    /// What is expected to let them go: a CCR under way, or the time rule.
    pub by: ReleasedBy,
    /// Until the time rule lets them go in any case.
    pub time_left: Duration,
}

/// Safe retry of one controller now ([`super::Controller::safe_retry`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafeRetryStatus {
    pub mode: SafeRetry,
    /// Dead associations whose commands may still execute.
    pub holds: Vec<HoldStatus>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CcrPhase {
    /// No CCR for it (mode, target, or nothing held).
    None,
    /// Asked of the CCR task.
    Asked,
    Succeeded,
    Failed,
}

#[derive(Debug, Clone, Copy)]
struct Lost {
    ctrl: LostController,
    instance: CtrlInstance,
    /// The time rule's instant.
    deadline: Instant,
    /// When the host recorded the loss (for the hold-time histogram).
    at: Instant,
    held: usize,
    ccr: CcrPhase,
    /// Its place in the order of the controller's losses ([`Losses`]).
    seq: u64,
}

/// The dead associations of a controller up to some moment, and the live one then (its loss
/// may not be recorded yet when a command's failure is seen): what a command that failed
/// by then may still have running in the target. Later losses are not its concern: it was
/// not in flight on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Losses(u64);

impl Lost {
    fn quiet(&self, now: Instant) -> bool {
        self.ccr == CcrPhase::Succeeded || self.deadline <= now
    }
}

/// What the controller's handle, its executor and its CCR task share.
pub(super) struct SafeShared {
    state: Mutex<SafeState>,
    /// A dead association went quiet, or a CCR outcome came in.
    changed: Notify,
    /// The CCR task has something to do.
    ccr_wake: Notify,
}

struct SafeState {
    policy: HoldPolicy,
    /// The live association (None while down).
    current: Option<Assoc>,
    /// The target answered a CCR with Invalid Opcode: it does not offer CCR after all.
    ccr_refused: bool,
    lost: [Option<Lost>; LOST_MAX],
    /// Losses recorded so far (the last one's `seq`).
    losses: u64,
    /// Deadlines of dead associations that did not fit in `lost` (older than any in it).
    overflow: Option<Instant>,
    /// CCRs for the task to send, with the instant past which they are of no use.
    asks: [Option<(CtrlInstance, Instant)>; LOST_MAX],
    /// Their outcomes, for the executor.
    outcomes: [Option<(CtrlInstance, CcrOutcome)>; LOST_MAX],
}

fn put<T>(table: &mut [Option<T>], v: T) -> bool {
    match table.iter_mut().find(|e| e.is_none()) {
        Some(e) => {
            *e = Some(v);
            true
        }
        None => false,
    }
}

impl SafeShared {
    pub(super) fn new(policy: HoldPolicy) -> SafeShared {
        SafeShared {
            state: Mutex::new(SafeState {
                policy,
                current: None,
                ccr_refused: false,
                lost: [None; LOST_MAX],
                losses: 0,
                overflow: None,
                asks: [None; LOST_MAX],
                outcomes: [None; LOST_MAX],
            }),
            changed: Notify::new(),
            ccr_wake: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SafeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn set_current(&self, a: Option<Assoc>) {
        self.lock().current = a;
    }

    pub(super) fn current(&self) -> Option<CtrlInstance> {
        self.lock().current.map(|a| a.instance)
    }

    /// The status for `list`.
    pub(super) fn status(&self, now: Instant) -> SafeRetryStatus {
        let st = self.lock();
        let holds = st
            .lost
            .iter()
            .flatten()
            .filter(|l| l.held > 0)
            .map(|l| HoldStatus {
                instance: l.instance,
                held: l.held,
                by: if l.ccr == CcrPhase::Asked || l.ccr == CcrPhase::Succeeded {
                    ReleasedBy::Ccr
                } else {
                    ReleasedBy::Time
                },
                time_left: l.deadline.saturating_since(now),
            })
            .collect();
        SafeRetryStatus {
            mode: st.policy.mode,
            holds,
        }
    }

    /// The losses so far, and the live association's should it be dying now.
    pub(super) fn losses(&self) -> Losses {
        let st = self.lock();
        Losses(st.losses + u64::from(st.current.is_some()))
    }

    /// When every dead association of `upto` is quiet (`None`: now).
    fn quiet_at(&self, now: Instant, upto: Losses) -> Option<Instant> {
        let st = self.lock();
        if st.policy.mode == SafeRetry::Off {
            return None;
        }
        st.lost
            .iter()
            .flatten()
            .filter(|l| l.seq <= upto.0 && !l.quiet(now))
            .map(|l| l.deadline)
            .chain(st.overflow.filter(|t| *t > now))
            .max()
    }

    /// Dead associations of `upto` a CCR through another controller could show finished
    /// now, claimed so that one CCR goes for each: `ccr` mode, a target that offers it, none
    /// asked yet.
    pub(super) fn claim_for_ccr(
        &self,
        now: Instant,
        upto: Losses,
    ) -> [Option<CtrlInstance>; LOST_MAX] {
        let mut guard = self.lock();
        let st = &mut *guard;
        let mut out = [None; LOST_MAX];
        if st.policy.mode != SafeRetry::Ccr || st.ccr_refused {
            return out;
        }
        let open = st.lost.iter_mut().flatten().filter(|l| {
            l.seq <= upto.0 && l.ccr == CcrPhase::None && l.ctrl.ccr_possible && !l.quiet(now)
        });
        for (o, l) in out.iter_mut().zip(open) {
            l.ccr = CcrPhase::Asked;
            *o = Some(l.instance);
        }
        out
    }

    /// A CCR claimed by [`SafeShared::claim_for_ccr`] was given up before its end (the
    /// controller carrying it failed, and its caller went on to another): the association is
    /// open again for the next claim, instead of waiting for the time rule.
    pub(super) fn unclaim(&self, impacted: CtrlInstance) {
        let mut st = self.lock();
        for l in st
            .lost
            .iter_mut()
            .flatten()
            .filter(|l| l.instance == impacted && l.ccr == CcrPhase::Asked)
        {
            l.ccr = CcrPhase::None;
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// What a CCR for `impacted` came to, sent by the CCR task or through another
    /// controller: an error counts as failed (the time rule decides), and Invalid Opcode
    /// means the target does not offer CCR after all.
    fn ccr_outcome(&self, impacted: CtrlInstance, r: Result<CcrOutcome, HostError>) -> CcrOutcome {
        match r {
            Ok(o) => o,
            Err(e) => {
                if let HostError::Nvme(n) = &e {
                    if same_code(n.status, Status::INVALID_OPCODE) {
                        self.lock().ccr_refused = true;
                    }
                }
                tracing::info!(
                    cntlid = impacted.cntlid,
                    error = %e,
                    "cross-controller reset failed; held commands wait for the time rule"
                );
                CcrOutcome::Failed
            }
        }
    }

    /// Hand the executor the outcome of a CCR; false if earlier ones are still untaken.
    fn put_outcome(&self, impacted: CtrlInstance, outcome: CcrOutcome) -> bool {
        let ok = put(&mut self.lock().outcomes, (impacted, outcome));
        if !ok {
            // The executor has not taken earlier outcomes: the time rule still holds.
            tracing::warn!("too many CCR outcomes pending; the time rule decides");
        }
        ok
    }

    /// A CCR claimed by [`SafeShared::claim_for_ccr`] ended: its dead association is quiet at
    /// once if it succeeded (the executor releases its held commands when it next looks).
    pub(super) fn on_peer_ccr(&self, impacted: CtrlInstance, r: Result<CcrOutcome, HostError>) {
        let outcome = self.ccr_outcome(impacted, r);
        if self.put_outcome(impacted, outcome) {
            let phase = match outcome {
                CcrOutcome::Succeeded => CcrPhase::Succeeded,
                CcrOutcome::Failed => CcrPhase::Failed,
            };
            let mut st = self.lock();
            for l in st
                .lost
                .iter_mut()
                .flatten()
                .filter(|l| l.instance == impacted)
            {
                l.ccr = phase;
            }
        }
        self.changed.notify_waiters();
    }

    /// A waiter for the next change: a dead association went quiet, a CCR outcome came in,
    /// or a loss was recorded.
    pub(super) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Resolves once no command of a dead association of `upto` can still execute.
    pub(super) async fn quiesced(&self, clock: Clock, upto: Losses) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = clock.now();
            let Some(at) = self.quiet_at(now, upto) else {
                return;
            };
            let sleep = tokio::time::sleep(at.saturating_since(now));
            tokio::select! {
                _ = changed => {}
                _ = sleep => {}
            }
        }
    }
}

/// Read the CCR log (LID 0x1E) through `admin` with Remove Completed, so the entries of
/// resets that ended leave it; `None` when `deadline` passes first.
async fn take_ccr_log(
    admin: &QueueHandle,
    clock: Clock,
    deadline: Instant,
) -> Result<Option<Response>, HostError> {
    let sqe = ccr::get_ccr_log(0, CCR_LOG_ENTRIES, true)?;
    let len = ccr::LOG_HEADER_LEN + CCR_LOG_ENTRIES * ccr::CcrLogEntry::LEN;
    let left = deadline.saturating_since(clock.now());
    match tokio::time::timeout(left, admin.submit(sqe, None, len)).await {
        Ok(r) => r.map(Some),
        Err(_) => Ok(None),
    }
}

/// Send a Cross-Controller Reset for `impacted` through the controller behind `admin` and
/// wait for its end, reading the CCR log (LID 0x1E) until its entry is complete, at most
/// until `deadline`: a reset still in progress then counts as failed (the time rule
/// decides). An error is the command's own (Invalid Opcode: the target does not offer CCR).
pub(super) async fn cross_reset_until(
    admin: &QueueHandle,
    clock: Clock,
    impacted: CtrlInstance,
    deadline: Instant,
) -> Result<CcrOutcome, HostError> {
    let left = |now: Instant| deadline.saturating_since(now);
    let mut cleared = false;
    let sent = loop {
        let sent = tokio::time::timeout(
            left(clock.now()),
            admin.submit(ccr::cross_ctrl_reset(0, impacted), None, 0),
        )
        .await;
        match sent {
            // The source's log keeps every reset it ran, those answered at once too, until
            // read with Remove Completed: read it so, and ask once more.
            Ok(Err(HostError::Nvme(e)))
                if !cleared && same_code(e.status, ccr::status::LOG_FULL) =>
            {
                cleared = true;
                if take_ccr_log(admin, clock, deadline).await?.is_none() {
                    return Ok(CcrOutcome::Failed);
                }
            }
            sent => break sent,
        }
    };
    match sent {
        Err(_) => return Ok(CcrOutcome::Failed),
        Ok(Ok(r)) => {
            if CcrResult::from_dw0(r.cqe.result as u32).immediate {
                return Ok(CcrOutcome::Succeeded);
            }
        }
        // This controller already runs a CCR for it: its entry tells the end.
        Ok(Err(HostError::Nvme(e))) if same_code(e.status, ccr::status::IN_PROGRESS) => {}
        Ok(Err(HostError::Nvme(e)))
            if same_code(e.status, ccr::status::LIMIT_EXCEEDED)
                || same_code(e.status, ccr::status::LOG_FULL) =>
        {
            return Ok(CcrOutcome::Failed)
        }
        Ok(Err(e)) => return Err(e),
    }
    // Accepted and under way: the log entry completes when the impacted controller's last
    // command is over (the target also raises an event naming the log).
    let mut pause = Duration::from_millis(1);
    loop {
        let now = clock.now();
        if now >= deadline {
            return Ok(CcrOutcome::Failed);
        }
        tokio::time::sleep(pause.min(left(now))).await;
        pause = (pause * 2).min(Duration::from_millis(50));
        let Some(r) = take_ccr_log(admin, clock, deadline).await? else {
            return Ok(CcrOutcome::Failed);
        };
        let Ok(log) = CcrLog::new_checked(&r.data[..]) else {
            return Err(HostError::Protocol(
                "the CCR log page is malformed; safe retry falls back to the time rule".into(),
            ));
        };
        match log.state_of(&impacted) {
            Some(CcrState::Success) => return Ok(CcrOutcome::Succeeded),
            Some(CcrState::Failed) => return Ok(CcrOutcome::Failed),
            Some(CcrState::InProgress) | None => {}
        }
    }
}

/// Entries read from the CCR log at a time (a target keeps a few per source controller).
const CCR_LOG_ENTRIES: usize = 16;

fn same_code(a: Status, b: Status) -> bool {
    (a.sct, a.sc) == (b.sct, b.sc)
}

/// The CCR task of a controller: sends the CCRs the executor asks for through the live
/// association's admin queue and hands back the outcomes. Ends with the controller.
pub(super) async fn ccr_task(
    admin: QueueHandle,
    clock: Clock,
    safe: Arc<SafeShared>,
    wake_executor: Arc<super::inbox::Inbox>,
) {
    loop {
        let woken = safe.ccr_wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let ask = safe.lock().asks.iter_mut().find_map(Option::take);
        let Some((impacted, deadline)) = ask else {
            woken.await;
            continue;
        };
        let r = cross_reset_until(&admin, clock, impacted, deadline).await;
        let outcome = safe.ccr_outcome(impacted, r);
        safe.put_outcome(impacted, outcome);
        wake_executor.wake.notify_one();
    }
}

/// Labels are fixed at connect; handles update without allocating.
pub(super) struct SafeMetrics {
    held: metrics::Counter,
    by_ccr: metrics::Counter,
    by_time: metrics::Counter,
    by_off: metrics::Counter,
    hold_secs: metrics::Histogram,
}

impl SafeMetrics {
    pub(super) fn new(subnqn: &str) -> SafeMetrics {
        let l = |by: &'static str| [("subnqn", subnqn.to_string()), ("by", by.to_string())];
        let s = [("subnqn", subnqn.to_string())];
        SafeMetrics {
            held: metrics::counter!("nvmf_ctrl_safe_retry_held_total", &s),
            by_ccr: metrics::counter!("nvmf_ctrl_safe_retry_released_total", &l("ccr")),
            by_time: metrics::counter!("nvmf_ctrl_safe_retry_released_total", &l("time")),
            by_off: metrics::counter!("nvmf_ctrl_safe_retry_released_total", &l("off")),
            hold_secs: metrics::histogram!("nvmf_ctrl_safe_retry_hold_seconds", &s),
        }
    }
}

/// The executor's side: the hold table (tags: queue index << 16 | slot), sized at connect.
pub(super) struct SafeExec {
    pub(super) shared: Arc<SafeShared>,
    hold: Hold<u32>,
    /// The association the attempt under way identified: current once LIVE.
    pub(super) next: Option<Assoc>,
    metrics: SafeMetrics,
    /// For the log.
    subnqn: Arc<str>,
}

impl SafeExec {
    pub(super) fn new(shared: Arc<SafeShared>, capacity: usize, subnqn: &str) -> SafeExec {
        let policy = shared.lock().policy;
        SafeExec {
            shared,
            hold: Hold::new(policy, capacity),
            next: None,
            metrics: SafeMetrics::new(subnqn),
            subnqn: subnqn.into(),
        }
    }

    /// When the next held command may go.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        self.hold.poll_timeout()
    }
}

fn tag(qi: usize, slot: usize) -> u32 {
    (qi as u32) << 16 | slot as u32
}

impl SafeExec {
    /// The connection just torn down was the live association: record it as lost, with the
    /// last contact on any of its queues. `reconnecting`: the controller will resend what
    /// was in flight (not deleted).
    pub(super) fn on_lost<D: DeviceContext>(
        &mut self,
        now: Instant,
        kato: Duration,
        admin: &QueueCtl<D>,
        io: &[QueueCtl<D>],
        reconnecting: bool,
    ) {
        let last = std::iter::once(admin)
            .chain(io.iter())
            .map(|q| q.lock().last_contact(now))
            .max()
            .unwrap_or(now);
        let shared = self.shared.clone();
        let mut st = shared.lock();
        let Some(a) = st.current.take() else { return };
        let lost = LostController {
            instance: a.instance,
            last_contact: last,
            kato,
            cqt_ms: a.cqt_ms,
            traffic_based_keep_alive: a.tbkas,
            ccr_possible: a.offers_ccr && !st.ccr_refused,
        };
        let deadline = lost.quiesced_by(&st.policy);
        st.losses += 1;
        let seq = st.losses;
        if reconnecting && st.policy.mode == SafeRetry::Ccr && !lost.ccr_possible {
            // An operator who chose CCR should see that this target leaves only the slower
            // rule, and how long it holds writes.
            tracing::info!(
                subnqn = %self.subnqn,
                cntlid = a.instance.cntlid,
                hold_ms = deadline.saturating_since(last).as_millis() as u64,
                kato_ms = kato.as_millis() as u64,
                cqt_ms = lost.cqt(&st.policy).as_millis() as u64,
                cqt_from = if a.cqt_ms == 0 { "--cqt-default" } else { "target" },
                "safe retry falls back to the time rule: the target offers no cross-controller \
                 reset, so writes in flight on the dead controller wait k x KATO + CQT after \
                 the last contact"
            );
        }
        let rec = Lost {
            ctrl: lost,
            instance: a.instance,
            deadline,
            at: now,
            held: 0,
            ccr: CcrPhase::None,
            seq,
        };
        if !put(&mut st.lost, rec) {
            // The oldest goes to the overflow deadline (its held commands keep their own
            // deadlines in the hold table): the newest loss must have its record, the stale
            // commands of the next reconnect are held by it.
            let oldest = (0..LOST_MAX).min_by_key(|&i| st.lost[i].map_or(now, |l| l.at));
            if let Some(i) = oldest {
                if let Some(old) = st.lost[i].replace(rec) {
                    let t = old.deadline;
                    st.overflow = Some(st.overflow.map_or(t, |o| o.max(t)));
                }
            }
        }
        drop(st);
        // A CCR through another controller may be wanted for it (`quiesced_via`).
        shared.changed.notify_waiters();
    }

    /// The controller is LIVE again, before its held commands are resumed: hold back those
    /// that change state and were out on the last dead association, and ask for a CCR.
    pub(super) fn on_live<D: DeviceContext>(
        &mut self,
        now: Instant,
        admin: &QueueCtl<D>,
        io: &[QueueCtl<D>],
    ) {
        let shared = self.shared.clone();
        let mut st = shared.lock();
        st.current = self.next.take().or(st.current);
        let off = st.policy.mode == SafeRetry::Off;
        // The stale commands not held back yet were all out on the latest loss.
        let latest = (0..LOST_MAX)
            .filter_map(|i| st.lost[i].map(|l| (i, l)))
            .max_by_key(|(_, l)| l.at);
        let Some((ri, rec)) = latest else {
            return;
        };
        let hold = &mut self.hold;
        let (mut held, mut resent) = (0, 0);
        for (qi, q) in std::iter::once(admin).chain(io.iter()).enumerate() {
            let kind = if qi == 0 {
                QueueKind::Admin
            } else {
                QueueKind::Io
            };
            q.lock().gate_stale(|slot, op| {
                if CmdClass::of(kind, op) == CmdClass::Idempotent {
                    return false;
                }
                if off {
                    resent += 1;
                    return false;
                }
                match hold.hold(now, &rec.ctrl, tag(qi, slot), CmdClass::Mutating) {
                    Ok(()) => {
                        held += 1;
                        true
                    }
                    // Sized from the queues' slots, the table cannot be full.
                    Err(e) => {
                        tracing::error!(error = %e, "command resent without a hold");
                        false
                    }
                }
            });
        }
        self.metrics.by_off.increment(resent);
        if held == 0 {
            return;
        }
        self.metrics.held.increment(held as u64);
        let want_ccr = st.policy.mode == SafeRetry::Ccr
            && rec.ctrl.ccr_possible
            && !st.ccr_refused
            && rec.ccr == CcrPhase::None;
        let asked = want_ccr && put(&mut st.asks, (rec.instance, rec.deadline));
        if let Some(r) = st.lost[ri].as_mut() {
            r.held += held;
            if asked {
                r.ccr = CcrPhase::Asked;
            }
        }
        if asked {
            shared.ccr_wake.notify_one();
        }
    }

    /// Take CCR outcomes and let go every held command whose rule allows it now.
    pub(super) fn release<D: DeviceContext>(
        &mut self,
        now: Instant,
        admin: &QueueCtl<D>,
        io: &[QueueCtl<D>],
    ) {
        let shared = self.shared.clone();
        let mut st = shared.lock();
        let mut any = false;
        for k in 0..LOST_MAX {
            let Some((inst, outcome)) = st.outcomes[k].take() else {
                continue;
            };
            any = true;
            self.hold.on_ccr(now, inst, outcome);
            for l in st.lost.iter_mut().flatten().filter(|l| l.instance == inst) {
                l.ccr = match outcome {
                    CcrOutcome::Succeeded => CcrPhase::Succeeded,
                    CcrOutcome::Failed => CcrPhase::Failed,
                };
            }
        }
        let m = &self.metrics;
        let lost = &mut st.lost;
        self.hold.release_due_from(now, |t, inst| {
            let (qi, slot) = ((t >> 16) as usize, (t & 0xFFFF) as usize);
            let q = if qi == 0 { admin } else { &io[qi - 1] };
            let sent = q.lock().ungate(slot, now);
            q.poke();
            let Some(l) = lost.iter_mut().flatten().find(|l| l.instance == inst) else {
                return;
            };
            l.held = l.held.saturating_sub(1);
            if sent {
                let c = if l.ccr == CcrPhase::Succeeded && now < l.deadline {
                    &m.by_ccr
                } else {
                    &m.by_time
                };
                c.increment(1);
            }
            if l.held == 0 {
                m.hold_secs.record(now.saturating_since(l.at).as_secs_f64());
            }
        });
        // Forget the dead associations that are quiet and hold nothing.
        for e in st.lost.iter_mut() {
            if e.is_some_and(|l| l.held == 0 && l.quiet(now)) {
                *e = None;
                any = true;
            }
        }
        if st.overflow.is_some_and(|t| t <= now) {
            st.overflow = None;
            any = true;
        }
        drop(st);
        if any {
            shared.changed.notify_waiters();
        }
    }

    /// The I/O queues' held commands were given back to the multipath layer (admin commands
    /// stay): hold none of them. Whoever takes them on another path waits for the same rule
    /// (`Controller::quiesced_via`).
    pub(super) fn handed_back(&mut self) {
        self.hold.forget_if(|t| t >> 16 != 0);
        let mut st = self.shared.lock();
        for l in st.lost.iter_mut().flatten() {
            l.held = self.hold.held_from(&l.instance);
        }
    }

    /// Held commands were failed (deletion, fast_io_fail_tmo, ctrl_loss_tmo): hold nothing.
    pub(super) fn failed_held(&mut self) {
        self.hold.clear();
        let mut st = self.shared.lock();
        for l in st.lost.iter_mut().flatten() {
            l.held = 0;
        }
    }
}

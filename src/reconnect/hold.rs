//! Safe retry: which commands that were in flight on a dead connection may be sent again, and
//! when (NVMe TP4129 "KATO Corrections and Clarifications", TP8028 "Rapid Path Failure
//! Recovery").
//!
//! A write that was in flight when its connection died may still be executing in the target:
//! queued in its backend, or on a controller that has not yet noticed the host is gone. Sent
//! again at once and acknowledged, then overwritten by a newer write, it can still be
//! overwritten in turn by the stale original. So a command that changes state is held until
//! one of:
//! - a Cross-Controller Reset through another controller of the subsystem reported the old
//!   controller instance reset (its commands are finished);
//! - the old controller has had time to notice the loss and quiesce: `k x KATO + CQT` after
//!   the host's last exchange with it, `k` = 3 with traffic-based keep alive, 2 without
//!   (TP4129; Linux `nvmef_req_hold_timeout_ms`);
//! - the target showed, in a way the spec makes binding, that the old association is gone.
//!
//! Commands that only read go at once. Mode `off` lets everything go at once (what Linux
//! mainline and SPDK do).
//!
//! Sans-I/O: inputs are events and a `now`; outputs are released commands
//! ([`Hold::release_due`]), CCRs to send ([`Hold::poll_ccr`]) and the next deadline
//! ([`Hold::poll_timeout`]). Every table is sized at construction; nothing allocates after
//! [`Hold::new`], so the recovery path can use it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::nvme::admin::opcode;
use crate::nvme::ccr::CtrlInstance;
use crate::verbs::Instant;

/// `--safe-retry`: how in-flight commands of a dead connection are let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SafeRetry {
    /// Cross-Controller Reset where the subsystem offers it and another controller of it is
    /// live; the time rule otherwise, and always as the upper bound.
    #[default]
    Ccr,
    /// The time rule only: `k x KATO + CQT` after the last exchange.
    Cqt,
    /// Resend at once (unsafe: a stale write may land after a newer one).
    Off,
}

impl SafeRetry {
    pub fn name(self) -> &'static str {
        match self {
            SafeRetry::Ccr => "ccr",
            SafeRetry::Cqt => "cqt",
            SafeRetry::Off => "off",
        }
    }
}

impl FromStr for SafeRetry {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ccr" => Ok(SafeRetry::Ccr),
            "cqt" => Ok(SafeRetry::Cqt),
            "off" => Ok(SafeRetry::Off),
            _ => Err(format!("safe-retry must be ccr, cqt or off, not {s:?}")),
        }
    }
}

impl fmt::Display for SafeRetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// CQT assumed for a controller that reports none (Identify CQT 0). TP4129 leaves a zero CQT
/// meaning "not reported", not "instant"; a target with a slow backend needs more than 0.
pub const DEFAULT_CQT: Duration = Duration::from_secs(10);

/// The knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldPolicy {
    pub mode: SafeRetry,
    /// CQT for controllers that report 0.
    pub default_cqt: Duration,
}

impl Default for HoldPolicy {
    fn default() -> Self {
        HoldPolicy {
            mode: SafeRetry::default(),
            default_cqt: DEFAULT_CQT,
        }
    }
}

/// Whether a command may run twice, or late, without changing what the host sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmdClass {
    /// Reads and queries: sent again at once.
    Idempotent,
    /// Everything that changes state, and everything not known to be harmless: held.
    Mutating,
}

/// Which queue a command was on (admin and I/O opcodes overlap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueKind {
    Admin,
    Io,
}

impl CmdClass {
    /// The class of `opcode` on `queue`. Unknown opcodes, Fabrics commands and Flush are
    /// held: a flush acknowledged before the writes it covers are known finished would
    /// promise what the target may not keep.
    pub fn of(queue: QueueKind, op: u8) -> CmdClass {
        const COMPARE: u8 = 0x05;
        let idempotent = match queue {
            QueueKind::Io => matches!(op, opcode::io::READ | COMPARE),
            QueueKind::Admin => matches!(
                op,
                opcode::admin::IDENTIFY
                    | opcode::admin::GET_LOG_PAGE
                    | opcode::admin::GET_FEATURES
                    | opcode::admin::KEEP_ALIVE
                    | opcode::admin::ASYNC_EVENT_REQUEST
                    // Resetting a dead instance twice does what resetting it once does; held,
                    // a CCR lost with its connection would wait for itself.
                    | opcode::admin::CROSS_CTRL_RESET
            ),
        };
        if idempotent {
            CmdClass::Idempotent
        } else {
            CmdClass::Mutating
        }
    }
}

/// What the host knew of a controller whose connection died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LostController {
    /// The controller instance (CNTLID, CIU, CIRN from its Identify data).
    pub instance: CtrlInstance,
    /// The last exchange with it: the later of the last completion received and the last
    /// command or keep alive sent. The controller may have heard from the host until then,
    /// so its keep-alive timer runs from no earlier than this.
    pub last_contact: Instant,
    /// The Keep Alive Timeout in force on that association.
    pub kato: Duration,
    /// Identify CQT in milliseconds; 0 = not reported.
    pub cqt_ms: u16,
    /// CTRATT.TBKAS: the controller counts any traffic as keep alive.
    pub traffic_based_keep_alive: bool,
    /// Identify CCRL non-zero and another controller of the subsystem is live.
    pub ccr_possible: bool,
}

impl LostController {
    /// When the time rule lets this controller's commands go.
    pub fn quiesced_by(&self, policy: &HoldPolicy) -> Instant {
        let k = if self.traffic_based_keep_alive { 3 } else { 2 };
        self.last_contact + self.kato.saturating_mul(k) + self.cqt(policy)
    }

    /// The CQT the time rule uses: the controller's, else the policy's default.
    pub fn cqt(&self, policy: &HoldPolicy) -> Duration {
        if self.cqt_ms == 0 {
            policy.default_cqt
        } else {
            Duration::from_millis(u64::from(self.cqt_ms))
        }
    }
}

/// How a Cross-Controller Reset ended, from its completion (IRS) or the CCR log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CcrOutcome {
    /// The impacted controller's commands are finished.
    Succeeded,
    /// No reset: the time rule decides.
    Failed,
}

/// The table is full: the command was not taken and is handed back. Sized from the
/// controller's queue slots, this does not happen; the caller fails the command rather than
/// resend it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("safe-retry hold table is full ({capacity} commands): size it from the queue slots")]
pub struct HoldFull<T> {
    pub tag: T,
    pub capacity: usize,
}

#[derive(Debug, Clone, Copy)]
struct Slot<T> {
    tag: T,
    instance: CtrlInstance,
    not_before: Instant,
}

/// Held commands of one controller (all its instances), identified by a `T` the caller
/// chooses (its retry-slot index).
#[derive(Debug, Clone)]
pub struct Hold<T> {
    policy: HoldPolicy,
    slots: Vec<Slot<T>>,
    ccr_wanted: Vec<CtrlInstance>,
}

/// How many controller instances may wait for a CCR at once: one per connection loss not yet
/// answered. Past it the time rule alone applies, which is safe.
pub const CCR_QUEUE: usize = 4;

impl<T: Copy + PartialEq> Hold<T> {
    /// A table for at most `capacity` held commands.
    pub fn new(policy: HoldPolicy, capacity: usize) -> Hold<T> {
        Hold {
            policy,
            slots: Vec::with_capacity(capacity),
            ccr_wanted: Vec::with_capacity(CCR_QUEUE),
        }
    }

    pub fn policy(&self) -> &HoldPolicy {
        &self.policy
    }

    /// Commands held now.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The connection to `lost` died with commands in flight: each in-flight command follows
    /// with [`Hold::hold`]. Queues a CCR for `lost` when the mode and the controller allow it.
    pub fn on_connection_lost(&mut self, lost: &LostController) {
        if self.policy.mode == SafeRetry::Ccr
            && lost.ccr_possible
            && !self.ccr_wanted.contains(&lost.instance)
            && self.ccr_wanted.len() < self.ccr_wanted.capacity()
        {
            self.ccr_wanted.push(lost.instance);
        }
    }

    /// Hold command `tag` of class `class` that was in flight on `lost`.
    pub fn hold(
        &mut self,
        now: Instant,
        lost: &LostController,
        tag: T,
        class: CmdClass,
    ) -> Result<(), HoldFull<T>> {
        if self.slots.len() == self.slots.capacity() {
            return Err(HoldFull {
                tag,
                capacity: self.slots.capacity(),
            });
        }
        let not_before = match (self.policy.mode, class) {
            (SafeRetry::Off, _) | (_, CmdClass::Idempotent) => now,
            (_, CmdClass::Mutating) => lost.quiesced_by(&self.policy),
        };
        self.slots.push(Slot {
            tag,
            instance: lost.instance,
            not_before,
        });
        Ok(())
    }

    /// The next CCR to send: the impacted controller instance. Sent through any live
    /// controller of the same subsystem; the answer comes back through [`Hold::on_ccr`].
    pub fn poll_ccr(&mut self) -> Option<CtrlInstance> {
        if self.ccr_wanted.is_empty() {
            None
        } else {
            Some(self.ccr_wanted.remove(0))
        }
    }

    /// A CCR for `impacted` ended. Success lets its commands go now; failure leaves them to
    /// the time rule.
    pub fn on_ccr(&mut self, now: Instant, impacted: CtrlInstance, outcome: CcrOutcome) {
        if self.policy.mode != SafeRetry::Ccr || outcome != CcrOutcome::Succeeded {
            return;
        }
        self.release_instance(now, impacted);
    }

    /// The target showed that `instance`'s association is gone for good (binding evidence,
    /// not a guess): its commands can no longer execute.
    pub fn on_association_gone(&mut self, now: Instant, instance: CtrlInstance) {
        self.release_instance(now, instance);
    }

    fn release_instance(&mut self, now: Instant, instance: CtrlInstance) {
        for s in self.slots.iter_mut().filter(|s| s.instance == instance) {
            s.not_before = s.not_before.min(now);
        }
    }

    /// Hand every command that may be sent again at `now` to `resend`, in the order they
    /// were held, and forget it.
    pub fn release_due(&mut self, now: Instant, mut resend: impl FnMut(T)) {
        self.release_due_from(now, |t, _| resend(t));
    }

    /// [`Hold::release_due`], with the instance each command was in flight on.
    pub fn release_due_from(&mut self, now: Instant, mut resend: impl FnMut(T, CtrlInstance)) {
        self.slots.retain(|s| {
            if s.not_before <= now {
                resend(s.tag, s.instance);
                false
            } else {
                true
            }
        });
    }

    /// Commands held now that were in flight on `instance`.
    pub fn held_from(&self, instance: &CtrlInstance) -> usize {
        self.slots
            .iter()
            .filter(|s| s.instance == *instance)
            .count()
    }

    /// Every held command was failed (deletion, fast_io_fail_tmo, ctrl_loss_tmo): hold
    /// nothing, ask for no CCR.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.ccr_wanted.clear();
    }

    /// When the next held command may go; `None` when nothing is held.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.slots.iter().map(|s| s.not_before).min()
    }

    /// How long until every command held now may go (for `list`).
    pub fn time_left(&self, now: Instant) -> Option<Duration> {
        self.slots
            .iter()
            .map(|s| s.not_before)
            .max()
            .map(|t| t.saturating_since(now))
    }

    /// The command `tag` was failed or completed another way: stop holding it.
    pub fn forget(&mut self, tag: T) {
        self.forget_if(|t| t == tag);
    }

    /// Stop holding every command whose tag `gone` accepts (they were failed).
    pub fn forget_if(&mut self, mut gone: impl FnMut(T) -> bool) {
        self.slots.retain(|s| !gone(s.tag));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;

    fn at(ms: u64) -> Instant {
        Instant::from_nanos(ms * MS)
    }

    fn lost(last_ms: u64, kato_ms: u64, cqt_ms: u16, ccr: bool) -> LostController {
        LostController {
            instance: CtrlInstance {
                cntlid: 1,
                ciu: 1,
                cirn: 42,
            },
            last_contact: at(last_ms),
            kato: Duration::from_millis(kato_ms),
            cqt_ms,
            traffic_based_keep_alive: false,
            ccr_possible: ccr,
        }
    }

    fn released(h: &mut Hold<u16>, now: Instant) -> Vec<u16> {
        let mut v = Vec::new();
        h.release_due(now, |t| v.push(t));
        v
    }

    fn policy(mode: SafeRetry) -> HoldPolicy {
        HoldPolicy {
            mode,
            default_cqt: Duration::from_millis(700),
        }
    }

    #[test]
    fn reads_go_at_once_writes_wait_two_kato_plus_cqt() {
        let mut h = Hold::new(policy(SafeRetry::Cqt), 4);
        let l = lost(100, 1000, 300, false);
        h.on_connection_lost(&l);
        h.hold(
            at(500),
            &l,
            1,
            CmdClass::of(QueueKind::Io, opcode::io::READ),
        )
        .unwrap();
        h.hold(
            at(500),
            &l,
            2,
            CmdClass::of(QueueKind::Io, opcode::io::WRITE),
        )
        .unwrap();
        assert_eq!(h.poll_ccr(), None, "cqt mode sends no CCR");
        assert_eq!(released(&mut h, at(500)), vec![1]);
        // 100 + 2 x 1000 + 300.
        assert_eq!(h.poll_timeout(), Some(at(2400)));
        assert_eq!(h.time_left(at(400)), Some(Duration::from_millis(2000)));
        assert!(released(&mut h, at(2399)).is_empty());
        assert_eq!(released(&mut h, at(2400)), vec![2]);
        assert!(h.is_empty() && h.poll_timeout().is_none());
    }

    #[test]
    fn traffic_based_keep_alive_waits_three_kato_and_zero_cqt_takes_the_default() {
        let mut l = lost(0, 1000, 0, false);
        l.traffic_based_keep_alive = true;
        assert_eq!(l.quiesced_by(&policy(SafeRetry::Cqt)), at(3700));
    }

    #[test]
    fn ccr_success_releases_early_failure_leaves_the_time_rule() {
        let mut h = Hold::new(policy(SafeRetry::Ccr), 4);
        let l = lost(0, 1000, 500, true);
        h.on_connection_lost(&l);
        h.on_connection_lost(&l);
        for tag in [1, 2] {
            h.hold(at(10), &l, tag, CmdClass::Mutating).unwrap();
        }
        assert_eq!(h.poll_ccr(), Some(l.instance));
        assert_eq!(h.poll_ccr(), None, "one CCR per instance");
        h.on_ccr(at(20), l.instance, CcrOutcome::Failed);
        assert!(released(&mut h, at(30)).is_empty());
        // A success for another instance (a CNTLID reused by a newer association) does
        // nothing to these commands.
        let newer = CtrlInstance {
            ciu: 2,
            ..l.instance
        };
        h.on_ccr(at(40), newer, CcrOutcome::Succeeded);
        assert!(released(&mut h, at(40)).is_empty());
        h.on_ccr(at(50), l.instance, CcrOutcome::Succeeded);
        assert_eq!(released(&mut h, at(50)), vec![1, 2]);
    }

    #[test]
    fn ccr_is_not_asked_where_not_possible_and_ignored_in_cqt_mode() {
        let mut h: Hold<u16> = Hold::new(policy(SafeRetry::Ccr), 2);
        let l = lost(0, 1000, 500, false);
        h.on_connection_lost(&l);
        assert_eq!(h.poll_ccr(), None);
        let mut h = Hold::new(policy(SafeRetry::Cqt), 2);
        let l = lost(0, 1000, 500, true);
        h.on_connection_lost(&l);
        h.hold(at(0), &l, 7, CmdClass::Mutating).unwrap();
        h.on_ccr(at(1), l.instance, CcrOutcome::Succeeded);
        assert!(released(&mut h, at(1)).is_empty());
    }

    #[test]
    fn association_gone_releases_in_any_mode() {
        let mut h = Hold::new(policy(SafeRetry::Cqt), 2);
        let l = lost(0, 5000, 500, false);
        h.on_connection_lost(&l);
        h.hold(at(0), &l, 7, CmdClass::Mutating).unwrap();
        h.on_association_gone(at(3), l.instance);
        assert_eq!(released(&mut h, at(3)), vec![7]);
    }

    #[test]
    fn off_releases_everything_at_once() {
        let mut h = Hold::new(policy(SafeRetry::Off), 2);
        let l = lost(0, 5000, 500, true);
        h.on_connection_lost(&l);
        assert_eq!(h.poll_ccr(), None);
        h.hold(at(9), &l, 1, CmdClass::Mutating).unwrap();
        h.hold(at(9), &l, 2, CmdClass::Idempotent).unwrap();
        assert_eq!(released(&mut h, at(9)), vec![1, 2]);
    }

    #[test]
    fn a_full_table_hands_the_command_back() {
        let mut h = Hold::new(policy(SafeRetry::Cqt), 1);
        let l = lost(0, 5000, 500, false);
        h.hold(at(0), &l, 1, CmdClass::Mutating).unwrap();
        assert_eq!(
            h.hold(at(0), &l, 2, CmdClass::Mutating),
            Err(HoldFull {
                tag: 2,
                capacity: 1
            })
        );
        h.forget(1);
        assert!(h.is_empty());
    }

    #[test]
    fn modes_parse_and_print() {
        for m in [SafeRetry::Ccr, SafeRetry::Cqt, SafeRetry::Off] {
            assert_eq!(m.name().parse::<SafeRetry>(), Ok(m));
        }
        assert!("on".parse::<SafeRetry>().is_err());
        assert_eq!(SafeRetry::default(), SafeRetry::Ccr);
        assert_eq!(
            CmdClass::of(QueueKind::Io, opcode::io::FLUSH),
            CmdClass::Mutating
        );
        assert_eq!(
            CmdClass::of(QueueKind::Admin, opcode::admin::GET_LOG_PAGE),
            CmdClass::Idempotent
        );
        // 0x02 is Read on an I/O queue but Get Log Page on the admin queue; 0x01 is Write
        // on an I/O queue and must never count as a query.
        assert_eq!(CmdClass::of(QueueKind::Io, 0x01), CmdClass::Mutating);
        assert_eq!(CmdClass::of(QueueKind::Admin, 0x09), CmdClass::Mutating);
        assert_eq!(CmdClass::of(QueueKind::Io, 0x7F), CmdClass::Mutating);
    }

    #[derive(Debug, Clone)]
    enum Ev {
        Tick(u64),
        CcrOk,
        CcrFailed,
        Gone,
    }

    fn ev() -> impl Strategy<Value = Ev> {
        prop_oneof![
            4 => (0u64..4000).prop_map(Ev::Tick),
            1 => Just(Ev::CcrOk),
            1 => Just(Ev::CcrFailed),
            1 => Just(Ev::Gone),
        ]
    }

    fn mode() -> impl Strategy<Value = SafeRetry> {
        prop_oneof![
            Just(SafeRetry::Ccr),
            Just(SafeRetry::Cqt),
            Just(SafeRetry::Off)
        ]
    }

    proptest! {
        /// Whatever the events: a mutating command is never let go before its rule allows
        /// (time rule, or an earlier CCR success in ccr mode, or association gone), always
        /// by the time rule, and `off` lets everything go at once.
        #[test]
        fn never_early_always_by_the_time_rule(
            mode in mode(),
            last in 0u64..1000,
            lost_after in 0u64..3000,
            kato in 1u64..3000,
            cqt in 0u16..2000,
            tbkas: bool,
            ccr_possible: bool,
            classes in proptest::collection::vec(any::<bool>(), 1..16),
            events in proptest::collection::vec(ev(), 0..24),
        ) {
            let p = policy(mode);
            let mut l = lost(last, kato, cqt, ccr_possible);
            l.traffic_based_keep_alive = tbkas;
            // TP4129, written out here rather than taken from the code under test.
            let k = if tbkas { 3 } else { 2 };
            let cqt_ns = if cqt == 0 { 700 * MS } else { u64::from(cqt) * MS };
            let deadline = Instant::from_nanos(last * MS + k * kato * MS + cqt_ns);
            let mut h = Hold::new(p, classes.len());
            let mut now = at(last + lost_after);
            h.on_connection_lost(&l);
            for (i, &mutating) in classes.iter().enumerate() {
                let class = if mutating { CmdClass::Mutating } else { CmdClass::Idempotent };
                h.hold(now, &l, i as u16, class).unwrap();
            }
            let ccr_sent = h.poll_ccr().is_some();
            prop_assert_eq!(ccr_sent, mode == SafeRetry::Ccr && ccr_possible);
            // When the rule first allowed the mutating commands to go.
            let mut allowed = if mode == SafeRetry::Off { Some(now) } else { None };
            let mut gone = vec![false; classes.len()];
            for e in events.into_iter().chain([Ev::Tick(0)]) {
                match e {
                    Ev::Tick(d) => now = now + Duration::from_millis(d),
                    Ev::CcrOk => {
                        h.on_ccr(now, l.instance, CcrOutcome::Succeeded);
                        if mode == SafeRetry::Ccr {
                            allowed = allowed.or(Some(now));
                        }
                    }
                    Ev::CcrFailed => h.on_ccr(now, l.instance, CcrOutcome::Failed),
                    Ev::Gone => {
                        h.on_association_gone(now, l.instance);
                        allowed = allowed.or(Some(now));
                    }
                }
                let mut out = Vec::new();
                h.release_due(now, |t| out.push(t));
                for t in out {
                    let i = usize::from(t);
                    prop_assert!(!gone[i], "released twice");
                    gone[i] = true;
                    if classes[i] {
                        let ok = now >= deadline || allowed.is_some_and(|a| a <= now);
                        prop_assert!(ok, "write {} released at {:?}, rule allows {:?} / {:?}",
                            i, now, deadline, allowed);
                    }
                }
                for (i, &mutating) in classes.iter().enumerate() {
                    if !mutating || mode == SafeRetry::Off || now >= deadline {
                        prop_assert!(gone[i], "command {} still held at {:?}", i, now);
                    }
                }
            }
            // Past the time rule nothing is left, whatever CCR did.
            let end = deadline.max(now);
            h.release_due(end, |t| gone[usize::from(t)] = true);
            prop_assert!(gone.iter().all(|&g| g) && h.is_empty());
        }
    }
}

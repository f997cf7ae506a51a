//! The controller state machine: pure, fed events and `now`, answering with actions. It owns
//! every time rule of recovery (reconnect delay, fast_io_fail_tmo, ctrl_loss_tmo, the replug
//! window, the keep-alive schedule) so tests drive them with virtual time, tick by tick.
//!
//! Transitions are declared in [`TRANSITIONS`]; the machine takes no other.

use std::time::Duration;

use crate::verbs::Instant;

use super::policy::{Identity, Policy};

/// Controller states, with Linux's names (`enum nvme_ctrl_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CtrlState {
    New,
    Live,
    Resetting,
    Connecting,
    Deleting,
    Dead,
}

impl CtrlState {
    pub fn name(self) -> &'static str {
        match self {
            CtrlState::New => "new",
            CtrlState::Live => "live",
            CtrlState::Resetting => "resetting",
            CtrlState::Connecting => "connecting",
            CtrlState::Deleting => "deleting",
            CtrlState::Dead => "dead",
        }
    }

    pub const ALL: [CtrlState; 6] = [
        CtrlState::New,
        CtrlState::Live,
        CtrlState::Resetting,
        CtrlState::Connecting,
        CtrlState::Deleting,
        CtrlState::Dead,
    ];

    pub fn from_index(i: u8) -> CtrlState {
        Self::ALL[(i as usize).min(5)]
    }

    pub fn index(self) -> u8 {
        Self::ALL.iter().position(|s| *s == self).unwrap_or(0) as u8
    }
}

/// Why the controller left LIVE. Every cause takes the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The HCA reported a fatal error (a reset).
    DeviceFatal,
    /// The HCA was hot-removed.
    DeviceRemoved,
    /// The target tore a queue's connection down (DREQ).
    CmDisconnect,
    /// A keep-alive went unanswered for keep_alive_tmo.
    KeepAliveLost,
    /// A work completion failed or the QP went to error (retry exhausted, remote error).
    Transport,
    /// A command got no response within the I/O timeout.
    IoTimeout,
    /// The user asked for a controller reset.
    UserReset,
}

impl Cause {
    pub fn name(self) -> &'static str {
        match self {
            Cause::DeviceFatal => "device-fatal",
            Cause::DeviceRemoved => "device-removed",
            Cause::CmDisconnect => "cm-disconnect",
            Cause::KeepAliveLost => "keep-alive-lost",
            Cause::Transport => "transport-error",
            Cause::IoTimeout => "io-timeout",
            Cause::UserReset => "user-reset",
        }
    }

    pub const ALL: [Cause; 7] = [
        Cause::DeviceFatal,
        Cause::DeviceRemoved,
        Cause::CmDisconnect,
        Cause::KeepAliveLost,
        Cause::Transport,
        Cause::IoTimeout,
        Cause::UserReset,
    ];
}

/// Why pending I/O was failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailReason {
    /// fast_io_fail_tmo passed: a host path error; the controller keeps reconnecting.
    FastIoFail,
    /// ctrl_loss_tmo passed: the controller is deleted.
    CtrlLoss,
    /// max_reconnects attempts failed.
    MaxReconnects,
    /// The hot-removed device did not come back within replug_window.
    ReplugWindow,
    /// The user disconnected.
    Deleted,
    /// Another path of the subsystem carries it (multipath with more than one path).
    Failover,
}

impl FailReason {
    pub fn name(self) -> &'static str {
        match self {
            FailReason::FastIoFail => "fast_io_fail_tmo expired",
            FailReason::CtrlLoss => "ctrl_loss_tmo expired",
            FailReason::MaxReconnects => "max_reconnects used up",
            FailReason::ReplugWindow => "device not back within replug_window",
            FailReason::Deleted => "controller deleted",
            FailReason::Failover => "path failed: given to another path of the subsystem",
        }
    }
}

/// What the machine is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The initial connect or a reconnect attempt brought every queue up.
    Connected,
    /// A connect attempt failed (the target refused or did not answer, a step failed).
    /// Counts against `max_reconnects` (when the delay is positive) and, with a zero delay,
    /// lengthens the gap before the next attempt.
    ConnectFailed,
    /// A connect attempt was cut short by something other than the target: the device went
    /// away under it, or a deadline fired while it ran. Counts against nothing but time.
    ConnectCut,
    /// Something broke (see [`Cause`]).
    Failed(Cause),
    /// Every HCA resource has been dropped and in-flight I/O is held.
    TornDown,
    /// A device is present: ours if its identity passes the policy.
    DeviceUp(Identity),
    /// Our device went away (`removed`: hot-remove, else a fatal reset).
    DeviceDown { removed: bool },
    /// The outstanding keep-alive completed.
    KeepAliveOk,
    /// The user disconnects.
    Delete,
    /// Deleting finished.
    Deleted,
    /// Whether another path of the subsystem can carry this controller's I/O. While it can,
    /// I/O held by a lost connection goes back to the multipath layer at once instead of
    /// waiting for the reconnect (Linux `nvme_failover_req`).
    OtherPaths(bool),
}

/// What the machine asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    StopKeepAlive,
    /// Send a keep-alive on the admin queue.
    SendKeepAlive,
    /// Orderly shutdown (CC.SHN) before deleting; best effort.
    Shutdown,
    /// Drop every HCA resource, whatever state it is in; hold in-flight I/O.
    TearDown,
    /// Reconnect admin then I/O queues through the device.
    Connect {
        attempt: u32,
    },
    /// Resubmit held I/O; the controller is LIVE.
    Resubmit,
    /// Fail held I/O, and new I/O while not LIVE.
    FailHeld(FailReason),
    /// Give held I/O (not admin commands) back to the multipath layer, and new I/O while
    /// not LIVE: another path carries it.
    HandBack,
    /// Fail everything pending; nothing more is accepted.
    FailAll(FailReason),
}

/// Up to eight actions, with no heap.
#[derive(Debug, Clone, Copy, Default)]
pub struct Actions {
    buf: [Option<Action>; 8],
    len: usize,
}

impl Actions {
    fn push(&mut self, a: Action) {
        if self.len < self.buf.len() {
            self.buf[self.len] = Some(a);
            self.len += 1;
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn iter(&self) -> impl Iterator<Item = Action> + '_ {
        self.buf[..self.len].iter().flatten().copied()
    }
    pub fn contains(&self, a: Action) -> bool {
        self.iter().any(|x| x == a)
    }
}

/// What moves the machine from one state to another: the triggers of [`TRANSITIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Trigger {
    Connected,
    ConnectFailed,
    /// A failure of any [`Cause`].
    Failed,
    /// Every HCA resource was dropped.
    TornDown,
    /// An attempt failed or was cut short, with budget left.
    Retry,
    /// ctrl_loss_tmo, max_reconnects or replug_window ran out.
    GiveUp,
    /// The user deletes the controller.
    Delete,
    Deleted,
}

impl Trigger {
    pub fn name(self) -> &'static str {
        match self {
            Trigger::Connected => "connected",
            Trigger::ConnectFailed => "connect failed",
            Trigger::Failed => "failure (any cause)",
            Trigger::TornDown => "resources dropped",
            Trigger::Retry => "attempt failed or cut, budget left",
            Trigger::GiveUp => "ctrl_loss_tmo / max_reconnects / replug_window",
            Trigger::Delete => "delete (user)",
            Trigger::Deleted => "deleted",
        }
    }
}

/// Every transition the machine can take: (from, trigger, to).
pub const TRANSITIONS: &[(CtrlState, Trigger, CtrlState)] = {
    use CtrlState::*;
    use Trigger::*;
    &[
        (New, Connected, Live),
        (New, ConnectFailed, Deleting),
        (New, Delete, Deleting),
        (Live, Failed, Resetting),
        (Live, Delete, Deleting),
        (Resetting, TornDown, Connecting),
        (Resetting, GiveUp, Deleting),
        (Resetting, Delete, Deleting),
        (Connecting, Connected, Live),
        (Connecting, Retry, Resetting),
        (Connecting, GiveUp, Deleting),
        (Connecting, Delete, Deleting),
        (Deleting, Deleted, Dead),
    ]
};

/// [`TRANSITIONS`] as text, one row a line, for review and the checked-in snapshot.
pub fn describe() -> String {
    let mut out = String::new();
    for (from, on, to) in TRANSITIONS {
        out.push_str(&format!(
            "{:<11} --{}--> {}\n",
            from.name(),
            on.name(),
            to.name()
        ));
    }
    out
}

/// A snapshot for `list` and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    pub state: CtrlState,
    pub cause: Option<Cause>,
    /// Attempts made in this episode (Linux `nr_reconnects`).
    pub attempt: u32,
    /// Failed attempts that count against `max_attempts` (attempts cut short by the device
    /// going away do not).
    pub failed_attempts: u32,
    pub max_attempts: Option<u32>,
    /// When the next attempt goes, while waiting for one (the pacing gap, or
    /// `reconnect_delay`).
    pub next_attempt_in: Option<Duration>,
    /// Time left before ctrl_loss_tmo deletes the controller, while recovering.
    pub loss_in: Option<Duration>,
    pub device_present: bool,
    /// A device came back that is not ours (other GUID / PCI).
    pub foreign_device: bool,
    pub failfast: bool,
    /// Completed recoveries.
    pub recoveries: u64,
    /// Recovery episodes started: each failure that took the controller out of LIVE. Less
    /// `recoveries`, the episodes in progress or not recovered.
    pub episodes: u64,
    pub fail_reason: Option<FailReason>,
}

/// The controller state machine.
#[derive(Debug, Clone)]
pub struct Machine {
    policy: Policy,
    ours: Identity,
    state: CtrlState,
    cause: Option<Cause>,
    loss_at: Option<Instant>,
    failfast_at: Option<Instant>,
    failfast: bool,
    /// Another path can carry this controller's I/O (see [`Event::OtherPaths`]).
    other_paths: bool,
    replug_at: Option<Instant>,
    next_attempt_at: Option<Instant>,
    attempts: u32,
    /// Failed attempts of this episode that count against max_reconnects.
    charged: u32,
    /// Consecutive failed attempts: the pacing gap grows with them.
    streak: u32,
    in_attempt: bool,
    device_present: bool,
    foreign: bool,
    ka_next: Option<Instant>,
    ka_deadline: Option<Instant>,
    recoveries: u64,
    episodes: u64,
    fail_reason: Option<FailReason>,
    /// The last transition taken, for tests and logs.
    pub last: Option<(CtrlState, Trigger, CtrlState)>,
}

fn due(t: Option<Instant>, now: Instant) -> bool {
    t.is_some_and(|t| t <= now)
}

impl Machine {
    /// A controller about to make its first connection through the device `ours`.
    pub fn new(policy: Policy, ours: Identity) -> Machine {
        Machine {
            policy,
            ours,
            state: CtrlState::New,
            cause: None,
            loss_at: None,
            failfast_at: None,
            failfast: false,
            other_paths: false,
            replug_at: None,
            next_attempt_at: None,
            attempts: 0,
            charged: 0,
            streak: 0,
            in_attempt: false,
            device_present: true,
            foreign: false,
            ka_next: None,
            ka_deadline: None,
            recoveries: 0,
            episodes: 0,
            fail_reason: None,
            last: None,
        }
    }

    pub fn state(&self) -> CtrlState {
        self.state
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// New I/O should fail at once (fast_io_fail_tmo passed, or the controller is gone).
    pub fn failing_fast(&self) -> bool {
        self.failfast || matches!(self.state, CtrlState::Deleting | CtrlState::Dead)
    }

    pub fn status(&self, now: Instant) -> Status {
        Status {
            state: self.state,
            cause: self.cause,
            attempt: self.attempts,
            failed_attempts: self.charged,
            max_attempts: self.policy.max_reconnects(),
            next_attempt_in: (self.state == CtrlState::Connecting && !self.in_attempt)
                .then_some(self.next_attempt_at)
                .flatten()
                .map(|t| t.saturating_since(now)),
            loss_in: self.loss_at.map(|t| t.saturating_since(now)),
            device_present: self.device_present,
            foreign_device: self.foreign,
            failfast: self.failfast,
            recoveries: self.recoveries,
            episodes: self.episodes,
            fail_reason: self.fail_reason,
        }
    }

    fn goto(&mut self, to: CtrlState, why: Trigger) {
        debug_assert!(
            TRANSITIONS.contains(&(self.state, why, to)),
            "undeclared transition {:?} --{why:?}--> {to:?}",
            self.state
        );
        self.last = Some((self.state, why, to));
        self.state = to;
    }

    /// The earliest instant at which [`Machine::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut take = |x: Option<Instant>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        match self.state {
            CtrlState::Live => {
                take(self.ka_deadline);
                if self.ka_deadline.is_none() {
                    take(self.ka_next);
                }
            }
            CtrlState::Resetting | CtrlState::Connecting => {
                take(self.loss_at);
                if !self.failfast {
                    take(self.failfast_at);
                }
                if !self.device_present {
                    take(self.replug_at);
                }
                if self.state == CtrlState::Connecting && !self.in_attempt && self.device_present {
                    take(self.next_attempt_at);
                }
            }
            _ => {}
        }
        t
    }

    /// Time passed: fire what is due.
    pub fn handle_timeout(&mut self, now: Instant) -> Actions {
        let mut a = Actions::default();
        self.step(now, &mut a);
        a
    }

    /// Feed an event.
    pub fn handle(&mut self, now: Instant, ev: Event) -> Actions {
        use CtrlState::*;
        let mut a = Actions::default();
        match (self.state, ev) {
            (Dead, _) => return a,
            (Deleting, Event::Delete) => {}
            (_, Event::Delete) => {
                let was_live = self.state == Live;
                self.goto(Deleting, Trigger::Delete);
                if was_live {
                    a.push(Action::StopKeepAlive);
                    a.push(Action::Shutdown);
                }
                self.fail_reason = Some(FailReason::Deleted);
                a.push(Action::TearDown);
                a.push(Action::FailAll(FailReason::Deleted));
            }
            (Deleting, Event::Deleted) => {
                self.in_attempt = false;
                self.goto(Dead, Trigger::Deleted);
            }
            (New, Event::Connected) | (Connecting, Event::Connected) => {
                self.enter_live(now, &mut a)
            }
            (New, Event::ConnectFailed) => {
                self.goto(Deleting, Trigger::ConnectFailed);
                a.push(Action::TearDown);
                a.push(Action::FailAll(FailReason::Deleted));
            }
            (Connecting, Event::ConnectCut) => {
                self.in_attempt = false;
                self.goto(Resetting, Trigger::Retry);
                a.push(Action::TearDown);
            }
            (Connecting, Event::ConnectFailed) => {
                self.in_attempt = false;
                self.charged = self.charged.saturating_add(1);
                self.streak = self.streak.saturating_add(1);
                match self.policy.max_reconnects() {
                    Some(m) if self.charged >= m => self.give_up(FailReason::MaxReconnects, &mut a),
                    _ => {
                        self.goto(Resetting, Trigger::Retry);
                        a.push(Action::TearDown);
                    }
                }
            }
            (Live, Event::Failed(c)) => self.enter_resetting(now, c, &mut a),
            (Live, Event::DeviceDown { removed }) => {
                let c = if removed {
                    Cause::DeviceRemoved
                } else {
                    Cause::DeviceFatal
                };
                self.enter_resetting(now, c, &mut a)
            }
            (Live, Event::KeepAliveOk) => self.ka_deadline = None,
            (_, Event::OtherPaths(on)) => {
                let now_on = on && !self.other_paths;
                self.other_paths = on;
                if now_on && matches!(self.state, Resetting | Connecting) {
                    a.push(Action::HandBack);
                }
            }
            (Resetting, Event::TornDown) => {
                self.goto(Connecting, Trigger::TornDown);
                self.next_attempt_at = Some(now + self.policy.retry_gap(self.streak));
            }
            (Resetting | Connecting, ev) if device_loss(ev).is_some() => {
                self.device_present = false;
                if device_loss(ev) == Some(true) && self.replug_at.is_none() {
                    self.replug_at = Some(now + self.policy.replug_window);
                }
            }
            (_, Event::DeviceUp(id)) => {
                if self.policy.identity.accepts(&self.ours, &id) {
                    self.device_present = true;
                    self.foreign = false;
                    self.replug_at = None;
                } else {
                    self.foreign = true;
                }
            }
            _ => {}
        }
        self.step(now, &mut a);
        a
    }

    fn enter_live(&mut self, now: Instant, a: &mut Actions) {
        if self.state == CtrlState::Connecting {
            self.recoveries += 1;
        }
        self.goto(CtrlState::Live, Trigger::Connected);
        self.in_attempt = false;
        self.streak = 0;
        self.device_present = true;
        self.foreign = false;
        self.loss_at = None;
        self.failfast_at = None;
        self.failfast = false;
        self.replug_at = None;
        self.next_attempt_at = None;
        if self.recoveries > 0 {
            a.push(Action::Resubmit);
        }
        self.ka_deadline = None;
        self.ka_next =
            (!self.policy.keep_alive_tmo.is_zero()).then(|| now + self.policy.keep_alive_tmo / 2);
    }

    fn enter_resetting(&mut self, now: Instant, c: Cause, a: &mut Actions) {
        self.goto(CtrlState::Resetting, Trigger::Failed);
        self.cause = Some(c);
        self.episodes += 1;
        self.attempts = 0;
        self.charged = 0;
        self.streak = 0;
        self.in_attempt = false;
        self.fail_reason = None;
        self.ka_next = None;
        self.ka_deadline = None;
        self.loss_at = self.policy.ctrl_loss_tmo.map(|d| now + d);
        self.failfast_at = self.policy.fast_io_fail_tmo.map(|d| now + d);
        self.failfast = false;
        match c {
            Cause::DeviceRemoved => {
                self.device_present = false;
                self.replug_at = Some(now + self.policy.replug_window);
            }
            Cause::DeviceFatal => self.device_present = false,
            _ => {}
        }
        a.push(Action::StopKeepAlive);
        a.push(Action::TearDown);
        if self.other_paths {
            a.push(Action::HandBack);
        }
    }

    fn give_up(&mut self, why: FailReason, a: &mut Actions) {
        self.goto(CtrlState::Deleting, Trigger::GiveUp);
        self.in_attempt = false;
        self.fail_reason = Some(why);
        a.push(Action::TearDown);
        a.push(Action::FailAll(why));
    }

    /// Fire whatever time has made due.
    fn step(&mut self, now: Instant, a: &mut Actions) {
        match self.state {
            CtrlState::Live => {
                if due(self.ka_deadline, now) {
                    self.enter_resetting(now, Cause::KeepAliveLost, a);
                    return;
                }
                if self.ka_deadline.is_none() && due(self.ka_next, now) {
                    let kato = self.policy.keep_alive_tmo;
                    self.ka_deadline = Some(now + kato);
                    self.ka_next = Some(now + kato / 2);
                    a.push(Action::SendKeepAlive);
                }
            }
            CtrlState::Resetting | CtrlState::Connecting => {
                if due(self.loss_at, now) {
                    return self.give_up(FailReason::CtrlLoss, a);
                }
                if !self.device_present && due(self.replug_at, now) {
                    return self.give_up(FailReason::ReplugWindow, a);
                }
                if !self.failfast && due(self.failfast_at, now) {
                    self.failfast = true;
                    a.push(Action::FailHeld(FailReason::FastIoFail));
                }
                if self.state == CtrlState::Connecting
                    && !self.in_attempt
                    && self.device_present
                    && due(self.next_attempt_at, now)
                {
                    self.attempts += 1;
                    self.in_attempt = true;
                    a.push(Action::Connect {
                        attempt: self.attempts,
                    });
                }
            }
            _ => {}
        }
    }
}

/// Does `ev` say our device went away? `Some(true)`: hot-removed; `Some(false)`: reset.
fn device_loss(ev: Event) -> Option<bool> {
    match ev {
        Event::DeviceDown { removed } => Some(removed),
        Event::Failed(Cause::DeviceRemoved) => Some(true),
        Event::Failed(Cause::DeviceFatal) => Some(false),
        _ => None,
    }
}

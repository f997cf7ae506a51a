//! What the controller, its bring-up, its supervisor and its namespace rescans share: the
//! status they publish, the device they run on, and the bounded admin command they all use.

use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::nvme::admin;
use crate::nvme::Sqe;
use crate::reconnect::{Cause, CtrlState, Status};
use crate::verbs::{DeviceSource, Instant};

use super::inbox::Inbox;
use super::queue::{self, Clock, QueueHandle};
use super::HostError;

/// What `list` and the metrics show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtrlStatus {
    pub machine: Status,
    pub cntlid: u16,
    /// When `machine` was taken, on the controller's clock.
    pub at: Instant,
    /// Duration of the last completed recovery (failure → LIVE).
    pub last_recovery: Option<Duration>,
    /// Where the last completed recovery's time went.
    pub last_trace: Option<RecoveryTrace>,
}

/// Where the time of one recovery went: instants on the controller's clock, taken by the
/// supervisor as each step ends (the marks of the attempt that connected; earlier attempts
/// are counted). Fixed size, so recording allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoveryTrace {
    /// The cause the executor acted on: the first report that took the controller out of
    /// LIVE.
    pub cause: Option<Cause>,
    /// The failure reached the supervisor (it started tearing down).
    pub failed: Option<Instant>,
    /// Every HCA resource was dropped.
    pub torn_down: Option<Instant>,
    /// The attempt that connected started.
    pub attempt_start: Option<Instant>,
    /// It had the device open.
    pub device_open: Option<Instant>,
    /// Its admin queue's CM connection was established.
    pub admin_cm: Option<Instant>,
    /// Its admin queue was connected (Fabrics Connect) and the controller enabled.
    pub admin_ready: Option<Instant>,
    /// Every I/O queue was connected and held I/O resubmitted: LIVE.
    pub live: Option<Instant>,
    /// Attempts in the episode (the last one connected).
    pub attempts: u32,
}

impl CtrlStatus {
    pub fn state(&self) -> CtrlState {
        self.machine.state
    }
}

impl RecoveryTrace {
    /// The marks of the one path in the order it takes them: failed, torn down, attempt
    /// started, device open, admin CM connection, admin ready, LIVE.
    pub fn steps(&self) -> [Option<Instant>; 7] {
        [
            self.failed,
            self.torn_down,
            self.attempt_start,
            self.device_open,
            self.admin_cm,
            self.admin_ready,
            self.live,
        ]
    }
}

/// What the controller and its supervisor share.
pub(super) struct CtrlShared {
    pub(super) inbox: Arc<Inbox>,
    /// Safe retry's state: the live association, the dead ones, the CCRs asked.
    pub(super) safe: Arc<super::saferetry::SafeShared>,
    pub(super) status: watch::Sender<CtrlStatus>,
    pub(super) clock: Clock,
}

/// Where the controller finds its device, and the context it runs on now.
pub(super) struct DevShared<S: DeviceSource> {
    pub(super) source: S,
    pub(super) name: String,
    pub(super) current: Mutex<S::Device>,
}

/// [`DevShared`] without its backend type: the public [`Controller`](super::Controller) has none, so exports and
/// the fio plugin hold one controller type whatever the backend.
pub(super) trait Backing: Send + Sync {
    fn as_any(&self) -> &dyn Any;
    /// The current context, as `&Mutex<D>`.
    fn current(&self) -> &dyn Any;
}

impl<S: DeviceSource> Backing for DevShared<S> {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn current(&self) -> &dyn Any {
        &self.current
    }
}

/// An admin command bounded by `timeout` (a bring-up step, or a rescan).
pub(super) async fn bounded_admin(
    admin: &QueueHandle,
    timeout: Duration,
    sqe: Sqe,
    data_in: usize,
) -> Result<queue::Response, HostError> {
    let what = match sqe.opcode {
        admin::opcode::admin::IDENTIFY => "Identify",
        _ => "an admin command",
    };
    tokio::time::timeout(timeout, admin.submit(sqe, None, data_in))
        .await
        .map_err(|_| {
            HostError::Timeout(format!(
                "{what} got no answer within the connect timeout ({} ms)",
                timeout.as_millis()
            ))
        })?
}

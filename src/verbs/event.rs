//! What happens to a device context: its lifecycle, and the asynchronous events it reports.

use super::{CqId, Qpn};

/// Where a device context is in its life: live, or a zombie kept for teardown only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    Live,
    /// DEVICE_FATAL seen: a zombie until every object is released.
    Fatal,
    /// Hot-removed: a zombie whose device will not come back under this context.
    Removed,
}

/// Asynchronous events (ibv_event_type), in the order the device reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncEvent {
    PortActive,
    PortError,
    DeviceFatal,
    /// The device left the system (hot-remove); it will not come back under this context.
    DeviceRemoved,
    QpFatal(Qpn),
    /// A remote peer broke the rules of a memory region (IBA 11.6.3.1).
    QpAccessError(Qpn),
    CqError(CqId),
}

//! Where the host finds a device's context, now and after a reset or a re-plug.

use std::sync::Arc;

use tokio::sync::Notify;

use super::{DeviceContext, Identity};

/// A device's current context, as a source hands it out.
#[derive(Clone)]
pub struct Opened<D> {
    pub dev: D,
    pub identity: Identity,
    /// Moves on with every new context of the device (reset, re-plug), so a holder of an
    /// older one can tell that its context was replaced.
    pub generation: u64,
}

/// The devices of this host, by name. Cheap to clone.
pub trait DeviceSource: Clone + Send + Sync + 'static {
    type Device: DeviceContext;

    /// The live current context of device `name`, if it is present.
    fn open(&self, name: &str) -> Option<Opened<Self::Device>>;
    /// Is `name` in the device list, read afresh? A device that died but is still listed
    /// (a reset) is present; a hot-removed one is not.
    fn present(&self, name: &str) -> bool;
    /// The connection manager to use on `dev`, a context this source opened. A context has
    /// one, shared by everyone who connects through it, as the kernel has one `ib_cm` per
    /// device: two would take each other's MADs.
    fn cm(&self, dev: &Self::Device) -> <Self::Device as DeviceContext>::Cm;
    /// Notified (`notify_waiters`) whenever a device is plugged, reset or removed.
    fn changed(&self) -> Arc<Notify>;
}

//! Fault injection for chaos tools and tests, kept off the production seam: a
//! [`FaultInjector`] wraps a device source, hands the host its devices unchanged, and resets
//! or unplugs one on demand. Whoever builds the controller on it keeps the injector (or a
//! [`DeviceFaults`] handle) beside the controller; the controller itself cannot inflict.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::{DeviceContext, DeviceSource, Opened};

/// A device source whose devices can be reset by hand. Not part of [`DeviceSource`]: a host
/// only ever reacts to a reset; chaos tools and tests reach this through a [`FaultInjector`].
pub trait ResetHook: DeviceSource {
    /// A fatal reset of `name`, its new context live after `down_for` where the source can
    /// bring one back.
    fn inflict_reset(
        &self,
        name: &str,
        down_for: Duration,
    ) -> impl Future<Output = Result<(), String>> + Send;

    /// A hot-remove of `name`, the same card plugged back after `down_for`, where the source
    /// can plug one back; others refuse.
    fn inflict_unplug(
        &self,
        name: &str,
        down_for: Duration,
    ) -> impl Future<Output = Result<(), String>> + Send {
        let _ = down_for;
        let msg = format!(
            "{name} cannot be unplugged from here: unplug it from outside (rxe: `rdma link delete`, then `rdma link add`)"
        );
        std::future::ready(Err(msg))
    }
}

/// `S` with faults on demand: every [`DeviceSource`] call goes to `S` unchanged.
#[derive(Clone)]
pub struct FaultInjector<S> {
    inner: S,
}

impl<S: ResetHook> FaultInjector<S> {
    pub fn new(inner: S) -> FaultInjector<S> {
        FaultInjector { inner }
    }

    /// The wrapped source.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Reset device `name` as a fatal error would; it is back after `down_for`.
    pub async fn reset(&self, name: &str, down_for: Duration) -> Result<(), String> {
        self.inner.inflict_reset(name, down_for).await
    }

    /// Unplug device `name`; the same card is plugged back after `down_for`.
    pub async fn unplug(&self, name: &str, down_for: Duration) -> Result<(), String> {
        self.inner.inflict_unplug(name, down_for).await
    }

    /// A handle that resets device `name`, for holders that do not know the source's type.
    pub fn device(&self, name: &str) -> DeviceFaults {
        DeviceFaults {
            inner: Arc::new(self.clone()),
            name: name.into(),
        }
    }
}

impl<S: DeviceSource> DeviceSource for FaultInjector<S> {
    type Device = S::Device;

    fn open(&self, name: &str) -> Option<Opened<S::Device>> {
        self.inner.open(name)
    }

    fn present(&self, name: &str) -> bool {
        self.inner.present(name)
    }

    fn cm(&self, dev: &S::Device) -> <S::Device as DeviceContext>::Cm {
        self.inner.cm(dev)
    }

    fn changed(&self) -> Arc<Notify> {
        self.inner.changed()
    }
}

type ResetFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;

/// [`FaultInjector::reset`] and [`FaultInjector::unplug`] without the source's type.
trait Reset: Send + Sync {
    fn reset<'a>(&'a self, name: &'a str, down_for: Duration) -> ResetFuture<'a>;
    fn unplug<'a>(&'a self, name: &'a str, down_for: Duration) -> ResetFuture<'a>;
}

impl<S: ResetHook> Reset for FaultInjector<S> {
    fn reset<'a>(&'a self, name: &'a str, down_for: Duration) -> ResetFuture<'a> {
        Box::pin(FaultInjector::reset(self, name, down_for))
    }
    fn unplug<'a>(&'a self, name: &'a str, down_for: Duration) -> ResetFuture<'a> {
        Box::pin(FaultInjector::unplug(self, name, down_for))
    }
}

/// Resets and unplugs of one device of a [`FaultInjector`], whatever its source. Cheap to
/// clone.
#[derive(Clone)]
pub struct DeviceFaults {
    inner: Arc<dyn Reset>,
    name: Arc<str>,
}

impl DeviceFaults {
    /// Reset the device as a fatal error would; it is back after `down_for`.
    pub async fn reset(&self, down_for: Duration) -> Result<(), String> {
        self.inner.reset(&self.name, down_for).await
    }

    /// Unplug the device; the same card is plugged back after `down_for`.
    pub async fn unplug(&self, down_for: Duration) -> Result<(), String> {
        self.inner.unplug(&self.name, down_for).await
    }

    /// The device's name in its source.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Debug for DeviceFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFaults")
            .field("name", &self.name)
            .finish()
    }
}

//! The devices of this host: the device list plus the running contexts, and the lifecycle
//! operations chaos tests and the CLI inflict on them (reset, hot-remove, re-plug).
//!
//! A reset ends the current context (it turns into a zombie, its driver lets go of the UDP
//! port) and, after an optional delay, opens a new context with the same identity on the
//! same address under the next generation. A hot-remove ends the context and takes the
//! device out of the list until `replug` brings it (or a different identity) back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::simnet::SimNet;
use super::{Fabric, SoftHca};
use crate::hca::device::{DeviceConfig, DeviceIdentity};
use crate::hca::registry::{DeviceInfo, DeviceList, RegistryError};

#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("cannot bind the device's UDP address: {0}")]
    Bind(#[from] std::io::Error),
    #[error("no device {0}")]
    NoSuchDevice(String),
}

struct Entry {
    hca: SoftHca,
    config: DeviceConfig,
    generation: u64,
}

#[derive(Default)]
struct Inner {
    list: DeviceList,
    running: HashMap<String, Entry>,
}

/// Shared handle to the host's soft devices.
#[derive(Clone)]
pub struct DeviceManager {
    inner: Arc<Mutex<Inner>>,
    changed: Arc<Notify>,
    fabric: Fabric,
}

impl Default for DeviceManager {
    fn default() -> DeviceManager {
        DeviceManager::new(false)
    }
}

impl SimNet {
    /// A device manager whose devices attach to this network.
    pub fn device_manager(&self) -> DeviceManager {
        DeviceManager::on(self.fabric())
    }
}

impl DeviceManager {
    /// Devices on UDP sockets, with or without segmentation offload (with it, the loopback
    /// path too; see [`Fabric::Udp`]).
    pub fn new(offload: bool) -> DeviceManager {
        DeviceManager::on(Fabric::Udp {
            offload,
            loopback: offload,
        })
    }

    /// Devices attached to `fabric`: UDP, or a simulated network
    /// ([`crate::driver::SimNet::device_manager`]).
    pub fn on(fabric: Fabric) -> DeviceManager {
        DeviceManager {
            inner: Arc::default(),
            changed: Arc::default(),
            fabric,
        }
    }

    /// The network this manager's devices attach to.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Plug a device and start its context. Its address is fixed at the first bind, so a
    /// reset or re-plug comes back on the same UDP port.
    pub async fn plug(&self, mut config: DeviceConfig) -> Result<SoftHca, ManagerError> {
        let mut fresh = config.clone();
        let next_gen = self
            .lock()
            .list
            .last_generation(&config.identity.name)
            .map_or(0, |g| g + 1);
        fresh.seed = config.seed ^ next_gen.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let hca = SoftHca::start_on(fresh, &self.fabric).await?;
        config.addr = hca.addr();
        let info = match self.lock().list.plug(config.identity.clone()) {
            Ok(i) => i,
            Err(e) => {
                hca.remove();
                return Err(e.into());
            }
        };
        self.lock().running.insert(
            info.name.clone(),
            Entry {
                hca: hca.clone(),
                config,
                generation: info.generation,
            },
        );
        self.changed.notify_waiters();
        Ok(hca)
    }

    /// The present devices.
    pub fn refresh(&self) -> Vec<DeviceInfo> {
        self.lock().list.refresh()
    }

    /// The live context of `name`, if the device is present and its context is current.
    pub fn open(&self, name: &str) -> Option<(SoftHca, DeviceInfo)> {
        let g = self.lock();
        let info = g.list.get(name)?;
        let e = g.running.get(name)?;
        (e.generation == info.generation && e.hca.lifecycle() == crate::verbs::Lifecycle::Live)
            .then(|| (e.hca.clone(), info))
    }

    /// A fatal reset: the context dies now; a new one with the same identity is live after
    /// `down_for`.
    pub async fn reset(&self, name: &str, down_for: Duration) -> Result<SoftHca, ManagerError> {
        let (old, config) = {
            let g = self.lock();
            let e = g
                .running
                .get(name)
                .ok_or_else(|| ManagerError::NoSuchDevice(name.into()))?;
            (e.hca.clone(), e.config.clone())
        };
        old.fatal();
        old.stopped().await;
        if !down_for.is_zero() {
            tokio::time::sleep(down_for).await;
        }
        // A new life: new memory keys and QP numbers (each context keys its generator from
        // the OS anew; the seed, unused by real devices, moves with the generation too).
        let mut fresh = config.clone();
        let next_gen = self.lock().list.get(name).map_or(0, |i| i.generation + 1);
        fresh.seed = config.seed ^ next_gen.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let hca = SoftHca::start_on(fresh, &self.fabric).await?;
        let info = self.lock().list.reset(name)?;
        self.lock().running.insert(
            name.to_string(),
            Entry {
                hca: hca.clone(),
                config,
                generation: info.generation,
            },
        );
        self.changed.notify_waiters();
        Ok(hca)
    }

    /// Hot-remove: the context dies and the device leaves the list.
    pub async fn unplug(&self, name: &str) -> Result<(), ManagerError> {
        let old = {
            let mut g = self.lock();
            g.list.unplug(name)?;
            g.running.get(name).map(|e| e.hca.clone())
        };
        if let Some(h) = old {
            h.remove();
            h.stopped().await;
        }
        self.changed.notify_waiters();
        Ok(())
    }

    /// Bring an unplugged device back, with the identity given (the same one, or another
    /// card in its place), on the address it had.
    pub async fn replug(&self, identity: DeviceIdentity) -> Result<SoftHca, ManagerError> {
        let mut config = {
            let g = self.lock();
            g.running
                .get(&identity.name)
                .map(|e| e.config.clone())
                .ok_or_else(|| ManagerError::NoSuchDevice(identity.name.clone()))?
        };
        config.identity = identity;
        self.plug(config).await
    }

    /// Wait until a present, live device satisfies `want`, or `timeout` passes.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        want: impl Fn(&DeviceInfo) -> bool,
    ) -> Option<(SoftHca, DeviceInfo)> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let found = self
                .refresh()
                .into_iter()
                .filter(|i| want(i))
                .find_map(|i| self.open(&i.name));
            if found.is_some() {
                return found;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// Notified (`notify_waiters`) whenever a device is plugged, reset or unplugged.
    pub fn changed(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    /// The address device `name` is bound to.
    pub fn addr_of(&self, name: &str) -> Option<SocketAddr> {
        self.lock().running.get(name).map(|e| e.config.addr)
    }
}

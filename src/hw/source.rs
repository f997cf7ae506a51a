//! The kernel RDMA devices of this host as a device source ([`crate::verbs::DeviceSource`]):
//! libibverbs' device list, read afresh, and the current context of each device.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use super::cm_port::HwCm;
use super::context::{release_cm_contexts, HwContext, REMOVED};
use super::device::{list_devices, HwDeviceInfo, Selector};
use super::reset::HeldDown;
use super::HwError;
use crate::harness::alloc_audit;
use crate::verbs::{DeviceSource, Guid, Opened, ResetHook};

/// How often a source reads the device list to see devices come and go (libibverbs has no
/// notification for it; rdma_cm reports only the removal of a device that holds an id).
pub const DEVICE_POLL: Duration = Duration::from_millis(100);

struct SourceShared {
    changed: Arc<Notify>,
    /// The current context per device selector.
    current: Mutex<HashMap<String, (HwContext, u64)>>,
    generation: AtomicU64,
    held_down: HeldDown,
}

/// The kernel RDMA devices of this host, named by selector: a device name (`rxe0`),
/// `guid:<GUID>` or `pci:<dddd:bb:dd.f>`. Cheap to clone.
#[derive(Clone)]
pub struct HwSource {
    sh: Arc<SourceShared>,
}

fn selector(name: &str) -> Option<Selector> {
    match name.parse::<Selector>() {
        Ok(Selector::Any) | Err(_) => None,
        Ok(s) => Some(s),
    }
}

impl HwSource {
    /// A source, and a task that reads the device list every [`DEVICE_POLL`] (needs a tokio
    /// runtime; the task ends with the last clone of the source).
    pub fn new() -> HwSource {
        let sh = Arc::new(SourceShared {
            changed: Arc::new(Notify::new()),
            current: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            held_down: HeldDown::default(),
        });
        tokio::spawn(poll_devices(Arc::downgrade(&sh)));
        HwSource { sh }
    }

    /// Check that `name` is a usable device selector and the device is there now.
    pub fn check(name: &str) -> Result<HwDeviceInfo, HwError> {
        let sel = selector(name).ok_or_else(|| {
            HwError::Invalid(format!(
                "{name:?} is not a device: give a name (rxe0), guid:<GUID> or pci:<address>"
            ))
        })?;
        let devs = list_devices()?;
        sel.select(&devs)
            .cloned()
            .ok_or_else(|| HwError::NoSuchDevice(name.to_string()))
    }
}

/// The device list, every [`DEVICE_POLL`]: a change wakes the hosts, and the context of a
/// device that left the list (or came back as another card under its selector) is dead.
async fn poll_devices(sh: Weak<SourceShared>) {
    let mut last: Vec<(String, Guid)> = Vec::new();
    loop {
        tokio::time::sleep(DEVICE_POLL).await;
        let Some(s) = sh.upgrade() else { return };
        // The device list stands in for the kernel's device events: platform code, as the
        // soft-HCA's device manager is.
        let _platform = alloc_audit::enter();
        // A list that cannot be read this round (EMFILE, ...) says nothing about the devices.
        let Ok(devs) = list_devices() else {
            continue;
        };
        let now: Vec<(String, Guid)> = devs.iter().map(|d| (d.name.clone(), d.guid)).collect();
        let dead: Vec<HwContext> = s
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|(c, _)| !c.ctx.gone() && !devs.iter().any(|d| d.guid == c.ctx.info.guid))
            .map(|(c, _)| c.clone())
            .collect();
        for c in dead {
            c.ctx.kill(REMOVED);
        }
        if now != last {
            if last.iter().any(|d| !now.contains(d)) {
                alloc_audit::platform(release_cm_contexts);
            }
            last = now;
            s.changed.notify_waiters();
        }
    }
}

impl Default for HwSource {
    fn default() -> HwSource {
        HwSource::new()
    }
}

impl DeviceSource for HwSource {
    type Device = HwContext;

    fn open(&self, name: &str) -> Option<Opened<HwContext>> {
        let _platform = alloc_audit::enter();
        let sel = selector(name)?;
        if self.sh.held_down.holds(name) {
            return None;
        }
        let devs = list_devices().ok()?;
        let info = sel.select(&devs)?.clone();
        let mut cur = self.sh.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((c, g)) = cur.get(name) {
            if !c.ctx.gone() && c.ctx.info.guid == info.guid {
                return Some(Opened {
                    dev: c.clone(),
                    identity: c.ctx.identity,
                    generation: *g,
                });
            }
            if !c.ctx.gone() {
                // Another card now answers to this selector: ours is gone.
                c.ctx.kill(REMOVED);
            }
        }
        let ctx = match HwContext::open(info, self.sh.changed.clone()) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("opening RDMA device {name}: {e}");
                return None;
            }
        };
        let g = self.sh.generation.fetch_add(1, Ordering::Relaxed) + 1;
        cur.insert(name.to_string(), (ctx.clone(), g));
        Some(Opened {
            identity: ctx.ctx.identity,
            dev: ctx,
            generation: g,
        })
    }

    fn present(&self, name: &str) -> bool {
        let _platform = alloc_audit::enter();
        let Some(sel) = selector(name) else {
            return false;
        };
        list_devices()
            .map(|d| sel.select(&d).is_some())
            .unwrap_or(false)
    }

    fn cm(&self, dev: &HwContext) -> HwCm {
        HwCm {
            ctx: dev.ctx.clone(),
        }
    }

    fn changed(&self) -> Arc<Notify> {
        self.sh.changed.clone()
    }
}

impl ResetHook for HwSource {
    async fn inflict_reset(&self, name: &str, down_for: Duration) -> Result<(), String> {
        let cur = self
            .sh
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|(c, _)| c.clone());
        let sh = &self.sh;
        sh.held_down.reset(name, cur, down_for, &sh.changed).await
    }
}

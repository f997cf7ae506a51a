//! A reset inflicted by hand on a kernel RDMA device, for chaos tools and tests: our context
//! dies as on DEVICE_FATAL and its selector is held down (no context handed out) for a while.
//! The kernel device itself is untouched: this drives our whole recovery path on a real
//! device.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use super::context::{HwContext, FATAL};

/// Selectors held down by a reset: no context is handed out for them until it ends.
#[derive(Default)]
pub(super) struct HeldDown(Mutex<HashSet<String>>);

impl HeldDown {
    pub(super) fn holds(&self, name: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name)
    }

    fn set(&self, name: &str, on: bool) {
        let mut h = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if on {
            h.insert(name.to_string());
        } else {
            h.remove(name);
        }
    }

    /// A reset of `name`, whose current context is `cur`, as the host sees one: the context
    /// dies as on IBV_EVENT_DEVICE_FATAL (every verbs object and cm_id of ours dropped at
    /// once), no context is handed out for `down_for`, then the device may be opened anew.
    /// `changed` hears both edges.
    pub(super) async fn reset(
        &self,
        name: &str,
        cur: Option<HwContext>,
        down_for: Duration,
        changed: &Notify,
    ) -> Result<(), String> {
        let Some(c) = cur.filter(|c| !c.ctx.gone()) else {
            return Err(format!("RDMA device {name} has no open context to reset"));
        };
        self.set(name, true);
        c.ctx.kill(FATAL);
        changed.notify_waiters();
        if !down_for.is_zero() {
            tokio::time::sleep(down_for).await;
        }
        self.set(name, false);
        changed.notify_waiters();
        Ok(())
    }
}

//! Namespaces and Asynchronous Events. The namespaces are read at connect, and read again
//! after every reconnect (once LIVE, outside the recovery path; Linux scans on every
//! reconnect too) and whenever the caller asks (after a Namespace Attribute Changed event).
//! Each carries its identity (NGUID, EUI-64, UUID): a namespace whose identity changed
//! behind the same NSID is a different one, and [`Controller::same_namespace`](super::Controller::same_namespace) fails for
//! users of the old one.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::nvme::admin;
use crate::nvme::{IdentifyNamespace, NsIdentity};
use crate::reconnect::CtrlState;

use super::queue::QueueHandle;
use super::state::{bounded_admin, CtrlStatus};
use super::HostError;

/// A namespace as the host sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NsInfo {
    pub nsid: u32,
    pub block_size: u32,
    pub blocks: u64,
    /// What tells it apart from another namespace the controller may later show under the
    /// same NSID.
    pub ident: NsIdentity,
}

impl NsInfo {
    pub fn bytes(&self) -> u64 {
        self.blocks * self.block_size as u64
    }

    /// Is `other` this namespace (the same NSID and identity; its size may differ)?
    pub fn same_as(&self, other: &NsInfo) -> bool {
        self.nsid == other.nsid && self.ident == other.ident
    }
}

/// The active namespaces as last read, shared by the controller and its rescans.
pub(super) struct NsTable {
    pub(super) list: std::sync::RwLock<Vec<NsInfo>>,
    /// Counts the rescans that changed `list`.
    version: watch::Sender<u64>,
    /// One rescan at a time, so that a slow one cannot put back a list older than the last.
    scanning: tokio::sync::Mutex<()>,
}

impl NsTable {
    pub(super) fn new() -> NsTable {
        NsTable {
            list: std::sync::RwLock::new(Vec::new()),
            version: watch::channel(0).0,
            scanning: tokio::sync::Mutex::new(()),
        }
    }

    /// A receiver that sees each rescan that changed the list (a count of them).
    pub(super) fn watch(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    pub(super) fn get(&self) -> std::sync::RwLockReadGuard<'_, Vec<NsInfo>> {
        self.list.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Read the namespaces from the controller behind `admin` and keep them; say what
    /// changed (logged, and by `version`).
    pub(super) async fn rescan(
        &self,
        admin: &QueueHandle,
        timeout: Duration,
        subnqn: &str,
    ) -> Result<Vec<NsInfo>, HostError> {
        let _one = self.scanning.lock().await;
        let new = identify_namespaces(admin, timeout).await?;
        let old = std::mem::replace(
            &mut *self.list.write().unwrap_or_else(|e| e.into_inner()),
            new.clone(),
        );
        if old != new {
            for l in ns_changes(&old, &new) {
                tracing::info!(subnqn, "{l}");
            }
            self.version.send_modify(|v| *v += 1);
        }
        Ok(new)
    }
}

/// What differs between two namespace lists, a line each.
fn ns_changes(old: &[NsInfo], new: &[NsInfo]) -> Vec<String> {
    let mut out = Vec::new();
    for n in new {
        match old.iter().find(|o| o.nsid == n.nsid) {
            None => out.push(format!("namespace {} added ({} bytes)", n.nsid, n.bytes())),
            Some(o) if !o.same_as(n) => out.push(format!(
                "namespace {} is a different namespace now (its identity changed): users of \
                 the old one get errors",
                n.nsid
            )),
            Some(o) if o.bytes() != n.bytes() => out.push(format!(
                "namespace {} resized from {} to {} bytes",
                n.nsid,
                o.bytes(),
                n.bytes()
            )),
            Some(_) => {}
        }
    }
    for o in old.iter().filter(|o| !new.iter().any(|n| n.nsid == o.nsid)) {
        out.push(format!(
            "namespace {} removed: its users get errors",
            o.nsid
        ));
    }
    out
}

/// An Asynchronous Event the controller reported (NVMe base spec, Asynchronous Event
/// Request completion, Dword 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// 0 error, 1 SMART / health, 2 notice, 6 I/O command set specific, 7 vendor.
    pub kind: u8,
    /// For a notice: 0x00 namespace attribute changed, 0xF0 discovery log page changed.
    pub info: u8,
    /// The log page that tells more (0x04 changed namespace list, 0x70 discovery log).
    pub log_page: u8,
}

impl AsyncEvent {
    pub const NOTICE: u8 = 2;
    pub const NS_ATTR_CHANGED: u8 = 0x00;
    pub const DISCOVERY_LOG_CHANGED: u8 = 0xF0;

    pub fn from_result(dw0: u32) -> AsyncEvent {
        AsyncEvent {
            kind: (dw0 & 0x7) as u8,
            info: (dw0 >> 8) as u8,
            log_page: (dw0 >> 16) as u8,
        }
    }

    pub fn to_result(self) -> u32 {
        u32::from(self.kind & 7) | u32::from(self.info) << 8 | u32::from(self.log_page) << 16
    }

    pub fn namespaces_changed(&self) -> bool {
        self.kind == Self::NOTICE && self.info == Self::NS_ATTR_CHANGED
    }

    pub fn discovery_changed(&self) -> bool {
        self.kind == Self::NOTICE && self.info == Self::DISCOVERY_LOG_CHANGED
    }
}

/// The active namespaces, their sizes and identities, as the controller reports them now.
pub(super) async fn identify_namespaces(
    admin: &QueueHandle,
    timeout: Duration,
) -> Result<Vec<NsInfo>, HostError> {
    let r = bounded_admin(
        admin,
        timeout,
        admin::identify_active_namespaces(0, 0),
        4096,
    )
    .await?;
    let ids: Vec<u32> = crate::nvme::identify::active_namespace_ids(&r.data).collect();
    let mut out = Vec::with_capacity(ids.len());
    for nsid in ids {
        let r = bounded_admin(admin, timeout, admin::identify_namespace(0, nsid), 4096).await?;
        let ns =
            IdentifyNamespace::parse(&r.data).map_err(|e| HostError::Protocol(e.to_string()))?;
        let bs = ns.block_size().ok_or_else(|| {
            HostError::Protocol(format!("namespace {nsid} has no valid LBA format"))
        })?;
        // A controller without descriptor lists (before NVMe 1.3) answers with an error
        // status: its namespaces are told apart by the Identify Namespace fields alone.
        let descs = match bounded_admin(
            admin,
            timeout,
            admin::identify(0, admin::cns::NS_ID_DESCRIPTORS, nsid, 0),
            4096,
        )
        .await
        {
            Ok(r) => Some(r.data),
            Err(HostError::Nvme(_)) => None,
            Err(e) => return Err(e),
        };
        out.push(NsInfo {
            nsid,
            block_size: bs,
            blocks: ns.nsze,
            ident: NsIdentity::from_identify(&ns, descs.as_deref()),
        });
    }
    Ok(out)
}

/// Rescan the namespaces each time the controller is LIVE again after a reconnect: a
/// namespace added, resized, removed or replaced while the association was down is seen at
/// once, not at the next unrelated event. Runs beside the recovery path, after it, so that
/// path stays free of allocations. Ends when the controller does.
pub(super) async fn rescan_after_reconnects(
    admin: QueueHandle,
    timeout: Duration,
    table: Arc<NsTable>,
    mut status: watch::Receiver<CtrlStatus>,
    subnqn: String,
) {
    let mut seen = status.borrow().machine.recoveries;
    loop {
        let s = status
            .wait_for(|s| {
                s.state() == CtrlState::Dead
                    || (s.state() == CtrlState::Live && s.machine.recoveries > seen)
            })
            .await
            .map(|s| *s);
        let s = match s {
            Ok(s) if s.state() == CtrlState::Live => s,
            _ => return,
        };
        seen = s.machine.recoveries;
        if let Err(e) = table.rescan(&admin, timeout, &subnqn).await {
            // The association failed again (the next reconnect rescans) or the target did
            // not answer: the list stays as it was until the next event.
            tracing::warn!(
                subnqn,
                error = %e,
                "reading the namespaces after a reconnect failed; kept the previous list"
            );
        }
    }
}

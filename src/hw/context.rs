//! One open context of a kernel RDMA device ([`HwContext`]): its verbs objects, its rdma_cm
//! connections and its death. The seam's calls on it are in [`super::backend`], its
//! connection manager in [`super::cm_port`].
//!
//! Death of a context. A context dies when the device reports DEVICE_FATAL, when rdma_cm
//! reports DEVICE_REMOVAL on any of its connections (rxe removal arrives only this way), or
//! when the device leaves libibverbs' list (a source polls it). Then every verbs object of the
//! context is dropped at once, whatever state it is in and whoever still holds a clone: the
//! kernel finishes removing a device only once every user context on it is closed and every
//! rdma_cm id on it is destroyed, and the device cannot come back before. Every later call on
//! the context fails with [`VerbsError::DeviceGone`] or does nothing.
//!
//! Like the soft-HCA's, every call runs as platform code for the allocation audit: sideway,
//! libibverbs and librdmacm stand for the verbs provider, whose memory is not the host's to
//! preallocate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_qp_attr};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::BasicQueuePair;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, Notify};

use super::cm::CmId;
use super::device::{HwCq, HwDevice, HwDeviceInfo};
use super::events::AsyncEvents;
use super::map::HwEvent;
use super::{BorrowedRawFd, HwError};
use crate::cm::ConnId;
use crate::harness::alloc_audit;
use crate::verbs::{AsyncEvent, CqId, Identity, Lifecycle, VerbsError};

pub(super) const LIVE: u8 = 0;
pub(super) const FATAL: u8 = 1;
pub(super) const REMOVED: u8 = 2;

/// One CQ with its completion channel, watched by tokio.
pub(super) struct CqEntry {
    // Field order is drop order: the fd watch before the channel it watches.
    pub(super) afd: AsyncFd<BorrowedRawFd>,
    pub(super) cq: HwCq,
    pub(super) unacked: AtomicU32,
}

// SAFETY: the raw CQ and channel behind `cq` are used through thread-safe libibverbs calls
// (poll, notify, get/ack events); `unacked` is atomic.
unsafe impl Send for CqEntry {}
// SAFETY: as above.
unsafe impl Sync for CqEntry {}

impl Drop for CqEntry {
    fn drop(&mut self) {
        let n = self.unacked.load(Ordering::Relaxed);
        if n > 0 {
            // SAFETY: events got from this CQ must be acked before it is destroyed.
            unsafe { ibv_ack_cq_events(self.cq.raw_cq(), n) };
        }
    }
}

/// What rdma_cm computed for a QP's path (INIT, RTR, RTS attributes with their masks).
pub(super) type Path = [(ibv_qp_attr, i32); 3];

/// A QP's path, kept from the REP (active side) or the REQ (passive side) until the owner
/// moves the QP to RTS.
pub(super) struct Pending {
    pub(super) path: Path,
    /// Active side: the connection to send the RTU on once the QP is in RTS. The passive
    /// side answers with an accept instead.
    pub(super) establish: Option<Arc<Conn>>,
}

pub(super) struct QpEntry {
    pub(super) qp: BasicQueuePair,
    pub(super) pending: Option<Pending>,
}

/// Every verbs object of a live context. Field order is drop order: QPs before their CQs
/// and MRs, MRs before their PDs, everything before the context.
pub(super) struct Res {
    pub(super) qps: HashMap<u32, QpEntry>,
    pub(super) mrs: HashMap<u32, Arc<sideway::ibverbs::memory_region::MemoryRegion>>,
    pub(super) cqs: HashMap<u32, Arc<CqEntry>>,
    pub(super) pds: HashMap<u32, Arc<ProtectionDomain>>,
    pub(super) next_cq: u32,
    pub(super) next_pd: u32,
    pub(super) dev: HwDevice,
}

pub(super) struct Ctx {
    pub(super) info: HwDeviceInfo,
    pub(super) identity: Identity,
    pub(super) life: AtomicU8,
    /// Woken (`notify_waiters`) when the context dies.
    pub(super) died: Notify,
    pub(super) res: Mutex<Option<Res>>,
    /// rdma_cm connections made through this context.
    pub(super) conns: Mutex<HashMap<u32, Arc<Conn>>>,
    pub(super) tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// The source's notify: a death is a change of the device list as the host sees it.
    pub(super) changed: Arc<Notify>,
}

impl Ctx {
    pub(super) fn lifecycle(&self) -> Lifecycle {
        match self.life.load(Ordering::Acquire) {
            LIVE => Lifecycle::Live,
            FATAL => Lifecycle::Fatal,
            _ => Lifecycle::Removed,
        }
    }

    pub(super) fn res(&self) -> MutexGuard<'_, Option<Res>> {
        self.res.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The context died (`how`: FATAL or REMOVED): drop every verbs object and rdma_cm id
    /// now, tell connection watchers, CQ waiters and the source.
    pub(super) fn kill(&self, how: u8) {
        if self
            .life
            .compare_exchange(LIVE, how, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        tracing::warn!(
            device = %self.info.name,
            "RDMA device {}: dropping every verbs object and rdma_cm id of the context",
            if how == REMOVED { "removed" } else { "reported a fatal error" }
        );
        let conns: Vec<Arc<Conn>> = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, c)| c)
            .collect();
        for c in &conns {
            c.report();
        }
        let res = self.res().take();
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
        alloc_audit::platform(|| {
            drop(res);
            drop(conns);
            if how == REMOVED {
                release_cm_contexts();
            }
        });
        self.died.notify_waiters();
        self.changed.notify_waiters();
    }

    pub(super) fn gone(&self) -> bool {
        self.life.load(Ordering::Acquire) != LIVE
    }
}

/// One open context of a kernel RDMA device. Cheap to clone.
#[derive(Clone)]
pub struct HwContext {
    pub(super) ctx: Arc<Ctx>,
}

pub(super) fn verr(call: &'static str, e: HwError) -> VerbsError {
    tracing::debug!("{call}: {e}");
    VerbsError::InvalidArgument(call)
}

impl HwContext {
    /// Open the device `info` describes, and watch its async events (needs a tokio runtime).
    pub fn open(info: HwDeviceInfo, changed: Arc<Notify>) -> Result<HwContext, HwError> {
        let dev = HwDevice::open_info(info.clone())?;
        let events = AsyncEvents::new(&dev)?;
        let identity = Identity {
            guid: info.guid,
            pci: info.pci.unwrap_or_default(),
        };
        let ctx = Arc::new(Ctx {
            info,
            identity,
            life: AtomicU8::new(LIVE),
            died: Notify::new(),
            res: Mutex::new(Some(Res {
                qps: HashMap::new(),
                mrs: HashMap::new(),
                cqs: HashMap::new(),
                pds: HashMap::new(),
                next_cq: 1,
                next_pd: 1,
                dev,
            })),
            conns: Mutex::new(HashMap::new()),
            tasks: Mutex::new(Vec::new()),
            changed,
        });
        let weak = Arc::downgrade(&ctx);
        let t = tokio::spawn(watch_async_events(events, weak));
        ctx.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(t.abort_handle());
        Ok(HwContext { ctx })
    }

    /// The device this context is on.
    pub fn info(&self) -> &HwDeviceInfo {
        &self.ctx.info
    }

    /// Run `f` on the live objects; `DeviceGone` once the context died.
    pub(super) fn with<R>(
        &self,
        f: impl FnOnce(&mut Res) -> Result<R, VerbsError>,
    ) -> Result<R, VerbsError> {
        alloc_audit::platform(|| match self.ctx.res().as_mut() {
            Some(r) => f(r),
            None => Err(VerbsError::DeviceGone),
        })
    }

    /// Run `f` on the live objects if there are any (release calls: nothing to release on a
    /// dead context).
    pub(super) fn release(&self, f: impl FnOnce(&mut Res)) {
        alloc_audit::platform(|| {
            if let Some(r) = self.ctx.res().as_mut() {
                f(r)
            }
        })
    }

    pub(super) fn cq_entry(&self, cq: CqId) -> Option<Arc<CqEntry>> {
        self.ctx.res().as_ref()?.cqs.get(&cq.0).cloned()
    }
}

/// The device's async events: DEVICE_FATAL kills the context; a port error breaks every
/// connection through it (the host recovers them; the device itself may be fine).
async fn watch_async_events(events: AsyncEvents, ctx: Weak<Ctx>) {
    loop {
        let e = events.next().await;
        let Some(c) = ctx.upgrade() else { return };
        match e {
            Ok(HwEvent::Known(AsyncEvent::DeviceFatal)) | Err(_) => {
                c.kill(FATAL);
                return;
            }
            Ok(HwEvent::Known(AsyncEvent::PortError)) => {
                tracing::warn!(device = %c.info.name, "port error: connections through it break");
                for conn in c.conns.lock().unwrap_or_else(|e| e.into_inner()).values() {
                    conn.report();
                }
            }
            Ok(ev) => tracing::debug!(device = %c.info.name, "async event {ev:?}"),
        }
    }
}

/// librdmacm opens a verbs context of its own on every device an id binds to, and closes it
/// only once it knows the device is dead and no id is left on it. It learns that from a
/// DEVICE_REMOVAL event, or when it re-reads the device list; but the kernel removes a device
/// (rxe: `rdma link delete`) by waiting first for every verbs context on it to close, before
/// rdma_cm's DEVICE_REMOVAL is sent. So once ours are dropped, have librdmacm re-read the
/// list (`rdma_get_devices` does), so that its context of the dead device closes too.
pub(super) fn release_cm_contexts() {
    let mut n = 0;
    // SAFETY: plain librdmacm calls; the list is freed with the call made for it.
    unsafe {
        let list = rdma_mummy_sys::rdma_get_devices(&mut n);
        if !list.is_null() {
            rdma_mummy_sys::rdma_free_devices(list);
        }
    }
}

/// One rdma_cm connection.
pub(super) struct Conn {
    pub(super) id: CmId,
    /// Whom to tell (once) when the connection breaks.
    pub(super) watcher: Mutex<Option<mpsc::UnboundedSender<ConnId>>>,
    /// Passive side: whom to tell (once) when the request becomes a connection.
    pub(super) on_established: Mutex<Option<mpsc::UnboundedSender<ConnId>>>,
    pub(super) broken: AtomicBool,
    pub(super) conn_id: ConnId,
    /// Passive side: the request's path, until [`CmListen::attach`] hands it to our QP.
    pub(super) request: Mutex<Option<Path>>,
    /// Woken when the connection is forgotten (abort, disconnect, reject), so that its
    /// watcher lets go of the id and the id is destroyed.
    pub(super) closed: Notify,
}

impl Conn {
    pub(super) fn new(id: CmId, n: u32, request: Option<Path>) -> Conn {
        Conn {
            id,
            watcher: Mutex::new(None),
            on_established: Mutex::new(None),
            broken: AtomicBool::new(false),
            conn_id: ConnId(n),
            request: Mutex::new(request),
            closed: Notify::new(),
        }
    }

    /// The connection broke: tell the watcher, once.
    pub(super) fn report(&self) {
        self.broken.store(true, Ordering::Release);
        if let Some(tx) = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = tx.send(self.conn_id);
        }
    }
}

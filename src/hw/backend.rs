//! A kernel RDMA device behind the backend seam ([`crate::verbs`]): [`HwContext`] is a device
//! context (verbs through sideway), [`HwSource`] a device source (libibverbs' device list,
//! read afresh), [`HwCm`] the connection manager (rdma_cm, our FFI in [`super::cm`]).
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

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_get_cq_event, ibv_qp_attr, ibv_req_notify_cq};
use sideway::ibverbs::device_context::Mtu as IbMtu;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, Notify};

use super::cm::{ev, CmId, ConnRequest, ListenEvent};
use super::device::{access_flags, list_devices, HwCq, HwDevice, HwDeviceInfo, Selector};
use super::events::AsyncEvents;
use super::map::HwEvent;
use super::verbs::{poll_raw, post_recv_wr, post_send_wr};
use super::{watch, BorrowedRawFd, HwError};
use crate::cm::private::{NvmeCmAccept, NvmeCmReject, NvmeCmRequest, NvmeRejectStatus};
use crate::cm::{AcceptParams, ConnId, ConnectParams, Established};
use crate::harness::alloc_audit;
use crate::verbs::{
    Access, AsyncEvent, CmError, CmListen, CmPort, CqId, DeviceContext, DeviceSource, Guid,
    HostBuffer, Identity, Incoming, Lifecycle, MemKey, MrInfo, Mtu, Opened, PdId, PeerInfo, Psn,
    QpCaps, Qpn, RcAttr, RecvWr, SendWr, VerbsError, WcOpcode, WorkCompletion, INCOMING_BACKLOG,
};

/// How often a source reads the device list to see devices come and go (libibverbs has no
/// notification for it; rdma_cm reports only the removal of a device that holds an id).
pub const DEVICE_POLL: Duration = Duration::from_millis(100);

// ---------------------------------------------------------------------------------------
// Host memory

/// Page-aligned, zeroed host memory that a kernel RDMA device may DMA into once registered.
/// The host keeps it across contexts and registers it again on each.
pub struct HwMem {
    ptr: NonNull<u8>,
    layout: Layout,
    /// Makes host-side access atomic (the device's DMA is not ordered by it, as with any
    /// registered memory: the bytes of a posted request belong to the device until it
    /// completes).
    lock: Mutex<()>,
}

// SAFETY: plain owned memory; host access goes through `lock`.
unsafe impl Send for HwMem {}
// SAFETY: as above.
unsafe impl Sync for HwMem {}

impl Drop for HwMem {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl HwMem {
    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The first byte, for registering the buffer by hand.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl HwMem {
    /// `len` zeroed, page-aligned bytes (pages come in as registration pins them), or why
    /// not: the layout, if it cannot be had.
    fn try_new(len: usize) -> Result<HwMem, Option<Layout>> {
        let layout = Layout::from_size_align(len.max(1), 4096).map_err(|_| None)?;
        // SAFETY: non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or(Some(layout))?;
        Ok(HwMem {
            ptr,
            layout,
            lock: Mutex::new(()),
        })
    }
}

impl HostBuffer for HwMem {
    fn alloc(len: usize) -> HwMem {
        match HwMem::try_new(len) {
            Ok(m) => m,
            Err(Some(layout)) => std::alloc::handle_alloc_error(layout),
            Err(None) => panic!("buffer size overflows"),
        }
    }

    fn try_alloc(len: usize) -> Option<HwMem> {
        HwMem::try_new(len).ok()
    }

    /// Registration pins every page of a kernel device's MR, so nothing is lazier than this.
    fn try_alloc_lazy(len: usize) -> Option<HwMem> {
        HwMem::try_new(len).ok()
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len(), "read past the buffer");
        let _g = self.guard();
        // SAFETY: in bounds; `out` is not part of this buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }

    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len(), "write past the buffer");
        let _g = self.guard();
        // SAFETY: in bounds; `data` is not part of this buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
    }

    fn with_range<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let end = offset.checked_add(len).expect("range overflows");
        assert!(end <= self.len(), "range past the buffer");
        let _g = self.guard();
        // SAFETY: in bounds; the guard makes this the only host-side borrow of these bytes,
        // and only these bytes are borrowed.
        f(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) })
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        HwMem::as_mut_ptr(self)
    }
}

// ---------------------------------------------------------------------------------------
// Device context

const LIVE: u8 = 0;
const FATAL: u8 = 1;
const REMOVED: u8 = 2;

/// One CQ with its completion channel, watched by tokio.
struct CqEntry {
    // Field order is drop order: the fd watch before the channel it watches.
    afd: AsyncFd<BorrowedRawFd>,
    cq: HwCq,
    unacked: AtomicU32,
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
type Path = [(ibv_qp_attr, i32); 3];

/// A QP's path, kept from the REP (active side) or the REQ (passive side) until the owner
/// moves the QP to RTS.
struct Pending {
    path: Path,
    /// Active side: the connection to send the RTU on once the QP is in RTS. The passive
    /// side answers with an accept instead.
    establish: Option<Arc<Conn>>,
}

struct QpEntry {
    qp: BasicQueuePair,
    pending: Option<Pending>,
}

/// Every verbs object of a live context. Field order is drop order: QPs before their CQs
/// and MRs, MRs before their PDs, everything before the context.
struct Res {
    qps: HashMap<u32, QpEntry>,
    mrs: HashMap<u32, Arc<sideway::ibverbs::memory_region::MemoryRegion>>,
    cqs: HashMap<u32, Arc<CqEntry>>,
    pds: HashMap<u32, Arc<ProtectionDomain>>,
    next_cq: u32,
    next_pd: u32,
    dev: HwDevice,
}

struct Ctx {
    info: HwDeviceInfo,
    identity: Identity,
    life: AtomicU8,
    /// Woken (`notify_waiters`) when the context dies.
    died: Notify,
    res: Mutex<Option<Res>>,
    /// rdma_cm connections made through this context.
    conns: Mutex<HashMap<u32, Arc<Conn>>>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// The source's notify: a death is a change of the device list as the host sees it.
    changed: Arc<Notify>,
}

impl Ctx {
    fn lifecycle(&self) -> Lifecycle {
        match self.life.load(Ordering::Acquire) {
            LIVE => Lifecycle::Live,
            FATAL => Lifecycle::Fatal,
            _ => Lifecycle::Removed,
        }
    }

    fn res(&self) -> MutexGuard<'_, Option<Res>> {
        self.res.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The context died (`how`: FATAL or REMOVED): drop every verbs object and rdma_cm id
    /// now, tell connection watchers, CQ waiters and the source.
    fn kill(&self, how: u8) {
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

    fn gone(&self) -> bool {
        self.life.load(Ordering::Acquire) != LIVE
    }
}

/// One open context of a kernel RDMA device. Cheap to clone.
#[derive(Clone)]
pub struct HwContext {
    ctx: Arc<Ctx>,
}

fn verr(call: &'static str, e: HwError) -> VerbsError {
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
    fn with<R>(&self, f: impl FnOnce(&mut Res) -> Result<R, VerbsError>) -> Result<R, VerbsError> {
        alloc_audit::platform(|| match self.ctx.res().as_mut() {
            Some(r) => f(r),
            None => Err(VerbsError::DeviceGone),
        })
    }

    /// Run `f` on the live objects if there are any (release calls: nothing to release on a
    /// dead context).
    fn release(&self, f: impl FnOnce(&mut Res)) {
        alloc_audit::platform(|| {
            if let Some(r) = self.ctx.res().as_mut() {
                f(r)
            }
        })
    }

    fn cq_entry(&self, cq: CqId) -> Option<Arc<CqEntry>> {
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

fn mtu_of(raw: u32) -> Mtu {
    match raw {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

fn ib_mtu(m: Mtu) -> IbMtu {
    match m {
        Mtu::Mtu256 => IbMtu::Mtu256,
        Mtu::Mtu512 => IbMtu::Mtu512,
        Mtu::Mtu1024 => IbMtu::Mtu1024,
        Mtu::Mtu2048 => IbMtu::Mtu2048,
        Mtu::Mtu4096 => IbMtu::Mtu4096,
    }
}

impl DeviceContext for HwContext {
    type Mem = HwMem;
    type Cm = HwCm;

    fn identity(&self) -> Identity {
        self.ctx.identity
    }

    fn lifecycle(&self) -> Lifecycle {
        self.ctx.lifecycle()
    }

    fn same(&self, other: &HwContext) -> bool {
        Arc::ptr_eq(&self.ctx, &other.ctx)
    }

    fn inflict_fatal(&self) {
        self.ctx.kill(FATAL)
    }

    fn alloc_pd(&self) -> Result<PdId, VerbsError> {
        self.with(|r| {
            let pd = r
                .dev
                .context()
                .alloc_pd()
                .map_err(|e| verr("ibv_alloc_pd", HwError::sideway("ibv_alloc_pd", e)))?;
            let id = r.next_pd;
            r.next_pd += 1;
            r.pds.insert(id, pd);
            Ok(PdId(id))
        })
    }

    fn dealloc_pd(&self, pd: PdId) {
        self.release(|r| {
            r.pds.remove(&pd.0);
        })
    }

    fn reg_mr(
        &self,
        pd: PdId,
        mem: &HwMem,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MrInfo, VerbsError> {
        if offset.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Err(VerbsError::InvalidArgument("MR past the end of its buffer"));
        }
        self.with(|r| {
            let p = r.pds.get(&pd.0).ok_or(VerbsError::InvalidHandle("PD"))?;
            let addr = mem.addr() + offset as u64;
            // SAFETY: the host keeps `mem` (allocated, not moving) until it deregisters.
            let mr = unsafe { p.reg_mr(addr as usize, len, access_flags(access)) }
                .map_err(|e| verr("ibv_reg_mr", HwError::sideway("ibv_reg_mr", e)))?;
            let info = MrInfo {
                lkey: MemKey(mr.lkey()),
                rkey: if access.intersects(Access::REMOTE_READ | Access::REMOTE_WRITE) {
                    MemKey(mr.rkey())
                } else {
                    MemKey(0)
                },
                addr,
                len: len as u64,
                access,
            };
            r.mrs.insert(mr.lkey(), mr);
            Ok(info)
        })
    }

    fn dereg_mr(&self, mr: &MrInfo) {
        self.release(|r| {
            r.mrs.remove(&mr.lkey.0);
        })
    }

    /// User-space verbs have no fast registration (IB_WR_REG_MR is a kernel verb); memory
    /// windows of type 2 would be the way, and sideway does not bind them yet. So a region
    /// keeps its key for the life of the connection here, as with Linux nvme-rdma's
    /// `register_always=N`.
    fn per_use_keys(&self) -> bool {
        false
    }

    /// sideway 0.4.3's post path has no SEND_WITH_INV setter (see `post_send_wr`).
    fn send_with_invalidate(&self) -> bool {
        false
    }

    fn rekey_mr(&self, _mr: &mut MrInfo, _len: usize, _access: Access) -> Result<(), VerbsError> {
        Ok(())
    }

    fn invalidate_mr(&self, _mr: &MrInfo) {}

    fn create_cq(&self, depth: usize) -> Result<CqId, VerbsError> {
        self.with(|r| {
            let cqe = u32::try_from(depth).map_err(|_| VerbsError::InvalidArgument("CQ depth"))?;
            let cq = r.dev.create_cq(cqe).map_err(|e| verr("ibv_create_cq", e))?;
            // SAFETY: the channel's fd lives as long as `cq`, which the entry drops after it.
            let afd = unsafe { watch((*cq.raw_channel()).fd) }
                .map_err(|e| verr("watch CQ channel", e.into()))?;
            let id = r.next_cq;
            r.next_cq += 1;
            r.cqs.insert(
                id,
                Arc::new(CqEntry {
                    afd,
                    cq,
                    unacked: AtomicU32::new(0),
                }),
            );
            Ok(CqId(id))
        })
    }

    fn destroy_cq(&self, cq: CqId) {
        self.release(|r| {
            r.cqs.remove(&cq.0);
        })
    }

    fn create_rc_qp(
        &self,
        pd: PdId,
        cq: CqId,
        caps: QpCaps,
        access: Access,
    ) -> Result<Qpn, VerbsError> {
        self.with(|r| {
            let p = r
                .pds
                .get(&pd.0)
                .ok_or(VerbsError::InvalidHandle("PD"))?
                .clone();
            let c = r.cqs.get(&cq.0).ok_or(VerbsError::InvalidHandle("CQ"))?;
            let mut qp = p
                .create_qp_builder()
                .setup_qp_type(QueuePairType::ReliableConnection)
                .setup_max_send_wr(caps.max_send_wr)
                .setup_max_recv_wr(caps.max_recv_wr)
                .setup_max_send_sge(crate::hca::qp::MAX_SGE as u32)
                .setup_max_recv_sge(crate::hca::qp::MAX_SGE as u32)
                .setup_max_inline_data(0)
                .setup_send_cq(c.cq.cq.clone())
                .setup_recv_cq(c.cq.cq.clone())
                .build()
                .map_err(|e| verr("ibv_create_qp", HwError::sideway("ibv_create_qp", e)))?;
            // INIT on port 1 (what rdma_cm picks on the single-port devices we support; the
            // connect checks it); the CM's own INIT attributes are applied again at RTR.
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(1)
                .setup_access_flags(access_flags(access));
            qp.modify(&a)
                .map_err(|e| verr("modify QP to INIT", HwError::sideway("ibv_modify_qp", e)))?;
            let n = qp.qp_number();
            r.qps.insert(n, QpEntry { qp, pending: None });
            Ok(Qpn::new(n))
        })
    }

    fn rc_to_rts(
        &self,
        qpn: Qpn,
        peer: PeerInfo,
        _local_psn: Psn,
        attr: &RcAttr,
    ) -> Result<(), VerbsError> {
        let conn = self.with(|r| {
            let e = r
                .qps
                .get_mut(&qpn.get())
                .ok_or(VerbsError::InvalidHandle("QP"))?;
            let p = e
                .pending
                .take()
                .ok_or(VerbsError::InvalidArgument("QP has no rdma_cm connection"))?;
            let [init, rtr, rts] = p.path;
            if rtr.0.dest_qp_num != peer.qpn.get() {
                return Err(VerbsError::InvalidArgument(
                    "peer QPN differs from the CM's",
                ));
            }
            let modify = |qp: &mut BasicQueuePair, a: &QueuePairAttribute, what| {
                qp.modify(a)
                    .map_err(|e| verr(what, HwError::sideway("ibv_modify_qp", e)))
            };
            // INIT -> INIT first, as librdmacm's ucma_modify_qp_rtr does: now that the
            // responder resources are agreed the CM grants the remote access the target's
            // RDMA READ/WRITE need.
            let init = QueuePairAttribute::from(&init.0, init.1);
            modify(&mut e.qp, &init, "modify QP to INIT")?;
            let cm_mtu = mtu_of(rtr.0.path_mtu);
            let mut rtr = QueuePairAttribute::from(&rtr.0, rtr.1);
            rtr.setup_path_mtu(ib_mtu(cm_mtu.min(attr.mtu)));
            modify(&mut e.qp, &rtr, "modify QP to RTR")?;
            let mut rts = QueuePairAttribute::from(&rts.0, rts.1);
            rts.setup_timeout(attr.timeout)
                .setup_retry_cnt(attr.retry_cnt)
                .setup_rnr_retry(attr.rnr_retry);
            modify(&mut e.qp, &rts, "modify QP to RTS")?;
            Ok(p.establish)
        })?;
        match conn {
            Some(c) => {
                alloc_audit::platform(|| c.id.establish()).map_err(|e| verr("rdma_establish", e))
            }
            None => Ok(()),
        }
    }

    fn destroy_qp(&self, qpn: Qpn) {
        self.release(|r| {
            r.qps.remove(&qpn.get());
        })
    }

    fn post(
        &self,
        qpn: Qpn,
        recvs: &mut Vec<RecvWr>,
        sends: &mut Vec<SendWr>,
    ) -> Result<(), VerbsError> {
        let out = self.with(|r| {
            let Some(e) = r.qps.get_mut(&qpn.get()) else {
                return Err(VerbsError::InvalidHandle("QP"));
            };
            let mut first = Ok(());
            for wr in recvs.iter() {
                if let Err(err) = post_recv_wr(&mut e.qp, wr) {
                    first = first.and(Err(verr("ibv_post_recv", err)));
                }
            }
            for wr in sends.iter() {
                if let Err(err) = post_send_wr(&mut e.qp, wr) {
                    first = first.and(Err(verr("ibv_post_send", err)));
                }
            }
            first
        });
        recvs.clear();
        sends.clear();
        out
    }

    fn poll_cq(&self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        alloc_audit::platform(|| {
            let Some(e) = self.cq_entry(cq) else { return 0 };
            // SAFETY: `e` keeps the CQ alive.
            unsafe { poll_raw(e.cq.raw_cq(), max, out, |_, _| WcOpcode::Send) }.unwrap_or(0)
        })
    }

    async fn wait_cq(&self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        let Some(e) = alloc_audit::platform(|| self.cq_entry(cq)) else {
            return 0;
        };
        loop {
            let died = self.ctx.died.notified();
            tokio::pin!(died);
            died.as_mut().enable();
            if self.ctx.gone() {
                return 0;
            }
            let poll = |out: &mut Vec<WorkCompletion>| {
                alloc_audit::platform(|| {
                    // SAFETY: `e` keeps the CQ alive.
                    unsafe { poll_raw(e.cq.raw_cq(), max, out, |_, _| WcOpcode::Send) }.unwrap_or(0)
                })
            };
            let n = poll(out);
            if n > 0 {
                return n;
            }
            // Arm, then poll again: a completion that landed in between raises no event.
            // SAFETY: live CQ.
            if unsafe { ibv_req_notify_cq(e.cq.raw_cq(), 0) } != 0 {
                return 0;
            }
            let n = poll(out);
            if n > 0 {
                return n;
            }
            tokio::select! {
                g = e.afd.readable() => {
                    let Ok(mut g) = g else { return 0 };
                    let mut got = 0;
                    loop {
                        let mut c = std::ptr::null_mut();
                        let mut cctx = std::ptr::null_mut();
                        // SAFETY: non-blocking channel owned by the entry.
                        if unsafe { ibv_get_cq_event(e.cq.raw_channel(), &mut c, &mut cctx) } != 0 {
                            break;
                        }
                        got += 1;
                    }
                    g.clear_ready();
                    if got > 0 {
                        // SAFETY: acking events we got from this CQ.
                        unsafe { ibv_ack_cq_events(e.cq.raw_cq(), got) };
                    }
                }
                _ = &mut died => return 0,
            }
        }
    }
}

/// librdmacm opens a verbs context of its own on every device an id binds to, and closes it
/// only once it knows the device is dead and no id is left on it. It learns that from a
/// DEVICE_REMOVAL event, or when it re-reads the device list; but the kernel removes a device
/// (rxe: `rdma link delete`) by waiting first for every verbs context on it to close, before
/// rdma_cm's DEVICE_REMOVAL is sent. So once ours are dropped, have librdmacm re-read the
/// list (`rdma_get_devices` does), so that its context of the dead device closes too.
fn release_cm_contexts() {
    let mut n = 0;
    // SAFETY: plain librdmacm calls; the list is freed with the call made for it.
    unsafe {
        let list = rdma_mummy_sys::rdma_get_devices(&mut n);
        if !list.is_null() {
            rdma_mummy_sys::rdma_free_devices(list);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Connection manager

/// The next [`ConnId`] of any context of this process.
static NEXT_CONN: AtomicU32 = AtomicU32::new(1);

/// One rdma_cm connection.
struct Conn {
    id: CmId,
    /// Whom to tell (once) when the connection breaks.
    watcher: Mutex<Option<mpsc::UnboundedSender<ConnId>>>,
    /// Passive side: whom to tell (once) when the request becomes a connection.
    on_established: Mutex<Option<mpsc::UnboundedSender<ConnId>>>,
    broken: std::sync::atomic::AtomicBool,
    conn_id: ConnId,
    /// Passive side: the request's path, until [`CmListen::attach`] hands it to our QP.
    request: Mutex<Option<Path>>,
    /// Woken when the connection is forgotten (abort, disconnect, reject), so that its
    /// watcher lets go of the id and the id is destroyed.
    closed: Notify,
}

impl Conn {
    fn new(id: CmId, n: u32, request: Option<Path>) -> Conn {
        Conn {
            id,
            watcher: Mutex::new(None),
            on_established: Mutex::new(None),
            broken: std::sync::atomic::AtomicBool::new(false),
            conn_id: ConnId(n),
            request: Mutex::new(request),
            closed: Notify::new(),
        }
    }

    /// The connection broke: tell the watcher, once.
    fn report(&self) {
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

/// The rdma_cm side of one context. Cheap to clone.
#[derive(Clone)]
pub struct HwCm {
    ctx: Arc<Ctx>,
}

/// Read one connection's events until it ends or is forgotten: DISCONNECTED (or, on the
/// passive side, a request that never became a connection) breaks it and forgets it,
/// DEVICE_REMOVAL kills the context (which destroys every id on the device, as the kernel
/// waits for).
async fn watch_conn(conn: Arc<Conn>, ctx: Weak<Ctx>) {
    loop {
        let e = tokio::select! {
            e = conn.id.event(Duration::from_secs(24 * 3600), "connection event") => e,
            _ = conn.closed.notified() => return,
        };
        let Some(c) = ctx.upgrade() else { return };
        let broken = match e {
            Ok(e) if e.kind == ev::DEVICE_REMOVAL => {
                c.kill(REMOVED);
                return;
            }
            Ok(e)
                if matches!(
                    e.kind,
                    ev::DISCONNECTED | ev::CONNECT_ERROR | ev::UNREACHABLE | ev::REJECTED
                ) =>
            {
                tracing::debug!(device = %c.info.name, "rdma_cm event {}", e.name());
                true
            }
            Ok(e) => {
                tracing::debug!(device = %c.info.name, "rdma_cm event {}", e.name());
                if e.kind == ev::ESTABLISHED {
                    let tx = conn
                        .on_established
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take();
                    if let Some(tx) = tx {
                        let _ = tx.send(conn.conn_id);
                    }
                }
                false
            }
            Err(HwError::CmTimeout(_)) => false,
            Err(_) => true,
        };
        if broken {
            conn.report();
            // Its owner learns it from the report; the id goes once nobody holds it.
            c.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&conn.conn_id.0);
            return;
        }
    }
}

/// A resolution failure that a neighbour or route still being learned explains.
fn resolve_transient(e: &HwError) -> bool {
    match e {
        HwError::Verbs { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::ENXIO | libc::ENODATA | libc::EHOSTUNREACH | libc::ETIMEDOUT)
        ),
        HwError::CmUnexpected { got, .. } => matches!(*got, "ADDR_ERROR" | "ROUTE_ERROR"),
        _ => false,
    }
}

fn refused(e: HwError) -> CmError {
    match e {
        HwError::Rejected {
            nvme: Some(s),
            status,
        } => CmError::Refused(format!(
            "the target refused the connection: {} (rdma_cm reject reason {status})",
            s.message()
        )),
        HwError::Rejected { status, .. } => CmError::Refused(format!(
            "the target refused the connection (rdma_cm reject reason {status}; 8 means no \
             listener on that port)"
        )),
        e => CmError::Refused(e.to_string()),
    }
}

impl HwCm {
    async fn connect_inner(
        &self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Established, CmError> {
        let ctx = &self.ctx;
        // rdma_cm addresses the listener by IP and service port (NVMe-oF: 4420); `peer` is
        // the target's RoCEv2 address as the soft-HCA names it (UDP port 4791).
        let peer = SocketAddr::new(peer.ip(), params.service_port);
        // Address and route resolution can fail while the neighbour entry is still being
        // learned (first contact: ENXIO / ENODATA from rdma_resolve_route, or an
        // ADDR_ERROR / ROUTE_ERROR event); such a failure is retried with a fresh id until
        // the attempt's deadline, as the kernel host's own retries would.
        let deadline = tokio::time::Instant::now() + timeout;
        let id = loop {
            let id = alloc_audit::platform(CmId::new).map_err(refused)?;
            match id.resolve(peer, timeout).await {
                Ok(()) => break id,
                Err(e) if resolve_transient(&e) && tokio::time::Instant::now() < deadline => {
                    tracing::debug!("rdma_cm resolve of {peer}: {e}; again");
                    drop(id);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(refused(e)),
            }
        };
        match id.device_guid() {
            Some(g) if g == ctx.identity.guid => {}
            Some(g) => {
                return Err(CmError::Refused(format!(
                    "{peer} is reached through RDMA device guid {g}, not {} ({}); pick that \
                     device with --device",
                    ctx.info.name, ctx.identity.guid
                )))
            }
            None => return Err(CmError::Refused("rdma_cm bound no device".into())),
        }
        if id.port() != 1 {
            return Err(CmError::Refused(format!(
                "{peer} is reached through port {} of {}; only port 1 is supported",
                id.port(),
                ctx.info.name
            )));
        }
        let ev = id
            .request(
                params.local_qpn.get(),
                private,
                params.responder_resources,
                params.initiator_depth,
                timeout,
            )
            .await
            .map_err(refused)?;
        let attrs = alloc_audit::platform(|| -> Result<_, HwError> {
            Ok((id.qp_attr(1)?, id.qp_attr(2)?, id.qp_attr(3)?))
        })
        .map_err(refused)?;
        let (init, rtr, rts) = attrs;
        let r = (
            rtr.0.dest_qp_num,
            rtr.0.rq_psn,
            rtr.0.max_dest_rd_atomic,
            rtr.0.path_mtu,
        );
        let t = (
            rts.0.sq_psn,
            rts.0.max_rd_atomic,
            rts.0.retry_cnt,
            rts.0.rnr_retry,
            rts.0.timeout,
        );
        let path = [init, rtr, rts];
        // Numbered across contexts: a late disconnect report of a dead context's connection
        // must not name a connection of its successor.
        let n = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn::new(id, n, None));
        let registered = alloc_audit::platform(|| {
            let mut res = ctx.res();
            let Some(r) = res.as_mut() else {
                return Err(CmError::DeviceGone(
                    "the RDMA device went away while connecting",
                ));
            };
            let Some(q) = r.qps.get_mut(&params.local_qpn.get()) else {
                return Err(CmError::Refused("no such QP".into()));
            };
            q.pending = Some(Pending {
                path,
                establish: Some(conn.clone()),
            });
            self.spawn_watch(&conn);
            Ok(())
        });
        registered?;
        Ok(Established {
            id: ConnId(n),
            remote_id: ConnId(0),
            peer,
            remote_ca_guid: Guid::default(),
            remote_qpn: Qpn::new(r.0),
            remote_psn: Psn::new(r.1),
            local_psn: Psn::new(t.0),
            responder_resources: r.2,
            initiator_depth: t.1,
            retry_count: t.2,
            rnr_retry_count: t.3,
            path_mtu: mtu_of(r.3),
            target_ack_delay: 0,
            ack_timeout: t.4,
            accept: NvmeCmAccept::parse(&ev.private).ok(),
            private_data: ev.private,
        })
    }

    /// Forget connection `id`: its watcher lets go of it, and its id is destroyed once the
    /// caller drops what this returns.
    fn take(&self, id: ConnId) -> Option<Arc<Conn>> {
        let c = self
            .ctx
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id.0)?;
        c.closed.notify_one();
        Some(c)
    }

    fn conn(&self, id: ConnId) -> Option<Arc<Conn>> {
        self.ctx
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id.0)
            .cloned()
    }

    /// Watch `conn`'s events for as long as the context lives.
    fn spawn_watch(&self, conn: &Arc<Conn>) {
        self.ctx
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(conn.conn_id.0, conn.clone());
        let t = tokio::spawn(watch_conn(conn.clone(), Arc::downgrade(&self.ctx)));
        self.ctx
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(t.abort_handle());
    }
}

impl CmPort for HwCm {
    async fn connect(
        &self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Established, CmError> {
        if self.ctx.gone() {
            return Err(CmError::DeviceGone("the RDMA device is gone"));
        }
        // rdma_cm is the platform's connection manager, as the soft-HCA's CM is
        // (`CmService::connect`): what it allocates is not the host's.
        alloc_audit::Platform::new(async {
            let died = self.ctx.died.notified();
            tokio::pin!(died);
            died.as_mut().enable();
            tokio::select! {
                r = self.connect_inner(peer, params, private, timeout) => r,
                _ = &mut died => {
                    Err(CmError::DeviceGone("the RDMA device went away while connecting"))
                }
            }
        })
        .await
    }

    fn abort(&self, id: ConnId) {
        alloc_audit::platform(|| drop(self.take(id)))
    }

    fn disconnect(&self, id: ConnId) {
        alloc_audit::platform(|| {
            if let Some(c) = self.take(id) {
                let _ = c.id.disconnect();
            }
        })
    }

    fn watch(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        alloc_audit::platform(|| {
            let conns = self.ctx.conns.lock().unwrap_or_else(|e| e.into_inner());
            match conns.get(&id.0) {
                Some(c) if !c.broken.load(Ordering::Acquire) => {
                    *c.watcher.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
                }
                _ => {
                    let _ = tx.send(id);
                }
            }
        })
    }
}

/// Connection requests a listener may have waiting (`rdma_listen` backlog).
const LISTEN_BACKLOG: i32 = 128;

/// Serve a listening id until the context dies: each CONNECT_REQUEST becomes a connection
/// of the context, reported on `tx`; DEVICE_REMOVAL kills the context.
async fn serve_listen(cm: HwCm, id: CmId, tx: mpsc::Sender<Incoming>) {
    loop {
        let e = id.listen_event().await;
        if cm.ctx.gone() {
            return;
        }
        match e {
            Ok(ListenEvent::Request(r)) => {
                if let Some(inc) = alloc_audit::platform(|| cm.on_request(r)) {
                    match tx.try_send(inc) {
                        Ok(()) => {}
                        // The target is behind: refuse rather than queue without end.
                        Err(mpsc::error::TrySendError::Full(inc)) => {
                            tracing::debug!(device = %cm.ctx.info.name, "connection request refused: listener backlog full");
                            let rej = NvmeCmReject::new(NvmeRejectStatus::NoResources).emit();
                            CmListen::reject(&cm, inc.id, &rej);
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => return,
                    }
                }
            }
            Ok(ListenEvent::Other(e)) if e.kind == ev::DEVICE_REMOVAL => {
                cm.ctx.kill(REMOVED);
                return;
            }
            Ok(ListenEvent::Other(e)) => {
                tracing::debug!(device = %cm.ctx.info.name, "rdma_cm listener event {}", e.name())
            }
            // A request whose id could not be moved to a channel of its own was refused.
            Err(HwError::Verbs { call, source }) if call != "rdma_get_cm_event" => {
                tracing::warn!(device = %cm.ctx.info.name, "connection request refused: {call}: {source}")
            }
            Err(e) => {
                tracing::error!(device = %cm.ctx.info.name, "rdma_cm listener failed: {e}");
                return;
            }
        }
    }
}

impl HwCm {
    /// A connection request: on this context's device and port 1, with a path rdma_cm can
    /// give our QP, or refused here.
    fn on_request(&self, r: ConnRequest) -> Option<Incoming> {
        let name = &self.ctx.info.name;
        let refuse = |why: String| {
            tracing::warn!(device = %name, "connection request refused: {why}");
            let _ = r.id.reject(&[]);
        };
        if r.id.device_guid() != Some(self.ctx.identity.guid) || r.id.port() != 1 {
            refuse(format!(
                "it came in on device guid {:?} port {}, not port 1 of {name}",
                r.id.device_guid(),
                r.id.port()
            ));
            return None;
        }
        let path = match (r.id.qp_attr(1), r.id.qp_attr(2), r.id.qp_attr(3)) {
            (Ok(i), Ok(rtr), Ok(rts)) => [i, rtr, rts],
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                refuse(format!("no QP path from rdma_cm: {e}"));
                return None;
            }
        };
        let [_, rtr, rts] = &path;
        let peer =
            r.id.peer_addr()
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let (qpn, psn) = (Qpn::new(rtr.0.dest_qp_num), Psn::new(rtr.0.rq_psn));
        let (local_psn, path_mtu) = (Psn::new(rts.0.sq_psn), mtu_of(rtr.0.path_mtu));
        let nvme = NvmeCmRequest::parse(&r.private);
        let n = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn::new(r.id, n, Some(path)));
        self.spawn_watch(&conn);
        Some(Incoming {
            id: ConnId(n),
            peer: PeerInfo {
                addr: peer,
                qpn,
                psn,
            },
            local_psn,
            path_mtu,
            nvme,
        })
    }
}

impl CmListen for HwCm {
    fn listen(&self, at: SocketAddr) -> Result<mpsc::Receiver<Incoming>, CmError> {
        if self.ctx.gone() {
            return Err(CmError::DeviceGone("the RDMA device is gone"));
        }
        let name = &self.ctx.info.name;
        let id = alloc_audit::platform(|| -> Result<CmId, HwError> {
            let id = CmId::new()?;
            id.listen(at, LISTEN_BACKLOG)?;
            Ok(id)
        })
        .map_err(|e| CmError::Refused(format!("cannot listen on {at}: {e}")))?;
        match id.device_guid() {
            Some(g) if g != self.ctx.identity.guid => {
                return Err(CmError::Refused(format!(
                    "{} is an address of RDMA device guid {g}, not of {name}: listen on an \
                     address of {name}'s network interface",
                    at.ip()
                )))
            }
            // A wildcard address: requests through other devices are refused one by one.
            _ => {}
        }
        let (tx, rx) = mpsc::channel(INCOMING_BACKLOG);
        let t = tokio::spawn(serve_listen(self.clone(), id, tx));
        self.ctx
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(t.abort_handle());
        Ok(rx)
    }

    fn attach(&self, id: ConnId, qpn: Qpn) -> Result<(), CmError> {
        alloc_audit::platform(|| {
            let conn = self
                .conn(id)
                .ok_or_else(|| CmError::Refused("the connection request is gone".into()))?;
            let path = conn
                .request
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .ok_or_else(|| CmError::Refused("the request is attached already".into()))?;
            let mut res = self.ctx.res();
            let r = res
                .as_mut()
                .ok_or(CmError::DeviceGone("the RDMA device is gone"))?;
            let q = r
                .qps
                .get_mut(&qpn.get())
                .ok_or_else(|| CmError::Refused("no such QP".into()))?;
            q.pending = Some(Pending {
                path,
                establish: None,
            });
            Ok(())
        })
    }

    fn accept(&self, id: ConnId, params: AcceptParams, private: &[u8]) -> Result<(), CmError> {
        alloc_audit::platform(|| {
            let conn = self
                .conn(id)
                .ok_or_else(|| CmError::Refused("the connection request is gone".into()))?;
            conn.id
                .accept(params.local_qpn.get(), private, params.rnr_retry_count)
                .map_err(|e| CmError::Refused(e.to_string()))
        })
    }

    fn reject(&self, id: ConnId, private: &[u8]) {
        alloc_audit::platform(|| {
            if let Some(c) = self.take(id) {
                if let Err(e) = c.id.reject(private) {
                    tracing::debug!("rdma_reject: {e}");
                }
            }
        })
    }

    fn watch_established(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>) {
        alloc_audit::platform(|| {
            if let Some(c) = self.conn(id) {
                *c.on_established.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
            }
        })
    }
}

// ---------------------------------------------------------------------------------------
// Device source

struct SourceShared {
    changed: Arc<Notify>,
    /// The current context per device selector.
    current: Mutex<HashMap<String, (HwContext, u64)>>,
    generation: AtomicU64,
    /// Selectors held down by [`DeviceSource::inflict_reset`]: no context until it ends.
    held_down: Mutex<HashSet<String>>,
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
            held_down: Mutex::new(HashSet::new()),
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
        if self
            .sh
            .held_down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name)
        {
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

    /// A reset as the host sees one: the current context dies as on IBV_EVENT_DEVICE_FATAL
    /// (every verbs object and cm_id of ours dropped at once), no context is handed out for
    /// `down_for`, then the device is opened anew. The kernel device itself is untouched:
    /// this drives our whole recovery path on a real device (chaos, tests).
    async fn inflict_reset(&self, name: &str, down_for: Duration) -> Result<(), String> {
        let cur = self
            .sh
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|(c, _)| c.clone());
        let Some(c) = cur.filter(|c| !c.ctx.gone()) else {
            return Err(format!("RDMA device {name} has no open context to reset"));
        };
        let held = |on: bool| {
            let mut h = self.sh.held_down.lock().unwrap_or_else(|e| e.into_inner());
            if on {
                h.insert(name.to_string());
            } else {
                h.remove(name);
            }
        };
        held(true);
        c.ctx.kill(FATAL);
        self.sh.changed.notify_waiters();
        if !down_for.is_zero() {
            tokio::time::sleep(down_for).await;
        }
        held(false);
        self.sh.changed.notify_waiters();
        Ok(())
    }
}

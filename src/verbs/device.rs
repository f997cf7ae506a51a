//! One open context of an RDMA device, as the host uses it.

use std::future::Future;

use super::{
    Access, CmPort, CqId, Guid, Lifecycle, MrInfo, Mtu, PciAddr, PdId, PeerInfo, Psn, QpCaps, Qpn,
    RecvWr, SendWr, VerbsError, WorkCompletion,
};

/// What identifies a device across its contexts (resets, re-plugs): its node GUID and PCI
/// address. A context that comes back with another identity is another card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub guid: Guid,
    pub pci: PciAddr,
}

/// Host memory a device may read and write through memory regions. The host allocates it
/// once and registers the same buffers again on every new context, so nothing on the
/// recovery path allocates; a backend that needs pinned or aligned pages provides them here.
pub trait HostBuffer: Sized + Send + Sync + 'static {
    /// `len` zeroed bytes, ready to register (pages faulted in where that matters).
    fn alloc(len: usize) -> Self;
    /// As [`HostBuffer::alloc`], or `None` when the memory cannot be had: what a peer asks
    /// for must not abort the process.
    fn try_alloc(len: usize) -> Option<Self>;
    /// `len` zeroed bytes whose pages come in as they are first used (where registering
    /// does not pin them all anyway), or `None` when the memory cannot be had. For a
    /// target's staging: a 128-entry queue of 1 MiB slots then costs a mapping, not 128 MiB
    /// of page faults before the host hears back.
    fn try_alloc_lazy(len: usize) -> Option<Self>;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn read(&self, offset: usize, out: &mut [u8]);
    fn write(&self, offset: usize, data: &[u8]);
    /// A hint: this buffer is far larger than any cache and what is written to it is rarely
    /// read back soon (a RAM namespace), so the device's copies into it may bypass the
    /// cache. A device that copies with the CPU heeds it; one that writes by DMA need not.
    fn stream_writes(&self) {}
    /// Run `f` over bytes `offset..offset + len` (and only those: other bytes of the buffer
    /// may be in use by the device or by C code at the same time). As with DMA, the bytes a
    /// posted work request names belong to the device until it completes; this only makes
    /// the access atomic. Panics if the range leaves the buffer.
    fn with_range<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R;
    /// The first byte, which never moves: for a caller that fills and reads the buffer itself
    /// (a registered I/O buffer handed to C code). Writing through it is sound only for bytes
    /// no posted work request names, as with DMA.
    fn as_mut_ptr(&self) -> *mut u8;
}

/// How an RC QP behaves once connected: the `ibv_qp_attr` fields the host chooses for RTR
/// and RTS (the rest comes from the peer and the connection manager).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcAttr {
    pub mtu: Mtu,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// Packets in flight before the requester waits for an ACK; devices that pace on their
    /// own ignore it.
    pub max_unacked: u32,
}

/// One open context of a device. Cheap to clone: every clone is the same context.
///
/// Every create/register call fails with [`VerbsError::DeviceGone`] once the device died
/// (fatal error or removal), and every destroy/deregister/dealloc call succeeds then, so the
/// recovery path can drop a context's objects whatever state they are in.
pub trait DeviceContext: Clone + Send + Sync + 'static {
    /// Host memory this device registers.
    type Mem: HostBuffer;
    /// The connection manager of a context.
    type Cm: CmPort;

    /// Node GUID and PCI address of the device behind this context.
    fn identity(&self) -> Identity;
    fn lifecycle(&self) -> Lifecycle;
    /// Is `other` this very context (not merely a context of the same device)?
    fn same(&self, other: &Self) -> bool;
    /// Do this context's packets to `peer` stay in memory (another context of this
    /// process, as the soft-HCA's loopback path and rxe's own loopback do) rather than go
    /// over a network? Hosts choose how to send writes by it
    /// (`ConnectOptions::inline_depth`). No, unless the backend knows better.
    fn reaches_in_memory(&self, _peer: std::net::SocketAddr) -> bool {
        false
    }
    fn alloc_pd(&self) -> Result<PdId, VerbsError>;
    fn dealloc_pd(&self, pd: PdId);
    /// Register `len` bytes of `mem` from `offset`.
    fn reg_mr(
        &self,
        pd: PdId,
        mem: &Self::Mem,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MrInfo, VerbsError>;
    fn dereg_mr(&self, mr: &MrInfo);
    /// Can a region be given a fresh key for each use ([`DeviceContext::rekey_mr`],
    /// [`DeviceContext::invalidate_mr`])? Where it cannot, a region keeps the key it was
    /// registered with until it is deregistered.
    fn per_use_keys(&self) -> bool;
    /// Can a SEND carry an invalidation of the peer's key ([`SendOp::SendWithInv`])? Where it
    /// cannot, a target answers with a plain SEND and the host invalidates the key itself
    /// (as Linux nvme-rdma does when the response did not).
    ///
    /// [`SendOp::SendWithInv`]: super::SendOp::SendWithInv
    fn send_with_invalidate(&self) -> bool;
    /// Fast registration (what IB_WR_REG_MR with a new key does): from now on the region
    /// answers to a fresh key only, lkey and rkey alike, and is valid over its first `len`
    /// bytes with `access` (each at most what it was registered with, else an error); `mr`
    /// is updated. The old key is refused at once. Allocates nothing: it runs per I/O. A
    /// no-op where [`DeviceContext::per_use_keys`] is false.
    fn rekey_mr(&self, mr: &mut MrInfo, len: usize, access: Access) -> Result<(), VerbsError>;
    /// Local invalidate (IB_WR_LOCAL_INV): the region refuses every access until the next
    /// [`DeviceContext::rekey_mr`]. A no-op where [`DeviceContext::per_use_keys`] is false.
    fn invalidate_mr(&self, mr: &MrInfo);
    fn create_cq(&self, depth: usize) -> Result<CqId, VerbsError>;
    fn destroy_cq(&self, cq: CqId);
    /// An RC QP in INIT on `cq` (send and receive), with `access` for remote peers. On error
    /// nothing is left behind.
    fn create_rc_qp(
        &self,
        pd: PdId,
        cq: CqId,
        caps: QpCaps,
        access: Access,
    ) -> Result<Qpn, VerbsError>;
    /// INIT → RTR → RTS towards `peer`, sending from `local_psn`.
    fn rc_to_rts(
        &self,
        qpn: Qpn,
        peer: PeerInfo,
        local_psn: Psn,
        attr: &RcAttr,
    ) -> Result<(), VerbsError>;
    fn destroy_qp(&self, qpn: Qpn);

    /// Post every receive, then every send, of one turn at once (one lock, one doorbell) and
    /// leave both vectors empty. Every request is tried; the first refusal is returned.
    fn post(
        &self,
        qpn: Qpn,
        recvs: &mut Vec<RecvWr>,
        sends: &mut Vec<SendWr>,
    ) -> Result<(), VerbsError>;
    /// Move up to `max` completions of `cq` into `out`, without waiting.
    fn poll_cq(&self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize;
    /// Wait until `cq` has completions, then move up to `max` of them into `out`. Returns 0
    /// only if the device died with nothing left to reap.
    fn wait_cq<'a>(
        &'a self,
        cq: CqId,
        max: usize,
        out: &'a mut Vec<WorkCompletion>,
    ) -> impl Future<Output = usize> + Send + 'a;
}

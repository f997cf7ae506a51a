//! One open soft-HCA context: the verbs objects (PDs, MRs, CQs, QPs) and the sans-I/O packet
//! pump. Inputs are `handle_datagram(now, …)` (or `handle_ipv4`, a datagram with its IP
//! header), `handle_timeout(now)` and verbs calls; outputs are `poll_transmit`,
//! `poll_timeout` and `poll_event`. It owns no socket and reads no clock.
//!
//! Lifecycle follows the "RDMA reset flows" zombie model: after `fatal()` or `remove()` the
//! context stays usable for teardown only. Pending WQEs complete with WR_FLUSH_ERR, posts fail
//! at once, release calls succeed and free software state, and anything that would allocate
//! or change device state fails with [`VerbsError::DeviceGone`].

use crate::verbs::{Lifecycle, VerbsError};
use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;
use std::net::{IpAddr, SocketAddr};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::cq::Cq;
use super::mr::{HostMem, MrTable};
use super::qp::state::{self, AttrMask, QpState};
use super::qp::{Ctx, Qp, QpAttr, MAX_IN_MEMORY_SEG};
use crate::verbs::{Access, MrInfo, PdId};
use crate::verbs::{CqId, WorkCompletion};
use crate::verbs::{Guid, Instant, MemKey, PciAddr, Qpn};
use crate::verbs::{QpCaps, RecvWr, SendWr};

/// A QP context over the device's shared tables. A macro rather than a method, so that the
/// `self.qps` entry the caller holds stays a disjoint borrow from these fields.
macro_rules! ctx {
    ($d:ident, $now:expr) => {
        Ctx {
            mrs: &mut $d.mrs,
            cqs: &mut $d.cqs,
            stats: &mut $d.stats,
            events: &mut $d.events,
            local: $d.config.addr,
            now: $now,
            ack_delay: $d.ack_delay,
            icrc_by_port: $d.icrc_by_port,
        }
    };
}

mod pump;
pub use pump::emit_gsi;

/// A management datagram is always 256 bytes (IBA 13.4.2).
pub const MAD_LEN: usize = 256;
/// MADs queued per direction before new ones are refused.
const GSI_QUEUE: usize = 256;
use super::Stats;
use crate::verbs::AsyncEvent;

/// Who a device is: what survives a reset and what a re-plug may change.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceIdentity {
    pub name: String,
    pub guid: Guid,
    pub pci: PciAddr,
}

impl DeviceIdentity {
    /// An identity whose GUID is the EUI-64 of `mac`.
    pub fn from_mac(name: &str, mac: [u8; 6], pci: PciAddr) -> DeviceIdentity {
        DeviceIdentity {
            name: name.to_string(),
            guid: Guid::from_mac(mac),
            pci,
        }
    }
}

/// How received ICRCs are treated. The ICRC covers the IPv4 identification and DF flag,
/// which a UDP socket does not show; the driver hands the device either a UDP payload
/// ([`Device::handle_datagram`]) or a whole IPv4 datagram read off a raw socket
/// ([`Device::handle_ipv4`]), and the mode says what to do with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IcrcCheck {
    /// Verify. A UDP payload is checked assuming the sender used IP identification 0 and
    /// DF, as Linux does for an unconnected UDP socket (our soft-HCA always does): for
    /// soft-HCA peers.
    Verify,
    /// For peers that number their IPv4 datagrams (rxe, NICs): verify against the real
    /// header. The driver reads IPv4 datagrams whole from a raw socket (CAP_NET_RAW);
    /// IPv6 hides nothing the ICRC covers (traffic class, flow label and hop limit are
    /// masked, rxe_icrc.c), so a UDP payload from an IPv6 peer is verified as it is. An
    /// IPv4 UDP payload (no raw socket) is accepted unchecked and counted
    /// (`Stats::rx_icrc_unchecked`). `required`: the driver refuses to start without the
    /// raw socket instead.
    RealHeader { required: bool },
    /// Accept every ICRC unchecked (counted as `Stats::rx_icrc_unchecked`).
    Skip,
}

impl IcrcCheck {
    /// Does this mode want IPv4 datagrams whole, with their header (a raw socket)?
    pub fn wants_ip_header(self) -> bool {
        matches!(self, IcrcCheck::RealHeader { .. })
    }
}

#[derive(Debug, Clone)]
pub struct DeviceConfig {
    pub identity: DeviceIdentity,
    /// The address this device's UDP socket is bound to; source of every packet.
    pub addr: SocketAddr,
    pub icrc: IcrcCheck,
    /// Where the peers listen. `None`: at the address their packets come from (soft-HCAs,
    /// which send from the port they are bound to, so several share a host). `Some(4791)`:
    /// peers are RoCEv2 devices (rxe, NICs) that send from a per-QP source port (0xC000 +
    /// hash) but receive only on 4791 (anchors §7.4): every packet's sender is answered at
    /// its IP and this port, CM replies and QP traffic alike.
    pub peer_port: Option<u16>,
    /// Seed for memory keys and QPNs, used only by [`Device::new_seeded`] (the simulator,
    /// which replays a run from its seed). [`Device::new`], what a real device uses, keys
    /// its generator from the OS CSPRNG and ignores it.
    pub seed: u64,
}

/// The UDP port every RoCEv2 device receives on (IANA "roce", include/rdma/ib_verbs.h).
pub const ROCE_V2_PORT: u16 = 4791;

/// Is the peer at `ip` possibly a real RoCEv2 device (Linux rxe, a NIC) rather than one of
/// our soft-HCAs? Loopback peers are ours (several share 127.0.0.1 on their own ports);
/// anything else is treated as the real thing: no UDP GSO (each segment would carry its
/// own IP identification, which the peer's ICRC check covers), received ICRCs checked
/// against the real IP header ([`IcrcCheck::RealHeader`]), peers answered at port 4791, and path MTU 1024 (what rxe derives from a 1500-byte Ethernet MTU).
pub fn roce_peer(ip: IpAddr) -> bool {
    !ip.is_loopback()
}

/// Capacity bounds of one context.
pub const MAX_CQE: usize = 1 << 16;
pub const MAX_QP_WR: u32 = 1 << 14;
/// The lowest QPN a regular QP gets, and how many random draws may hit a QPN in use
/// before creating a QP fails.
const FIRST_QPN: u32 = 17;
const QPN_DRAWS: usize = 64;

pub struct Device {
    config: DeviceConfig,
    lifecycle: Lifecycle,
    pds: BTreeMap<u32, ()>,
    next_pd: u32,
    mrs: MrTable,
    cqs: FxHashMap<CqId, Cq>,
    next_cq: u32,
    qps: FxHashMap<Qpn, Qp>,
    /// Memory keys and QPNs. A CSPRNG (ChaCha12), keyed by the OS for a real
    /// device: a peer that learns some keys must not be able to work out the others.
    rng: StdRng,
    stats: Stats,
    events: VecDeque<AsyncEvent>,
    schedule: VecDeque<Qpn>,
    /// QP1 (GSI): CM MADs in and out, bounded so a flood cannot grow memory.
    gsi_rx: VecDeque<(SocketAddr, [u8; MAD_LEN])>,
    gsi_tx: VecDeque<(SocketAddr, [u8; MAD_LEN])>,
    gsi_psn: u32,
    /// Events and MADs handed out so far; with the queue lengths, a monotonic activity count.
    popped: u64,
    /// ACK coalescing delay (see `qp::DEFAULT_ACK_DELAY`).
    ack_delay: std::time::Duration,
    /// QPs leave their packets' ICRC for the port to fill in.
    icrc_by_port: bool,
    /// Whether two addresses are contexts of this process whose packets go in memory
    /// ([`Device::set_in_memory_path`]).
    in_memory_path: Option<fn(SocketAddr, SocketAddr) -> bool>,
    /// CQs that received completions since the driver last asked.
    cq_dirty: Vec<CqId>,
}

impl Device {
    /// A device whose memory keys and QPNs come from a generator keyed by the OS CSPRNG
    /// (panics only if the OS has no entropy source at all, at start-up).
    pub fn new(config: DeviceConfig) -> Device {
        Device::build(config, StdRng::from_os_rng())
    }

    /// A device that draws its keys and QPNs from `config.seed`, so a simulator run replays
    /// exactly. Never for a device on a real network: its keys are as guessable as its seed.
    pub fn new_seeded(config: DeviceConfig) -> Device {
        let rng = StdRng::seed_from_u64(config.seed);
        Device::build(config, rng)
    }

    fn build(config: DeviceConfig, rng: StdRng) -> Device {
        let mut d = Device {
            config,
            lifecycle: Lifecycle::Live,
            pds: BTreeMap::new(),
            next_pd: 1,
            mrs: MrTable::default(),
            cqs: FxHashMap::default(),
            next_cq: 1,
            qps: FxHashMap::default(),
            rng,
            stats: Stats::default(),
            events: VecDeque::new(),
            schedule: VecDeque::new(),
            cq_dirty: Vec::new(),
            gsi_rx: VecDeque::with_capacity(GSI_QUEUE),
            gsi_tx: VecDeque::with_capacity(GSI_QUEUE),
            gsi_psn: 0,
            popped: 0,
            ack_delay: crate::hca::qp::DEFAULT_ACK_DELAY,
            icrc_by_port: false,
            in_memory_path: None,
        };
        d.events.push_back(AsyncEvent::PortActive);
        d
    }

    /// How long an owed ACK may wait to go out with a packet of ours to the same peer
    /// before it leaves alone. Zero sends every ACK at once (one per receive batch).
    pub fn set_ack_delay(&mut self, delay: std::time::Duration) {
        self.ack_delay = delay;
    }

    /// Leave the ICRC of the QPs' outgoing packets zero (`on`), for the port to compute as
    /// it sends them ([`crate::hca::wire::fill_icrc`], with this device's address as the
    /// source), as a NIC computes the ICRC on its way out: the driver's UDP port does this
    /// when it can hand packets to another context of the process in memory, which needs
    /// no ICRC at all. Management datagrams always carry theirs.
    pub fn set_icrc_by_port(&mut self, on: bool) {
        self.icrc_by_port = on;
    }

    /// The driver's port is on the in-memory path between contexts of this process, and
    /// `reaches(ours, theirs)` says whether a peer is too. A QP whose AV names such a peer
    /// gets the path's larger packets (`QpAttr::in_memory_seg`) unless it was given a size:
    /// decided here, when the AV is set, whoever brings the QP up (the backend seam, CM, a
    /// test by hand), so that both ends, asking the same registry, agree.
    pub fn set_in_memory_path(&mut self, reaches: Option<fn(SocketAddr, SocketAddr) -> bool>) {
        self.in_memory_path = reaches;
    }

    pub fn identity(&self) -> &DeviceIdentity {
        &self.config.identity
    }
    pub fn addr(&self) -> SocketAddr {
        self.config.addr
    }
    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle
    }
    pub fn is_live(&self) -> bool {
        self.lifecycle == Lifecycle::Live
    }
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The driver's count of packets the loopback path dropped for this context (a full
    /// inbox); reported as `Stats::rx_loopback_full`.
    pub fn set_loopback_full(&mut self, dropped: u64) {
        self.stats.rx_loopback_full = dropped;
    }

    fn live(&self) -> Result<(), VerbsError> {
        if self.is_live() {
            Ok(())
        } else {
            Err(VerbsError::DeviceGone)
        }
    }

    /// Count of live objects: (PDs, MRs, CQs, QPs). Zero everywhere after a clean teardown.
    pub fn object_counts(&self) -> (usize, usize, usize, usize) {
        (
            self.pds.len(),
            self.mrs.len(),
            self.cqs.len(),
            self.qps.len(),
        )
    }

    // ---- lifecycle --------------------------------------------------------------------

    /// The device hit a fatal error (or was reset): every QP is flushed, the context turns
    /// into a zombie and DEVICE_FATAL is raised.
    pub fn fatal(&mut self) {
        if self.lifecycle != Lifecycle::Live {
            return;
        }
        self.lifecycle = Lifecycle::Fatal;
        self.flush_everything();
        self.events.push_back(AsyncEvent::PortError);
        self.events.push_back(AsyncEvent::DeviceFatal);
    }

    /// The device was hot-removed: as fatal, then DEVICE_REMOVED.
    pub fn remove(&mut self) {
        if self.lifecycle == Lifecycle::Live {
            self.fatal();
        }
        if self.lifecycle != Lifecycle::Removed {
            self.lifecycle = Lifecycle::Removed;
            self.events.push_back(AsyncEvent::DeviceRemoved);
        }
    }

    fn flush_everything(&mut self) {
        let mut qpns: Vec<Qpn> = self.qps.keys().copied().collect();
        qpns.sort();
        for qpn in qpns {
            let Some(qp) = self.qps.get_mut(&qpn) else {
                continue;
            };
            let mut ctx = ctx!(self, Instant::ZERO);
            qp.attr.state = QpState::Err;
            qp.flush_all(&mut ctx);
            qp.resp.nak = None;
        }
        self.schedule.clear();
        self.gsi_tx.clear();
        for q in self.qps.values_mut() {
            q.scheduled = false;
        }
        self.mark_all_cqs_dirty();
    }

    fn mark_all_cqs_dirty(&mut self) {
        self.cq_dirty.extend(self.cqs.keys().copied());
    }

    // ---- verbs: allocation (fail on a zombie) -------------------------------------------

    pub fn alloc_pd(&mut self) -> Result<PdId, VerbsError> {
        self.live()?;
        let id = self.next_pd;
        self.next_pd += 1;
        self.pds.insert(id, ());
        Ok(PdId(id))
    }

    /// Register `len` bytes of `mem` starting at `offset`.
    pub fn reg_mr(
        &mut self,
        pd: PdId,
        mem: &HostMem,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MrInfo, VerbsError> {
        self.live()?;
        if !self.pds.contains_key(&pd.0) {
            return Err(VerbsError::InvalidHandle("protection domain"));
        }
        if offset.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Err(VerbsError::InvalidArgument(
                "memory region exceeds its buffer",
            ));
        }
        // IBA 10.6.3.1: remote write needs local write.
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            return Err(VerbsError::InvalidArgument(
                "REMOTE_WRITE requires LOCAL_WRITE",
            ));
        }
        Ok(self
            .mrs
            .insert(&mut self.rng, pd, mem.clone(), offset, len, access))
    }

    pub fn create_cq(&mut self, cqe: usize) -> Result<CqId, VerbsError> {
        self.live()?;
        if cqe == 0 || cqe > MAX_CQE {
            return Err(VerbsError::InvalidArgument("CQ size out of range"));
        }
        let id = CqId(self.next_cq);
        self.next_cq += 1;
        self.cqs.insert(id, Cq::new(cqe));
        Ok(id)
    }

    pub fn create_qp(
        &mut self,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        caps: QpCaps,
    ) -> Result<Qpn, VerbsError> {
        self.live()?;
        if !self.pds.contains_key(&pd.0) {
            return Err(VerbsError::InvalidHandle("protection domain"));
        }
        if !self.cqs.contains_key(&send_cq) || !self.cqs.contains_key(&recv_cq) {
            return Err(VerbsError::InvalidHandle("completion queue"));
        }
        if caps.max_send_wr == 0 || caps.max_send_wr > MAX_QP_WR || caps.max_recv_wr > MAX_QP_WR {
            return Err(VerbsError::InvalidArgument("QP queue size out of range"));
        }
        // Each QPN drawn at random from the whole 24-bit space: counted up, they would tell
        // a peer how many connections were made between two of its own and which QPNs its
        // neighbours have; and a reset device would hand out the QPNs its previous lives
        // used, which a peer still holding those connections refuses as stale. QP0 and
        // QP1 are special; rxe starts regular QPs at 17. A table full enough to miss this
        // often is far past any real device's QP count.
        let qpn = (0..QPN_DRAWS)
            .map(|_| Qpn::new(self.rng.random_range(FIRST_QPN..=Qpn::MASK)))
            .find(|q| !self.qps.contains_key(q))
            .ok_or(VerbsError::QueueFull("queue pair number"))?;
        self.qps
            .insert(qpn, Qp::new(qpn, pd, send_cq, recv_cq, caps));
        Ok(qpn)
    }

    /// ibv_modify_qp: checked against the transition table before anything changes.
    pub fn modify_qp(&mut self, qpn: Qpn, attr: &QpAttr, mask: AttrMask) -> Result<(), VerbsError> {
        self.live()?;
        let mut attr = *attr;
        if let (Some(reaches), Some(dest)) = (self.in_memory_path, attr.dest) {
            if mask.contains(AttrMask::AV)
                && attr.in_memory_seg == 0
                && reaches(self.config.addr, dest)
            {
                attr.in_memory_seg = MAX_IN_MEMORY_SEG;
            }
        }
        let attr = &attr;
        let qp = self
            .qps
            .get_mut(&qpn)
            .ok_or(VerbsError::InvalidHandle("queue pair"))?;
        let cur = qp.attr.state;
        let next = if mask.contains(AttrMask::STATE) {
            attr.state
        } else {
            cur
        };
        state::check(cur, next, mask)?;
        if mask.contains(AttrMask::AV) && attr.dest.is_none() {
            return Err(VerbsError::InvalidArgument(
                "address vector without a destination",
            ));
        }
        if mask.contains(AttrMask::RETRY_CNT) && attr.retry_cnt > 7
            || mask.contains(AttrMask::RNR_RETRY) && attr.rnr_retry > 7
            || mask.contains(AttrMask::MIN_RNR_TIMER) && attr.min_rnr_timer > 31
            || mask.contains(AttrMask::TIMEOUT) && attr.timeout > 31
        {
            return Err(VerbsError::InvalidArgument(
                "retry or timer field out of range",
            ));
        }
        let mut ctx = ctx!(self, Instant::ZERO);
        qp.apply(&mut ctx, attr, mask);
        let qpn = qp.qpn;
        self.after_qp_change(qpn, Instant::ZERO);
        Ok(())
    }

    pub fn query_qp(&self, qpn: Qpn) -> Result<QpAttr, VerbsError> {
        self.qps
            .get(&qpn)
            .map(|q| q.attr)
            .ok_or(VerbsError::InvalidHandle("queue pair"))
    }

    // ---- verbs: release (always succeed on a zombie) ------------------------------------

    pub fn destroy_qp(&mut self, qpn: Qpn) -> Result<(), VerbsError> {
        let gone = self.qps.remove(&qpn).is_some();
        self.schedule.retain(|q| *q != qpn);
        if gone || !self.is_live() {
            Ok(())
        } else {
            Err(VerbsError::InvalidHandle("queue pair"))
        }
    }

    pub fn destroy_cq(&mut self, cq: CqId) -> Result<(), VerbsError> {
        if self.is_live() {
            if !self.cqs.contains_key(&cq) {
                return Err(VerbsError::InvalidHandle("completion queue"));
            }
            if self
                .qps
                .values()
                .any(|q| q.send_cq == cq || q.recv_cq == cq)
            {
                return Err(VerbsError::Busy("completion queue"));
            }
        }
        self.cqs.remove(&cq);
        Ok(())
    }

    /// Give the region registered under `key` a fresh key, valid from now on over its
    /// first `len` bytes with `access` (fast registration); the old key is refused at once.
    pub fn rekey_mr(
        &mut self,
        key: MemKey,
        len: u64,
        access: Access,
    ) -> Result<MrInfo, VerbsError> {
        self.live()?;
        self.mrs
            .rekey(&mut self.rng, key, len, access)
            .ok_or(VerbsError::InvalidHandle(
                "memory region of that length and access",
            ))
    }

    /// Local invalidate: the region under `key` refuses every access until rekeyed. On a dead
    /// device this succeeds (nothing can reach the region any more).
    pub fn invalidate_mr(&mut self, key: MemKey) -> Result<(), VerbsError> {
        if self.mrs.invalidate_local(key).is_ok() || !self.is_live() {
            Ok(())
        } else {
            Err(VerbsError::InvalidHandle("memory region"))
        }
    }

    pub fn dereg_mr(&mut self, key: MemKey) -> Result<(), VerbsError> {
        if self.mrs.remove(key) || !self.is_live() {
            Ok(())
        } else {
            Err(VerbsError::InvalidHandle("memory region"))
        }
    }

    pub fn dealloc_pd(&mut self, pd: PdId) -> Result<(), VerbsError> {
        if self.is_live() {
            if !self.pds.contains_key(&pd.0) {
                return Err(VerbsError::InvalidHandle("protection domain"));
            }
            if self.mrs.any_in_pd(pd) || self.qps.values().any(|q| q.pd == pd) {
                return Err(VerbsError::Busy("protection domain"));
            }
        }
        self.pds.remove(&pd.0);
        Ok(())
    }

    /// Release everything at once, whatever state it is in: the recovery path's first step.
    pub fn release_all(&mut self) {
        self.qps.clear();
        self.schedule.clear();
        self.cqs.clear();
        self.mrs.clear();
        self.pds.clear();
        self.cq_dirty.clear();
    }

    // ---- verbs: data path ---------------------------------------------------------------

    pub fn post_send(&mut self, now: Instant, qpn: Qpn, wr: SendWr) -> Result<(), VerbsError> {
        self.live()?;
        let qp = self
            .qps
            .get_mut(&qpn)
            .ok_or(VerbsError::InvalidHandle("queue pair"))?;
        match qp.attr.state {
            QpState::Reset | QpState::Init | QpState::Rtr => {
                return Err(VerbsError::InvalidQpState(qp.attr.state))
            }
            _ => {}
        }
        if qp.sq.len() >= qp.caps.max_send_wr as usize {
            return Err(VerbsError::QueueFull("send"));
        }
        if wr.sgl.total_len() > u32::MAX as u64 >> 1 {
            return Err(VerbsError::InvalidArgument("message longer than 2 GiB"));
        }
        let mut ctx = ctx!(self, now);
        qp.post_send(&mut ctx, wr);
        self.after_qp_change(qpn, now);
        Ok(())
    }

    pub fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<(), VerbsError> {
        self.live()?;
        let qp = self
            .qps
            .get_mut(&qpn)
            .ok_or(VerbsError::InvalidHandle("queue pair"))?;
        if qp.attr.state == QpState::Reset {
            return Err(VerbsError::InvalidQpState(QpState::Reset));
        }
        if qp.rq.len() >= qp.caps.max_recv_wr as usize {
            return Err(VerbsError::QueueFull("receive"));
        }
        let mut ctx = ctx!(self, Instant::ZERO);
        qp.post_recv(&mut ctx, wr);
        self.after_qp_change(qpn, Instant::ZERO);
        Ok(())
    }

    /// Move up to `max` completions into `out`. Works on a zombie, so flushed completions
    /// can be reaped.
    pub fn poll_cq(&mut self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        let Some(q) = self.cqs.get_mut(&cq) else {
            return 0;
        };
        let n = max.min(q.entries.len());
        out.extend(q.entries.drain(..n));
        n
    }

    /// CQs that gained completions since the last call (for the driver's wakeups).
    pub fn take_dirty_cqs(&mut self, out: &mut Vec<CqId>) {
        out.append(&mut self.cq_dirty);
    }

    fn mark_cq_if_nonempty(&mut self, cq: CqId) {
        if self.cqs.get(&cq).is_some_and(|q| !q.entries.is_empty()) && !self.cq_dirty.contains(&cq)
        {
            self.cq_dirty.push(cq);
        }
    }

    fn after_qp_change(&mut self, qpn: Qpn, now: Instant) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        let (sc, rc) = (qp.send_cq, qp.recv_cq);
        if !qp.scheduled && qp.wants_transmit(now) {
            qp.scheduled = true;
            self.schedule.push_back(qpn);
        }
        self.mark_cq_if_nonempty(sc);
        self.mark_cq_if_nonempty(rc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64 QPs of one context: unique, regular (past QP0, QP1 and rxe's reserved ones), and
    /// not counted up: a random draw follows its predecessor with a chance of 1 in 16 M.
    #[test]
    fn qpns_are_drawn_at_random_and_unique() {
        let mut d = Device::new(DeviceConfig {
            identity: DeviceIdentity::from_mac(
                "soft0",
                [2, 0, 0, 0, 0, 1],
                PciAddr::new(0, 0, 1, 0),
            ),
            addr: "127.0.0.1:4791".parse().unwrap(),
            icrc: IcrcCheck::Verify,
            peer_port: None,
            seed: 0,
        });
        let pd = d.alloc_pd().unwrap();
        let cq = d.create_cq(16).unwrap();
        let caps = QpCaps {
            max_send_wr: 4,
            max_recv_wr: 4,
        };
        let qpns: Vec<u32> = (0..64)
            .map(|_| d.create_qp(pd, cq, cq, caps).unwrap().get())
            .collect();
        let unique: std::collections::BTreeSet<u32> = qpns.iter().copied().collect();
        assert_eq!(unique.len(), qpns.len(), "{qpns:?}");
        assert!(
            qpns.iter().all(|q| (FIRST_QPN..=Qpn::MASK).contains(q)),
            "{qpns:?}"
        );
        let successors = qpns
            .windows(2)
            .filter(|w| w[1] == w[0].wrapping_add(1))
            .count();
        assert!(
            successors < 8,
            "{successors} of 63 QPNs follow the one before: {qpns:?}"
        );
    }
}

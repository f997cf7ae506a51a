//! The target's RDMA transport: a queue's registered rings (receive capsules, responses,
//! per-slot data staging), the work requests that move them (receives, RDMA READ and WRITE
//! of command data, response SENDs), and posting them in batches.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::nvme::{SglDescriptor, Sqe, Status};
use crate::verbs::{
    Access, DeviceContext, HostBuffer, Instant, MemKey, MrInfo, Mtu, PdId, RcAttr, RecvWr, SendOp,
    SendWr, Sgl, VerbsError,
};

use super::budget::Usage;
use super::command::{Bytes, Slot, CQE_LEN};
use super::port::{port_index, QRef};
use super::Namespace;

pub(super) const WR_RECV: u64 = 1;
pub(super) const WR_RDMA_READ: u64 = 2;
pub(super) const WR_RDMA_WRITE: u64 = 3;
pub(super) const WR_SEND: u64 = 4;

pub(super) fn wr_id(kind: u64, slot: usize) -> u64 {
    (kind << 32) | slot as u64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    Free,
    /// Waiting for RDMA READ of the host's data.
    Fetching,
    /// Response (and data) posted; waiting for the SEND completion.
    Responding,
    /// An Async Event Request, held until there is an event (or the queue goes).
    Parked,
    /// Its namespace work runs on a worker ([`super::backend`]).
    Executing,
}

pub(super) struct Cmd {
    pub stage: Stage,
    pub sqe: Sqe,
    /// How long the capsule was, in-capsule data included (that data is in the slot's
    /// staging).
    pub capsule_len: usize,
    /// Where the data for the host is when not in the slot's staging: an address and lkey
    /// in a RAM namespace's memory region (a read sent without a copy). Taken by `respond`.
    pub src: Option<(u64, MemKey)>,
    /// Its data was fetched straight into a RAM namespace (a write without a copy).
    pub landed: bool,
    /// An in-capsule write's data, still in its receive buffer (offset, bytes there): set by
    /// `on_capsule` while it runs the command, which posts the buffer again only after. The
    /// write copies it into the namespace from there, or into staging for a worker.
    pub inline: Option<(usize, usize)>,
}

/// A queue is born small: until Fabrics Connect succeeds it has one command slot, one
/// receive buffer and staging for the Connect data, whatever size the REQ asked for, so a
/// peer that is not (yet) a host of ours costs a few KiB per queue. A successful Connect
/// gives it `size` slots and `max_transfer` of staging each (`Engine::grow`).
///
/// One slot, not a few: the single receive buffer is reposted only once the command it
/// carried is answered, and never after a Connect that succeeds, so when the rings are
/// replaced nothing posted (receive, READ or SEND) still points into the old ones.
pub(super) struct TQueue<M> {
    /// The port (device) it is on.
    pub port: u16,
    pub qid: u16,
    /// Path MTU of its QP, bytes: the most one packet carries.
    pub mtu: u32,
    /// The queue size the host asked for (and gets after Connect).
    pub size: usize,
    /// Command slots and receive buffers allocated now: 1 before Connect, then `size`.
    pub slots: usize,
    pub cntlid: Option<u16>,
    pub capsule_len: usize,
    /// Staging per slot now: `CONNECT_DATA` before Connect, then `io_staging_len`.
    pub staging_len: usize,
    pub io_staging_len: usize,
    /// Full rings in place (Fabrics Connect succeeded).
    pub grown: bool,
    /// Before Connect: the one receive buffer holds a capsule not yet answered, so it is
    /// not posted.
    pub boot_held: bool,
    /// Counted against `max_unconnected_per_ip` from its RTU until Fabrics Connect
    /// succeeds, and against `max_pre_rtu_per_ip` before its RTU.
    pub peer_ip: IpAddr,
    /// Its RTU arrived (or its first capsule, which proves the same): before that it sits
    /// in the pre-RTU table and counts against no budget.
    pub established: bool,
    /// What it holds of the budgets ([`Ledger`]), and the host NQN that was charged for it
    /// (once Fabrics Connect named one): given back when it goes.
    pub charged: Usage,
    pub host: Option<Box<str>>,
    pub recv: Ring<M>,
    pub rsp: Ring<M>,
    pub data: Ring<M>,
    pub cmds: Vec<Cmd>,
    pub free: Vec<usize>,
    /// Capsules that arrived while every command slot was taken, by receive buffer (not
    /// reposted until they get a slot). A host may send its next command as soon as it has
    /// a response, before its ACK of that response reaches us and frees the slot; Linux
    /// nvmet keeps twice the queue's response contexts for the same reason. Bounded by the
    /// receive buffers, so it never grows past the queue size.
    pub held: VecDeque<(usize, usize)>,
    pub dead: bool,
    /// When the queue was accepted: one that never completes Fabrics Connect is dropped.
    pub born: Instant,
    /// This incarnation of the queue, for work finished on a worker after it went.
    pub token: u64,
    /// Cleared when the queue goes, so its jobs stop.
    pub alive: Arc<AtomicBool>,
}

impl<M: HostBuffer> TQueue<M> {
    pub fn footprint(&self) -> usize {
        self.recv.0.len() + self.rsp.0.len() + self.data.0.len()
    }

    /// Copy `len` bytes of in-capsule data, at `from` in the receive ring, into slot `c`'s
    /// staging.
    pub fn stage_from_recv(&self, c: usize, from: usize, len: usize) {
        let recv = &self.recv.0;
        self.data
            .0
            .with_range(c * self.staging_len, len, |g| recv.read(from, g));
    }

    /// Slot `c`'s staging as the device sees it: address and lkey.
    pub fn staging_at(&self, c: usize) -> (u64, MemKey) {
        (
            self.data.1.addr + (c * self.staging_len) as u64,
            self.data.1.lkey,
        )
    }
}

pub(super) fn rc_attr(mtu: Mtu) -> RcAttr {
    RcAttr {
        mtu,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_unacked: 256,
    }
}

/// The devices as the engine uses them (one per port, port `p` at `p - 1`), with the lists
/// a post goes through (kept, so that posting allocates nothing).
pub(super) struct Io<D> {
    devs: Vec<D>,
    recvs: Vec<RecvWr>,
    sends: Vec<SendWr>,
    /// While a batch of completions is handled, work requests wait here and go to the device
    /// in one post per QP at the end of the turn ([`Io::flush`]): one device lock and one
    /// driver wake-up per QP and turn, not three per command.
    deferring: bool,
    /// Held requests with their QP and the order they were made in.
    pending: Vec<(QRef, u32, Wr)>,
}

enum Wr {
    Send(SendWr),
    Recv(RecvWr),
}

impl<D: DeviceContext> Io<D> {
    pub fn new(dev: D) -> Io<D> {
        Io {
            devs: vec![dev],
            recvs: Vec::with_capacity(1),
            sends: Vec::with_capacity(1),
            deferring: false,
            pending: Vec::new(),
        }
    }

    /// The device of port `port`.
    pub fn dev(&self, port: u16) -> &D {
        // Ports are only ever added, and a queue names one that exists.
        &self.devs[port_index(port)]
    }

    /// Add the device of the next port.
    pub fn add(&mut self, dev: D) {
        self.devs.push(dev);
    }

    /// Post `wr` on `qpn` (at the end of the turn while deferring: a QP that refuses it then
    /// is broken, and its queue goes with the completions that say so).
    pub fn post_send(&mut self, q: QRef, wr: SendWr) -> Result<(), VerbsError> {
        if self.deferring {
            let n = self.pending.len() as u32;
            self.pending.push((q, n, Wr::Send(wr)));
            return Ok(());
        }
        self.sends.push(wr);
        let dev = &self.devs[port_index(q.port)];
        dev.post(q.qpn, &mut self.recvs, &mut self.sends)
    }

    pub fn post_recv(&mut self, q: QRef, wr: RecvWr) -> Result<(), VerbsError> {
        if self.deferring {
            let n = self.pending.len() as u32;
            self.pending.push((q, n, Wr::Recv(wr)));
            return Ok(());
        }
        self.recvs.push(wr);
        let dev = &self.devs[port_index(q.port)];
        dev.post(q.qpn, &mut self.recvs, &mut self.sends)
    }

    /// Hold work requests until [`Io::flush`].
    pub fn defer(&mut self) {
        self.deferring = true;
    }

    /// Post what was held, one post per QP, each QP's requests in the order they were made.
    pub fn flush(&mut self) {
        self.deferring = false;
        // By QP, then in the order made (an RDMA WRITE before its response); an unstable
        // sort on both keys keeps that order without the merge buffer a stable sort
        // allocates every turn.
        self.pending.sort_unstable_by_key(|(q, n, _)| (*q, *n));
        let mut i = 0;
        while i < self.pending.len() {
            let q = self.pending[i].0;
            while i < self.pending.len() && self.pending[i].0 == q {
                match &self.pending[i].2 {
                    Wr::Send(w) => self.sends.push(*w),
                    Wr::Recv(w) => self.recvs.push(*w),
                }
                i += 1;
            }
            // A refusal means the QP is broken: its queue goes with its error completions.
            let dev = &self.devs[port_index(q.port)];
            let _ = dev.post(q.qpn, &mut self.recvs, &mut self.sends);
            self.recvs.clear();
            self.sends.clear();
        }
        self.pending.clear();
    }
}

/// SEND command slot `c`'s response capsule (already in its buffer); a slot whose SEND
/// cannot be posted is free again.
///
/// A command whose keyed SGL asked for it (subtype 0xF) gets a SEND with Invalidate of its
/// key, as nvmet-rdma answers: the host's buffer is shut to us the moment the response
/// lands, with no local invalidation on the host's side. A device that cannot send with
/// invalidate answers with a plain SEND: the host then invalidates the key itself.
pub(super) fn send_response<D: DeviceContext>(
    d: &mut Io<D>,
    qpn: QRef,
    q: &mut TQueue<D::Mem>,
    c: usize,
) {
    let op = match SglDescriptor::parse(&q.cmds[c].sqe.dptr) {
        Ok(SglDescriptor::Keyed {
            key,
            invalidate: true,
            ..
        }) if d.dev(qpn.port).send_with_invalidate() => SendOp::SendWithInv(MemKey(key)),
        _ => SendOp::Send,
    };
    let wr = SendWr::signaled(
        wr_id(WR_SEND, c),
        op,
        Sgl::one(
            q.rsp.1.addr + (c * CQE_LEN) as u64,
            CQE_LEN as u32,
            q.rsp.1.lkey,
        ),
    );
    if d.post_send(qpn, wr).is_err() {
        q.cmds[c].stage = Stage::Free;
        q.free.push(c);
    }
}

/// Post receive buffer `r` again; false if the QP refused it.
pub(super) fn repost<D: DeviceContext>(
    d: &mut Io<D>,
    qpn: QRef,
    q: &TQueue<D::Mem>,
    r: usize,
) -> bool {
    let sgl = Sgl::one(
        q.recv.1.addr + (r * q.capsule_len) as u64,
        q.capsule_len as u32,
        q.recv.1.lkey,
    );
    d.post_recv(
        qpn,
        RecvWr {
            wr_id: wr_id(WR_RECV, r),
            sgl,
        },
    )
    .is_ok()
}

/// Before Connect: the one receive buffer goes back once its command is answered.
pub(super) fn release_boot_recv<D: DeviceContext>(
    d: &mut Io<D>,
    qpn: QRef,
    q: &mut TQueue<D::Mem>,
) {
    if !q.grown && q.boot_held {
        q.boot_held = false;
        repost(d, qpn, q, 0);
    }
}

pub(super) type Ring<M> = (Arc<M>, MrInfo);
/// A queue's receive, response and staging rings, and its command slots.
pub(super) type Rings<M> = ([Ring<M>; 3], Vec<Cmd>);

/// Receive, response and staging rings of `slots` slots, registered, and a command per
/// slot; `None` (nothing left allocated or registered) if memory or the device refuses.
pub(super) fn alloc_rings<D: DeviceContext>(
    d: &mut Io<D>,
    port: u16,
    pd: PdId,
    slots: usize,
    capsule_len: usize,
    staging_len: usize,
) -> Option<Rings<D::Mem>> {
    let mut cmds = Vec::new();
    cmds.try_reserve_exact(slots).ok()?;
    for _ in 0..slots {
        cmds.push(Cmd {
            stage: Stage::Free,
            sqe: Sqe::new(0, 0),
            capsule_len: 0,
            src: None,
            landed: false,
            inline: None,
        });
    }
    // Staging is the big one (slots x max_transfer): its pages come in as commands use
    // them, so accepting a queue (and a host's reconnect) costs no page faults up front.
    let specs = [
        (slots.checked_mul(capsule_len)?, Access::LOCAL_WRITE, false),
        (slots.checked_mul(CQE_LEN)?, Access::empty(), false),
        (slots.checked_mul(staging_len)?, Access::LOCAL_WRITE, true),
    ];
    let mut rings: Vec<Ring<D::Mem>> = Vec::with_capacity(3);
    for (len, access, lazy) in specs {
        let mem = if lazy {
            D::Mem::try_alloc_lazy(len)
        } else {
            D::Mem::try_alloc(len)
        };
        let mr = mem.and_then(|m| {
            let mr = d.dev(port).reg_mr(pd, &m, 0, len, access).ok()?;
            Some((Arc::new(m), mr))
        });
        match mr {
            Some(r) => rings.push(r),
            None => {
                for (_, mr) in rings {
                    d.dev(port).dereg_mr(&mr);
                }
                return None;
            }
        }
    }
    let rings: [Ring<D::Mem>; 3] = rings.try_into().ok()?;
    Some((rings, cmds))
}

/// RAM namespaces read so far through each port, with their memory region on that port's
/// PD where its device registers their memory (`None`: it cannot, reads copy through
/// staging). Registered on first use, deregistered when the namespace is gone from every
/// subsystem or the engine closes.
#[derive(Default)]
pub(super) struct NsRegions(Vec<(u16, Arc<Namespace>, Option<MrInfo>)>);

impl NsRegions {
    /// The memory region of RAM namespace `ns` on `pd`, registered the first time it is
    /// asked for: `None` where the device cannot register the namespace's memory (another
    /// device's memory type, or the registration failed), and reads copy through staging.
    /// Local access only (reads from it, RDMA READ responses into it): we post the RDMA, no
    /// peer ever gets a key to the namespace.
    fn get<D: DeviceContext>(
        &mut self,
        d: &mut Io<D>,
        port: u16,
        pd: PdId,
        ns: &Arc<Namespace>,
    ) -> Option<MrInfo> {
        if let Some((_, _, mr)) = self
            .0
            .iter()
            .find(|(p, n, _)| *p == port && Arc::ptr_eq(n, ns))
        {
            return *mr;
        }
        // A namespace no subsystem has any more (only this list holds it) gives its
        // region back, so the list is bounded by the namespaces that exist.
        let held = |n: &Arc<Namespace>| self.0.iter().filter(|(_, x, _)| Arc::ptr_eq(x, n)).count();
        let gone: Vec<bool> = self
            .0
            .iter()
            .map(|(_, n, _)| Arc::strong_count(n) == held(n))
            .collect();
        let mut gone = gone.into_iter();
        self.0.retain(|(p, _, mr)| {
            let gone = gone.next().unwrap_or(false);
            if let (true, Some(mr)) = (gone, mr) {
                d.dev(*p).dereg_mr(mr);
            }
            !gone
        });
        let mem = ns
            .ram_store()
            .and_then(|s| s.as_any().downcast_ref::<D::Mem>());
        let mr = mem.and_then(|m| {
            d.dev(port)
                .reg_mr(pd, m, 0, m.len(), Access::LOCAL_WRITE)
                .ok()
        });
        self.0.push((port, ns.clone(), mr));
        mr
    }

    /// The region to move a queue's data to or from RAM namespace `ns` without a copy, if
    /// there is one. Only where a packet carries whole blocks (path MTU `mtu` at least the
    /// block size): each packet is gathered or scattered under the memory's lock, as every
    /// other access to it is made, so a read that races a write to the same blocks (NVMe
    /// leaves their order open) sees each block whole, old or new, as the one-block atomic
    /// write unit promises. Nothing is held while data crosses the network, so a dead
    /// queue still retrying its RDMA keeps no live host waiting.
    pub fn direct<D: DeviceContext>(
        &mut self,
        d: &mut Io<D>,
        port: u16,
        pd: PdId,
        mtu: u32,
        ns: &Arc<Namespace>,
    ) -> Option<MrInfo> {
        if !ns.is_ram() || mtu < ns.block_size() {
            return None;
        }
        self.get(d, port, pd, ns)
    }

    /// Deregister every region (the engine closes).
    pub fn close<D: DeviceContext>(&mut self, d: &mut Io<D>) {
        for (port, _, mr) in self.0.drain(..) {
            if let Some(mr) = mr {
                d.dev(port).dereg_mr(&mr);
            }
        }
    }
}

/// Command slot `c` of a queue, as a command handler sees it ([`Slot`]).
pub(super) struct SlotRef<'a, D: DeviceContext> {
    pub q: &'a mut TQueue<D::Mem>,
    pub c: usize,
    pub d: &'a mut Io<D>,
    pub pd: PdId,
    pub regions: &'a mut NsRegions,
}

impl<D: DeviceContext> Slot for SlotRef<'_, D> {
    fn port(&self) -> u16 {
        self.q.port
    }

    fn qid(&self) -> u16 {
        self.q.qid
    }

    fn cntlid(&self) -> Option<u16> {
        self.q.cntlid
    }

    fn size(&self) -> usize {
        self.q.size
    }

    fn staging_len(&self) -> usize {
        self.q.staging_len
    }

    fn capsule_len(&self) -> usize {
        self.q.cmds[self.c].capsule_len
    }

    /// In-capsule write data from its receive buffer, anything else from staging.
    fn data_in(&mut self, len: usize, f: Bytes) -> Result<(), Status> {
        if len > self.q.staging_len {
            return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr());
        }
        let (mem, at) = match self.q.cmds[self.c].inline {
            Some((from, n)) if len <= n => (&self.q.recv.0, from),
            Some(_) => return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr()),
            None => (&self.q.data.0, self.c * self.q.staging_len),
        };
        mem.with_range(at, len, f)
    }

    fn data_out(&mut self, len: usize, f: Bytes) -> Result<(), Status> {
        if len > self.q.staging_len {
            return Err(Status::SGL_DATA_LENGTH_INVALID.with_dnr());
        }
        self.q
            .data
            .0
            .with_range(self.c * self.q.staging_len, len, f)
    }

    fn landed(&self) -> bool {
        self.q.cmds[self.c].landed
    }

    fn inline(&self) -> Option<usize> {
        self.q.cmds[self.c].inline.map(|(_, n)| n)
    }

    fn stage_inline(&mut self, len: usize) {
        if let Some((from, _)) = self.q.cmds[self.c].inline {
            self.q.stage_from_recv(self.c, from, len);
        }
    }

    fn send_from(&mut self, ns: &Arc<Namespace>, off: u64) -> bool {
        match self
            .regions
            .direct(self.d, self.q.port, self.pd, self.q.mtu, ns)
        {
            Some(mr) => {
                self.q.cmds[self.c].src = Some((mr.addr + off, mr.lkey));
                true
            }
            None => false,
        }
    }
}

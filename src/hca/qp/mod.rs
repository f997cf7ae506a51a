//! RC queue pairs. The QP is split the way rxe splits it: the requester turns send WQEs into
//! packets (`requester.rs`), the completer consumes ACKs, NAKs and read responses and retires
//! WQEs (`completer.rs`), and the responder executes inbound requests (`responder.rs`). This
//! file holds the shared state, work request types and error/flush handling.

mod completer;
mod requester;
mod responder;
pub mod rto;
pub mod state;

use crate::verbs::{Mtu, QpCaps, RecvWr, SendWr};
use std::collections::VecDeque;
use std::time::Duration;

use rustc_hash::FxHashMap;
use std::net::SocketAddr;

use super::cq::Cq;
use super::mr::MrTable;
use super::Stats;
use crate::verbs::AsyncEvent;
use crate::verbs::{Access, PdId};
use crate::verbs::{CqId, WcOpcode, WcStatus, WorkCompletion};
use crate::verbs::{Instant, MemKey, Psn, Qpn};
pub use state::{AttrMask, ModifyError, QpState};

/// Request packets between AckReq bits inside a long message (rxe uses 64).
const ACK_EVERY: u32 = 16;

/// How long an owed ACK may wait for a packet of ours to the same peer to go out with
/// (see [`RespState::ack_due`]). A NIC coalesces ACKs the same way; the requester's
/// retransmit timer (4.096 µs × 2^timeout, 67 ms at the usual 14) is far longer.
pub const DEFAULT_ACK_DELAY: std::time::Duration = std::time::Duration::from_micros(100);

/// Request packets taken in since the last ACK after which the ACK leaves at once, so a
/// requester's window of unacknowledged PSNs (128 by default) keeps moving.
const ACK_NOW_PKTS: u32 = 64;

/// QP attributes (ibv_qp_attr). A modify names the ones it sets with an [`AttrMask`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    pub state: QpState,
    pub access: Access,
    pub port: u8,
    pub pkey_index: u16,
    /// The address vector: where the peer's soft-HCA (or RoCEv2 NIC) listens.
    pub dest: Option<SocketAddr>,
    pub path_mtu: Mtu,
    pub dest_qpn: Qpn,
    pub rq_psn: Psn,
    pub sq_psn: Psn,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code we advertise (IBA table 45; 0 = 655.36 ms, 1 = 10 µs …).
    pub min_rnr_timer: u8,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout; 0 waits forever.
    pub timeout: u8,
    /// Transport retries, 0..=7 (7 means seven, as on hardware; rxe reads it as forever).
    pub retry_cnt: u8,
    /// RNR retries, 0..=7 (7 means forever, IBA 9.7.5.2.8).
    pub rnr_retry: u8,
    /// Most unacknowledged request packets in flight (rxe: 128).
    pub max_unacked: u32,
    /// Payload bytes per packet (every FIRST and MIDDLE packet, every full READ response)
    /// when both ends are soft-HCA contexts of one process, whose packets take the in-memory
    /// loopback path (`driver::local`) and never meet a wire or its MTU. 0, the default, is
    /// the path MTU, as on any wire. Both ends must agree: the requester counts a READ's
    /// response PSNs by it and the responder checks packet lengths against it. Not an IBA
    /// attribute; carried along with the AV, like `max_unacked`. A value outside path MTU
    /// ..= [`MAX_IN_MEMORY_SEG`] means the path MTU.
    pub in_memory_seg: u32,
}

/// The most payload per packet a QP may be given for the in-memory path
/// ([`QpAttr::in_memory_seg`]): 16 KiB keeps a driver turn's 256 packets inside a loopback
/// inbox (8 MiB) and takes most of what larger packets would (own loop, 128 KiB QD8: 16 KiB
/// and 64 KiB packets both run 1.3-1.5x the 4 KiB rate).
pub const MAX_IN_MEMORY_SEG: u32 = crate::hca::wire::MAX_PAYLOAD as u32;

impl QpAttr {
    /// Payload bytes per full packet on this QP's path: the path MTU, or the in-memory
    /// segment when one is set.
    pub fn seg_bytes(&self) -> u32 {
        let mtu = self.path_mtu.bytes();
        if (mtu..=MAX_IN_MEMORY_SEG).contains(&self.in_memory_seg) {
            self.in_memory_seg
        } else {
            mtu
        }
    }
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            state: QpState::Reset,
            access: Access::empty(),
            port: 1,
            pkey_index: 0,
            dest: None,
            path_mtu: Mtu::Mtu1024,
            dest_qpn: Qpn::new(0),
            rq_psn: Psn::new(0),
            sq_psn: Psn::new(0),
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_unacked: 128,
            in_memory_seg: 0,
        }
    }
}

/// Local ACK timeout in nanoseconds, or None for "wait forever".
pub fn ack_timeout_ns(code: u8) -> Option<u64> {
    if code == 0 {
        return None;
    }
    Some(4096u64 << code.min(31))
}

/// RNR NAK timer values in microseconds (IBA table 45).
pub fn rnr_timer_us(code: u8) -> u64 {
    const T: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    T[(code & 31) as usize]
}

pub(crate) struct SendWqe {
    pub wr: SendWr,
    pub len: u32,
    /// PSN of the first packet; valid once `started`.
    pub first_psn: Psn,
    /// Packets (or, for a READ, response packets) the WQE spans.
    pub npkts: u32,
    pub started: bool,
}

impl SendWqe {
    fn last_psn(&self) -> Psn {
        self.first_psn.add(self.npkts - 1)
    }
    fn contains(&self, psn: Psn) -> bool {
        self.started && !psn.before(self.first_psn) && !psn.after(self.last_psn())
    }
}

/// Requester progress: which WQE and packet goes out next, under which PSN.
#[derive(Default)]
pub(crate) struct ReqState {
    pub next: usize,
    pub pkt: u32,
    pub psn: Psn,
    /// One past the highest PSN ever sent; ACKs beyond it are ghosts.
    pub max_psn: Psn,
    pub since_ack_req: u32,
}

/// Completer state: the oldest unacknowledged PSN and the retry machinery.
///
/// Two deadlines run while requests are unacknowledged. `timer` is the adaptive retransmit
/// timer ([`rto::RttEstimator`]): when it expires the requester goes back to the oldest
/// unacknowledged PSN (go-back-N, as on the wire today). `ack_timeout_at` is the IBA local
/// ACK timeout, restarted by progress and by each retry spent: only an expiry at or past it
/// is a transport timeout that spends one of `retry_cnt` retries, so a QP still fails after
/// `retry_cnt` + 1 local ACK timeouts without progress, at the time the IBA says, however
/// often the adaptive timer resent in between.
#[derive(Default)]
pub(crate) struct CompState {
    pub psn: Psn,
    pub retry_left: u8,
    pub rnr_left: u8,
    /// The adaptive retransmit timer (never later than `ack_timeout_at`).
    pub timer: Option<Instant>,
    /// When the IBA local ACK timeout expires.
    pub ack_timeout_at: Option<Instant>,
    pub rnr_until: Option<Instant>,
    /// The PSN of the last rewind, so one loss is not retried once per late packet.
    pub rewound_at: Option<Psn>,
    pub rtt: rto::RttEstimator,
    /// The packet being timed for an RTT sample and when it left (Karn: only a packet sent
    /// once, and only until something is sent again).
    pub timed: Option<(Psn, Instant)>,
    /// When a tail-loss probe goes out if no ACK moves things forward before.
    pub probe_at: Option<Instant>,
    /// A probe is due: the requester resends its last packet with AckReq.
    pub probe_due: bool,
    /// A probe went out since the last progress (one per loss episode).
    pub probed: bool,
    /// The backoff lasts until this PSN (one past the last sent at the latest expiry) is
    /// reached, or an RTT sample is taken.
    pub backoff_until: Option<Psn>,
    /// A retransmit timer expired and no ACK has moved things forward since: only the
    /// oldest unacknowledged packet may be out. The go-back-N resend starts with that packet
    /// alone, asking for its ACK, and the rest follows once an ACK moves things forward (as
    /// F-RTO does for TCP, RFC 5682). If the timer fired early (the ACK was
    /// late, nothing was lost) the peer answers the duplicate with its latest ACK and
    /// nothing else is resent; if the packet was lost, the peer dropped everything after
    /// it, and the rest goes one round trip later. Without it, a timer that fires early, as
    /// a burst of large messages can make it, resends the whole window (128 packets) that
    /// the peer drops as duplicates, and the extra load makes the next ACK late too.
    pub lone_resend: bool,
}

pub(crate) enum RespMsg {
    Send {
        wqe: RecvWr,
        offset: u32,
    },
    Write {
        va: u64,
        rkey: MemKey,
        len: u32,
        offset: u32,
    },
}

#[derive(Clone, Copy)]
pub(crate) struct ReadCtx {
    pub va: u64,
    pub rkey: MemKey,
    pub len: u32,
    pub first_psn: Psn,
    pub npkts: u32,
    pub next: u32,
}

#[derive(Default)]
pub(crate) struct RespState {
    pub epsn: Psn,
    pub msn: u32,
    pub cur: Option<RespMsg>,
    /// A NAK was sent for the current gap; send no more until the expected PSN arrives.
    pub nak_sent: bool,
    pub ack: Option<Psn>,
    /// When the owed ACK leaves even alone. Before then it waits for the next request
    /// packets this QP sends to the peer and goes out right behind them, in the same batch:
    /// at queue depth 1 a command's ACK rides with its response and a response's ACK with
    /// the next command, instead of each costing the peer a wakeup of its own.
    pub ack_due: Option<Instant>,
    /// Request packets taken in since the last ACK left.
    pub ack_pkts: u32,
    /// Request packets of ours went out while the ACK was owed: it leaves right after them.
    pub ride: bool,
    pub nak: Option<(Psn, crate::hca::wire::AethSyndrome)>,
    pub reads: VecDeque<ReadCtx>,
    /// The last `max_dest_rd_atomic` READs executed (rxe's read resources): a duplicate
    /// READ is answered again only if it asks for a part of one of them, so a peer cannot
    /// make us queue or send more than it was given the first time.
    pub served: VecDeque<ReadCtx>,
}

impl RespState {
    /// Drop the owed ACK, if any, with its deadline, packet count and ride flag; return the
    /// PSN it would have acknowledged.
    pub fn forget_ack(&mut self) -> Option<Psn> {
        self.ack_due = None;
        self.ack_pkts = 0;
        self.ride = false;
        self.ack.take()
    }
}

/// Everything a QP may touch outside itself while handling an input.
pub(crate) struct Ctx<'a> {
    pub mrs: &'a mut MrTable,
    pub cqs: &'a mut FxHashMap<CqId, Cq>,
    pub stats: &'a mut Stats,
    pub events: &'a mut VecDeque<AsyncEvent>,
    pub local: SocketAddr,
    pub now: Instant,
    /// The device's ACK coalescing delay (zero: every ACK leaves at once).
    pub ack_delay: std::time::Duration,
    /// Leave the ICRC of outgoing packets zero: the port fills it in (see
    /// `Device::set_icrc_by_port`).
    pub icrc_by_port: bool,
}

impl Ctx<'_> {
    pub fn complete(&mut self, cq: CqId, wc: WorkCompletion) {
        if wc.status == WcStatus::WrFlushErr {
            self.stats.flushed += 1;
        }
        if let Some(q) = self.cqs.get_mut(&cq) {
            if !q.push(wc) {
                self.stats.cq_overflows += 1;
                self.events.push_back(AsyncEvent::CqError(cq));
            }
        }
    }
}

pub(crate) struct Qp {
    pub qpn: Qpn,
    pub pd: PdId,
    pub send_cq: CqId,
    pub recv_cq: CqId,
    pub caps: QpCaps,
    pub attr: QpAttr,
    pub sq: VecDeque<SendWqe>,
    pub rq: VecDeque<RecvWr>,
    pub req: ReqState,
    pub comp: CompState,
    pub resp: RespState,
    /// In the device's transmit schedule.
    pub scheduled: bool,
}

impl Qp {
    pub fn new(qpn: Qpn, pd: PdId, send_cq: CqId, recv_cq: CqId, caps: QpCaps) -> Qp {
        Qp {
            qpn,
            pd,
            send_cq,
            recv_cq,
            caps,
            attr: QpAttr::default(),
            sq: VecDeque::with_capacity(caps.max_send_wr as usize),
            rq: VecDeque::with_capacity(caps.max_recv_wr as usize),
            req: ReqState::default(),
            comp: CompState::default(),
            resp: RespState::default(),
            scheduled: false,
        }
    }

    /// Apply a modify that `state::check` accepted.
    pub fn apply(&mut self, ctx: &mut Ctx<'_>, attr: &QpAttr, mask: AttrMask) {
        let old = self.attr.state;
        let a = &mut self.attr;
        macro_rules! take {
            ($flag:ident, $field:ident) => {
                if mask.contains(AttrMask::$flag) {
                    a.$field = attr.$field;
                }
            };
        }
        take!(ACCESS_FLAGS, access);
        take!(PORT, port);
        take!(PKEY_INDEX, pkey_index);
        take!(AV, dest);
        take!(PATH_MTU, path_mtu);
        take!(DEST_QPN, dest_qpn);
        take!(MAX_QP_RD_ATOMIC, max_rd_atomic);
        take!(MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
        take!(MIN_RNR_TIMER, min_rnr_timer);
        take!(TIMEOUT, timeout);
        take!(RETRY_CNT, retry_cnt);
        take!(RNR_RETRY, rnr_retry);
        // Not an IBA attribute; carried along with the AV.
        if mask.contains(AttrMask::AV) {
            a.max_unacked = attr.max_unacked.max(1);
            a.in_memory_seg = attr.in_memory_seg;
        }
        if mask.contains(AttrMask::RQ_PSN) {
            a.rq_psn = attr.rq_psn;
            self.resp.epsn = attr.rq_psn;
        }
        if mask.contains(AttrMask::SQ_PSN) {
            a.sq_psn = attr.sq_psn;
            self.req.psn = attr.sq_psn;
            self.req.max_psn = attr.sq_psn;
            self.comp.psn = attr.sq_psn;
        }
        if mask.contains(AttrMask::RETRY_CNT) {
            self.comp.retry_left = a.retry_cnt.min(7);
        }
        if mask.contains(AttrMask::RNR_RETRY) {
            self.comp.rnr_left = a.rnr_retry.min(7);
        }
        if mask.contains(AttrMask::STATE) {
            let new = attr.state;
            self.attr.state = new;
            match new {
                QpState::Reset => self.reset(),
                QpState::Err if old != QpState::Err => self.flush_all(ctx),
                _ => {}
            }
        }
    }

    /// Back to RESET: all queues emptied without completions (IBA 10.3.1.1).
    fn reset(&mut self) {
        let (qpn, pd, scq, rcq, caps) = (self.qpn, self.pd, self.send_cq, self.recv_cq, self.caps);
        let scheduled = self.scheduled;
        *self = Qp::new(qpn, pd, scq, rcq, caps);
        self.scheduled = scheduled;
    }

    /// Complete every outstanding WQE with WR_FLUSH_ERR, whether or not it was signaled:
    /// error completions are always generated.
    pub fn flush_all(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(w) = self.sq.pop_front() {
            ctx.complete(
                self.send_cq,
                WorkCompletion {
                    wr_id: w.wr.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: w.wr.op.wc_opcode(),
                    qpn: self.qpn,
                    byte_len: 0,
                    imm: None,
                    invalidated: None,
                },
            );
        }
        if let Some(RespMsg::Send { wqe, .. }) = self.resp.cur.take() {
            self.rq.push_front(wqe);
        }
        while let Some(w) = self.rq.pop_front() {
            ctx.complete(
                self.recv_cq,
                WorkCompletion {
                    wr_id: w.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: WcOpcode::Recv,
                    qpn: self.qpn,
                    byte_len: 0,
                    imm: None,
                    invalidated: None,
                },
            );
        }
        self.req = ReqState::default();
        self.comp.stop_timers();
        self.comp.rnr_until = None;
        self.resp.reads.clear();
        self.resp.served.clear();
        self.resp.forget_ack();
    }

    /// Move to ERR after a failed WQE or a fatal responder error.
    pub fn enter_error(&mut self, ctx: &mut Ctx<'_>) {
        if self.attr.state != QpState::Err {
            self.attr.state = QpState::Err;
            self.flush_all(ctx);
        }
    }

    pub fn post_send(&mut self, ctx: &mut Ctx<'_>, wr: SendWr) {
        let len = wr.sgl.total_len() as u32;
        self.sq.push_back(SendWqe {
            wr,
            len,
            first_psn: Psn::new(0),
            npkts: 0,
            started: false,
        });
        if self.attr.state == QpState::Err {
            self.flush_all(ctx);
        }
    }

    pub fn post_recv(&mut self, ctx: &mut Ctx<'_>, wr: RecvWr) {
        self.rq.push_back(wr);
        if self.attr.state == QpState::Err {
            self.flush_all(ctx);
        }
    }

    /// Earliest instant at which `handle_timeout` has work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.comp.timer,
            self.comp.probe_at,
            self.comp.rnr_until,
            self.ack_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// True if `poll_transmit` would produce a packet now.
    pub fn wants_transmit(&self, now: Instant) -> bool {
        self.responder_wants_transmit(now)
            || self.requester_can_send(now)
            || self.probe_can_send(now)
    }

    fn icrc_ctx(&self, local: SocketAddr) -> Option<crate::hca::wire::IcrcContext> {
        self.attr
            .dest
            .map(|d| crate::hca::wire::IcrcContext::new(local, d))
    }

    /// Produce one packet into `out`, returning where it goes.
    pub fn poll_transmit(&mut self, ctx: &mut Ctx<'_>, out: &mut Vec<u8>) -> Option<SocketAddr> {
        let dest = self.attr.dest?;
        let icrc = self.icrc_ctx(ctx.local)?;
        let icrc = (!ctx.icrc_by_port).then_some(&icrc);
        let start = out.len();
        let sent = if self.responder_poll(ctx, icrc, out) {
            true
        } else if self.probe_poll(ctx, icrc, out) || self.requester_poll(ctx, icrc, out) {
            self.resp.ride |= self.resp.ack.is_some();
            true
        } else {
            self.responder_ack(ctx, icrc, out)
        };
        if sent {
            ctx.stats.tx_packets += 1;
            ctx.stats.tx_bytes += (out.len() - start) as u64;
            return Some(dest);
        }
        None
    }

    pub fn handle_timeout(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now;
        if self.comp.rnr_until.is_some_and(|t| t <= now) {
            self.comp.rnr_until = None;
        }
        if self.comp.probe_at.is_some_and(|t| t <= now) {
            self.comp.probe_at = None;
            if self.outstanding() && !self.comp.probed {
                self.comp.probed = true;
                self.comp.probe_due = true;
            }
        }
        if self.comp.timer.is_some_and(|t| t <= now) {
            self.comp.timer = None;
            if self.outstanding() {
                self.comp.rtt.back_off();
                self.comp.backoff_until = Some(self.req.max_psn);
                if self.comp.ack_timeout_at.is_none_or(|t| t <= now) {
                    // The IBA local ACK timeout: spend a retry.
                    ctx.stats.timeouts += 1;
                    self.retry(ctx, self.comp.psn);
                } else {
                    // The adaptive timer, early: resend, spend nothing.
                    ctx.stats.rto_timeouts += 1;
                    self.rewind(ctx, self.comp.psn);
                    self.arm_rto(ctx);
                }
                self.comp.lone_resend = true;
            }
        }
    }

    /// Any sent-but-unacknowledged work?
    fn outstanding(&self) -> bool {
        self.sq.front().is_some_and(|w| w.started)
    }

    /// Start a fresh wait for an ACK: the local ACK timeout from now, and the adaptive timer
    /// and the tail-loss probe under it. A timeout attribute of 0 waits forever: no timer.
    fn arm_timer(&mut self, ctx: &mut Ctx<'_>) {
        self.comp.ack_timeout_at =
            ack_timeout_ns(self.attr.timeout).map(|ns| ctx.now + Duration::from_nanos(ns));
        self.arm_rto(ctx);
        self.arm_probe(ctx);
    }

    /// (Re)arm the adaptive retransmit timer from now, never past the local ACK timeout.
    fn arm_rto(&mut self, ctx: &mut Ctx<'_>) {
        let (Some(max), Some(limit)) =
            (ack_timeout_ns(self.attr.timeout), self.comp.ack_timeout_at)
        else {
            self.comp.timer = None;
            return;
        };
        // An RDMA READ owed data is timed the same way: every response packet that brings
        // data is progress and re-arms the timer, so a long READ streaming in is not taken
        // for lost. (It once kept the IBA timer here: READs resent early left the peer's
        // responder answers to duplicates queued that it then counted against new READs,
        // NAKing one as invalid and failing the QP; `exec_read` drops those now.)
        let rto = self.comp.rtt.rto(max);
        ctx.stats.rto_ns = rto;
        self.comp.timer = Some((ctx.now + Duration::from_nanos(rto)).min(limit));
    }

    /// Arm the tail-loss probe 2·SRTT (plus the peer's ACK delay) from now, if one is still
    /// allowed in this episode and it would go out before the retransmit timer.
    fn arm_probe(&mut self, ctx: &Ctx<'_>) {
        self.comp.probe_at = None;
        if self.comp.probed || self.read_limit().is_some() {
            return;
        }
        let ack_delay = u64::try_from(ctx.ack_delay.as_nanos()).unwrap_or(u64::MAX);
        if let (Some(pto), Some(timer)) = (self.comp.rtt.pto(ack_delay), self.comp.timer) {
            let at = ctx.now + Duration::from_nanos(pto);
            if at < timer {
                self.comp.probe_at = Some(at);
            }
        }
    }
}

impl CompState {
    /// Nothing is waited for any more (flush, RNR wait): every deadline off.
    fn stop_timers(&mut self) {
        self.timer = None;
        self.ack_timeout_at = None;
        self.probe_at = None;
        self.probe_due = false;
        self.timed = None;
    }
}

//! The CM endpoint: one per device, many connections keyed by local communication ID, both
//! the active (connect) and the passive (listen / accept) side, and teardown.
//!
//! quinn-style and sans-I/O. Inputs: [`CmEndpoint::handle_mad`] and
//! [`CmEndpoint::handle_timeout`], each with `now`. Commands: `listen`, `connect`, `accept`,
//! `reject`, `disconnect`, `abort`, `notify_comm_est`. Outputs, drained after every input:
//! [`CmEndpoint::poll_transmit`] (256-byte MADs with their destination),
//! [`CmEndpoint::poll_timeout`] (when to call `handle_timeout` next) and
//! [`CmEndpoint::poll_event`].
//!
//! Every state change goes through the table in [`super::state`]; the handlers here do what
//! the row says (send, arm a timer, report an event). Local communication IDs, transaction
//! IDs, starting PSNs and ephemeral ports come from the RNG handed in at construction: one
//! keyed by the OS CSPRNG on a real network (a peer that sees some IDs and PSNs must not be
//! able to predict the next: they are what keeps others from speaking for a connection),
//! a seeded one in tests and fuzzing, so a run replays exactly.
//!
//! Timers use the IBA encoding, 4.096 µs × 2^n ([`iba_time`]), where Linux rounds to
//! milliseconds (cm.c `cm_convert_to_ms`). What each timer covers follows cm.c:
//! - REQ: 2 × packet lifetime + the remote CM response timeout we advertise, retried
//!   `max_cm_retries` times (`ib_send_cm_req`);
//! - REP: the REQ's local CM response timeout, retried the REQ's max CM retries times
//!   (`cm_req_handler`); DREQ: the same per-connection timeout as the handshake;
//! - after an MRA: its service timeout + the path's ACK timeout (`cm_mra_handler`), for this
//!   and the remaining retries;
//! - TimeWait: the connection's ACK timeout (`cm_enter_timewait`, `av.timeout`).
//!
//! Malformed MADs, MADs for no connection and MADs the state does not expect are dropped and
//! counted in [`CmStats`]; nothing a peer sends can make this code panic.

mod inbound;
mod index;

use super::api::{
    ack_timeout, iba_time, AcceptParams, CmConfig, CmError, CmEvent, CmStats, ConnId,
    ConnectParams, ConnectRequest, Established, Rejected, MAX_MRA_TIMEOUT_EXP,
    MAX_PEER_TIMEOUT_EXP, MAX_TIMEWAIT_EXP,
};
use super::fill_private;
use super::mad::{MsgRef, RejectReason, TransportType, MAD_LEN};
use super::messages::{
    CmMad, CmMessage, DrepRepr, DreqRepr, MraRepr, RejRepr, RepRepr, ReqRepr, RtuRepr,
};
use super::private::{
    build_req_private, gid_from_ip, service_id, split_req_private, CmaHdrRepr, NvmeCmAccept,
    NvmeCmReject, NvmeCmRequest, REQ_ULP_LEN,
};
use super::state::{lookup, ConnState, Input};
use crate::verbs::Mtu;
use crate::verbs::{Guid, Instant, Psn, Qpn};
use rand::rngs::{SmallRng, StdRng};
use rand::{Rng, RngCore, SeedableRng};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// One connection's record.
#[derive(Debug, Clone)]
struct Conn {
    state: ConnState,
    /// Created by a REQ (we listen) rather than by `connect`.
    passive: bool,
    peer: SocketAddr,
    /// 0 until the peer's REQ or REP told us.
    remote_id: u32,
    remote_guid: Guid,
    /// Transaction ID of the handshake: the REQ's, echoed by REP / RTU / REJ / MRA.
    tid: u64,
    local_qpn: Qpn,
    /// Known from REQ (passive) or REP (active).
    remote_qpn: Option<Qpn>,
    local_psn: Psn,
    remote_psn: Psn,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    path_mtu: Mtu,
    target_ack_delay: u8,
    /// The path's ACK timeout exponent (Linux `av.timeout`): MRA waits and TimeWait use it.
    av_timeout: u8,
    /// One try of the handshake / DREQ.
    try_timeout: Duration,
    max_retries: u8,
    // The outstanding message and its timer (Linux `cm_id_priv->msg`).
    pending: Option<[u8; MAD_LEN]>,
    deadline: Option<Instant>,
    retries_left: u8,
    /// The last answer we sent that the peer may ask for again (RTU).
    last_reply: Option<[u8; MAD_LEN]>,
    /// What the endpoint's indexes hold for this connection (see `CmEndpoint::sync`).
    indexed: IndexKeys,
}

/// A connection as the endpoint's lookups find it: by the peer's comm ID (duplicate REQs,
/// timeout REJs), by the peer's QPN (stale connections) and by deadline (timers). Each is
/// (peer IP, peer CA GUID, value) and the local comm ID, so a lookup is a range, not a scan
/// of every connection (TimeWait ones included) per MAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct IndexKeys {
    remote: Option<PeerKey>,
    qpn: Option<PeerKey>,
    deadline: Option<Instant>,
}

type PeerKey = (IpAddr, u64, u32);

impl Conn {
    fn index_keys(&self) -> IndexKeys {
        let ip = self.peer.ip();
        IndexKeys {
            remote: Some((ip, self.remote_guid.0, self.remote_id)),
            qpn: self.remote_qpn.map(|q| (ip, self.remote_guid.0, q.get())),
            deadline: self.deadline,
        }
    }
}

/// Every entry of `set` under `k`, in local comm ID order.
fn peer_range(
    set: &BTreeSet<(IpAddr, u64, u32, u32)>,
    k: PeerKey,
) -> impl Iterator<Item = u32> + '_ {
    set.range((k.0, k.1, k.2, 0)..=(k.0, k.1, k.2, u32::MAX))
        .map(|e| e.3)
}

/// The CM of one device.
pub struct CmEndpoint {
    config: CmConfig,
    rng: Box<dyn RngCore + Send>,
    /// Upper half of the transaction IDs we originate (Linux: the MAD agent's `hi_tid`).
    tid_hi: u32,
    conns: BTreeMap<u32, Conn>,
    /// (peer IP, peer GUID, peer comm ID, local comm ID) of every connection.
    by_remote: BTreeSet<(IpAddr, u64, u32, u32)>,
    /// (peer IP, peer GUID, peer QPN, local comm ID) of connections whose peer QPN we know.
    by_qpn: BTreeSet<(IpAddr, u64, u32, u32)>,
    /// (deadline, local comm ID) of every armed timer.
    timers: BTreeSet<(Instant, u32)>,
    listening: BTreeSet<u64>,
    transmits: VecDeque<(SocketAddr, [u8; MAD_LEN])>,
    events: VecDeque<CmEvent>,
    stats: CmStats,
}

impl fmt::Debug for CmEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEndpoint")
            .field("config", &self.config)
            .field("connections", &self.conns.len())
            .field("listening", &self.listening)
            .field("stats", &self.stats)
            .finish()
    }
}

impl CmEndpoint {
    /// `rng` is the only source of randomness; seed it to replay a run, key it from the OS
    /// ([`from_os_rng`](Self::from_os_rng)) on a real network.
    pub fn new(config: CmConfig, mut rng: impl RngCore + Send + 'static) -> CmEndpoint {
        let tid_hi = rng.random();
        CmEndpoint {
            config,
            rng: Box::new(rng),
            tid_hi,
            conns: BTreeMap::new(),
            by_remote: BTreeSet::new(),
            by_qpn: BTreeSet::new(),
            timers: BTreeSet::new(),
            listening: BTreeSet::new(),
            // Sized for a burst (one MAD per connection of a host that went away), so a
            // long-lived endpoint's footprint does not depend on its history.
            transmits: VecDeque::with_capacity(32),
            events: VecDeque::with_capacity(32),
            stats: CmStats::default(),
        }
    }

    /// [`new`](Self::new) with `SmallRng::seed_from_u64(seed)`: for tests and fuzzing only,
    /// its IDs and PSNs are as guessable as the seed.
    pub fn from_seed(config: CmConfig, seed: u64) -> CmEndpoint {
        CmEndpoint::new(config, SmallRng::seed_from_u64(seed))
    }

    /// [`new`](Self::new) with a CSPRNG (ChaCha12) keyed by the OS: what a CM on a real
    /// network uses (panics only if the OS has no entropy source at all, at start-up).
    pub fn from_os_rng(config: CmConfig) -> CmEndpoint {
        CmEndpoint::new(config, StdRng::from_os_rng())
    }

    pub fn config(&self) -> &CmConfig {
        &self.config
    }
    pub fn stats(&self) -> &CmStats {
        &self.stats
    }
    /// The state of a connection; `None` once it is forgotten.
    pub fn state(&self, id: ConnId) -> Option<ConnState> {
        self.conns.get(&id.0).map(|c| c.state)
    }
    /// The PSN we send with on `id`: from the REQ on the passive side, from the REP on the
    /// active side (0 before it).
    pub fn local_psn(&self, id: ConnId) -> Option<Psn> {
        self.conns.get(&id.0).map(|c| c.local_psn)
    }
    /// Connections in the table, TimeWait included.
    /// Connections whose DREQ is not answered yet (neither DREP nor its retries ran out).
    pub fn disconnecting(&self) -> usize {
        self.conns
            .values()
            .filter(|c| c.state == ConnState::DreqSent)
            .count()
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Answer REQs for `service_id` (see [`service_id`](super::private::service_id)).
    /// Returns false if already listening.
    pub fn listen(&mut self, service_id: u64) -> bool {
        self.listening.insert(service_id)
    }
    /// Stop answering REQs for `service_id`; connections already made are unaffected.
    pub fn unlisten(&mut self, service_id: u64) -> bool {
        self.listening.remove(&service_id)
    }

    // --- outputs --------------------------------------------------------------------------------

    /// The next MAD to send and where to (the peer's CM address: its IP, UDP port 4791).
    pub fn poll_transmit(&mut self) -> Option<(SocketAddr, [u8; MAD_LEN])> {
        self.transmits.pop_front()
    }
    /// When [`handle_timeout`](Self::handle_timeout) must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        // Every driver asks after each input and command: the place to check, in debug
        // builds, that no change to a connection bypassed `sync`.
        debug_assert!(self.indexes_consistent(), "CM indexes out of step");
        self.timers.first().map(|&(t, _)| t)
    }
    pub fn poll_event(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }

    // --- commands -------------------------------------------------------------------------------

    /// Start connecting to the CM at `peer` (its IP, port 4791): send a REQ for the TCP-space
    /// service `params.service_port` carrying the rdma_cm IP header and `ulp_private` (at most
    /// 56 bytes; NVMe-oF: [`NvmeCmRequest::emit`]). Answers arrive as events.
    pub fn connect(
        &mut self,
        now: Instant,
        peer: SocketAddr,
        params: &ConnectParams,
        ulp_private: &[u8],
    ) -> Result<ConnId, CmError> {
        check_len(ulp_private, REQ_ULP_LEN)?;
        let local_id = self.alloc_id();
        // Our receive PSN: the REQ carries it (see `ConnectRequest::local_psn`); the REP
        // will say what we send with.
        let recv_psn = Psn::new(self.rng.random());
        let src_port = if params.src_port == 0 {
            self.rng.random_range(32768..61000)
        } else {
            params.src_port
        };
        let cma = CmaHdrRepr::new(SocketAddr::new(self.config.local_ip, src_port), peer.ip());
        let lat = ack_timeout(self.config.ack_delay, self.config.packet_lifetime);
        let req = ReqRepr {
            local_comm_id: local_id,
            service_id: service_id(params.service_port),
            local_ca_guid: self.config.ca_guid,
            local_qkey: 0,
            local_qpn: params.local_qpn,
            responder_resources: params.responder_resources,
            initiator_depth: params.initiator_depth,
            remote_cm_response_timeout: self.config.cm_response_timeout,
            transport: TransportType::Rc,
            flow_control: params.flow_control,
            starting_psn: recv_psn,
            local_cm_response_timeout: self.config.cm_response_timeout,
            retry_count: params.retry_count.min(7),
            pkey: self.config.pkey,
            path_mtu: params.path_mtu,
            rnr_retry_count: params.rnr_retry_count.min(7),
            max_cm_retries: self.config.max_cm_retries.min(15),
            srq: false,
            primary_local_lid: 0xFFFF,
            primary_remote_lid: 0xFFFF,
            primary_local_gid: gid_from_ip(self.config.local_ip),
            primary_remote_gid: gid_from_ip(peer.ip()),
            flow_label: 0,
            packet_rate: 0,
            traffic_class: params.traffic_class,
            hop_limit: params.hop_limit,
            sl: 0,
            subnet_local: params.hop_limit <= 1,
            local_ack_timeout: lat,
            private_data: build_req_private(&cma, ulp_private),
        };
        let tid = self.form_tid(local_id);
        let mut conn = Conn {
            state: ConnState::Idle,
            passive: false,
            peer,
            remote_id: 0,
            remote_guid: Guid(0),
            tid,
            local_qpn: params.local_qpn,
            remote_qpn: None,
            local_psn: Psn::new(0),
            remote_psn: recv_psn,
            responder_resources: params.responder_resources,
            initiator_depth: params.initiator_depth,
            retry_count: params.retry_count.min(7),
            rnr_retry_count: params.rnr_retry_count.min(7),
            path_mtu: params.path_mtu,
            target_ack_delay: 0,
            // cm.c cm_init_av_by_path: av.timeout = packet lifetime + 1 until the REP's
            // target ACK delay refines it.
            av_timeout: self.config.packet_lifetime.saturating_add(1).min(31),
            try_timeout: self.config.req_timeout(),
            max_retries: self.config.max_cm_retries.min(15),
            pending: None,
            deadline: None,
            retries_left: 0,
            last_reply: None,
            indexed: IndexKeys::default(),
        };
        let mad = CmMad {
            transaction_id: tid,
            message: CmMessage::Req(req),
        }
        .emit();
        arm(&mut conn, now, mad);
        self.send(peer, mad);
        self.insert_conn(local_id, conn);
        self.apply(local_id, Input::Connect);
        Ok(ConnId(local_id))
    }

    /// Accept a [`CmEvent::ConnectRequest`]: send a REP with `private` (at most 196 bytes;
    /// NVMe-oF: [`NvmeCmAccept::emit`]) and wait for the RTU.
    pub fn accept(
        &mut self,
        now: Instant,
        id: ConnId,
        params: &AcceptParams,
        private: &[u8],
    ) -> Result<(), CmError> {
        check_len(private, RepRepr::PRIVATE_LEN)?;
        self.check(id, Input::Accept, "accept")?;
        let mut pd = [0u8; RepRepr::PRIVATE_LEN];
        fill_private(&mut pd, private);
        let config = self.config;
        let Some(conn) = self.conns.get_mut(&id.0) else {
            return Err(CmError::UnknownConnection(id));
        };
        conn.local_qpn = params.local_qpn;
        // The REP carries our receive PSN (the peer's send PSN).
        let starting_psn = params.starting_psn.unwrap_or(conn.remote_psn);
        conn.remote_psn = starting_psn;
        conn.responder_resources = params.responder_resources;
        conn.initiator_depth = params.initiator_depth;
        let rep = RepRepr {
            local_comm_id: id.0,
            remote_comm_id: conn.remote_id,
            local_qkey: 0,
            local_qpn: params.local_qpn,
            starting_psn,
            responder_resources: params.responder_resources,
            initiator_depth: params.initiator_depth,
            target_ack_delay: config.ack_delay.min(31),
            failover: 0,
            flow_control: params.flow_control,
            rnr_retry_count: params.rnr_retry_count.min(7),
            srq: false,
            local_ca_guid: config.ca_guid,
            private_data: pd,
        };
        let mad = CmMad {
            transaction_id: conn.tid,
            message: CmMessage::Rep(rep),
        }
        .emit();
        arm(conn, now, mad);
        let peer = conn.peer;
        self.sync(id.0);
        self.send(peer, mad);
        self.apply(id.0, Input::Accept);
        Ok(())
    }

    /// Refuse a [`CmEvent::ConnectRequest`] with `reason` and `private` (at most 148 bytes;
    /// NVMe-oF: reason [`RejectReason::CONSUMER_DEFINED`] and [`NvmeCmReject::emit`]).
    pub fn reject(
        &mut self,
        id: ConnId,
        reason: RejectReason,
        private: &[u8],
    ) -> Result<(), CmError> {
        check_len(private, RejRepr::PRIVATE_LEN)?;
        self.check(id, Input::Reject, "reject")?;
        let Some(conn) = self.conns.get(&id.0) else {
            return Err(CmError::UnknownConnection(id));
        };
        // cm_format_rej in REQ_RCVD: local comm ID 0, message REQ.
        let mad = rej_mad(
            conn.tid,
            0,
            conn.remote_id,
            MsgRef::Req,
            reason,
            &[],
            private,
        );
        let peer = conn.peer;
        self.send(peer, mad);
        self.apply(id.0, Input::Reject);
        Ok(())
    }

    /// Tear an established connection down: send a DREQ with `private` (at most 220 bytes),
    /// retried like the handshake; `Disconnected` follows on DREP or when retries run out.
    pub fn disconnect(&mut self, now: Instant, id: ConnId, private: &[u8]) -> Result<(), CmError> {
        check_len(private, DreqRepr::PRIVATE_LEN)?;
        self.check(id, Input::Disconnect, "disconnect")?;
        self.start_dreq(now, id.0, private);
        Ok(())
    }

    /// Drop a connection in whatever state, telling the peer the way Linux `ib_destroy_cm_id`
    /// does (REJ before establishment, one DREQ after), and forget it at once: no more events
    /// for `id`. For the recovery path, where every resource goes regardless of state.
    pub fn abort(&mut self, id: ConnId) -> Result<(), CmError> {
        self.check(id, Input::Abort, "abort")?;
        let Some(conn) = self.conns.get(&id.0) else {
            return Err(CmError::UnknownConnection(id));
        };
        let mad = match conn.state {
            ConnState::ReqSent | ConnState::MraReqRcvd => Some(rej_mad(
                conn.tid,
                id.0,
                conn.remote_id,
                MsgRef::Other,
                RejectReason::TIMEOUT,
                &self.config.ca_guid.to_bytes(),
                &[],
            )),
            ConnState::ReqRcvd => Some(rej_mad(
                conn.tid,
                0,
                conn.remote_id,
                MsgRef::Req,
                RejectReason::CONSUMER_DEFINED,
                &[],
                &[],
            )),
            ConnState::RepSent | ConnState::MraRepRcvd => Some(rej_mad(
                conn.tid,
                id.0,
                conn.remote_id,
                MsgRef::Other,
                RejectReason::CONSUMER_DEFINED,
                &[],
                &[],
            )),
            ConnState::Established => Some(self.dreq_mad(id.0, conn, &[])),
            _ => None,
        };
        let peer = conn.peer;
        if let Some(m) = mad {
            self.send(peer, m);
        }
        self.apply(id.0, Input::Abort);
        Ok(())
    }

    /// The owner's QP received from the peer while we wait for the RTU, which proves the
    /// peer is established (Linux `ib_cm_notify(IB_EVENT_COMM_EST)`).
    pub fn notify_comm_est(&mut self, id: ConnId) -> Result<(), CmError> {
        self.check(id, Input::CommEst, "notify_comm_est")?;
        self.establish_passive(id.0, Vec::new());
        Ok(())
    }

    // --- inputs ---------------------------------------------------------------------------------

    /// A MAD arrived from `from`, the peer's CM address as replies should go to it (the
    /// driver passes the sender's IP with UDP port 4791: RoCEv2 always targets 4791,
    /// anchors §7.4). `data` must be the 256 MAD bytes, BTH and DETH already stripped.
    pub fn handle_mad(&mut self, now: Instant, from: SocketAddr, data: &[u8]) {
        self.stats.rx_mads += 1;
        let mad = match CmMad::parse(data) {
            Ok(m) => m,
            Err(_) => {
                self.stats.rx_malformed += 1;
                return;
            }
        };
        let tid = mad.transaction_id;
        match mad.message {
            CmMessage::Req(r) => self.on_req(now, from, tid, &r),
            CmMessage::Mra(m) => self.on_mra(now, from, &m),
            CmMessage::Rej(r) => self.on_rej(now, from, &r),
            CmMessage::Rep(r) => self.on_rep(from, &r),
            CmMessage::Rtu(r) => self.on_rtu(from, &r),
            CmMessage::Dreq(d) => self.on_dreq(now, from, tid, &d),
            CmMessage::Drep(d) => self.on_drep(now, from, &d),
        }
    }

    /// Fire every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<u32> = self
            .timers
            .range(..=(now, u32::MAX))
            .map(|&(_, k)| k)
            .collect();
        for key in due {
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            if conn.state == ConnState::TimeWait {
                conn.deadline = None;
                self.sync(key);
                self.apply(key, Input::TimewaitExpired);
                self.events
                    .push_back(CmEvent::TimewaitExit { id: ConnId(key) });
            } else if conn.retries_left > 0 && conn.pending.is_some() {
                conn.retries_left -= 1;
                conn.deadline = Some(now + conn.try_timeout);
                let (peer, mad) = (conn.peer, conn.pending);
                self.sync(key);
                if self.apply(key, Input::Retransmit).is_some() {
                    if let Some(m) = mad {
                        self.stats.retransmits += 1;
                        self.send(peer, m);
                    }
                }
            } else {
                conn.deadline = None;
                conn.pending = None;
                let from = conn.state;
                self.sync(key);
                self.stats.timeouts += 1;
                if let Some(to) = self.apply(key, Input::RetriesExhausted) {
                    let id = ConnId(key);
                    match (from, to) {
                        (ConnState::DreqSent, ConnState::TimeWait) => {
                            self.enter_timewait(now, key);
                            self.events.push_back(CmEvent::Disconnected { id });
                        }
                        _ => self.events.push_back(CmEvent::Unreachable { id }),
                    }
                }
            }
        }
    }

    // --- helpers --------------------------------------------------------------------------------

    /// Move `key` along the table. `None` (and nothing changes) if the state has no row for
    /// `on`; a move to Idle forgets the connection.
    fn apply(&mut self, key: u32, on: Input) -> Option<ConnState> {
        let conn = self.conns.get_mut(&key)?;
        let t = lookup(conn.state, on)?;
        if t.to == ConnState::Idle {
            self.remove_conn(key);
        } else {
            conn.state = t.to;
        }
        Some(t.to)
    }

    /// [`apply`](Self::apply), counting a refused input as unexpected.
    fn apply_checked(&mut self, key: u32, on: Input) -> Option<ConnState> {
        let r = self.apply(key, on);
        if r.is_none() {
            self.stats.rx_unexpected += 1;
        }
        r
    }

    /// Is `on` legal for `id` now?
    fn check(&self, id: ConnId, on: Input, op: &'static str) -> Result<(), CmError> {
        let conn = self
            .conns
            .get(&id.0)
            .ok_or(CmError::UnknownConnection(id))?;
        match lookup(conn.state, on) {
            Some(_) => Ok(()),
            None => Err(CmError::InvalidState {
                id,
                state: conn.state,
                op,
            }),
        }
    }

    /// The connection a message names by our comm ID (`ours`) and the peer's (`theirs`), from
    /// the peer's address; counts a miss.
    fn matched(&mut self, from: SocketAddr, ours: u32, theirs: u32) -> Option<u32> {
        let r = self.matched_quiet(from, ours, theirs);
        if r.is_none() {
            self.stats.rx_unmatched += 1;
        }
        r
    }

    fn matched_quiet(&self, from: SocketAddr, ours: u32, theirs: u32) -> Option<u32> {
        let c = self.conns.get(&ours)?;
        (c.remote_id == theirs && c.remote_id != 0 && c.peer.ip() == from.ip()).then_some(ours)
    }

    fn report_passive_established(&mut self, key: u32, private_data: Vec<u8>) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        conn.pending = None;
        conn.deadline = None;
        let ev = Established {
            id: ConnId(key),
            remote_id: ConnId(conn.remote_id),
            peer: conn.peer,
            remote_ca_guid: conn.remote_guid,
            remote_qpn: conn.remote_qpn.unwrap_or_default(),
            remote_psn: conn.remote_psn,
            local_psn: conn.local_psn,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            retry_count: conn.retry_count,
            rnr_retry_count: conn.rnr_retry_count,
            path_mtu: conn.path_mtu,
            target_ack_delay: conn.target_ack_delay,
            ack_timeout: conn.av_timeout,
            accept: None,
            private_data,
        };
        self.sync(key);
        self.events.push_back(CmEvent::Established(ev));
    }

    fn establish_passive(&mut self, key: u32, private_data: Vec<u8>) {
        if self.apply(key, Input::CommEst).is_some() {
            self.report_passive_established(key, private_data);
        }
    }

    /// Send a DREQ on an established connection and wait for the DREP.
    fn start_dreq(&mut self, now: Instant, key: u32, private: &[u8]) {
        let Some(conn) = self.conns.get(&key) else {
            return;
        };
        let mad = self.dreq_mad(key, conn, private);
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        arm(conn, now, mad);
        let peer = conn.peer;
        self.sync(key);
        self.send(peer, mad);
        self.apply(key, Input::Disconnect);
    }

    fn dreq_mad(&self, key: u32, conn: &Conn, private: &[u8]) -> [u8; MAD_LEN] {
        let mut pd = [0u8; DreqRepr::PRIVATE_LEN];
        fill_private(&mut pd, private);
        CmMad {
            // cm_format_dreq: a fresh transaction, cm_form_tid.
            transaction_id: self.form_tid(key),
            message: CmMessage::Dreq(DreqRepr {
                local_comm_id: key,
                remote_comm_id: conn.remote_id,
                remote_qpn: conn.remote_qpn.unwrap_or_default(),
                private_data: pd,
            }),
        }
        .emit()
    }

    fn enter_timewait(&mut self, now: Instant, key: u32) {
        if let Some(c) = self.conns.get_mut(&key) {
            c.pending = None;
            c.deadline = Some(now + iba_time(c.av_timeout.min(MAX_TIMEWAIT_EXP)));
        }
        self.sync(key);
    }

    fn send(&mut self, to: SocketAddr, mad: [u8; MAD_LEN]) {
        self.stats.tx_mads += 1;
        self.transmits.push_back((to, mad));
    }

    /// A fresh nonzero comm ID not in use (TimeWait included). IDs are random, like Linux's
    /// (`cm_alloc_id_priv` XORs a random operand), so a restarted peer does not reuse one.
    fn alloc_id(&mut self) -> u32 {
        loop {
            let v: u32 = self.rng.random();
            if v != 0 && !self.conns.contains_key(&v) {
                return v;
            }
        }
    }

    /// cm.c `cm_form_tid`: the agent's high half, the comm ID as the low half.
    fn form_tid(&self, local_id: u32) -> u64 {
        ((self.tid_hi as u64) << 32) | local_id as u64
    }
}

/// Make `mad` the outstanding message of `conn`, first try now.
fn arm(conn: &mut Conn, now: Instant, mad: [u8; MAD_LEN]) {
    conn.pending = Some(mad);
    conn.retries_left = conn.max_retries;
    conn.deadline = Some(now + conn.try_timeout);
}

fn check_len(private: &[u8], max: usize) -> Result<(), CmError> {
    if private.len() > max {
        Err(CmError::PrivateDataTooLong {
            len: private.len(),
            max,
        })
    } else {
        Ok(())
    }
}

fn rej_mad(
    tid: u64,
    local: u32,
    remote: u32,
    msg: MsgRef,
    reason: RejectReason,
    ari: &[u8],
    private: &[u8],
) -> [u8; MAD_LEN] {
    let mut ari_bytes = [0u8; RejRepr::ARI_LEN];
    fill_private(&mut ari_bytes, ari);
    let mut pd = [0u8; RejRepr::PRIVATE_LEN];
    fill_private(&mut pd, private);
    CmMad {
        transaction_id: tid,
        message: CmMessage::Rej(RejRepr {
            local_comm_id: local,
            remote_comm_id: remote,
            message_rejected: msg,
            ari_length: ari.len().min(RejRepr::ARI_LEN) as u8,
            reason,
            ari_bytes,
            private_data: pd,
        }),
    }
    .emit()
}

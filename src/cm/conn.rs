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

use super::fill_private;
use super::mad::{
    CmMad, CmMessage, DrepRepr, DreqRepr, MraRepr, MsgRef, RejRepr, RejectReason, RepRepr, ReqRepr,
    RtuRepr, TransportType, MAD_LEN,
};
use super::private::{
    build_req_private, gid_from_ip, service_id, split_req_private, CmaHdrRepr, NvmeCmAccept,
    NvmeCmReject, NvmeCmRequest, NvmeRejectStatus, PrivateError, REQ_ULP_LEN,
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

/// 4.096 µs × 2^`exp`, the IBA encoding of every CM and transport timeout (IBA §12.7.34,
/// §9.7.6.1.3). `exp` is a 5-bit field; larger values are clamped to 31.
pub fn iba_time(exp: u8) -> Duration {
    Duration::from_nanos(4096u64 << exp.min(31))
}

/// The longest a REP retry waits for the RTU here: 4.096 µs × 2^21 ≈ 8.6 s, whatever local
/// CM response timeout the REQ gives. The field carries up to 2^31 (≈ 2.4 h) and Linux
/// cm.c takes it as given, so one datagram could hold a connection record here for hours
/// (times 16 tries); Linux peers ask for 2^18..2^20.
pub const MAX_PEER_TIMEOUT_EXP: u8 = 21;

/// The longest service timeout an MRA may buy: 4.096 µs × 2^24 ≈ 69 s, what Linux rdma_cm
/// itself sends (cma.c `CMA_CM_MRA_SETTING`), plus the path's ACK timeout under the same cap.
pub const MAX_MRA_TIMEOUT_EXP: u8 = 24;

/// TimeWait lasts the connection's ACK timeout (cm.c `cm_enter_timewait`), which comes from
/// the peer's REQ or REP, but at most 4.096 µs × 2^20 ≈ 4.3 s. It only keeps a comm ID and
/// QPN from being reused while stray packets may still arrive; a few seconds cover that.
pub const MAX_TIMEWAIT_EXP: u8 = 20;

/// The local ACK timeout exponent that covers the peer's ACK delay plus a round trip
/// (IBA: 4.096 µs × 2^t ≥ ACK delay + 2 × packet lifetime). Take the larger of `ca_ack_delay`
/// and `packet_life_time + 1` (twice the lifetime) and go one step up when the other is
/// within a factor of two of it, so the sum is covered; as cm.c `cm_ack_timeout`.
pub fn ack_timeout(ca_ack_delay: u8, packet_life_time: u8) -> u8 {
    let twice_life = packet_life_time.saturating_add(1);
    let t = if twice_life >= ca_ack_delay {
        twice_life + (ca_ack_delay >= twice_life - 1) as u8
    } else {
        ca_ack_delay + (twice_life >= ca_ack_delay - 1) as u8
    };
    t.min(31)
}

/// A connection's handle: its local communication ID (never 0, unique in the endpoint while
/// the connection exists, TimeWait included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u32);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#010x}", self.0)
    }
}

/// Endpoint-wide settings. The defaults are Linux's rdma_cm over RoCE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmConfig {
    /// This device's IP address: source of the rdma_cm header and of the local GID.
    pub local_ip: IpAddr,
    /// This device's node GUID, sent as local CA GUID.
    pub ca_guid: Guid,
    /// CM response timeout exponent, both the one we expect of the peer and the one we
    /// promise (cma.c `CMA_CM_RESPONSE_TIMEOUT` = 20, ≈ 4.3 s; newer kernels 18).
    pub cm_response_timeout: u8,
    /// REQ / DREQ retries after the first send (cma.c `CMA_MAX_CM_RETRIES` = 15; 4 bits).
    pub max_cm_retries: u8,
    /// Path packet lifetime exponent (cma.c `CMA_IBOE_PACKET_LIFETIME`: 18, 16 in newer
    /// kernels).
    pub packet_lifetime: u8,
    /// Our HCA's ACK delay exponent, sent in REP as target ACK delay and folded into our local
    /// ACK timeout (rxe: `RXE_LOCAL_CA_ACK_DELAY` = 15).
    pub ack_delay: u8,
    /// Partition key (default partition, full member).
    pub pkey: u16,
}

impl CmConfig {
    pub fn new(local_ip: IpAddr, ca_guid: Guid) -> CmConfig {
        CmConfig {
            local_ip,
            ca_guid,
            cm_response_timeout: 20,
            max_cm_retries: 15,
            packet_lifetime: 16,
            ack_delay: 15,
            pkey: 0xFFFF,
        }
    }
    /// One REQ try: 2 × packet lifetime + the peer's response time (cm.c `ib_send_cm_req`).
    fn req_timeout(&self) -> Duration {
        iba_time(self.packet_lifetime) * 2 + iba_time(self.cm_response_timeout)
    }
}

/// What the active side asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectParams {
    /// Our RC QP.
    pub local_qpn: Qpn,
    /// The TCP-space port the peer listens on (NVMe-oF: 4420); gives the service ID.
    pub service_port: u16,
    /// Our rdma_cm source port for the IP header; 0 picks an ephemeral one (32768..61000, the
    /// Linux `ip_local_port_range` default) from the endpoint RNG.
    pub src_port: u16,
    /// Incoming RDMA reads/atomics we accept (Linux: the device's `max_qp_rd_atom`).
    pub responder_resources: u8,
    /// Outgoing RDMA reads/atomics we want in flight.
    pub initiator_depth: u8,
    pub path_mtu: Mtu,
    /// Transport retries (3 bits; nvme-rdma: 7).
    pub retry_count: u8,
    /// RNR retries (3 bits; nvme-rdma: 7 = infinite).
    pub rnr_retry_count: u8,
    /// End-to-end flow control (nvme-rdma: on).
    pub flow_control: bool,
    pub traffic_class: u8,
    /// More than 1 marks the path routed: permissive LIDs, subnet-local clear (cm.c
    /// `cm_format_req`).
    pub hop_limit: u8,
}

impl ConnectParams {
    /// The parameters Linux nvme-rdma uses (`nvme_rdma_route_resolved`), MTU 1024 (a 1500-byte
    /// Ethernet), hop limit 64.
    pub fn new(local_qpn: Qpn, service_port: u16) -> ConnectParams {
        ConnectParams {
            local_qpn,
            service_port,
            src_port: 0,
            responder_resources: 16,
            initiator_depth: 16,
            path_mtu: Mtu::Mtu1024,
            retry_count: 7,
            rnr_retry_count: 7,
            flow_control: true,
            traffic_class: 0,
            hop_limit: 64,
        }
    }
}

/// What the passive side answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptParams {
    pub local_qpn: Qpn,
    /// The PSN the peer is to start sending with (our receive PSN), which the REP carries;
    /// `None`: the one the CM drew at the REQ ([`ConnectRequest::remote_psn`]).
    pub starting_psn: Option<Psn>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub rnr_retry_count: u8,
    pub flow_control: bool,
}

impl AcceptParams {
    pub fn new(local_qpn: Qpn) -> AcceptParams {
        AcceptParams {
            local_qpn,
            starting_psn: None,
            responder_resources: 16,
            initiator_depth: 16,
            rnr_retry_count: 7,
            flow_control: true,
        }
    }
}

/// A REQ for a service we listen on (rdma_cm `RDMA_CM_EVENT_CONNECT_REQUEST`). Answer with
/// [`CmEndpoint::accept`] or [`CmEndpoint::reject`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectRequest {
    pub id: ConnId,
    /// Where the REQ came from; every reply goes there.
    pub peer: SocketAddr,
    pub service_id: u64,
    pub remote_ca_guid: Guid,
    pub remote_qpn: Qpn,
    /// The PSN the peer will start sending with (our receive PSN): drawn by the CM, sent back
    /// in the REP unless [`AcceptParams::starting_psn`] overrides it.
    pub remote_psn: Psn,
    /// The PSN we send with: the REQ's starting PSN. Linux ib_cm gives the starting PSN of
    /// each message to the *other* side's sender: the active side puts its receive PSN in
    /// the REQ (`ib_send_cm_req`: `rq_psn = REQ starting PSN`; `cm_req_handler`: `sq_psn =`
    /// it), the passive side its receive PSN in the REP.
    pub local_psn: Psn,
    /// From our side, as Linux `cm_format_req_event` swaps them: the peer's initiator depth
    /// is how many reads we must be able to serve ...
    pub responder_resources: u8,
    /// ... and its responder resources how many we may issue.
    pub initiator_depth: u8,
    pub path_mtu: Mtu,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub flow_control: bool,
    /// The rdma_cm IP header: the peer's address and source port, our address.
    pub cma: CmaHdrRepr,
    /// The ULP bytes after the IP header, parsed as an NVMe-oF connect request; on error
    /// [`PrivateError::nvme_status`] is the reject status to answer with.
    pub nvme: Result<NvmeCmRequest, PrivateError>,
    /// The same ULP bytes, raw (56 of them).
    pub private_data: Vec<u8>,
}

/// A connection is usable (rdma_cm `RDMA_CM_EVENT_ESTABLISHED`): everything needed to move
/// the QP to RTR and RTS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Established {
    pub id: ConnId,
    /// The peer's communication ID for the connection.
    pub remote_id: ConnId,
    pub peer: SocketAddr,
    pub remote_ca_guid: Guid,
    pub remote_qpn: Qpn,
    /// The peer's starting PSN: our QP's receive PSN (`rq_psn`).
    pub remote_psn: Psn,
    /// Our starting PSN: our QP's send PSN (`sq_psn`).
    pub local_psn: Psn,
    /// Our `max_dest_rd_atomic`.
    pub responder_resources: u8,
    /// Our `max_rd_atomic`.
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub path_mtu: Mtu,
    /// The peer's ACK delay (REP), 0 on the passive side.
    pub target_ack_delay: u8,
    /// Our QP's local ACK timeout exponent.
    pub ack_timeout: u8,
    /// Active side: the REP private data parsed as an NVMe-oF accept (`None` if it is not one).
    pub accept: Option<NvmeCmAccept>,
    /// The REP private data (active side) or RTU private data (passive; empty if established
    /// by `notify_comm_est`).
    pub private_data: Vec<u8>,
}

/// The peer refused (rdma_cm `RDMA_CM_EVENT_REJECTED`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub id: ConnId,
    pub reason: RejectReason,
    /// For a consumer-defined reject, the NVMe-oF status in its private data (status 0, i.e.
    /// no NVMe record, gives `None`), as Linux `nvme_rdma_conn_rejected` reads it.
    pub nvme_status: Option<NvmeRejectStatus>,
    pub ari: Vec<u8>,
    pub private_data: Vec<u8>,
}

/// What the owner hears about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmEvent {
    ConnectRequest(ConnectRequest),
    Established(Established),
    Rejected(Rejected),
    /// The peer never answered the REQ (active) or the REP (passive) (rdma_cm
    /// `RDMA_CM_EVENT_UNREACHABLE`, -ETIMEDOUT). The connection is forgotten.
    Unreachable {
        id: ConnId,
    },
    /// The connection is down: DREQ or DREP received, DREQ retries exhausted, or a REJ while
    /// connected (rdma_cm `RDMA_CM_EVENT_DISCONNECTED`). Reported once; TimeWait follows.
    Disconnected {
        id: ConnId,
    },
    /// TimeWait is over and the ID forgotten: the QP may be reused (rdma_cm
    /// `RDMA_CM_EVENT_TIMEWAIT_EXIT`).
    TimewaitExit {
        id: ConnId,
    },
}

impl CmEvent {
    pub fn id(&self) -> ConnId {
        match self {
            CmEvent::ConnectRequest(r) => r.id,
            CmEvent::Established(e) => e.id,
            CmEvent::Rejected(r) => r.id,
            CmEvent::Unreachable { id }
            | CmEvent::Disconnected { id }
            | CmEvent::TimewaitExit { id } => *id,
        }
    }
}

/// Why a command was refused. All are permanent for the call at hand: the caller asked for
/// something the connection cannot do; nothing was sent and nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    #[error("no connection {0}")]
    UnknownConnection(ConnId),
    #[error("connection {id} is {state:?}, where {op} is not allowed")]
    InvalidState {
        id: ConnId,
        state: ConnState,
        op: &'static str,
    },
    #[error("{len} bytes of private data exceed the {max} this message carries")]
    PrivateDataTooLong { len: usize, max: usize },
}

/// Counters; the driver publishes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CmStats {
    pub rx_mads: u64,
    /// Failed to parse: wrong length, class, version, method, attribute, field value.
    pub rx_malformed: u64,
    /// No connection with those comm IDs from that address.
    pub rx_unmatched: u64,
    /// The connection's state has no row for the message (late, duplicate or out of order).
    pub rx_unexpected: u64,
    /// Duplicates recognised: answered (REQ → REP or REJ, REP → RTU, DREQ → DREP) or, for a
    /// REQ the owner has not decided on yet, dropped.
    pub rx_duplicates: u64,
    pub tx_mads: u64,
    pub retransmits: u64,
    /// Connections whose retries ran out.
    pub timeouts: u64,
    /// REQs refused because nobody listens on the service ID.
    pub rej_invalid_service: u64,
    /// REQs refused as stale connections.
    pub rej_stale: u64,
}

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

    // --- message handlers -----------------------------------------------------------------------

    fn on_req(&mut self, now: Instant, from: SocketAddr, tid: u64, r: &ReqRepr) {
        // A REQ we have seen: same peer, same CA GUID, same comm ID (cm.c cm_match_req →
        // cm_insert_remote_id / cm_dup_req_handler).
        let dup = peer_range(
            &self.by_remote,
            (from.ip(), r.local_ca_guid.0, r.local_comm_id),
        )
        .find(|k| self.conns.get(k).is_some_and(|c| c.passive));
        if let Some(key) = dup {
            let Some(state) = self.conns.get(&key).map(|c| c.state) else {
                return;
            };
            if self.apply(key, Input::RecvDupReq).is_none() {
                return;
            }
            match state {
                ConnState::RepSent | ConnState::MraRepRcvd => {
                    if let Some(m) = self.conns.get(&key).and_then(|c| c.pending) {
                        self.stats.rx_duplicates += 1;
                        self.send(from, m);
                    }
                }
                ConnState::Established | ConnState::TimeWait => {
                    self.stats.rx_duplicates += 1;
                    self.stats.rej_stale += 1;
                    let m = rej_mad(
                        tid,
                        key,
                        r.local_comm_id,
                        MsgRef::Req,
                        RejectReason::STALE_CONN,
                        &[],
                        &[],
                    );
                    self.send(from, m);
                }
                // ReqRcvd: the owner has not answered; drop.
                _ => self.stats.rx_duplicates += 1,
            }
            return;
        }

        // A new comm ID from a QP that is still connected here: the peer lost its state
        // (reset, crash). Refuse as stale and disconnect the old connection
        // (cm_match_req: cm_insert_remote_qpn → REJ stale + ib_send_cm_dreq). Connections in
        // TimeWait do not count, as Linux drops them from the QPN table when they enter it;
        // otherwise a reconnect after a reset could reuse the QPN only after TimeWait. Nor do
        // connections already being torn down (DreqSent): we declared them stale once, so
        // the peer's next REQ is accepted instead of being refused until the DREQ times out.
        let stale = peer_range(
            &self.by_qpn,
            (from.ip(), r.local_ca_guid.0, r.local_qpn.get()),
        )
        .find_map(|k| {
            let c = self.conns.get(&k)?;
            (!matches!(c.state, ConnState::TimeWait | ConnState::DreqSent)).then_some((k, c.state))
        });
        if let Some((old, old_state)) = stale {
            self.stats.rej_stale += 1;
            let m = rej_mad(
                tid,
                0,
                r.local_comm_id,
                MsgRef::Req,
                RejectReason::STALE_CONN,
                &[],
                &[],
            );
            self.send(from, m);
            if old_state == ConnState::Established {
                self.start_dreq(now, old, &[]);
                // The owner learns now that the connection is dead (its peer lost it), so
                // it stops sending on a QP whose remote end has been reborn.
                self.events
                    .push_back(CmEvent::Disconnected { id: ConnId(old) });
            }
            return;
        }

        // Nobody listens: REJ invalid service ID, no state kept (cm_match_req → cm_issue_rej).
        if !self.listening.contains(&r.service_id) {
            self.stats.rej_invalid_service += 1;
            let m = rej_mad(
                tid,
                0,
                r.local_comm_id,
                MsgRef::Req,
                RejectReason::INVALID_SERVICE_ID,
                &[],
                &[],
            );
            self.send(from, m);
            return;
        }

        // rdma_cm refuses a REQ it cannot read, and a QP type other than its port space's
        // (RC for RDMA_PS_TCP): the listener callback fails and ib_cm destroys the new ID in
        // REQ_RCVD, which sends REJ consumer-defined without private data
        // (cma_ib_req_handler / cma_check_req_qp_type / cm_destroy_id).
        let (cma, ulp) = match split_req_private(&r.private_data) {
            Ok(x) if r.transport == TransportType::Rc => x,
            _ => {
                let m = rej_mad(
                    tid,
                    0,
                    r.local_comm_id,
                    MsgRef::Req,
                    RejectReason::CONSUMER_DEFINED,
                    &[],
                    &[],
                );
                self.send(from, m);
                return;
            }
        };

        let local_id = self.alloc_id();
        let recv_psn = Psn::new(self.rng.random());
        let conn = Conn {
            state: ConnState::Idle,
            passive: true,
            peer: from,
            remote_id: r.local_comm_id,
            remote_guid: r.local_ca_guid,
            tid,
            local_qpn: Qpn::new(0),
            remote_qpn: Some(r.local_qpn),
            // The REQ's PSN is what we send with; we pick what we receive with (REP).
            local_psn: r.starting_psn,
            remote_psn: recv_psn,
            // Linux cm_req_handler / cm_format_req_event swap these to our point of view.
            responder_resources: r.initiator_depth,
            initiator_depth: r.responder_resources,
            retry_count: r.retry_count,
            rnr_retry_count: r.rnr_retry_count,
            path_mtu: r.path_mtu,
            target_ack_delay: 0,
            // cm_req_handler: the path's packet lifetime is the REQ's local ACK timeout - 1,
            // and av.timeout = lifetime + 1.
            av_timeout: r.local_ack_timeout,
            try_timeout: iba_time(r.local_cm_response_timeout.min(MAX_PEER_TIMEOUT_EXP)),
            max_retries: r.max_cm_retries,
            pending: None,
            deadline: None,
            retries_left: 0,
            last_reply: None,
            indexed: IndexKeys::default(),
        };
        self.insert_conn(local_id, conn);
        self.apply(local_id, Input::RecvReq);
        self.events
            .push_back(CmEvent::ConnectRequest(ConnectRequest {
                id: ConnId(local_id),
                peer: from,
                service_id: r.service_id,
                remote_ca_guid: r.local_ca_guid,
                remote_qpn: r.local_qpn,
                remote_psn: recv_psn,
                local_psn: r.starting_psn,
                responder_resources: r.initiator_depth,
                initiator_depth: r.responder_resources,
                path_mtu: r.path_mtu,
                retry_count: r.retry_count,
                rnr_retry_count: r.rnr_retry_count,
                flow_control: r.flow_control,
                cma,
                nvme: NvmeCmRequest::parse(ulp),
                private_data: ulp.to_vec(),
            }));
    }

    fn on_rep(&mut self, from: SocketAddr, r: &RepRepr) {
        // cm_rep_handler looks the ID up by the REP's remote comm ID alone: we do not know the
        // peer's yet.
        let Some(conn) = self.conns.get(&r.remote_comm_id) else {
            self.stats.rx_unmatched += 1;
            return;
        };
        if conn.peer.ip() != from.ip() {
            self.stats.rx_unmatched += 1;
            return;
        }
        let key = r.remote_comm_id;
        if conn.state == ConnState::Established {
            // cm_dup_rep_handler matches both IDs.
            if conn.remote_id != r.local_comm_id {
                self.stats.rx_unmatched += 1;
                return;
            }
            let rtu = conn.last_reply;
            if self.apply(key, Input::RecvDupRep).is_some() {
                if let Some(m) = rtu {
                    self.stats.rx_duplicates += 1;
                    self.send(from, m);
                }
            }
            return;
        }
        if lookup(conn.state, Input::RecvRep).is_none() {
            self.stats.rx_unexpected += 1;
            return;
        }
        let config = self.config;
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        conn.remote_id = r.local_comm_id;
        conn.remote_guid = r.local_ca_guid;
        conn.remote_qpn = Some(r.local_qpn);
        // The REP's PSN is what we send with (the peer's receive PSN).
        conn.local_psn = r.starting_psn;
        // cm_rep_handler: our initiator depth is the peer's responder resources and back.
        conn.initiator_depth = r.responder_resources;
        conn.responder_resources = r.initiator_depth;
        conn.rnr_retry_count = r.rnr_retry_count;
        conn.target_ack_delay = r.target_ack_delay;
        conn.av_timeout = ack_timeout(r.target_ack_delay, config.packet_lifetime);
        conn.pending = None;
        conn.deadline = None;
        let rtu = CmMad {
            transaction_id: conn.tid,
            message: CmMessage::Rtu(RtuRepr {
                local_comm_id: key,
                remote_comm_id: r.local_comm_id,
                private_data: [0; RtuRepr::PRIVATE_LEN],
            }),
        }
        .emit();
        conn.last_reply = Some(rtu);
        let peer = conn.peer;
        let ev = Established {
            id: ConnId(key),
            remote_id: ConnId(r.local_comm_id),
            peer,
            remote_ca_guid: r.local_ca_guid,
            remote_qpn: r.local_qpn,
            remote_psn: conn.remote_psn,
            local_psn: r.starting_psn,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            retry_count: conn.retry_count,
            rnr_retry_count: conn.rnr_retry_count,
            path_mtu: conn.path_mtu,
            target_ack_delay: r.target_ack_delay,
            ack_timeout: conn.av_timeout,
            accept: NvmeCmAccept::parse(&r.private_data).ok(),
            private_data: r.private_data.to_vec(),
        };
        self.sync(key);
        self.send(peer, rtu);
        self.apply(key, Input::RecvRep);
        self.events.push_back(CmEvent::Established(ev));
    }

    fn on_rtu(&mut self, from: SocketAddr, r: &RtuRepr) {
        let Some(key) = self.matched(from, r.remote_comm_id, r.local_comm_id) else {
            return;
        };
        if self.apply_checked(key, Input::RecvRtu).is_none() {
            return;
        }
        // `apply_checked` already moved the state; report with the RTU's private data.
        self.report_passive_established(key, r.private_data.to_vec());
    }

    fn on_mra(&mut self, now: Instant, from: SocketAddr, m: &MraRepr) {
        // cm_acquire_mraed_id: an MRA for our REQ carries only our comm ID.
        let key = match m.message_mraed {
            MsgRef::Req => match self.conns.get(&m.remote_comm_id) {
                Some(c) if c.peer.ip() == from.ip() => Some(m.remote_comm_id),
                _ => None,
            },
            _ => self.matched_quiet(from, m.remote_comm_id, m.local_comm_id),
        };
        let Some(key) = key else {
            self.stats.rx_unmatched += 1;
            return;
        };
        let input = match m.message_mraed {
            MsgRef::Req => Input::RecvMraReq,
            MsgRef::Rep => Input::RecvMraRep,
            // MRA for LAP: alternate paths are not supported on RoCE.
            MsgRef::Other => {
                self.stats.rx_unexpected += 1;
                return;
            }
        };
        if self.apply_checked(key, input).is_none() {
            return;
        }
        if let Some(conn) = self.conns.get_mut(&key) {
            // cm_mra_handler: service timeout + the path's ACK timeout, for this and later
            // tries (ib_modify_mad changes the send's timeout).
            conn.try_timeout = iba_time(m.service_timeout.min(MAX_MRA_TIMEOUT_EXP))
                + iba_time(conn.av_timeout.min(MAX_MRA_TIMEOUT_EXP));
            conn.deadline = Some(now + conn.try_timeout);
        }
        self.sync(key);
    }

    fn on_rej(&mut self, now: Instant, from: SocketAddr, r: &RejRepr) {
        // cm_acquire_rejected_id: a timeout REJ names the sender by comm ID and CA GUID (in
        // the ARI), since it may not know ours; a REJ of our REQ carries only our comm ID;
        // anything else must match both.
        let key = if r.reason == RejectReason::TIMEOUT {
            let guid = r.ari().get(..8).map(|g| {
                let mut a = [0u8; 8];
                a.copy_from_slice(g);
                Guid(u64::from_be_bytes(a))
            });
            guid.and_then(|g| peer_range(&self.by_remote, (from.ip(), g.0, r.local_comm_id)).next())
        } else if r.message_rejected == MsgRef::Req {
            match self.conns.get(&r.remote_comm_id) {
                Some(c) if c.peer.ip() == from.ip() => Some(r.remote_comm_id),
                _ => None,
            }
        } else {
            self.matched_quiet(from, r.remote_comm_id, r.local_comm_id)
        };
        let Some(key) = key else {
            self.stats.rx_unmatched += 1;
            return;
        };
        let Some(from_state) = self.conns.get(&key).map(|c| c.state) else {
            return;
        };
        // A REJ of a REQ only means something while that REQ is outstanding: once a REP
        // established us, it is a delayed answer to a duplicate REQ.
        let connected = matches!(from_state, ConnState::Established | ConnState::DreqSent);
        if connected && r.message_rejected == MsgRef::Req {
            self.stats.rx_unexpected += 1;
            return;
        }
        let input = if r.reason == RejectReason::STALE_CONN {
            Input::RecvRejStale
        } else {
            Input::RecvRej
        };
        let Some(to) = self.apply_checked(key, input) else {
            return;
        };
        if let Some(c) = self.conns.get_mut(&key) {
            c.pending = None;
            c.deadline = None;
        }
        self.sync(key);
        let id = ConnId(key);
        if connected {
            self.events.push_back(CmEvent::Disconnected { id });
        } else {
            let nvme_status = (r.reason == RejectReason::CONSUMER_DEFINED)
                .then(|| NvmeCmReject::parse(&r.private_data).ok())
                .flatten()
                .map(|j| j.status)
                .filter(|s| s.as_u16() != 0);
            self.events.push_back(CmEvent::Rejected(Rejected {
                id,
                reason: r.reason,
                nvme_status,
                ari: r.ari().to_vec(),
                private_data: r.private_data.to_vec(),
            }));
        }
        if to == ConnState::TimeWait {
            self.enter_timewait(now, key);
        }
    }

    fn on_dreq(&mut self, now: Instant, from: SocketAddr, tid: u64, d: &DreqRepr) {
        let drep = |local: u32, remote: u32| {
            CmMad {
                transaction_id: tid,
                message: CmMessage::Drep(DrepRepr {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    private_data: [0; DrepRepr::PRIVATE_LEN],
                }),
            }
            .emit()
        };
        let Some(key) = self.matched_quiet(from, d.remote_comm_id, d.local_comm_id) else {
            // cm_dreq_handler → cm_issue_drep: answer a DREQ for an unknown connection so
            // the peer can finish its teardown (our DREP was lost and TimeWait is over, or
            // we never had the connection).
            self.stats.rx_unmatched += 1;
            self.send(from, drep(d.remote_comm_id, d.local_comm_id));
            return;
        };
        let Some(conn) = self.conns.get(&key) else {
            return;
        };
        // cm_dreq_handler ignores a DREQ naming another QP than ours.
        if conn.local_qpn != d.remote_qpn {
            self.stats.rx_unexpected += 1;
            return;
        }
        let from_state = conn.state;
        let peer = conn.peer;
        if self.apply_checked(key, Input::RecvDreq).is_none() {
            return;
        }
        self.send(peer, drep(key, d.local_comm_id));
        if from_state == ConnState::TimeWait {
            self.stats.rx_duplicates += 1;
            return;
        }
        if let Some(c) = self.conns.get_mut(&key) {
            c.pending = None;
        }
        self.enter_timewait(now, key);
        self.events
            .push_back(CmEvent::Disconnected { id: ConnId(key) });
    }

    fn on_drep(&mut self, now: Instant, from: SocketAddr, d: &DrepRepr) {
        let Some(key) = self.matched(from, d.remote_comm_id, d.local_comm_id) else {
            return;
        };
        if self.apply_checked(key, Input::RecvDrep).is_none() {
            return;
        }
        if let Some(c) = self.conns.get_mut(&key) {
            c.pending = None;
        }
        self.enter_timewait(now, key);
        self.events
            .push_back(CmEvent::Disconnected { id: ConnId(key) });
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

    /// Add a connection and index it.
    fn insert_conn(&mut self, key: u32, conn: Conn) {
        if let Some(old) = self.conns.insert(key, conn) {
            // `alloc_id` never returns a key in use; should that change, the old
            // connection's entries must not linger.
            self.unindex(key, old.indexed);
        }
        if let Some(c) = self.conns.get_mut(&key) {
            c.indexed = IndexKeys::default();
        }
        self.sync(key);
    }

    /// Forget a connection and its index entries.
    fn remove_conn(&mut self, key: u32) {
        if let Some(c) = self.conns.remove(&key) {
            self.unindex(key, c.indexed);
        }
    }

    /// Bring the indexes up to date with connection `key` after its peer IDs or deadline
    /// changed (nothing to do if it is gone: `remove_conn` took its entries).
    fn sync(&mut self, key: u32) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        let (old, new) = (c.indexed, c.index_keys());
        if old == new {
            return;
        }
        c.indexed = new;
        self.unindex(key, old);
        if let Some((ip, g, v)) = new.remote {
            self.by_remote.insert((ip, g, v, key));
        }
        if let Some((ip, g, v)) = new.qpn {
            self.by_qpn.insert((ip, g, v, key));
        }
        if let Some(t) = new.deadline {
            self.timers.insert((t, key));
        }
    }

    fn unindex(&mut self, key: u32, k: IndexKeys) {
        if let Some((ip, g, v)) = k.remote {
            self.by_remote.remove(&(ip, g, v, key));
        }
        if let Some((ip, g, v)) = k.qpn {
            self.by_qpn.remove(&(ip, g, v, key));
        }
        if let Some(t) = k.deadline {
            self.timers.remove(&(t, key));
        }
    }

    /// The indexes hold exactly what the connections say (checked in debug builds after
    /// every input and command).
    fn indexes_consistent(&self) -> bool {
        let keys = || self.conns.iter().map(|(&k, c)| (k, c.index_keys()));
        let remote: BTreeSet<_> = keys()
            .filter_map(|(k, i)| i.remote.map(|(a, b, c)| (a, b, c, k)))
            .collect();
        let qpn: BTreeSet<_> = keys()
            .filter_map(|(k, i)| i.qpn.map(|(a, b, c)| (a, b, c, k)))
            .collect();
        let timers: BTreeSet<_> = keys()
            .filter_map(|(k, i)| i.deadline.map(|t| (t, k)))
            .collect();
        remote == self.by_remote && qpn == self.by_qpn && timers == self.timers
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

//! What a user of the CM endpoint hands in and gets back: settings, connect and accept
//! parameters, events, errors and counters, and the IBA time encoding they are written in.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::mad::RejectReason;
use super::private::{CmaHdrRepr, NvmeCmAccept, NvmeCmRequest, NvmeRejectStatus, PrivateError};
use super::state::ConnState;
use crate::verbs::Mtu;
use crate::verbs::{Guid, Psn, Qpn};

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
    /// promise: 18, ≈ 1.07 s, as newer kernels (cma.c `CMA_CM_RESPONSE_TIMEOUT`; 20, ≈ 4.3
    /// s, in older ones). A lost REQ or REP is sent again after it: with 20 a connection
    /// whose REQ or REP is lost twice could not come up within the host's 5 s connect
    /// timeout, which under 10% packet loss failed about one connect in thirty.
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
            cm_response_timeout: 18,
            max_cm_retries: 15,
            packet_lifetime: 16,
            ack_delay: 15,
            pkey: 0xFFFF,
        }
    }
    /// One REQ try: 2 × packet lifetime + the peer's response time (cm.c `ib_send_cm_req`).
    pub(super) fn req_timeout(&self) -> Duration {
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

//! The connection manager port: how the host makes and breaks RC connections.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::cm::{AcceptParams, ConnId, ConnectParams, Established, NvmeCmRequest, PrivateError};

use super::{Mtu, PeerInfo, Psn, Qpn};

/// Why an active connect failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    /// The peer refused, did not answer in time, or the request could not be made.
    /// Transient unless the reason says otherwise.
    #[error("{0}")]
    Refused(String),
    /// The device died while connecting. Static, so that a failed attempt on the recovery
    /// path allocates nothing. Transient: the device may come back.
    #[error("{0}")]
    DeviceGone(&'static str),
}

/// The connection manager of one device context. Cheap to clone.
pub trait CmPort: Clone + Send + Sync + 'static {
    /// Active side: connect `params.qpn` to the listener at `peer`, carrying `private`, within
    /// `timeout`. The QP is left for the caller to bring to RTS with what comes back.
    fn connect<'a>(
        &'a self,
        peer: SocketAddr,
        params: ConnectParams,
        private: &'a [u8],
        timeout: Duration,
    ) -> impl Future<Output = Result<Established, CmError>> + Send + 'a;
    /// Forget a connection whatever its state (the recovery path): no wire exchange.
    fn abort(&self, id: ConnId);
    /// Orderly teardown (DREQ).
    fn disconnect(&self, id: ConnId);
    /// Be told (once) on `tx` when connection `id` is torn down by the peer or the transport.
    fn watch(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>);
}

/// A connection request for a service we listen on (rdma_cm `CONNECT_REQUEST`), as the
/// target needs it to set up a queue.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub id: ConnId,
    /// The peer: its address (what per-address caps count), its QPN and the PSN it starts
    /// sending with.
    pub peer: PeerInfo,
    /// The PSN we send with.
    pub local_psn: Psn,
    /// The path MTU of the request: our RDMA WRITEs and READ responses must not exceed it.
    pub path_mtu: Mtu,
    /// The private data parsed as an NVMe-oF CM request; on error
    /// [`PrivateError::nvme_status`] is the reject status to answer with.
    pub nvme: Result<NvmeCmRequest, PrivateError>,
}

/// Connection requests a listener's channel holds before new ones are refused.
pub const INCOMING_BACKLOG: usize = 128;

/// The passive side of a context's connection manager: what the built-in target listens
/// with. Answer every request with [`CmListen::accept`] or [`CmListen::reject`].
///
/// A queue is set up in this order: a QP in INIT on the target's CQ, [`CmListen::attach`]
/// to the request, [`DeviceContext::rc_to_rts`](super::DeviceContext::rc_to_rts), receives
/// posted, then [`CmListen::accept`] with the NVMe-oF accept private data.
pub trait CmListen: CmPort {
    /// Listen on `at` (IP and service port). Requests arrive on the returned channel until
    /// the context dies. An address of another device, or of none, is refused. At most
    /// [`INCOMING_BACKLOG`] requests wait there; one more is refused at once with NVMe-oF
    /// status "no resources" (a REQ costs the peer a datagram: it must not grow our queue).
    fn listen(&self, at: SocketAddr) -> Result<mpsc::Receiver<Incoming>, CmError>;
    /// Our QP `qpn` (in INIT) is to carry request `id`: where the connection manager
    /// decides the QP's path (rdma_cm), `rc_to_rts` on it takes it from the request.
    fn attach(&self, id: ConnId, qpn: Qpn) -> Result<(), CmError>;
    /// Accept request `id` with `params.local_qpn` (in RTS by now) and `private` (REP).
    /// The connection can then be watched, disconnected and aborted as an active one.
    fn accept(&self, id: ConnId, params: AcceptParams, private: &[u8]) -> Result<(), CmError>;
    /// Refuse request `id` with `private` (a consumer-defined REJ) and forget it.
    fn reject(&self, id: ConnId, private: &[u8]);
    /// Be told (once) on `tx` when request `id`, to be accepted, becomes a connection: the
    /// peer's RTU arrived (rdma_cm `ESTABLISHED`), so its source address is real. Call it
    /// before [`CmListen::accept`]. One that never gets there is torn down, and
    /// [`CmPort::watch`] tells.
    fn watch_established(&self, id: ConnId, tx: mpsc::UnboundedSender<ConnId>);
}

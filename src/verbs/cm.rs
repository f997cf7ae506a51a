//! The connection manager port: how the host makes and breaks RC connections.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::cm::{ConnId, ConnectParams, Established};

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

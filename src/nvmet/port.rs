//! The target's ports as the sans-I/O core names them: a port's ID and address, and a
//! queue by the port it came through and its QP there.

use crate::verbs::Qpn;

/// One port of the target: a device (and address) hosts connect through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// Its port ID (Discovery Log PORTID), from 1.
    pub id: u16,
    /// The address hosts reach it at, reported in the discovery log.
    pub addr: Option<std::net::SocketAddr>,
}

/// Where port `port` is in the per-port lists (ports are numbered from 1).
pub(super) fn port_index(port: u16) -> usize {
    usize::from(port.max(1)) - 1
}

/// A queue, as the registry names it: the port it came through and its QP there (QPNs
/// are a device's own, so two ports may each have a QP 17).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct QRef {
    pub port: u16,
    pub qpn: Qpn,
}

//! The network a soft-HCA context attaches to: real UDP sockets or a seeded in-memory
//! network. The manager and the driver choose by it; only the port behind it sends.

use super::simnet::SimNet;

/// The network a soft-HCA context is attached to.
#[derive(Clone, Debug)]
pub enum Fabric {
    /// Real UDP sockets; `offload`: UDP segmentation offload (GSO/GRO) towards soft-HCA
    /// peers (off towards rxe or a NIC, see `socket`); `loopback`: packets for another
    /// context of this process skip the socket and are handed over in memory
    /// ([`super::local`], like rxe's loopback; `NVMF_RDMA_LOOPBACK=udp` turns it off
    /// process-wide). Keys, PSNs, QPNs and CM IDs come from the OS CSPRNG.
    Udp { offload: bool, loopback: bool },
    /// A seeded in-memory network: no sockets, delivery on tokio's clock (so a paused
    /// runtime runs it in virtual time), and every key, PSN, QPN and CM ID drawn from the
    /// network's seed so that a run replays exactly. Never for a real network.
    Sim(SimNet),
}

impl Fabric {
    /// UDP with offload and the loopback path on: what soft-HCA peers on one host use.
    pub const UDP: Fabric = Fabric::Udp {
        offload: true,
        loopback: true,
    };
}

impl SimNet {
    /// This network, as something to attach a device to.
    pub fn fabric(&self) -> Fabric {
        Fabric::Sim(self.clone())
    }
}

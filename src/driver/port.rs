//! Where a soft-HCA context's datagrams go: a UDP socket on a real network, or a port on a
//! seeded in-memory network ([`SimNet`]). The driver loop is one piece of code over
//! [`PacketPort`]; only the port knows which.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use super::simnet::{SimNet, SimPort};
use super::socket::{bind_roce_socket, RxBatch, TxBatch};

/// The network a soft-HCA context is attached to.
#[derive(Clone, Debug)]
pub enum Fabric {
    /// Real UDP sockets; `offload`: UDP segmentation offload (GSO/GRO) towards soft-HCA
    /// peers (off towards rxe or a NIC, see `socket`). Keys, PSNs, QPNs and CM IDs come
    /// from the OS CSPRNG.
    Udp { offload: bool },
    /// A seeded in-memory network: no sockets, delivery on tokio's clock (so a paused
    /// runtime runs it in virtual time), and every key, PSN, QPN and CM ID drawn from the
    /// network's seed so that a run replays exactly. Never for a real network.
    Sim(SimNet),
}

impl Fabric {
    /// UDP with offload on: what soft-HCA peers on one host use.
    pub const UDP: Fabric = Fabric::Udp { offload: true };
}

/// One context's end of the network, as the driver loop uses it: wait until something can
/// be received, take a bounded batch, queue packets and send them in one go.
pub(crate) trait PacketPort: Send + 'static {
    /// The address packets from this port come from.
    fn local_addr(&self) -> SocketAddr;
    /// Resolves once a receive may find datagrams (it may still find none).
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_;
    /// Take what is queued, without waiting; returns the number of packets.
    fn recv(&mut self) -> io::Result<usize>;
    /// Packet `i` of the last `recv`.
    fn get(&self, i: usize) -> (SocketAddr, &[u8]);
    /// The buffer the next outgoing packet is written at the end of.
    fn tx_buf(&mut self) -> &mut Vec<u8>;
    /// The bytes from `start` to the end of [`PacketPort::tx_buf`] are one packet to `dst`.
    fn push(&mut self, dst: SocketAddr, start: usize);
    /// Packets queued since the last flush.
    fn tx_len(&self) -> usize;
    /// Send everything queued. Losses are the network's business (RC retransmits).
    fn flush(&mut self);
    /// Busy polling makes sense only where a wakeup costs real time.
    fn busy_poll(&self) -> bool;
}

/// A UDP socket with its batched receive and send buffers.
pub(crate) struct UdpPort {
    sock: tokio::net::UdpSocket,
    addr: SocketAddr,
    rx: RxBatch,
    tx: TxBatch,
}

impl UdpPort {
    pub(crate) fn bind(addr: SocketAddr, offload: bool) -> io::Result<UdpPort> {
        let (sock, gro) = bind_roce_socket(addr, offload)?;
        Ok(UdpPort {
            addr: sock.local_addr()?,
            sock,
            rx: RxBatch::new(),
            tx: TxBatch::new(gro),
        })
    }
}

impl PacketPort for UdpPort {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_ {
        self.sock.readable()
    }

    fn recv(&mut self) -> io::Result<usize> {
        self.rx.recv(&self.sock)
    }

    fn get(&self, i: usize) -> (SocketAddr, &[u8]) {
        self.rx.get(i)
    }

    fn tx_buf(&mut self) -> &mut Vec<u8> {
        &mut self.tx.buf
    }

    fn push(&mut self, dst: SocketAddr, start: usize) {
        self.tx.push(dst, start)
    }

    fn tx_len(&self) -> usize {
        self.tx.len()
    }

    fn flush(&mut self) {
        self.tx.flush(&self.sock)
    }

    fn busy_poll(&self) -> bool {
        true
    }
}

impl PacketPort for SimPort {
    fn local_addr(&self) -> SocketAddr {
        SimPort::addr(self)
    }

    async fn readable(&self) -> io::Result<()> {
        SimPort::readable(self).await;
        Ok(())
    }

    fn recv(&mut self) -> io::Result<usize> {
        Ok(SimPort::recv(self))
    }

    fn get(&self, i: usize) -> (SocketAddr, &[u8]) {
        SimPort::get(self, i)
    }

    fn tx_buf(&mut self) -> &mut Vec<u8> {
        SimPort::tx_buf(self)
    }

    fn push(&mut self, dst: SocketAddr, start: usize) {
        SimPort::push(self, dst, start)
    }

    fn tx_len(&self) -> usize {
        SimPort::tx_len(self)
    }

    fn flush(&mut self) {
        SimPort::flush(self)
    }

    fn busy_poll(&self) -> bool {
        false
    }
}

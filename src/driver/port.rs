//! Where a soft-HCA context's datagrams go: a UDP socket on a real network, or a port on a
//! seeded in-memory network ([`super::SimNet`]). The driver loop is one piece of code over
//! [`PacketPort`]; only the port knows which.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use std::sync::atomic::{AtomicBool, Ordering};

use super::local::{LocalLink, DELIVER_EARLY_BYTES};
use super::socket::{bind_udp, RawRx, RxBatch, TxBatch};
use crate::hca::wire::{fill_icrc, IcrcContext};
use crate::hca::IcrcCheck;

/// One received packet, as the port read it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Received<'a> {
    /// A UDP payload from `src` (the IP header stayed in the kernel).
    Udp(SocketAddr, &'a [u8]),
    /// A UDP payload from a loopback address `src`: it went through this machine's memory
    /// only, never a wire ([`crate::hca::Device::handle_host_datagram`]).
    HostUdp(SocketAddr, &'a [u8]),
    /// A whole IPv4 datagram, header included (a raw socket).
    Ipv4(&'a [u8]),
    /// A packet from a context of this process by the loopback path, from `src`.
    Loopback(SocketAddr, &'a [u8]),
}

/// One context's end of the network, as the driver loop uses it: wait until something can
/// be received, take a bounded batch, queue packets and send them in one go.
pub(crate) trait PacketPort: Send + 'static {
    /// The address packets from this port come from.
    fn local_addr(&self) -> SocketAddr;
    /// Resolves once a receive may find datagrams (it may still find none).
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_;
    /// Would [`PacketPort::readable`] be ready now? For a busy-polling driver between
    /// yields: readiness flags only, nothing registered, no syscall.
    fn has_input(&self) -> bool {
        false
    }
    /// Take what is queued, without waiting; returns the number of packets.
    fn recv(&mut self) -> io::Result<usize>;
    /// Packet `i` of the last `recv`.
    fn get(&self, i: usize) -> Received<'_>;
    /// The buffer the next outgoing packet is written at the end of.
    fn tx_buf(&mut self) -> &mut Vec<u8>;
    /// The bytes from `start` to the end of [`PacketPort::tx_buf`] are one packet to `dst`.
    fn push(&mut self, dst: SocketAddr, start: usize);
    /// Send everything queued. Losses are the network's business (RC retransmits).
    fn flush(&mut self);
    /// Busy polling makes sense only where a wakeup costs real time.
    fn busy_poll(&self) -> bool;
    /// The port computes the ICRC of the packets it sends over the network, and the device
    /// leaves it zero ([`crate::hca::Device::set_icrc_by_port`]).
    fn fills_icrc(&self) -> bool {
        false
    }
    /// Whether two addresses are contexts of this process on the in-memory path, for a port
    /// that is on it ([`crate::hca::Device::set_in_memory_path`]).
    fn in_memory_path(&self) -> Option<fn(SocketAddr, SocketAddr) -> bool> {
        None
    }
    /// Packets for this port it dropped itself (the loopback path's full inbox), so far.
    fn overflows(&self) -> u64 {
        0
    }
    /// Packets received or sent over the network so far (from or to another process or
    /// machine), not handed over in memory: a peer that needs a core of its own.
    fn network_packets(&self) -> u64 {
        0
    }
}

/// A UDP socket with its batched receive and send buffers; with a raw socket beside it
/// when received ICRCs are checked against the real IPv4 header, or the loopback path
/// ([`LocalLink`]) to the other contexts of this process when it talks to soft-HCA peers.
pub(crate) struct UdpPort {
    sock: tokio::net::UdpSocket,
    local: Option<LocalLink>,
    /// Packets of the last receive that came by the loopback path (they come first).
    local_n: usize,
    /// See [`PacketPort::network_packets`].
    network: u64,
    /// Where the datagrams are read, with their IPv4 headers, when the UDP socket only
    /// sends (see [`RawRx`]).
    raw: Option<RawRx>,
    addr: SocketAddr,
    rx: RxBatch,
    tx: TxBatch,
}

/// Set once the fallback without CAP_NET_RAW has been logged in this process.
static RAW_FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

impl UdpPort {
    /// Bind `addr`. When `icrc` wants the IP header ([`IcrcCheck::wants_ip_header`]) and
    /// `addr` is IPv4, datagrams are read off a raw socket and offload is off (a GRO run has
    /// one IP header, a GSO run numbers its IDs); without CAP_NET_RAW the port falls back
    /// to the UDP socket, logging that once per process (the device counts the packets it
    /// could not check), or fails when the mode says the raw socket is required.
    /// `loopback`: take part in the loopback path ([`LocalLink`]) where it applies (a
    /// specific address, the UDP socket read, offload on).
    pub(crate) fn bind(
        addr: SocketAddr,
        offload: bool,
        loopback: bool,
        icrc: IcrcCheck,
    ) -> io::Result<UdpPort> {
        let SocketAddr::V4(v4) = addr else {
            return Self::plain(addr, offload, loopback);
        };
        if !icrc.wants_ip_header() {
            return Self::plain(addr, offload, loopback);
        }
        let (sock, _) = bind_udp(addr, false, true)?;
        let local = sock.local_addr()?;
        let raw = match RawRx::open(std::net::SocketAddrV4::new(*v4.ip(), local.port())) {
            Ok(r) => r,
            Err(e) if icrc == (IcrcCheck::RealHeader { required: false }) => {
                if !RAW_FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %e,
                        "no raw socket (CAP_NET_RAW): ICRCs from RoCEv2 peers on IPv4 are not \
                         checked (softhca_rx_icrc_unchecked_total counts them)"
                    );
                }
                drop(sock);
                return Self::plain(addr, false, false);
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("raw socket for ICRC checks against real IPv4 headers: {e}"),
                ))
            }
        };
        Ok(UdpPort {
            addr: local,
            sock,
            local: None,
            local_n: 0,
            network: 0,
            raw: Some(raw),
            rx: RxBatch::new(),
            tx: TxBatch::new(false),
        })
    }

    fn plain(addr: SocketAddr, offload: bool, loopback: bool) -> io::Result<UdpPort> {
        let (sock, gro) = bind_udp(addr, offload, false)?;
        let addr = sock.local_addr()?;
        Ok(UdpPort {
            addr,
            sock,
            local: if offload && loopback {
                LocalLink::register(addr)
            } else {
                None
            },
            local_n: 0,
            network: 0,
            raw: None,
            rx: RxBatch::new(),
            tx: TxBatch::new(gro),
        })
    }
}

impl PacketPort for UdpPort {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits on the sources [`PacketPort::has_input`] probes (below): the two matches must
    /// name the same ones, or a spinner would miss what a sleeper wakes for.
    async fn readable(&self) -> io::Result<()> {
        match (&self.raw, &self.local) {
            (Some(raw), _) => raw.readable().await,
            (None, Some(local)) => tokio::select! {
                r = self.sock.readable() => r,
                () = local.readable() => Ok(()),
            },
            (None, None) => self.sock.readable().await,
        }
    }

    fn has_input(&self) -> bool {
        // The sources `readable` waits on, no other. `try_io` with a closure that reads
        // nothing: Ok while tokio holds the socket readable (set by its I/O driver, which
        // runs between the spinner's yields), and the readiness stays set for `recv`.
        match (&self.raw, &self.local) {
            (Some(raw), _) => raw.ready(),
            (None, local) => {
                local.as_ref().is_some_and(LocalLink::has_input)
                    || self
                        .sock
                        .try_io(tokio::io::Interest::READABLE, || Ok(()))
                        .is_ok()
            }
        }
    }

    fn recv(&mut self) -> io::Result<usize> {
        self.local_n = self.local.as_mut().map_or(0, LocalLink::recv);
        let n = match &self.raw {
            Some(raw) => self.rx.recv_raw(raw),
            None => self.rx.recv(&self.sock),
        }?;
        self.network += n as u64;
        Ok(self.local_n + n)
    }

    fn get(&self, i: usize) -> Received<'_> {
        if i < self.local_n {
            if let Some(local) = &self.local {
                let (src, data) = local.get(i);
                return Received::Loopback(src, data);
            }
        }
        let (src, data) = self.rx.get(i - self.local_n);
        match self.raw {
            Some(_) => Received::Ipv4(data),
            None if src.ip().is_loopback() => Received::HostUdp(src, data),
            None => Received::Udp(src, data),
        }
    }

    fn tx_buf(&mut self) -> &mut Vec<u8> {
        &mut self.tx.buf
    }

    fn push(&mut self, dst: SocketAddr, start: usize) {
        let len = self.tx.buf.len() - start;
        let Some(local) = self.local.as_mut() else {
            self.network += 1;
            return self.tx.push(dst, start);
        };
        if !local.take(dst, start, len) {
            self.network += 1;
            // Not for this process: the device left the ICRC to us (`fills_icrc`).
            fill_icrc(&IcrcContext::new(self.addr, dst), &mut self.tx.buf[start..]);
            return self.tx.push(dst, start);
        }
        if local.queued_bytes() >= DELIVER_EARLY_BYTES {
            let only_local = self.tx.is_empty();
            local.deliver(&mut self.tx.buf, only_local);
        }
    }

    fn flush(&mut self) {
        if let Some(local) = &mut self.local {
            let only_local = self.tx.is_empty();
            local.deliver(&mut self.tx.buf, only_local);
        }
        self.tx.flush(&self.sock)
    }

    fn busy_poll(&self) -> bool {
        true
    }

    fn network_packets(&self) -> u64 {
        self.network
    }

    /// With the loopback path: a packet for another context of the process needs no ICRC
    /// (the receiver does not check it), so it is computed only for those sent over UDP.
    fn fills_icrc(&self) -> bool {
        self.local.is_some()
    }

    fn in_memory_path(&self) -> Option<fn(SocketAddr, SocketAddr) -> bool> {
        self.local
            .is_some()
            .then_some(super::local::reaches as fn(_, _) -> _)
    }

    fn overflows(&self) -> u64 {
        self.local.as_ref().map_or(0, LocalLink::dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Queue one packet of `len` bytes of `byte` for `dst`, as the driver loop does.
    fn queue(port: &mut UdpPort, dst: SocketAddr, byte: u8, len: usize) {
        let buf = port.tx_buf();
        let start = buf.len();
        buf.resize(start + len, byte);
        port.push(dst, start);
    }

    fn drain(port: &mut UdpPort, got: &mut Vec<(u8, usize)>) -> usize {
        let n = port.recv().unwrap();
        for i in 0..n {
            let Received::Loopback(_, data) = port.get(i) else {
                panic!("packet {i} did not come by the loopback path");
            };
            assert!(data.iter().all(|&b| b == data[0]), "packet {i} mixed bytes");
            got.push((data[0], data.len()));
        }
        n
    }

    /// A turn that builds more than [`DELIVER_EARLY_BYTES`] for a local peer hands the first
    /// part over before the turn ends, so the peer's thread can start on it; what goes over
    /// UDP in the same turn, before and after, is not disturbed. Before the early hand-over,
    /// the peer found nothing until the flush.
    #[tokio::test]
    async fn a_large_turn_reaches_a_local_peer_before_it_ends() {
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut a = UdpPort::plain(any, true, true).unwrap();
        let mut b = UdpPort::plain(any, true, true).unwrap();
        assert!(a.local.is_some() && b.local.is_some(), "loopback path off");
        let far = std::net::UdpSocket::bind(any).unwrap();
        far.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let (bdst, fdst) = (b.local_addr(), far.local_addr().unwrap());
        const LEN: usize = 4096 + 60;
        let pkts = 2 * DELIVER_EARLY_BYTES / LEN + 3;
        let mut got = Vec::new();
        let mut early = 0;
        for (round, first_udp) in [(0u8, false), (1, true)] {
            if first_udp {
                queue(&mut a, fdst, b'u', 100);
            }
            for i in 0..pkts {
                queue(&mut a, bdst, round * 100 + (i % 100) as u8, LEN);
            }
            queue(&mut a, fdst, b'v', 200);
            early += drain(&mut b, &mut got);
            a.flush();
            drain(&mut b, &mut got);
        }
        assert!(
            early >= 4 * (DELIVER_EARLY_BYTES / LEN),
            "{early} packets early"
        );
        let want: Vec<(u8, usize)> = (0..2u8)
            .flat_map(|r| (0..pkts).map(move |i| (r * 100 + (i % 100) as u8, LEN)))
            .collect();
        assert_eq!(got, want);
        let mut udp = Vec::new();
        let mut buf = [0u8; 512];
        for _ in 0..3 {
            let n = far.recv(&mut buf).unwrap();
            udp.push((buf[0], n));
        }
        assert_eq!(udp, [(b'v', 200), (b'u', 100), (b'v', 200)]);
    }
}

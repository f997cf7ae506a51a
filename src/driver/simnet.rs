//! A seeded in-memory network for soft-HCA contexts: the same driver, device manager, CM
//! and built-in target as on UDP, with no sockets. Packets cross the link model of
//! [`crate::hca::sim`] (drop, duplicate, reorder, corrupt, latency, partitions), drawn from
//! one seeded generator, and arrive on tokio's clock, so a runtime with paused time
//! (`start_paused`) runs a whole host-and-target world in virtual time, as fast as the CPU
//! allows, and the same seed replays the same run.
//!
//! What makes a run replay: the network's decisions come from its seed; devices and CMs
//! attached to it draw keys, PSNs, QPNs and CM IDs from seeds derived from it (never from
//! the OS, see [`crate::driver::Fabric`]); time is tokio's; and the tasks run on one thread.
//! Memory addresses (MR virtual addresses in RETHs and SGLs) do differ between runs, so the
//! trace hash covers what the network did with each packet, not every payload byte.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::SeedableRng;
use tokio::sync::Notify;

use crate::hca::sim::{Faults, LinkStats, Wire};
use crate::verbs::Instant;

use super::port::{PacketPort, Received};

/// Ports handed out for binds to port 0 start here, as Linux's ephemeral range does.
const FIRST_EPHEMERAL: u16 = 49152;
/// Packets a port takes in one receive, as a socket's batch would.
const RX_BATCH: usize = 512;

/// A simulated network. Cheap to clone; every clone is the same network.
#[derive(Clone)]
pub struct SimNet {
    sh: Arc<NetShared>,
}

impl fmt::Debug for SimNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimNet(seed {})", self.sh.seed)
    }
}

struct NetShared {
    seed: u64,
    /// Zero of the network's clock (tokio time).
    epoch: tokio::time::Instant,
    net: Mutex<Net>,
    /// Wakes the delivery task: a packet went on the wire, or the network is gone.
    wire_wake: Arc<Notify>,
}

impl Drop for NetShared {
    fn drop(&mut self) {
        self.wire_wake.notify_one();
    }
}

struct Net {
    faults: Faults,
    rng: SmallRng,
    wire: Wire,
    stats: LinkStats,
    ports: BTreeMap<SocketAddr, Inbox>,
    next_port: u16,
    next_token: u64,
    /// Hosts whose traffic is cut, both ways.
    cuts: Vec<(IpAddr, IpAddr)>,
    /// FNV-1a over every delivery (see [`SimNet::trace_hash`]).
    trace: u64,
}

/// A bound port's receive queue.
struct Inbox {
    /// Which bind this is: a port re-bound after a reset is another socket.
    token: u64,
    packets: VecDeque<(SocketAddr, Vec<u8>)>,
    wake: Arc<Notify>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

fn addr_bytes(a: SocketAddr) -> [u8; 18] {
    let mut out = [0u8; 18];
    match a.ip() {
        IpAddr::V4(ip) => out[..4].copy_from_slice(&ip.octets()),
        IpAddr::V6(ip) => out[..16].copy_from_slice(&ip.octets()),
    }
    out[16..].copy_from_slice(&a.port().to_be_bytes());
    out
}

/// SplitMix64: spreads a seed and a salt into an independent seed.
pub fn mix(seed: u64, salt: u64) -> u64 {
    let mut z = seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SimNet {
    /// A network whose every random decision comes from `seed`, with `faults` on every
    /// packet. Starts its delivery task on the current tokio runtime (call it from inside
    /// the runtime that runs the devices; paused time makes it virtual).
    pub fn new(seed: u64, faults: Faults) -> SimNet {
        let wire_wake = Arc::new(Notify::new());
        let sh = Arc::new(NetShared {
            seed,
            epoch: tokio::time::Instant::now(),
            net: Mutex::new(Net {
                faults,
                rng: SmallRng::seed_from_u64(seed),
                wire: Wire::default(),
                stats: LinkStats::default(),
                ports: BTreeMap::new(),
                next_port: FIRST_EPHEMERAL,
                next_token: 1,
                cuts: Vec::new(),
                trace: FNV_OFFSET,
            }),
            wire_wake: wire_wake.clone(),
        });
        crate::harness::alloc_audit::spawn(deliver(Arc::downgrade(&sh), wire_wake));
        SimNet { sh }
    }

    pub fn seed(&self) -> u64 {
        self.sh.seed
    }

    /// A seed for something attached to this network (a device context, a CM), from
    /// `salt`: the same network seed and salt give the same seed.
    pub fn seed_for(&self, salt: u64) -> u64 {
        mix(self.sh.seed, salt)
    }

    fn lock(&self) -> MutexGuard<'_, Net> {
        self.sh.net.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The network's clock: time since it was made.
    pub fn now(&self) -> Duration {
        self.sh.epoch.elapsed()
    }

    /// Change what the link does to packets sent from now on.
    pub fn set_faults(&self, faults: Faults) {
        self.lock().faults = faults;
    }

    pub fn faults(&self) -> Faults {
        self.lock().faults
    }

    /// Cut all traffic between hosts `a` and `b`, both ways, until [`SimNet::heal`].
    pub fn partition(&self, a: IpAddr, b: IpAddr) {
        self.lock().cuts.push((a, b));
    }

    /// Lift every partition.
    pub fn heal(&self) {
        self.lock().cuts.clear();
    }

    /// What the link did so far.
    pub fn stats(&self) -> LinkStats {
        self.lock().stats.clone()
    }

    /// A hash of every delivery so far: when, from where, to where, how long, and the
    /// packet's first 12 bytes (the BTH: opcode, QPN, PSN). Two runs that deliver the same
    /// packets at the same virtual times have the same hash.
    pub fn trace_hash(&self) -> u64 {
        self.lock().trace
    }

    /// Bind `addr` (port 0 picks a free one). Fails with `AddrInUse` while another port
    /// holds it, as a UDP socket would.
    pub(crate) fn bind(&self, addr: SocketAddr) -> io::Result<SimPort> {
        let wake = Arc::new(Notify::new());
        let mut n = self.lock();
        let addr = if addr.port() == 0 {
            let mut found = None;
            for _ in 0..=(u16::MAX - FIRST_EPHEMERAL) {
                let p = n.next_port;
                n.next_port = if p == u16::MAX {
                    FIRST_EPHEMERAL
                } else {
                    p + 1
                };
                let a = SocketAddr::new(addr.ip(), p);
                if !n.ports.contains_key(&a) {
                    found = Some(a);
                    break;
                }
            }
            found.ok_or_else(|| io::Error::from(io::ErrorKind::AddrInUse))?
        } else if n.ports.contains_key(&addr) {
            return Err(io::Error::from(io::ErrorKind::AddrInUse));
        } else {
            addr
        };
        let token = n.next_token;
        n.next_token += 1;
        n.ports.insert(
            addr,
            Inbox {
                token,
                packets: VecDeque::new(),
                wake: wake.clone(),
            },
        );
        drop(n);
        Ok(SimPort {
            net: self.sh.clone(),
            addr,
            token,
            wake,
            rx: Vec::with_capacity(RX_BATCH),
            tx_buf: Vec::with_capacity(64 << 10),
            tx: Vec::with_capacity(256),
        })
    }
}

/// Moves packets from the wire into their ports' receive queues as their time comes.
async fn deliver(net: Weak<NetShared>, wake: Arc<Notify>) {
    loop {
        let (epoch, next) = {
            let Some(sh) = net.upgrade() else { return };
            let mut n = sh.net.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant(sh.epoch.elapsed().as_nanos() as u64);
            while let Some(p) = n.wire.pop_due(now) {
                let n = &mut *n;
                let mut h = fnv(n.trace, &now.0.to_le_bytes());
                h = fnv(h, &addr_bytes(p.src));
                h = fnv(h, &addr_bytes(p.dst));
                h = fnv(h, &(p.data.len() as u64).to_le_bytes());
                h = fnv(h, &p.data[..p.data.len().min(12)]);
                n.trace = h;
                match n.ports.get_mut(&p.dst) {
                    Some(inbox) => {
                        n.stats.delivered += 1;
                        inbox.packets.push_back((p.src, p.data));
                        inbox.wake.notify_one();
                    }
                    None => n.stats.undeliverable += 1,
                }
            }
            (sh.epoch, n.wire.next_delivery())
        };
        match next {
            Some(t) => {
                tokio::select! {
                    biased;
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep_until(epoch + Duration::from_nanos(t.0)) => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

/// One bound port: a soft-HCA context's end of the simulated network. Unbound when dropped
/// (when its driver task ends), so a reset device can bind its address again.
pub struct SimPort {
    net: Arc<NetShared>,
    addr: SocketAddr,
    token: u64,
    wake: Arc<Notify>,
    rx: Vec<(SocketAddr, Vec<u8>)>,
    tx_buf: Vec<u8>,
    /// (destination, start, length) of each queued packet in `tx_buf`.
    tx: Vec<(SocketAddr, usize, usize)>,
}

impl Drop for SimPort {
    fn drop(&mut self) {
        let mut n = self.net.net.lock().unwrap_or_else(|e| e.into_inner());
        if n.ports
            .get(&self.addr)
            .is_some_and(|i| i.token == self.token)
        {
            n.ports.remove(&self.addr);
        }
    }
}

impl SimPort {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn lock(&self) -> MutexGuard<'_, Net> {
        self.net.net.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves once packets are queued for this port.
    pub async fn readable(&self) {
        loop {
            if self
                .lock()
                .ports
                .get(&self.addr)
                .is_some_and(|i| i.token == self.token && !i.packets.is_empty())
            {
                return;
            }
            // notify_one keeps a permit, so a delivery between the check and here counts.
            self.wake.notified().await;
        }
    }

    /// Take up to a batch of queued packets; returns how many.
    pub fn recv(&mut self) -> usize {
        self.rx.clear();
        let mut n = self.net.net.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(inbox) = n.ports.get_mut(&self.addr) {
            if inbox.token == self.token {
                let k = inbox.packets.len().min(RX_BATCH);
                self.rx.extend(inbox.packets.drain(..k));
            }
        }
        self.rx.len()
    }

    pub fn get(&self, i: usize) -> (SocketAddr, &[u8]) {
        let (src, data) = &self.rx[i];
        (*src, data)
    }

    pub fn tx_buf(&mut self) -> &mut Vec<u8> {
        &mut self.tx_buf
    }

    pub fn push(&mut self, dst: SocketAddr, start: usize) {
        self.tx.push((dst, start, self.tx_buf.len() - start));
    }

    /// Put every queued packet on the wire.
    pub fn flush(&mut self) {
        if self.tx.is_empty() {
            return;
        }
        let now = Instant(self.net.epoch.elapsed().as_nanos() as u64);
        {
            let mut guard = self.net.net.lock().unwrap_or_else(|e| e.into_inner());
            let n = &mut *guard;
            for &(dst, start, len) in &self.tx {
                let (a, b) = (self.addr.ip(), dst.ip());
                let cut = n
                    .cuts
                    .iter()
                    .any(|&(x, y)| (x == a && y == b) || (x == b && y == a));
                n.wire.send(
                    &n.faults,
                    &mut n.rng,
                    &mut n.stats,
                    now,
                    self.addr,
                    dst,
                    &self.tx_buf[start..start + len],
                    cut,
                );
            }
        }
        self.tx.clear();
        self.tx_buf.clear();
        self.net.wire_wake.notify_one();
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

    fn get(&self, i: usize) -> Received<'_> {
        let (src, data) = SimPort::get(self, i);
        Received::Udp(src, data)
    }

    fn tx_buf(&mut self) -> &mut Vec<u8> {
        SimPort::tx_buf(self)
    }

    fn push(&mut self, dst: SocketAddr, start: usize) {
        SimPort::push(self, dst, start)
    }

    fn flush(&mut self) {
        SimPort::flush(self)
    }

    fn busy_poll(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn binds_like_udp_and_frees_the_port_when_dropped() {
        let net = SimNet::new(1, Faults::NONE);
        let a = net.bind(addr("127.0.0.1:0")).unwrap();
        let b = net.bind(addr("127.0.0.1:0")).unwrap();
        assert_eq!(a.addr().port(), FIRST_EPHEMERAL);
        assert_ne!(a.addr(), b.addr());
        let kind = net.bind(a.addr()).err().map(|e| e.kind());
        assert_eq!(kind, Some(io::ErrorKind::AddrInUse));
        let at = a.addr();
        drop(a);
        assert_eq!(net.bind(at).unwrap().addr(), at);
    }

    #[tokio::test(start_paused = true)]
    async fn delivers_after_the_latency_and_not_across_a_partition() {
        let net = SimNet::new(2, Faults::NONE);
        let mut a = net.bind(addr("127.0.0.1:1000")).unwrap();
        let mut b = net.bind(addr("127.0.0.2:1000")).unwrap();
        let send = |p: &mut SimPort, to: SocketAddr, byte: u8| {
            p.tx_buf().push(byte);
            p.push(to, 0);
            p.flush();
        };
        let t0 = tokio::time::Instant::now();
        send(&mut a, b.addr(), 7);
        assert_eq!(b.recv(), 0, "nothing arrives before its time");
        b.readable().await;
        assert!(t0.elapsed() >= Duration::from_nanos(Faults::NONE.latency_ns));
        assert_eq!(b.recv(), 1);
        assert_eq!(b.get(0), (a.addr(), &[7u8][..]));
        net.partition(a.addr().ip(), b.addr().ip());
        send(&mut b, a.addr(), 8);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(a.recv(), 0);
        net.heal();
        send(&mut b, a.addr(), 9);
        a.readable().await;
        assert_eq!(a.recv(), 1);
        assert_eq!(a.get(0).1, &[9u8][..]);
        let s = net.stats();
        assert_eq!((s.sent, s.delivered, s.dropped), (3, 2, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn the_same_seed_makes_the_same_faults() {
        async fn run(seed: u64) -> (LinkStats, u64) {
            let net = SimNet::new(seed, Faults::LOSSY);
            let mut a = net.bind(addr("127.0.0.1:1")).unwrap();
            let mut b = net.bind(addr("127.0.0.1:2")).unwrap();
            for i in 0..500u32 {
                let start = a.tx_buf().len();
                a.tx_buf().extend_from_slice(&i.to_be_bytes());
                a.push(b.addr(), start);
            }
            a.flush();
            tokio::time::sleep(Duration::from_millis(5)).await;
            while b.recv() > 0 {}
            (net.stats(), net.trace_hash())
        }
        let (s1, h1) = run(9).await;
        assert_eq!((s1.clone(), h1), run(9).await);
        assert!(
            s1.dropped > 0 && s1.duplicated > 0 && s1.reordered > 0,
            "{s1:?}"
        );
        assert_ne!(h1, run(10).await.1);
    }
}

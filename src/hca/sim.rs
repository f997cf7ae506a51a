//! A seeded, virtual-time simulator that drives several soft-HCA cores through a lossy link.
//!
//! Faults are edits to the in-flight queue (drop, duplicate, delay/reorder, corrupt) plus
//! partitions and device lifecycle operations at chosen points. Everything random comes from
//! one seed, and time only moves when the simulator moves it, so a failing seed replays the
//! same run bit for bit.

use std::collections::BinaryHeap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::device::{Device, DeviceConfig, DeviceIdentity, IcrcCheck};
use crate::verbs::{Instant, PciAddr};

/// What the link does to each packet, as probabilities in 0.0..=1.0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Faults {
    pub drop: f64,
    pub duplicate: f64,
    /// Probability a packet gets an extra random delay of up to `reorder_window_ns`, which
    /// lets later packets overtake it.
    pub reorder: f64,
    pub reorder_window_ns: u64,
    pub corrupt: f64,
    /// One-way base latency.
    pub latency_ns: u64,
    /// Time each sender takes to put one byte on the link (its rate; 10 is 100 MB/s), 0 for
    /// none: a sender's packets leave one after another, so a burst arrives spread out over
    /// its size divided by the rate, behind whatever that sender put on the link before.
    pub byte_ns: u64,
}

impl Faults {
    pub const NONE: Faults = Faults {
        drop: 0.0,
        duplicate: 0.0,
        reorder: 0.0,
        reorder_window_ns: 0,
        corrupt: 0.0,
        latency_ns: 2_000,
        byte_ns: 0,
    };
    /// A lossy link: 10% loss, with duplication and reordering.
    pub const LOSSY: Faults = Faults {
        drop: 0.10,
        duplicate: 0.10,
        reorder: 0.10,
        reorder_window_ns: 20_000,
        corrupt: 0.01,
        latency_ns: 2_000,
        byte_ns: 0,
    };
}

/// One datagram in flight.
#[derive(Debug, PartialEq, Eq)]
pub struct InFlight {
    pub at: Instant,
    seq: u64,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub data: Vec<u8>,
}

impl Ord for InFlight {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // BinaryHeap is a max-heap: earliest delivery first, then send order.
        o.at.cmp(&self.at).then(o.seq.cmp(&self.seq))
    }
}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// The packets in flight on a simulated link and the fault model that put them there. One
/// piece of code for both simulators: [`Sim`] steps it in its own virtual time, and the
/// driver's `SimNet` (`crate::driver::simnet`) delivers from it in tokio time.
#[derive(Debug, Default)]
pub struct Wire {
    queue: BinaryHeap<InFlight>,
    seq: u64,
    /// When each sender's link is free again (see [`Faults::byte_ns`]).
    busy: Vec<(SocketAddr, u64)>,
}

impl Wire {
    /// Put `data`, sent at `now`, on the wire under `faults`: dropped, duplicated,
    /// corrupted or delayed past later packets as `rng` decides, all of it counted in
    /// `stats`. `cut`: the two ends are partitioned, so the packet is lost.
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &mut self,
        f: &Faults,
        rng: &mut SmallRng,
        stats: &mut LinkStats,
        now: Instant,
        src: SocketAddr,
        dst: SocketAddr,
        data: &[u8],
        cut: bool,
    ) {
        stats.sent += 1;
        // Serialization: the packet leaves once the sender's earlier ones have, lost or not.
        let mut leave = now.0;
        if f.byte_ns > 0 {
            let i = match self.busy.iter().position(|&(a, _)| a == src) {
                Some(i) => i,
                None => {
                    self.busy.push((src, 0));
                    self.busy.len() - 1
                }
            };
            leave = leave.max(self.busy[i].1) + f.byte_ns * data.len() as u64;
            self.busy[i].1 = leave;
        }
        if cut || rng.random_bool(f.drop) {
            stats.dropped += 1;
            return;
        }
        let copies = if rng.random_bool(f.duplicate) {
            stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut data = data.to_vec();
            if rng.random_bool(f.corrupt) && !data.is_empty() {
                let at = rng.random_range(0..data.len());
                data[at] ^= 1 << rng.random_range(0..8);
                stats.corrupted += 1;
            }
            let mut delay = leave - now.0 + f.latency_ns;
            if f.reorder_window_ns > 0 && rng.random_bool(f.reorder) {
                delay += rng.random_range(0..f.reorder_window_ns);
                stats.reordered += 1;
            }
            self.seq += 1;
            self.queue.push(InFlight {
                at: Instant(now.0 + delay),
                seq: self.seq,
                src,
                dst,
                data,
            });
        }
    }

    /// When the next packet arrives.
    pub fn next_delivery(&self) -> Option<Instant> {
        self.queue.peek().map(|p| p.at)
    }

    /// The next packet due by `now`, in delivery order (time, then send order).
    pub fn pop_due(&mut self, now: Instant) -> Option<InFlight> {
        if self.queue.peek().is_some_and(|p| p.at <= now) {
            self.queue.pop()
        } else {
            None
        }
    }

    /// Drop everything in flight.
    pub fn clear(&mut self) {
        self.queue.clear();
        self.busy.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Link statistics, for tests that want to see the faults happened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub sent: u64,
    pub delivered: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    pub undeliverable: u64,
}

/// The simulated world: devices, the link between them and the clock.
pub struct Sim {
    pub seed: u64,
    pub now: Instant,
    pub faults: Faults,
    pub devices: Vec<Device>,
    /// Pairs of device indices whose traffic is cut, both ways.
    pub partitions: Vec<(usize, usize)>,
    pub link: LinkStats,
    rng: SmallRng,
    wire: Wire,
    buf: Vec<u8>,
}

/// A device address on the simulated network: 10.0.0.x would leave the machine in a real
/// run, so the simulator uses loopback addresses even though nothing is ever sent.
pub fn sim_addr(i: usize) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 1, (i + 1) as u8)), 4791)
}

/// A plausible identity for simulated device `i`, generation-independent.
pub fn sim_identity(i: usize) -> DeviceIdentity {
    DeviceIdentity::from_mac(
        &format!("srxe{i}"),
        [0x52, 0x54, 0x00, 0x00, 0x00, i as u8],
        PciAddr::new(0, 0x3b, i as u8, 0),
    )
}

impl Sim {
    pub fn new(seed: u64, faults: Faults, n_devices: usize) -> Sim {
        let mut rng = SmallRng::seed_from_u64(seed);
        let devices = (0..n_devices)
            .map(|i| {
                Device::new_seeded(DeviceConfig {
                    identity: sim_identity(i),
                    addr: sim_addr(i),
                    icrc: IcrcCheck::Verify,
                    peer_port: None,
                    seed: rng.random(),
                })
            })
            .collect();
        Sim {
            seed,
            now: Instant(1_000_000),
            faults,
            devices,
            partitions: Vec::new(),
            link: LinkStats::default(),
            rng,
            wire: Wire::default(),
            buf: Vec::with_capacity(4200),
        }
    }

    fn index_of(&self, addr: SocketAddr) -> Option<usize> {
        self.devices.iter().position(|d| d.addr() == addr)
    }

    fn partitioned(&self, a: usize, b: usize) -> bool {
        self.partitions
            .iter()
            .any(|&(x, y)| (x == a && y == b) || (x == b && y == a))
    }

    /// Replace device `i` with a fresh context (after a reset or re-plug), keeping or
    /// changing its identity.
    pub fn replace_device(&mut self, i: usize, identity: DeviceIdentity) {
        let seed = self.rng.random();
        self.devices[i] = Device::new_seeded(DeviceConfig {
            identity,
            addr: sim_addr(i),
            icrc: IcrcCheck::Verify,
            peer_port: None,
            seed,
        });
    }

    /// Collect every packet the devices want to send and put it on the link, without
    /// moving time (what [`Sim::step`] does first; a test calls it to put packets on the link
    /// while a partition is up, i.e. to lose exactly those).
    pub fn pump_transmit(&mut self) {
        for i in 0..self.devices.len() {
            loop {
                self.buf.clear();
                let Some(dst) = self.devices[i].poll_transmit(self.now, &mut self.buf) else {
                    break;
                };
                let src = self.devices[i].addr();
                let cut = self.index_of(dst).is_some_and(|to| self.partitioned(i, to));
                self.wire.send(
                    &self.faults,
                    &mut self.rng,
                    &mut self.link,
                    self.now,
                    src,
                    dst,
                    &self.buf,
                    cut,
                );
            }
        }
    }

    /// The next instant something happens: a delivery or a device timer.
    pub fn next_event(&self) -> Option<Instant> {
        let q = self.wire.next_delivery();
        let t = self.devices.iter().filter_map(|d| d.poll_timeout()).min();
        match (q, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Send what is ready, then advance to the next event and process it. Returns false
    /// when nothing is left to do (the world is quiet).
    pub fn step(&mut self) -> bool {
        self.pump_transmit();
        let Some(next) = self.next_event() else {
            return false;
        };
        if next > self.now {
            self.now = next;
        }
        while let Some(p) = self.wire.pop_due(self.now) {
            match self.index_of(p.dst) {
                Some(i) => {
                    self.link.delivered += 1;
                    self.devices[i].handle_datagram(self.now, p.src, &p.data);
                }
                None => self.link.undeliverable += 1,
            }
        }
        for d in &mut self.devices {
            if d.poll_timeout().is_some_and(|t| t <= self.now) {
                d.handle_timeout(self.now);
            }
        }
        self.pump_transmit();
        true
    }

    /// Step until `done` holds or `limit` of virtual time passes. Returns whether `done`.
    pub fn run_until(
        &mut self,
        limit: std::time::Duration,
        mut done: impl FnMut(&mut Sim) -> bool,
    ) -> bool {
        let end = self.now + limit;
        loop {
            if done(self) {
                return true;
            }
            if self.now >= end || !self.step() {
                return done(self);
            }
        }
    }

    /// Drop everything in flight (e.g. at a device reset, packets to the old context).
    pub fn clear_link(&mut self) {
        self.wire.clear();
    }
}

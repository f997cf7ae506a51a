//! The tokio driver: one task per open soft-HCA context owns its port (a UDP socket, or a
//! port on a simulated network, see [`Fabric`]) and its timer, feeds the sans-I/O [`Device`]
//! with datagrams and `now` (tokio's clock, so paused time pauses it), and sends what it
//! produces.
//! Applications reach the device through a [`SoftHca`] handle; completions wake them through
//! a [`tokio::sync::Notify`]. `backend` puts the soft-HCA behind the host's backend seam
//! ([`crate::verbs`]), with [`CmService`] as its connection manager.

mod backend;
pub mod cm;
mod fabric;
mod handoff;
pub mod local;
pub mod manager;
mod metrics_pub;
mod port;
pub mod simnet;
mod socket;
mod spin;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::hca::device::{Device, DeviceConfig};
use crate::timer::EarliestTimer;
use crate::verbs::CqId;
use crate::verbs::Instant;
use crate::verbs::Lifecycle;
use crate::verbs::{AsyncEvent, WorkCompletion};

pub use cm::CmService;
pub use fabric::Fabric;
pub use manager::{DeviceManager, ManagerError};
use port::PacketPort;
pub use simnet::SimNet;
pub use socket::{bind_roce_socket, RxBatch, TxBatch};

/// The busy-poll window new contexts start with, in ns (see [`SoftHca::set_busy_poll`]).
static DEFAULT_BUSY_POLL_NS: AtomicU64 = AtomicU64::new(0);

/// The window the command-line tools and the fio plugin use unless told otherwise.
pub const TOOL_BUSY_POLL: Duration = Duration::from_micros(50);

/// Set the busy-poll window of every soft-HCA context this process starts from now on
/// (also after resets and re-plugs). Off (zero) unless set; the CLI's `--busy-poll` and the
/// fio plugin's `busy_poll` option set it.
pub fn set_default_busy_poll(window: Duration) {
    DEFAULT_BUSY_POLL_NS.store(window_ns(window), Ordering::Relaxed);
}

/// The busy-poll window new contexts start with ([`set_default_busy_poll`]).
pub fn default_busy_poll() -> Duration {
    Duration::from_nanos(DEFAULT_BUSY_POLL_NS.load(Ordering::Relaxed))
}

/// Whether busy polling yields to other threads while the spinner is being preempted
/// ([`spin::SpinGate`]); off unless set.
static BUSY_POLL_GATE: AtomicBool = AtomicBool::new(false);

/// Hold busy polling off while the spinning thread is preempted (the CLI's
/// `--busy-poll-gate`, the fio plugin's `busy_poll_gate=1`). Off by default: on the 2-core
/// test machine it cuts host + target CPU per 4 KiB QD32 I/O by about a third when the
/// cores are oversubscribed, but with host and target alone on them it costs IOPS
/// (`nvmf-rdma bench`: 0.56x randwrite, 0.75x randread at QD32), so it is for a host whose
/// cores the application needs more than the initiator's latency does.
pub fn set_busy_poll_gate(on: bool) {
    BUSY_POLL_GATE.store(on, Ordering::Relaxed);
}

/// A busy-poll window as stored: nanoseconds, saturating.
fn window_ns(window: Duration) -> u64 {
    u64::try_from(window.as_nanos()).unwrap_or(u64::MAX)
}

/// Shared between the handle(s) and the driver task.
struct Shared {
    dev: Mutex<Device>,
    /// The driver has new work (a post, a modify, a lifecycle change): `kick` wakes a
    /// sleeping driver, `kicked` is what a busy-polling one reads ([`Shared::poke`]).
    kick: Notify,
    kicked: AtomicBool,
    /// Completions, async events or MADs are available.
    wake: Wakes,
    /// Zero of the device's virtual clock (tokio time).
    epoch: tokio::time::Instant,
    /// Set when the driver task has ended and closed the socket.
    stopped: tokio::sync::watch::Sender<bool>,
    /// Busy-poll window in ns (0: off); see [`SoftHca::set_busy_poll`].
    busy_poll_ns: AtomicU64,
    /// On a simulated network: the seed this context's CM draws from. `None` on a real
    /// network, where everything secret comes from the OS CSPRNG.
    replay_seed: Option<u64>,
}

/// Whom the driver wakes, and for what: the waiters of one CQ when it has completions, the
/// CM and event waiters when async events or MADs arrive, everyone when the device dies.
///
/// One `Notify` for all of it woke every CQ's consumer, the CM's MAD pump and event waiters
/// for each completion: at QD1 several tasks polled (each locking the device, the pump also
/// re-arming its timer) where one had work, 1.7 µs of the host's side of the round trip.
struct Wakes {
    /// Per CQ, created by its first waiter. An entry nobody holds is dropped once the list
    /// grows past [`Wakes::KEEP`] (CQs of torn-down connections): a waiter keeps its own
    /// clone from before it checks the CQ until it is woken, so no wakeup is lost.
    cqs: Mutex<Vec<(CqId, Arc<Notify>)>>,
    events: Arc<Notify>,
}

impl Wakes {
    const KEEP: usize = 16;

    fn new() -> Wakes {
        Wakes {
            cqs: Mutex::new(Vec::new()),
            events: Arc::new(Notify::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(CqId, Arc<Notify>)>> {
        self.cqs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The notifier of `cq`.
    fn cq(&self, cq: CqId) -> Arc<Notify> {
        let mut l = self.lock();
        if let Some((_, n)) = l.iter().find(|(c, _)| *c == cq) {
            return n.clone();
        }
        if l.len() >= Self::KEEP {
            l.retain(|(_, n)| Arc::strong_count(n) > 1);
        }
        let n = Arc::new(Notify::new());
        l.push((cq, n.clone()));
        n
    }

    /// Wake the waiters of the CQs in `dirty`.
    fn completions(&self, dirty: &[CqId]) {
        for (c, n) in self.lock().iter() {
            if dirty.contains(c) {
                n.notify_waiters();
            }
        }
    }

    /// The device died: wake everyone, to find it so.
    fn all(&self) {
        for (_, n) in self.lock().iter() {
            n.notify_waiters();
        }
        self.events.notify_waiters();
    }
}

impl Shared {
    /// Tell the driver it has work: the flag, which a busy-polling driver reads after each
    /// yield, and the `Notify`, which wakes a sleeping driver or schedules a spinning one
    /// at once (with nobody waiting it only stores a permit, no wakeup).
    fn poke(&self) {
        self.kicked.store(true, Ordering::Release);
        self.kick.notify_one();
    }
}

/// A handle to a running soft-HCA context. Cheap to clone.
#[derive(Clone)]
pub struct SoftHca {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl std::fmt::Debug for SoftHca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SoftHca({})", self.addr)
    }
}

impl SoftHca {
    /// Bind the device's UDP socket (port 0 picks one) and start its driver task on the
    /// current tokio runtime.
    pub async fn start(config: DeviceConfig) -> std::io::Result<SoftHca> {
        Self::start_with(config, true).await
    }

    /// As [`SoftHca::start`], choosing whether UDP segmentation offload (GSO/GRO) is used.
    /// Offload is for soft-HCA peers; turn it off towards rxe or a NIC (see `socket`). With
    /// offload the loopback path to contexts of this process is on too ([`Fabric::Udp`]).
    pub async fn start_with(config: DeviceConfig, offload: bool) -> std::io::Result<SoftHca> {
        let fabric = Fabric::Udp {
            offload,
            loopback: offload,
        };
        Self::start_on(config, &fabric).await
    }

    /// Start a context attached to `fabric`: bound to `config.addr` (port 0 picks one). On
    /// UDP its keys and QPNs come from the OS CSPRNG; on a simulated network from a seed
    /// derived from the network's seed and `config.seed`, so that the run replays.
    pub async fn start_on(mut config: DeviceConfig, fabric: &Fabric) -> std::io::Result<SoftHca> {
        match fabric {
            Fabric::Udp { offload, loopback } => {
                let port = port::UdpPort::bind(config.addr, *offload, *loopback, config.icrc)?;
                config.addr = port.local_addr();
                Ok(Self::launch(Device::new(config), port, None))
            }
            Fabric::Sim(net) => {
                let port = net.bind(config.addr)?;
                config.addr = port.addr();
                config.seed = net.seed_for(config.seed);
                let cm_seed = simnet::mix(config.seed, 0xC0);
                Ok(Self::launch(
                    Device::new_seeded(config),
                    port,
                    Some(cm_seed),
                ))
            }
        }
    }

    fn launch<P: PacketPort>(mut dev: Device, port: P, replay_seed: Option<u64>) -> SoftHca {
        let addr = port.local_addr();
        dev.set_icrc_by_port(port.fills_icrc());
        dev.set_in_memory_path(port.in_memory_path());
        let shared = Arc::new(Shared {
            dev: Mutex::new(dev),
            kick: Notify::new(),
            kicked: AtomicBool::new(false),
            wake: Wakes::new(),
            epoch: tokio::time::Instant::now(),
            stopped: tokio::sync::watch::channel(false).0,
            busy_poll_ns: AtomicU64::new(DEFAULT_BUSY_POLL_NS.load(Ordering::Relaxed)),
            replay_seed,
        });
        let task_shared = shared.clone();
        crate::harness::alloc_audit::spawn(async move {
            let done = task_shared.clone();
            if let Err(e) = drive(task_shared, port).await {
                tracing::error!(error = %e, "soft-HCA driver stopped");
                // A dead socket is a dead device.
                done.dev.lock().unwrap_or_else(|e| e.into_inner()).fatal();
                done.wake.all();
            }
            // `drive` returned, so the socket is closed.
            done.stopped.send_replace(true);
        });
        SoftHca { shared, addr }
    }

    /// The seed this context's CM draws from on a simulated network; `None` on a real one.
    pub fn replay_seed(&self) -> Option<u64> {
        self.shared.replay_seed
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Is `other` a handle to this same context (not merely the same address)?
    pub fn same(&self, other: &SoftHca) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Busy polling: after a turn that moved packets, the driver keeps polling its socket
    /// for `window` (yielding to the runtime's other tasks between polls) before it sleeps.
    /// A thread that sleeps has to be woken for the next packet, and on a virtual machine
    /// that wakeup is most of a queue-depth-1 round trip; polling costs a core while I/O
    /// flows and nothing once it stops. Zero (the default) turns it off.
    pub fn set_busy_poll(&self, window: Duration) {
        self.shared
            .busy_poll_ns
            .store(window_ns(window), Ordering::Relaxed);
    }

    /// The device's virtual "now".
    pub fn now(&self) -> Instant {
        Instant(self.shared.epoch.elapsed().as_nanos() as u64)
    }

    fn lock(&self) -> MutexGuard<'_, Device> {
        self.shared.dev.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `f` on the device (verbs calls), then wake the driver to send what it queued.
    pub fn with<R>(&self, f: impl FnOnce(&mut Device, Instant) -> R) -> R {
        let now = self.now();
        let r = crate::harness::alloc_audit::platform(|| f(&mut self.lock(), now));
        self.shared.poke();
        r
    }

    /// Run `f` on the device without waking the driver: for reads and for work that queues
    /// nothing to send (the caller kicks with [`SoftHca::kick`] if it did).
    pub fn with_quiet<R>(&self, f: impl FnOnce(&mut Device, Instant) -> R) -> R {
        let now = self.now();
        crate::harness::alloc_audit::platform(|| f(&mut self.lock(), now))
    }

    /// Wake the driver to transmit what was queued.
    pub fn kick(&self) {
        self.shared.poke();
    }

    /// Wait until `cq` has completions, then move up to `max` of them into `out`.
    /// Returns 0 only if the device died with nothing left to reap.
    pub async fn wait_cq(&self, cq: CqId, max: usize, out: &mut Vec<WorkCompletion>) -> usize {
        // The device's own bookkeeping (a CQ's first waiter makes its notifier), as
        // `with`'s work is: platform code to the allocation audit.
        let wake = crate::harness::alloc_audit::platform(|| self.shared.wake.cq(cq));
        loop {
            let notified = wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Polling queues nothing to send, so the driver is not kicked.
            let (n, live) = self.with_quiet(|d, _| (d.poll_cq(cq, max, out), d.is_live()));
            if n > 0 || !live {
                return n;
            }
            notified.await;
        }
    }

    /// Next asynchronous event, waiting for one.
    pub async fn next_event(&self) -> AsyncEvent {
        loop {
            let notified = self.shared.wake.events.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(e) = self.lock().poll_event() {
                return e;
            }
            notified.await;
        }
    }

    /// The notifier the driver pings when async events or MADs arrive, or the device dies
    /// (completions wake only their CQ's waiters, [`SoftHca::wait_cq`]). Consumers
    /// `enable()` a `notified()` before checking, so no wakeup is lost.
    pub fn event_handle(&self) -> Arc<Notify> {
        self.shared.wake.events.clone()
    }

    /// Wait until the driver task has ended and its UDP port is free again.
    pub async fn stopped(&self) {
        let mut rx = self.shared.stopped.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    pub fn lifecycle(&self) -> Lifecycle {
        self.lock().lifecycle()
    }

    /// Inflict a fatal error (a reset): the context becomes a zombie, the driver task ends
    /// and releases the UDP port so the device can come back on it.
    pub fn fatal(&self) {
        self.lock().fatal();
        self.shared.poke();
        self.shared.wake.all();
    }

    /// Hot-remove the device behind this context.
    pub fn remove(&self) {
        self.lock().remove();
        self.shared.poke();
        self.shared.wake.all();
    }
}

/// Most packets one turn of the driver loop builds before it looks at what came in again.
const TURN_PACKETS: usize = 256;
/// ... and most bytes: 256 full packets of the largest MTU with their headers, what a turn
/// queued for a peer before packets on the in-memory path grew to four times that
/// (`QpAttr::in_memory_seg`); without it one turn could put 4 MiB, half its inbox, in a
/// peer's inbox. The headers are counted so that over UDP a turn still ends at 256 full
/// packets, not a few short of it.
const TURN_BYTES: usize = TURN_PACKETS * (4096 + 128);

/// The driver loop: receive a batch, advance timers, transmit everything ready, publish
/// metrics, wake waiters; sleep until the next datagram, deadline or kick.
async fn drive<P: PacketPort>(shared: Arc<Shared>, mut port: P) -> std::io::Result<()> {
    let mut dirty = Vec::new();
    let name = shared
        .dev
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .identity()
        .name
        .clone();
    let mut metrics = metrics_pub::publisher(&name);
    // While busy polling, the counters are published at most every `PUBLISH_EVERY_NS` (and
    // once more before the driver sleeps); a sleeping driver publishes every turn.
    let mut publish_at = 0u64;
    let mut unpublished = false;
    let mut last_activity = u64::MAX;
    // One timer for the life of the driver, moved only earlier (see `EarliestTimer`): a
    // deadline that slides forward every turn (an ACK's, a retransmit timer's) must not
    // reset it every turn.
    let timer = EarliestTimer::new();
    tokio::pin!(timer);
    let epoch = shared.epoch;
    // Busy polling: after a turn that moved packets, keep checking the socket (yielding to
    // the runtime's other tasks in between, see `spin`) instead of sleeping, for `busy_poll`.
    let mut spin_until: Option<std::time::Instant> = None;
    // Where the busy-poll window proper ends (`spin_until` may reach past it for a device
    // deadline): what an answer must come before (see `spin::AnswerGate`).
    let mut window: Option<std::ops::Range<std::time::Instant>> = None;
    // ... only while spells are answered, and (opt-in) not while spinning takes a core
    // someone else wants (see `spin`).
    let mut answers = spin::AnswerGate::default();
    // When packets last crossed the network (see `spin::Spell::InProcess`).
    let mut network_at: Option<std::time::Instant> = None;
    let mut network_seen = 0;
    let mut gate = spin::SpinGate::default();
    // Received MADs wait in the device for the CM's pump (see `handoff`).
    let mut gsi = handoff::HandOff::default();
    loop {
        let spinning = spin_until.filter(|&t| std::time::Instant::now() < t);
        let deadline = {
            let d = shared.dev.lock().unwrap_or_else(|e| e.into_inner());
            if !d.is_live() {
                metrics.publish(d.stats());
                return Ok(());
            }
            if unpublished && spinning.is_none() {
                // About to sleep: what the last turns did is published before.
                metrics.publish(d.stats());
            }
            d.poll_timeout()
        };
        if let Some(t) = deadline {
            let at = epoch + Duration::from_nanos(t.0);
            timer.as_mut().arm(at);
        }
        if spinning.is_none() {
            // A window that ran out during a turn: no spell, no verdict.
            window = None;
        }
        match spinning {
            Some(until) => {
                let due = deadline.map(|t| epoch.into_std() + Duration::from_nanos(t.0));
                let seen = spin(&shared, &mut port, until, due, network_at).await;
                if let Some(w) = window.take() {
                    answers.spell_ended(seen.at, spin::spell(seen, w));
                }
            }
            None => tokio::select! {
                biased;
                r = port.readable() => { r?; }
                _ = shared.kick.notified() => {}
                _ = &mut timer => {}
            },
        }
        // Receive whatever is queued (bounded), then let the core react all at once: that
        // is where ACK coalescing comes from.
        let n = port.recv()?;
        if n > 0 {
            tracing::trace!(device = %name, n, "received");
        }
        let mut next = 0;
        let (mut d, now) = loop {
            {
                let mut d = shared.dev.lock().unwrap_or_else(|e| e.into_inner());
                d.set_loopback_full(port.overflows());
                let now = Instant(epoch.elapsed().as_nanos() as u64);
                match handle_received(&mut d, &port, next..n, now, &mut gsi) {
                    None => break (d, now),
                    Some(stop) => next = stop,
                }
            }
            // The MAD queue is full and packets of this batch are left: its reader (the
            // CM's pump) runs first, and the batch goes on where it stopped.
            shared.wake.events.notify_waiters();
            tokio::task::yield_now().await;
        };
        if d.poll_timeout().is_some_and(|t| t <= now) {
            d.handle_timeout(now);
        }
        // Collect a bounded batch under the lock, send it after releasing the lock.
        let (mut sent, mut bytes) = (0, 0);
        while sent < TURN_PACKETS && bytes < TURN_BYTES {
            let buf = port.tx_buf();
            let start = buf.len();
            let Some(dst) = d.poll_transmit(now, buf) else {
                break;
            };
            bytes += buf.len() - start;
            port.push(dst, start);
            sent += 1;
        }
        let more = sent >= TURN_PACKETS || bytes >= TURN_BYTES;
        d.take_dirty_cqs(&mut dirty);
        let act = d.activity();
        let events = act != last_activity;
        last_activity = act;
        if spin_until.is_none() || now.0 >= publish_at {
            metrics.publish(d.stats());
            publish_at = now.0 + PUBLISH_EVERY_NS;
            unpublished = false;
        } else {
            unpublished = true;
        }
        let next_deadline = d.poll_timeout();
        drop(d);
        if sent > 0 {
            tracing::trace!(device = %name, n = sent, "sending");
        }
        let busy_poll = shared.busy_poll_ns.load(Ordering::Relaxed);
        if busy_poll > 0 && port.busy_poll() {
            let t = std::time::Instant::now();
            let network = port.network_packets();
            if network != network_seen {
                network_seen = network;
                network_at = Some(t);
            }
            if n > 0 || sent > 0 {
                let allowed = answers.allow(t)
                    && (!BUSY_POLL_GATE.load(Ordering::Relaxed)
                        || gate.allow(t, n + sent, spin::thread_preemptions));
                window = allowed.then(|| t..t + Duration::from_nanos(busy_poll));
                spin_until = window.as_ref().map(|w| w.end);
            }
            let next = next_deadline.map(|d| epoch.into_std() + Duration::from_nanos(d.0));
            spin_until = spin::spin_until(spin_until, t, next);
        }
        port.flush();
        if more {
            shared.poke();
        }
        if !dirty.is_empty() {
            shared.wake.completions(&dirty);
            dirty.clear();
        }
        if events {
            shared.wake.events.notify_waiters();
        }
    }
}

/// Hand packets `range` of the port's last receive to the device. `Some(i)` when packet
/// `i` found the device's queue of received MADs full and its reader should run first
/// ([`handoff::HandOff`]); packets before it were handed over.
fn handle_received<P: PacketPort>(
    d: &mut Device,
    port: &P,
    range: std::ops::Range<usize>,
    now: Instant,
    gsi: &mut handoff::HandOff,
) -> Option<usize> {
    for i in range {
        if gsi.wait(d.gsi_full()) {
            return Some(i);
        }
        match port.get(i) {
            port::Received::Udp(src, data) => d.handle_datagram(now, src, data),
            port::Received::HostUdp(src, data) => d.handle_host_datagram(now, src, data),
            port::Received::Ipv4(datagram) => d.handle_ipv4(now, datagram),
            port::Received::Loopback(src, data) => d.handle_loopback(now, src, data),
        }
    }
    None
}

/// How often a busy-polling driver publishes its counters: comparing and copying them
/// every turn was a tenth of a turn's cost, and a scrape comes every few seconds.
const PUBLISH_EVERY_NS: u64 = 1_000_000;

/// Busy polling between turns: yield to the runtime's other tasks, then read flags only (a
/// post or lifecycle change poked the driver, the port has input, the device's next
/// deadline or the end of the window came), until one says there is a turn to run; what
/// it saw of the spell, with whether a packet crossed the network (last at `network_at`)
/// recently enough for a late answer to count against the peer.
///
/// Between yields nothing is made again: the kick waiter is registered once per spell, and
/// the inbox, the socket and the clock are only read. A spin iteration that went through
/// the `select!` of a sleeping driver (three waiters made and dropped, the timer polled)
/// cost 1.4-2 µs here (docs/performance.md, "A QD1 round trip"); and with no
/// waiter on the inbox, a loopback delivery to a spinning peer only stores a permit instead
/// of waking it, which for a driver on another thread was a write to its runtime's eventfd.
async fn spin<P: PacketPort>(
    shared: &Shared,
    port: &mut P,
    until: std::time::Instant,
    due: Option<std::time::Instant>,
    network_at: Option<std::time::Instant>,
) -> spin::Looked {
    // Registered once per spell, so a post by another task of this runtime schedules the
    // driver at once instead of after the runtime's next look at its I/O and timers.
    let kick = shared.kick.notified();
    tokio::pin!(kick);
    kick.as_mut().enable();
    let mut last = std::time::Instant::now();
    let mut longest_gap = Duration::ZERO;
    loop {
        let kicked = tokio::select! {
            biased;
            _ = &mut kick => true,
            _ = tokio::task::yield_now() => false,
        };
        let now = std::time::Instant::now();
        longest_gap = longest_gap.max(now.saturating_duration_since(last));
        last = now;
        let input = kicked || shared.kicked.swap(false, Ordering::AcqRel) || port.has_input();
        if input || now >= until || due.is_some_and(|d| now >= d) {
            return spin::Looked {
                input,
                at: now,
                longest_gap,
                network_peer: network_at
                    .is_some_and(|t| now.saturating_duration_since(t) < spin::UNANSWERED_HOLD_OFF),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    /// Is the waiter `n` woken (its `Notified` ready) after `f` runs?
    fn woken(n: &Notify, f: impl FnOnce()) -> bool {
        let mut w = pin!(n.notified());
        w.as_mut().enable();
        f();
        let mut cx = Context::from_waker(Waker::noop());
        matches!(w.as_mut().poll(&mut cx), Poll::Ready(()))
    }

    #[test]
    fn a_completion_wakes_its_own_cq_and_no_one_else() {
        let w = Wakes::new();
        let (a, b) = (w.cq(CqId(1)), w.cq(CqId(2)));
        assert!(Arc::ptr_eq(&a, &w.cq(CqId(1))), "one notifier per CQ");
        assert!(woken(&a, || w.completions(&[CqId(1)])));
        assert!(!woken(&b, || w.completions(&[CqId(1)])));
        assert!(!woken(&w.events, || w.completions(&[CqId(1), CqId(2)])));
        // The device died: everyone looks.
        assert!(woken(&b, || w.all()));
        assert!(woken(&w.events, || w.all()));
    }

    #[test]
    fn only_notifiers_nobody_holds_are_dropped() {
        let w = Wakes::new();
        let held = w.cq(CqId(0));
        for i in 1..=(Wakes::KEEP as u32 * 3) {
            drop(w.cq(CqId(i)));
        }
        assert!(w.lock().len() <= Wakes::KEEP + 1, "the list stays bounded");
        // A waiter's notifier survives the pruning: the driver still reaches it.
        assert!(woken(&held, || w.completions(&[CqId(0)])));
    }
}

//! The loopback path: soft-HCA contexts in one process hand each other their packets in
//! memory instead of through the kernel's UDP stack, as Linux rxe does for a destination
//! that is one of its own devices (`rxe_loopback`). The packets are the same bytes but for
//! the ICRC, which the sending device leaves zero (its port computes ICRCs only for what it
//! sends over UDP, `Device::set_icrc_by_port`), and go through the same receive path, except
//! that the receiver does not check their ICRC (they never left the process;
//! `Stats::rx_loopback` counts them). Only
//! the socket is skipped, which on loopback costs a system call and a walk of the IP stack
//! per run of packets, with the receiver's half of that walk done in the sender's thread.
//!
//! A context takes part when its UDP port is bound to a specific address (not a wildcard),
//! uses offload (soft-HCA peers only; towards rxe or a NIC offload is off) and reads its
//! datagrams from the UDP socket (not a raw socket for real-header ICRC checks). It then
//! registers an `Inbox` under its address; a sender whose destination is a registered
//! address in this process appends the packet there instead of sending it. Anything else
//! (another process, a proxy, rxe) still goes over UDP. A context started with
//! `Fabric::Udp { loopback: false, .. }` stays off it, and `NVMF_RDMA_LOOPBACK=udp` in the
//! environment keeps every context of the process off it (to measure the socket path, or to
//! put nftables between two contexts of one process).
//!
//! What a link does is kept: an inbox holds at most `INBOX_BYTES` (8 MiB) and drops what
//! does not fit (RC retransmits, as for a full socket buffer), and a context that is gone
//! (reset, hot-remove) takes its inbox with it, so packets to it are lost as they would be
//! on UDP.
//! Steady state allocates nothing: senders and receiver swap buffers that keep their
//! capacity.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, Weak};

use tokio::sync::Notify;

/// Most bytes an inbox holds before it drops packets (a socket's receive buffer plays the
/// same part on UDP).
pub(crate) const INBOX_BYTES: usize = 8 << 20;

/// A sender hands over what it has built for local peers whenever it reaches this many
/// bytes, not only at the end of its turn: the receiver's thread then works on the first
/// packets of a large transfer while the sender builds the rest, as a NIC's receiver starts
/// on a message's first packets while the sender's are still on the wire. Without it a turn
/// (up to 256 packets, a megabyte of 4 KiB payloads) reached the peer in one piece, so the
/// two threads took turns instead of overlapping: a 128 KiB write at QD8 ran no faster than
/// at QD1. Half a 128 KiB transfer: with writes in their capsules at any depth, a QD32 turn
/// of 4 KiB writes is 130 KiB of capsules, which a 128 KiB threshold handed over only at
/// the turn's end (own loop, 3 rounds: 4 KiB QD32 writes 188-247 K IOPS at 128 KiB,
/// 322-382 K at 64 KiB, 128 KiB transfers level; docs/performance.md).
pub(crate) const DELIVER_EARLY_BYTES: usize = 64 << 10;

/// Destinations a sender remembers the way to (see [`LocalLink::route`]).
const MAX_CACHED_PEERS: usize = 16;

/// Packets queued for one context, in arrival order, back to back in `buf`.
#[derive(Default)]
struct Queue {
    buf: Vec<u8>,
    /// (source, start, length)
    pkts: Vec<(SocketAddr, usize, usize)>,
}

impl Queue {
    fn with_capacity() -> Queue {
        Queue {
            buf: Vec::with_capacity(256 << 10),
            pkts: Vec::with_capacity(256),
        }
    }

    fn clear(&mut self) {
        self.buf.clear();
        self.pkts.clear();
    }
}

/// A context's receive queue on the loopback path.
pub(crate) struct Inbox {
    addr: SocketAddr,
    q: Mutex<Queue>,
    /// Something is queued (set and cleared under the lock; read without it).
    pending: AtomicBool,
    /// The context is gone: what is sent here is lost.
    closed: AtomicBool,
    wake: Notify,
    /// Packets dropped because the inbox was full.
    dropped: AtomicU64,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Every inbox of this process by address, and a generation that moves whenever one comes
/// or goes (senders cache their lookups until it moves).
struct Registry {
    map: Mutex<BTreeMap<SocketAddr, Weak<Inbox>>>,
    generation: AtomicU64,
}

/// This process's registry: null until first used, and again in a child just forked.
static REGISTRY: AtomicPtr<Registry> = AtomicPtr::new(std::ptr::null_mut());

fn registry() -> &'static Registry {
    let r = REGISTRY.load(Ordering::Acquire);
    // SAFETY: REGISTRY holds null or a leaked box, which is never freed.
    if let Some(r) = unsafe { r.as_ref() } {
        return r;
    }
    static AT_FORK: Once = Once::new();
    AT_FORK.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
        // Without it (the call fails only for want of memory) a child shares the parent's
        // registry, as before: its lookups find inboxes no thread of its own drains.
        unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    });
    let new = Box::into_raw(Box::new(Registry {
        map: Mutex::new(BTreeMap::new()),
        generation: AtomicU64::new(0),
    }));
    match REGISTRY.compare_exchange(r, new, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: just leaked, never freed.
        Ok(_) => unsafe { &*new },
        Err(won) => {
            // SAFETY: `new` was never shared; `won` is another thread's leaked box.
            drop(unsafe { Box::from_raw(new) });
            unsafe { &*won }
        }
    }
}

/// In the child of a fork (fio's `thread=0` jobs): start a registry of the child's own.
/// The parent's stays behind, with inboxes whose draining threads the child does not have,
/// and with its lock perhaps held, at the moment of the fork, by one of those threads: the
/// child's copy of that lock would never be released.
extern "C" fn forked() {
    REGISTRY.store(std::ptr::null_mut(), Ordering::Release);
}

/// Whether contexts that ask for the loopback path get it: yes, unless the process was
/// started with `NVMF_RDMA_LOOPBACK=udp` in its environment.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !std::env::var("NVMF_RDMA_LOOPBACK").is_ok_and(|v| v.eq_ignore_ascii_case("udp"))
    })
}

/// Whether packets from `from` to `to` take the loopback path: both are addresses of live
/// contexts of this process that registered for it.
pub(crate) fn reaches(from: SocketAddr, to: SocketAddr) -> bool {
    if !enabled() {
        return false;
    }
    let map = registry().map.lock().unwrap_or_else(|e| e.into_inner());
    let live = |a: &SocketAddr| {
        map.get(a)
            .and_then(Weak::upgrade)
            .is_some_and(|i| !i.closed.load(Ordering::Acquire))
    };
    live(&from) && live(&to)
}

/// One context's end of the loopback path: its registered inbox, what it took from it, and
/// what it is about to deliver to others.
pub(crate) struct LocalLink {
    inbox: Arc<Inbox>,
    /// The packets of the last receive (swapped out of the inbox).
    rx: Queue,
    /// Destinations looked up since the registry's generation was `seen`: `None` is "not
    /// in this process".
    peers: Vec<(SocketAddr, Option<Arc<Inbox>>)>,
    seen: u64,
    /// Packets of this turn for local peers: (index in `peers`, start, length) in the
    /// sender's transmit buffer.
    out: Vec<(usize, usize, usize)>,
    /// Their bytes.
    out_bytes: usize,
}

impl LocalLink {
    /// Register `addr` (the port's bound address). `None` where the loopback path does not
    /// apply: turned off, or a wildcard address (a reply could not name its source).
    pub(crate) fn register(addr: SocketAddr) -> Option<LocalLink> {
        if !enabled() || addr.ip().is_unspecified() || addr.port() == 0 {
            return None;
        }
        let inbox = Arc::new(Inbox {
            addr,
            q: Mutex::new(Queue::with_capacity()),
            pending: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            wake: Notify::new(),
            dropped: AtomicU64::new(0),
        });
        let r = registry();
        r.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, Arc::downgrade(&inbox));
        r.generation.fetch_add(1, Ordering::Release);
        Some(LocalLink {
            inbox,
            rx: Queue::with_capacity(),
            peers: Vec::new(),
            seen: u64::MAX,
            out: Vec::with_capacity(256),
            out_bytes: 0,
        })
    }

    /// Resolves when a sender has queued something here (or had, before this was called).
    pub(crate) async fn readable(&self) {
        if self.inbox.pending.load(Ordering::Acquire) {
            return;
        }
        self.inbox.wake.notified().await
    }

    /// Is something queued here? A flag read: no waiter is registered.
    pub(crate) fn has_input(&self) -> bool {
        self.inbox.pending.load(Ordering::Acquire)
    }

    /// Take everything queued; returns the number of packets.
    pub(crate) fn recv(&mut self) -> usize {
        self.rx.clear();
        if self.inbox.pending.load(Ordering::Acquire) {
            let mut q = self.inbox.lock();
            std::mem::swap(&mut *q, &mut self.rx);
            self.inbox.pending.store(false, Ordering::Release);
        }
        self.rx.pkts.len()
    }

    /// Packet `i` of the last receive.
    pub(crate) fn get(&self, i: usize) -> (SocketAddr, &[u8]) {
        let (src, s, l) = self.rx.pkts[i];
        (src, &self.rx.buf[s..s + l])
    }

    /// The inbox of `dst`, if it is a context of this process.
    fn route(&mut self, dst: SocketAddr) -> Option<usize> {
        // `out` holds indices into `peers`: the list is only rebuilt between turns. Within
        // a turn a context that went away is still found (its packets are then lost, as on
        // a closed port), and an address already found empty stays on UDP.
        let generation = registry().generation.load(Ordering::Acquire);
        if generation != self.seen && self.out.is_empty() {
            self.peers.clear();
            self.seen = generation;
        }
        let i = match self.peers.iter().position(|(a, _)| *a == dst) {
            Some(i) => i,
            None => {
                if self.peers.len() >= MAX_CACHED_PEERS && self.out.is_empty() {
                    // Many peers over UDP (a target serving remote hosts): look up again
                    // rather than scan a long list for every packet.
                    self.peers.clear();
                }
                let found = registry()
                    .map
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&dst)
                    .and_then(Weak::upgrade);
                self.peers.push((dst, found));
                self.peers.len() - 1
            }
        };
        self.peers[i].1.is_some().then_some(i)
    }

    /// Take the packet `buf[start..start + len]` for `dst` if `dst` is in this process; it is
    /// delivered by [`LocalLink::deliver`], before the transmit buffer is reused.
    pub(crate) fn take(&mut self, dst: SocketAddr, start: usize, len: usize) -> bool {
        match self.route(dst) {
            Some(peer) => {
                self.out.push((peer, start, len));
                self.out_bytes += len;
                true
            }
            None => false,
        }
    }

    /// Bytes of the packets taken since the last delivery.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.out_bytes
    }

    /// Hand the local packets taken so far (bytes in `buf`) to their inboxes and wake them:
    /// at the end of a turn, or once they reach [`DELIVER_EARLY_BYTES`].
    /// `only_local`: every packet in `buf` is one of them, so when they all go to one inbox
    /// that is empty, `buf` itself becomes its queue (swapped with the inbox's empty buffer)
    /// instead of being copied.
    pub(crate) fn deliver(&mut self, buf: &mut Vec<u8>, only_local: bool) {
        let src = self.inbox.addr;
        if only_local && self.deliver_whole(buf, src) {
            return;
        }
        let mut k = 0;
        while k < self.out.len() {
            let peer = self.out[k].0;
            let Some(inbox) = self.live(peer) else {
                // Gone since the lookup: lost, as on a closed UDP port.
                k += 1;
                continue;
            };
            let mut dropped = 0u64;
            {
                let mut q = inbox.lock();
                while k < self.out.len() && self.out[k].0 == peer {
                    let (_, s, l) = self.out[k];
                    k += 1;
                    if q.buf.len() + l > INBOX_BYTES {
                        dropped += 1;
                        continue;
                    }
                    let at = q.buf.len();
                    crate::hca::copy::extend_bytes(&mut q.buf, &buf[s..s + l]);
                    q.pkts.push((src, at, l));
                }
                if !q.pkts.is_empty() {
                    inbox.pending.store(true, Ordering::Release);
                }
            }
            if dropped > 0 {
                inbox.dropped.fetch_add(dropped, Ordering::Relaxed);
                tracing::debug!(dst = %inbox.addr, dropped, "loopback inbox full");
            }
            inbox.wake.notify_one();
        }
        self.out.clear();
        self.out_bytes = 0;
    }

    /// The inbox of `peers[peer]` unless its context is gone.
    fn live(&self, peer: usize) -> Option<&Inbox> {
        self.peers[peer]
            .1
            .as_deref()
            .filter(|inbox| !inbox.closed.load(Ordering::Relaxed))
    }

    /// [`LocalLink::deliver`]'s swap; false (nothing done) unless it applies.
    fn deliver_whole(&mut self, buf: &mut Vec<u8>, src: SocketAddr) -> bool {
        let Some(&(peer, _, _)) = self.out.first() else {
            return false;
        };
        if self.out.iter().any(|o| o.0 != peer) {
            return false;
        }
        let Some(inbox) = self.live(peer) else {
            return false;
        };
        {
            let mut q = inbox.lock();
            if !q.pkts.is_empty() || buf.len() > INBOX_BYTES {
                return false;
            }
            std::mem::swap(&mut q.buf, buf);
            q.pkts.extend(self.out.iter().map(|&(_, s, l)| (src, s, l)));
            inbox.pending.store(true, Ordering::Release);
        }
        inbox.wake.notify_one();
        self.out.clear();
        self.out_bytes = 0;
        buf.clear();
        true
    }

    /// Packets local senders could not queue here because the inbox was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.inbox.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for LocalLink {
    fn drop(&mut self) {
        self.inbox.closed.store(true, Ordering::Relaxed);
        let r = registry();
        let mut map = r.map.lock().unwrap_or_else(|e| e.into_inner());
        // A context bound to this address after us (a reset brings the device back on its
        // port) has replaced our entry; leave that one alone.
        let ours = map
            .get(&self.inbox.addr)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.inbox)));
        if ours {
            map.remove(&self.inbox.addr);
        }
        drop(map);
        r.generation.fetch_add(1, Ordering::Release);
        // Senders that still hold the inbox (until they see the generation move) find it
        // closed and drop what they would have put there (`LocalLink::live`).
        self.inbox.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Addresses of their own per test: the registry is the process's, shared by every test
    /// of this binary running at once.
    fn addr(test: u8, i: u8) -> SocketAddr {
        SocketAddr::from(([127, 91, test, i], 4791))
    }

    /// Queue `pkts` (destination, bytes) in one transmit buffer as the driver would, then
    /// deliver.
    fn send(l: &mut LocalLink, pkts: &[(SocketAddr, &[u8])], udp: &mut Vec<SocketAddr>) {
        let mut buf = Vec::new();
        for &(dst, bytes) in pkts {
            let start = buf.len();
            buf.extend_from_slice(bytes);
            if !l.take(dst, start, bytes.len()) {
                udp.push(dst);
            }
        }
        let only_local = udp.is_empty();
        l.deliver(&mut buf, only_local);
    }

    fn received(l: &mut LocalLink) -> Vec<(SocketAddr, Vec<u8>)> {
        let n = l.recv();
        (0..n).map(|i| (l.get(i).0, l.get(i).1.to_vec())).collect()
    }

    /// Packets stay in memory only between two live registered contexts
    /// (`ConnectOptions::inline_depth` chooses by this).
    #[test]
    fn reaches_only_between_live_registered_contexts() {
        let (a, b, c) = (addr(9, 1), addr(9, 2), addr(9, 3));
        let la = LocalLink::register(a).unwrap();
        let lb = LocalLink::register(b).unwrap();
        assert!(reaches(a, b) && reaches(b, a));
        assert!(!reaches(a, c), "nothing registered at c: over UDP");
        drop(lb);
        assert!(!reaches(a, b), "b's context is gone");
        drop(la);
        assert!(!reaches(a, a));
    }

    /// A fork while another thread holds the registry's lock (a driver looking a peer up)
    /// leaves the child a registry of its own, without the parent's contexts. Before, the
    /// child kept a copy of the parent's registry, lock held and never released there: its
    /// first context hung on it (here the alarm then kills the child).
    #[test]
    fn a_child_forked_while_the_registry_is_locked_starts_its_own() {
        let (a, b) = (addr(7, 1), addr(7, 2));
        let _parent = LocalLink::register(a).unwrap();
        let held = registry().map.lock().unwrap();
        // SAFETY: the child runs only the lines below and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe { libc::alarm(10) };
            let ok = LocalLink::register(b).is_some()
                && registry().map.lock().unwrap().get(&a).is_none();
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        drop(held);
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child: wait status {status:#x} (signal 14: it hung on the parent's lock)"
        );
    }

    #[test]
    fn packets_reach_the_context_at_their_address_in_order() {
        let (a, b, c) = (addr(1, 1), addr(1, 2), addr(1, 3));
        let mut la = LocalLink::register(a).unwrap();
        let mut lb = LocalLink::register(b).unwrap();
        let mut lc = LocalLink::register(c).unwrap();
        let far = addr(1, 9);
        // All for one empty inbox: the buffer itself is handed over.
        let mut udp = Vec::new();
        send(&mut la, &[(b, b"one"), (b, b"two")], &mut udp);
        // For two inboxes and one address that is not in this process: copied, and the
        // other address is left to UDP.
        send(
            &mut la,
            &[(c, b"x"), (b, b"three"), (far, b"udp"), (c, b"y")],
            &mut udp,
        );
        assert_eq!(udp, [far]);
        let got = received(&mut lb);
        let want: Vec<(SocketAddr, Vec<u8>)> = [b"one".as_slice(), b"two", b"three"]
            .iter()
            .map(|p| (a, p.to_vec()))
            .collect();
        assert_eq!(got, want);
        assert_eq!(received(&mut lc), [(a, b"x".to_vec()), (a, b"y".to_vec())]);
        assert!(received(&mut lb).is_empty());
        assert!(received(&mut lc).is_empty());
    }

    #[test]
    fn a_full_inbox_drops_what_does_not_fit() {
        let (a, b) = (addr(2, 1), addr(2, 2));
        let mut la = LocalLink::register(a).unwrap();
        let mut lb = LocalLink::register(b).unwrap();
        let pkt = vec![0xA5u8; 4096];
        let per_turn = 200;
        let turns = INBOX_BYTES / (pkt.len() * per_turn) + 3;
        let mut udp = Vec::new();
        for _ in 0..turns {
            let pkts: Vec<(SocketAddr, &[u8])> = (0..per_turn).map(|_| (b, &pkt[..])).collect();
            send(&mut la, &pkts, &mut udp);
        }
        let fit = INBOX_BYTES / pkt.len();
        assert_eq!(lb.recv(), fit);
        assert_eq!(lb.dropped(), (turns * per_turn - fit) as u64);
        // Taking them makes room again.
        send(&mut la, &[(b, &pkt[..])], &mut udp);
        assert_eq!(lb.recv(), 1);
        assert!(udp.is_empty());
    }

    #[test]
    fn a_context_gone_is_not_reached_and_its_successor_is() {
        let (a, b) = (addr(3, 1), addr(3, 2));
        let mut la = LocalLink::register(a).unwrap();
        let lb = LocalLink::register(b).unwrap();
        let mut udp = Vec::new();
        send(&mut la, &[(b, b"old")], &mut udp);
        // The successor binds the address before the old context's end is dropped (a reset
        // that brings the device back on its port): dropping the old one leaves it be.
        let mut lb2 = LocalLink::register(b).unwrap();
        drop(lb);
        send(&mut la, &[(b, b"new")], &mut udp);
        assert_eq!(received(&mut lb2), [(a, b"new".to_vec())]);
        drop(lb2);
        // Nobody at b now: UDP's business.
        send(&mut la, &[(b, b"gone")], &mut udp);
        assert_eq!(udp, [b]);
    }

    /// Contexts coming and going while a sender has packets taken but not delivered: each
    /// packet still goes to the context it was taken for, or is lost with it.
    #[test]
    fn a_context_that_comes_or_goes_mid_turn_gets_only_its_own_packets() {
        let (a, b, d) = (addr(5, 1), addr(5, 2), addr(5, 4));
        let mut la = LocalLink::register(a).unwrap();
        let lb = LocalLink::register(b).unwrap();
        let mut buf = Vec::new();
        buf.extend_from_slice(b"for b");
        assert!(la.take(b, 0, 5));
        drop(lb);
        let mut ld = LocalLink::register(d).unwrap();
        buf.extend_from_slice(b"for d");
        assert!(la.take(d, 5, 5));
        la.deliver(&mut buf, true);
        assert_eq!(received(&mut ld), [(a, b"for d".to_vec())]);
    }

    #[test]
    fn wildcard_addresses_stay_on_udp() {
        assert!(LocalLink::register(SocketAddr::from(([0, 0, 0, 0], 4791))).is_none());
        assert!(LocalLink::register(SocketAddr::from(([127, 91, 4, 1], 0))).is_none());
    }
}

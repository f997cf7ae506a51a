//! The CM state machines driven by sequences of mostly valid MADs, not single packets: two
//! endpoints (an active host side and a listening target side) exchange the real MADs of
//! connects, accepts, rejects and disconnects, and the fuzz input decides what happens to
//! each one on the way (delivered, dropped, delivered twice, replayed later, a byte changed,
//! sent from another address) and when the clock moves and which user call comes next.
//! Nothing may panic, a fired timer is never due again at once, and the host (which does not
//! listen) holds no connection it did not make.
//!
//! Byte-level parsing of single MADs is the `cm` target's job.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmf_rdma::cm::private::service_id;
use nvmf_rdma::cm::{
    AcceptParams, CmConfig, CmEndpoint, CmEvent, ConnId, ConnectParams, RejectReason,
};
use nvmf_rdma::verbs::{Guid, Instant, Qpn};
use std::net::SocketAddr;
use std::time::Duration;

const PORT: u16 = 4420;

struct Side {
    ep: CmEndpoint,
    addr: SocketAddr,
    /// Connections this side knows of, from its calls and its events.
    ids: Vec<ConnId>,
    /// Connection requests waiting for accept or reject.
    pending: Vec<ConnId>,
}

impl Side {
    fn new(ip: &str, seed: u64) -> Side {
        let ep = CmEndpoint::from_seed(CmConfig::new(ip.parse().unwrap(), Guid(seed)), seed);
        Side {
            ep,
            addr: format!("{ip}:4791").parse().unwrap(),
            ids: Vec::new(),
            pending: Vec::new(),
        }
    }

    fn events(&mut self) {
        while let Some(e) = self.ep.poll_event() {
            let id = e.id();
            if let CmEvent::ConnectRequest(_) = e {
                self.pending.push(id);
            }
            if !self.ids.contains(&id) && self.ids.len() < 64 {
                self.ids.push(id);
            }
        }
    }

    fn pick(&self, b: u8) -> Option<ConnId> {
        (!self.ids.is_empty()).then(|| self.ids[b as usize % self.ids.len()])
    }
}

fuzz_target!(|data: &[u8]| {
    let mut host = Side::new("10.0.0.1", 1);
    let mut target = Side::new("10.0.0.2", 2);
    target.ep.listen(service_id(PORT));
    let stranger: SocketAddr = "10.0.0.9:4791".parse().unwrap();
    let mut now = Instant::ZERO;
    // MADs on the wire, in order, each with the side it goes to (true: the target).
    let mut wire: Vec<(bool, [u8; 256])> = Vec::new();
    // Every MAD seen, for replays.
    let mut seen: Vec<(bool, [u8; 256])> = Vec::new();
    let mut calls = 0usize;
    let mut it = data.chunks(3);
    while let Some(op) = it.next() {
        let (a, b, c) = (op[0], *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0));
        match a % 10 {
            // The host connects (bounded, so an input cannot just pile up connections).
            0 if calls < 32 => {
                calls += 1;
                let p = ConnectParams::new(Qpn::new(100 + u32::from(b)), PORT);
                if let Ok(id) = host.ep.connect(now, target.addr, &p, &[c; 8]) {
                    host.ids.push(id);
                }
            }
            // The target accepts or rejects a request.
            1 | 2 if !target.pending.is_empty() => {
                let id = target.pending.remove(b as usize % target.pending.len());
                let _ = if a % 10 == 1 {
                    target
                        .ep
                        .accept(now, id, &AcceptParams::new(Qpn::new(200 + u32::from(c))), &[])
                } else {
                    target.ep.reject(id, RejectReason::CONSUMER_DEFINED, &[])
                };
            }
            // Either side disconnects or aborts a connection it knows of.
            3 => {
                let s = if b & 1 == 0 { &mut host } else { &mut target };
                if let Some(id) = s.pick(c) {
                    let _ = if b & 2 == 0 {
                        s.ep.disconnect(now, id, &[])
                    } else {
                        s.ep.abort(id)
                    };
                }
            }
            // The next MAD on the wire: delivered, dropped, or delivered twice.
            4..=6 if !wire.is_empty() => {
                let (to_target, mad) = wire.remove(0);
                let times = match a % 10 {
                    4 => 1,
                    5 => 0,
                    _ => 2,
                };
                for _ in 0..times {
                    deliver(&mut host, &mut target, to_target, &mad, None, now);
                }
            }
            // A MAD seen before, replayed; with a byte changed; or from a stranger.
            7 if !seen.is_empty() => {
                let (to_target, mut mad) = seen[b as usize % seen.len()];
                if c & 1 == 1 {
                    let at = 24 + (usize::from(c) * 7) % (256 - 24);
                    mad[at] ^= b | 1;
                }
                let from = (c & 2 == 2).then_some(stranger);
                deliver(&mut host, &mut target, to_target, &mad, from, now);
            }
            // Time passes; timers fire.
            8 => {
                now = now + Duration::from_millis(u64::from(b) * u64::from(c % 64 + 1));
                for s in [&mut host, &mut target] {
                    s.ep.handle_timeout(now);
                    if let Some(t) = s.ep.poll_timeout() {
                        assert!(t > now, "a timer is due at the time it was fired");
                    }
                }
            }
            _ => {}
        }
        for (to_target, s) in [(true, &mut host), (false, &mut target)] {
            while let Some((_, mad)) = s.ep.poll_transmit() {
                if wire.len() < 256 {
                    wire.push((to_target, mad));
                }
                if seen.len() < 64 {
                    seen.push((to_target, mad));
                }
            }
        }
        host.events();
        target.events();
        // The host does not listen: every connection it holds is one it made.
        assert!(host.ep.connections() <= calls, "host grew connections on its own");
    }
});

fn deliver(
    host: &mut Side,
    target: &mut Side,
    to_target: bool,
    mad: &[u8; 256],
    from: Option<SocketAddr>,
    now: Instant,
) {
    let (to, sender) = if to_target {
        (&mut target.ep, host.addr)
    } else {
        (&mut host.ep, target.addr)
    };
    to.handle_mad(now, from.unwrap_or(sender), mad);
}

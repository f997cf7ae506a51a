//! Property tests for the CM (`nvmf_rdma::cm`):
//!
//! * `handle_mad` never panics, whatever the bytes: arbitrary lengths and contents, and valid
//!   MADs with bytes flipped, fed to endpoints in every phase of a connection;
//! * every MAD that parses re-emits to bytes that parse to the same message;
//! * over a link that drops and duplicates at random, each connection's events come in a
//!   legal order, and once the timers run out both endpoints have forgotten everything.

use std::net::SocketAddr;

use nvmf_rdma::cm::mad::attr;
use nvmf_rdma::cm::messages::CmMad;
use nvmf_rdma::cm::private::{service_id, split_req_private};
use nvmf_rdma::cm::{
    AcceptParams, CmConfig, CmEndpoint, CmEvent, ConnId, ConnectParams, NvmeCmAccept, NvmeCmReject,
    NvmeCmRequest, MAD_LEN,
};
use nvmf_rdma::verbs::{Guid, Instant, Qpn};
use proptest::collection::vec;
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const A: &str = "10.0.0.1:4791";
const B: &str = "10.0.0.2:4791";

fn ep(addr: &str, seed: u64) -> CmEndpoint {
    let a: SocketAddr = addr.parse().unwrap();
    CmEndpoint::new(
        CmConfig::new(a.ip(), Guid(seed | 0x100)),
        SmallRng::seed_from_u64(seed),
    )
}

/// A handshake and teardown between two endpoints, every MAD delivered; returns the MADs in
/// order and the endpoints left in TimeWait.
fn reference_traffic() -> Vec<[u8; MAD_LEN]> {
    let (sa, sb): (SocketAddr, SocketAddr) = (A.parse().unwrap(), B.parse().unwrap());
    let (mut a, mut b) = (ep(A, 1), ep(B, 2));
    b.listen(service_id(4420));
    let now = Instant::ZERO;
    let id = a
        .connect(
            now,
            sb,
            &ConnectParams::new(Qpn::new(5), 4420),
            &NvmeCmRequest::default().emit(),
        )
        .unwrap();
    let mut log = Vec::new();
    let pump = |a: &mut CmEndpoint, b: &mut CmEndpoint, log: &mut Vec<[u8; MAD_LEN]>| loop {
        let mut any = false;
        while let Some((_, m)) = a.poll_transmit() {
            log.push(m);
            b.handle_mad(now, sa, &m);
            any = true;
        }
        while let Some((_, m)) = b.poll_transmit() {
            log.push(m);
            a.handle_mad(now, sb, &m);
            any = true;
        }
        if !any {
            break;
        }
    };
    pump(&mut a, &mut b, &mut log);
    let Some(CmEvent::ConnectRequest(r)) = b.poll_event() else {
        panic!("no request")
    };
    b.accept(
        now,
        r.id,
        &AcceptParams::new(Qpn::new(6)),
        &NvmeCmAccept { crqsize: 32 }.emit(),
    )
    .unwrap();
    pump(&mut a, &mut b, &mut log);
    a.disconnect(now, id, &[]).unwrap();
    pump(&mut a, &mut b, &mut log);
    // And one of each refusal.
    let (mut c, mut d) = (ep(A, 3), ep(B, 4));
    d.listen(service_id(4420));
    c.connect(now, sb, &ConnectParams::new(Qpn::new(7), 4420), &[])
        .unwrap();
    pump(&mut c, &mut d, &mut log);
    let Some(CmEvent::ConnectRequest(r)) = d.poll_event() else {
        panic!("no request")
    };
    d.reject(
        r.id,
        nvmf_rdma::cm::RejectReason::CONSUMER_DEFINED,
        &NvmeCmReject::new(nvmf_rdma::cm::NvmeRejectStatus::NoResources).emit(),
    )
    .unwrap();
    pump(&mut c, &mut d, &mut log);
    log
}

/// Endpoints in several phases to throw bytes at.
fn targets() -> Vec<CmEndpoint> {
    let sb: SocketAddr = B.parse().unwrap();
    let mut fresh = ep(B, 10);
    fresh.listen(service_id(4420));
    let mut active = ep(A, 11);
    active
        .connect(
            Instant::ZERO,
            sb,
            &ConnectParams::new(Qpn::new(1), 4420),
            &[],
        )
        .unwrap();
    let mut passive = ep(B, 12);
    passive.listen(service_id(4420));
    for m in reference_traffic().iter().take(1) {
        passive.handle_mad(Instant::ZERO, A.parse().unwrap(), m);
    }
    vec![fresh, active, passive]
}

fn feed(targets: &mut [CmEndpoint], from: SocketAddr, bytes: &[u8]) {
    for t in targets.iter_mut() {
        let before = t.stats().rx_mads;
        t.handle_mad(Instant(1_000), from, bytes);
        assert_eq!(t.stats().rx_mads, before + 1);
        while t.poll_transmit().is_some() {}
        while t.poll_event().is_some() {}
        t.handle_timeout(Instant(u64::MAX / 2));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn handle_mad_never_panics_on_arbitrary_bytes(bytes in vec(any::<u8>(), 0..300)) {
        let mut t = targets();
        feed(&mut t, A.parse().unwrap(), &bytes);
    }

    #[test]
    fn handle_mad_never_panics_on_cm_headers_with_arbitrary_bodies(
        attr_id in prop::sample::select(vec![
            attr::REQ, attr::MRA, attr::REJ, attr::REP, attr::RTU, attr::DREQ, attr::DREP,
            attr::SIDR_REQ, attr::LAP, 0,
        ]),
        body in vec(any::<u8>(), MAD_LEN - 24),
    ) {
        let mut m = [0u8; MAD_LEN];
        m[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
        m[16..18].copy_from_slice(&attr_id.to_be_bytes());
        m[24..].copy_from_slice(&body);
        let mut t = targets();
        feed(&mut t, A.parse().unwrap(), &m);
        feed(&mut t, B.parse().unwrap(), &m);
    }

    #[test]
    fn handle_mad_never_panics_on_mutated_real_traffic(
        pick in any::<prop::sample::Index>(),
        flips in vec((0usize..MAD_LEN, any::<u8>()), 1..8),
    ) {
        let log = reference_traffic();
        let mut m = *pick.get(&log);
        for (at, x) in flips {
            m[at] ^= x;
        }
        let mut t = targets();
        feed(&mut t, A.parse().unwrap(), &m);
        feed(&mut t, B.parse().unwrap(), &m);
    }

    #[test]
    fn what_parses_re_emits_to_the_same_message(
        pick in any::<prop::sample::Index>(),
        flips in vec((24usize..MAD_LEN, any::<u8>()), 0..6),
    ) {
        let log = reference_traffic();
        let mut m = *pick.get(&log);
        for (at, x) in flips {
            m[at] ^= x;
        }
        if let Ok(p) = CmMad::parse(&m) {
            let again = CmMad::parse(&p.emit()).expect("re-emitted MAD parses");
            prop_assert_eq!(again, p);
        }
    }

    #[test]
    fn lossy_link_gives_legal_event_orders_and_everything_ends(
        seed in any::<u64>(),
        // Mostly a usable link; sometimes one so bad that retries run out.
        loss in prop_oneof![3 => 0.0f64..0.6, 1 => 0.8f64..0.97],
        dup in 0.0f64..0.3,
    ) {
        lossy_run(seed, loss, dup)?;
    }
}

#[test]
fn reference_traffic_is_well_formed() {
    let log = reference_traffic();
    let names: Vec<_> = log
        .iter()
        .map(|m| CmMad::parse(m).unwrap().message.name())
        .collect();
    assert_eq!(names, ["REQ", "REP", "RTU", "DREQ", "DREP", "REQ", "REJ"]);
    let nvmf_rdma::cm::CmMessage::Req(r) = CmMad::parse(&log[0]).unwrap().message else {
        unreachable!()
    };
    assert!(split_req_private(&r.private_data).is_ok());
}

/// Per connection, the events a side may report, in order.
fn check_order(events: &[CmEvent]) -> Result<(), TestCaseError> {
    use std::collections::BTreeMap;
    let mut seq: BTreeMap<ConnId, Vec<&'static str>> = BTreeMap::new();
    for e in events {
        let name = match e {
            CmEvent::ConnectRequest(_) => "req",
            CmEvent::Established(_) => "est",
            CmEvent::Rejected(_) => "rej",
            CmEvent::Unreachable { .. } => "unr",
            CmEvent::Disconnected { .. } => "disc",
            CmEvent::TimewaitExit { .. } => "tw",
        };
        seq.entry(e.id()).or_default().push(name);
    }
    for (id, s) in seq {
        let s = s.join(" ");
        let legal = [
            "est disc tw",
            "rej",
            "rej tw",
            "unr",
            "est",
            "req est disc tw",
            "req rej",
            "req unr",
            "req est",
            "req rej tw",
            "req disc tw",
        ];
        prop_assert!(legal.contains(&s.as_str()), "{id}: illegal event order {s}");
    }
    Ok(())
}

fn lossy_run(seed: u64, loss: f64, dup: f64) -> Result<(), TestCaseError> {
    let (sa, sb): (SocketAddr, SocketAddr) = (A.parse().unwrap(), B.parse().unwrap());
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut a = ep(A, seed.wrapping_add(1));
    let mut b = ep(B, seed.wrapping_add(2));
    b.listen(service_id(4420));
    let mut now = Instant::ZERO;
    let mut ev_a = Vec::new();
    let mut ev_b = Vec::new();
    let id = a
        .connect(now, sb, &ConnectParams::new(Qpn::new(9), 4420), &[])
        .unwrap();
    let mut disconnect_sent = false;
    for _ in 0..5000 {
        // Move traffic, with loss and duplication.
        loop {
            let mut any = false;
            while let Some((_, m)) = a.poll_transmit() {
                any = true;
                if !rng.random_bool(loss) {
                    b.handle_mad(now, sa, &m);
                    if rng.random_bool(dup) {
                        b.handle_mad(now, sa, &m);
                    }
                }
            }
            while let Some((_, m)) = b.poll_transmit() {
                any = true;
                if !rng.random_bool(loss) {
                    a.handle_mad(now, sb, &m);
                    if rng.random_bool(dup) {
                        a.handle_mad(now, sb, &m);
                    }
                }
            }
            while let Some(e) = b.poll_event() {
                if let CmEvent::ConnectRequest(r) = &e {
                    b.accept(now, r.id, &AcceptParams::new(Qpn::new(10)), &[])
                        .unwrap();
                }
                ev_b.push(e);
            }
            while let Some(e) = a.poll_event() {
                ev_a.push(e);
            }
            if !any {
                break;
            }
        }
        if !disconnect_sent && ev_a.iter().any(|e| matches!(e, CmEvent::Established(_))) {
            // A disconnect is legal once A is established, even if it raced a DREQ.
            let _ = a.disconnect(now, id, &[]);
            disconnect_sent = true;
            continue;
        }
        let next = [a.poll_timeout(), b.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        match next {
            Some(t) => {
                prop_assert!(t >= now);
                now = t;
                a.handle_timeout(now);
                b.handle_timeout(now);
            }
            None => break,
        }
    }
    prop_assert_eq!(a.poll_timeout(), None, "A still has timers");
    prop_assert_eq!(b.poll_timeout(), None, "B still has timers");
    check_order(&ev_a)?;
    check_order(&ev_b)?;
    // With nothing armed, all that may be left are connections the owner holds open: those
    // whose last event was Established (A's DREQ never arrived at B, say).
    for (e, evs) in [(&a, &ev_a), (&b, &ev_b)] {
        let mut last = std::collections::BTreeMap::new();
        for x in evs {
            last.insert(x.id(), matches!(x, CmEvent::Established(_)));
        }
        let open = last.values().filter(|&&est| est).count();
        prop_assert_eq!(
            e.connections(),
            open,
            "seed {} loss {} dup {}",
            seed,
            loss,
            dup
        );
    }
    Ok(())
}

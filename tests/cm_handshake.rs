//! Two CM endpoints stepped against each other in virtual time, quinn-`Pair` style: every MAD
//! one side transmits is moved into the other's `handle_mad`, and faults are edits to that
//! traffic (drop the next REP, replay an old REQ, ...).
//!
//! Covered: REQ → REP → RTU with the loss of each message and the retransmission that repairs
//! it; MRA; REJ for an unknown service and a consumer reject carrying an NVMe status;
//! duplicate REQs (while the owner decides, while the REP is pending, once established);
//! a reset peer reusing its QPN (stale connection); REQ retries running out (Unreachable) on
//! both sides; DREQ / DREP teardown, lost DREP, DREQ for a forgotten connection, simultaneous
//! disconnect; abort; replay from a seed.

#[path = "common/snapshot.rs"]
mod snapshot;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::cm::mad::{attr, MsgRef};
use nvmf_rdma::cm::messages::{CmMad, CmMessage, MraRepr};
use nvmf_rdma::cm::private::{gid_from_ip, service_id};
use nvmf_rdma::cm::{
    iba_time, AcceptParams, CmConfig, CmEndpoint, CmError, CmEvent, ConnId, ConnState,
    ConnectParams, ConnectRequest, Established, NvmeCmAccept, NvmeCmReject, NvmeCmRequest,
    NvmeRejectStatus, PrivateError, RejectReason, Rejected, MAD_LEN,
};
use nvmf_rdma::verbs::{Guid, Instant, Mtu, Psn, Qpn};
use rand::rngs::SmallRng;
use rand::SeedableRng;

const PORT: u16 = 4420;
const A_QPN: Qpn = Qpn::new(0x11);
const B_QPN: Qpn = Qpn::new(0x22);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    A,
    B,
}

struct Node {
    ep: CmEndpoint,
    addr: SocketAddr,
    events: VecDeque<CmEvent>,
}

/// A (initiator, 192.168.1.10) and B (target, 192.168.1.20), both at UDP 4791.
struct Pair {
    a: Node,
    b: Node,
    now: Instant,
    /// Messages to drop: (sender, message name, how many more).
    drops: Vec<(Side, &'static str, usize)>,
    /// Everything that crossed the link, in order (sender, bytes), dropped ones included.
    log: Vec<(Side, [u8; MAD_LEN])>,
}

fn config(ip: &str, guid: u64) -> CmConfig {
    CmConfig::new(ip.parse().unwrap(), Guid(guid))
}

fn node(cfg: CmConfig, seed: u64) -> Node {
    Node {
        addr: SocketAddr::new(cfg.local_ip, 4791),
        ep: CmEndpoint::new(cfg, SmallRng::seed_from_u64(seed)),
        events: VecDeque::new(),
    }
}

impl Pair {
    fn new() -> Pair {
        Pair::with(
            config("192.168.1.10", 0x0A00_00FF_FE00_000A),
            config("192.168.1.20", 0x0B00_00FF_FE00_000B),
        )
    }
    fn with(a: CmConfig, b: CmConfig) -> Pair {
        Pair {
            a: node(a, 1),
            b: node(b, 2),
            now: Instant::ZERO,
            drops: Vec::new(),
            log: Vec::new(),
        }
    }
    fn node(&mut self, s: Side) -> &mut Node {
        match s {
            Side::A => &mut self.a,
            Side::B => &mut self.b,
        }
    }
    fn drop_next(&mut self, from: Side, name: &'static str) {
        self.drops.push((from, name, 1));
    }
    fn drop_all(&mut self, from: Side, name: &'static str) {
        self.drops.push((from, name, usize::MAX));
    }
    fn should_drop(&mut self, from: Side, mad: &[u8; MAD_LEN]) -> bool {
        let name = CmMad::parse(mad).map(|m| m.message.name()).unwrap_or("?");
        for d in &mut self.drops {
            if d.0 == from && (d.1 == name || d.1 == "*") && d.2 > 0 {
                d.2 -= 1;
                return true;
            }
        }
        false
    }
    /// Deliver `mad` as if `from` had sent it.
    fn inject(&mut self, from: Side, mad: &[u8]) {
        let now = self.now;
        let src = self.node(from).addr;
        let to = match from {
            Side::A => Side::B,
            Side::B => Side::A,
        };
        self.node(to).ep.handle_mad(now, src, mad);
        self.collect();
    }
    fn collect(&mut self) {
        while let Some(e) = self.a.ep.poll_event() {
            self.a.events.push_back(e);
        }
        while let Some(e) = self.b.ep.poll_event() {
            self.b.events.push_back(e);
        }
    }
    /// Move every pending MAD across until both sides are quiet. Returns how many crossed.
    fn step(&mut self) -> usize {
        let mut moved = 0;
        loop {
            let mut any = false;
            for from in [Side::A, Side::B] {
                while let Some((to, mad)) = self.node(from).ep.poll_transmit() {
                    any = true;
                    moved += 1;
                    let other = match from {
                        Side::A => Side::B,
                        Side::B => Side::A,
                    };
                    assert_eq!(to, self.node(other).addr, "{from:?} sent to a stranger");
                    self.log.push((from, mad));
                    if !self.should_drop(from, &mad) {
                        self.inject(from, &mad);
                    }
                }
            }
            self.collect();
            if !any {
                return moved;
            }
        }
    }
    /// Jump to the earliest timer of either side and fire it. False if none is armed.
    fn advance(&mut self) -> bool {
        let next = [self.a.ep.poll_timeout(), self.b.ep.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        let Some(t) = next else {
            return false;
        };
        assert!(t >= self.now, "timer in the past");
        self.now = t;
        self.a.ep.handle_timeout(t);
        self.b.ep.handle_timeout(t);
        self.collect();
        self.step();
        true
    }
    /// Step and fire timers until `done` or no timer is left (bounded).
    fn run_until(&mut self, mut done: impl FnMut(&mut Pair) -> bool) -> bool {
        self.step();
        for _ in 0..1000 {
            if done(self) {
                return true;
            }
            if !self.advance() {
                return done(self);
            }
        }
        false
    }
    fn sent(&self, from: Side, name: &str) -> usize {
        self.log
            .iter()
            .filter(|(s, m)| *s == from && CmMad::parse(m).map(|m| m.message.name()) == Ok(name))
            .count()
    }
    fn last_sent(&self, from: Side, name: &str) -> [u8; MAD_LEN] {
        self.log
            .iter()
            .rev()
            .find(|(s, m)| *s == from && CmMad::parse(m).map(|m| m.message.name()) == Ok(name))
            .map(|(_, m)| *m)
            .unwrap_or_else(|| panic!("{from:?} never sent {name}"))
    }
}

fn nvme_req() -> NvmeCmRequest {
    NvmeCmRequest {
        qid: 1,
        hrqsize: 128,
        hsqsize: 127,
        cntlid: 1,
    }
}

fn connect(p: &mut Pair) -> ConnId {
    p.b.ep.listen(service_id(PORT));
    let mut params = ConnectParams::new(A_QPN, PORT);
    params.responder_resources = 4;
    params.initiator_depth = 2;
    let now = p.now;
    p.a.ep
        .connect(now, p.b.addr, &params, &nvme_req().emit())
        .unwrap()
}

fn take_request(p: &mut Pair) -> ConnectRequest {
    match p.b.events.pop_front() {
        Some(CmEvent::ConnectRequest(r)) => r,
        other => panic!("B expected ConnectRequest, got {other:?}"),
    }
}

fn accept(p: &mut Pair, id: ConnId) {
    let mut ap = AcceptParams::new(B_QPN);
    ap.starting_psn = Some(Psn::new(0x00B0B0));
    ap.responder_resources = 2;
    ap.initiator_depth = 4;
    let now = p.now;
    p.b.ep
        .accept(now, id, &ap, &NvmeCmAccept { crqsize: 128 }.emit())
        .unwrap();
}

fn established(n: &mut Node) -> Established {
    match n.events.pop_front() {
        Some(CmEvent::Established(e)) => e,
        other => panic!("expected Established, got {other:?}"),
    }
}

/// Run a full handshake; returns (A's id, B's id).
fn handshake(p: &mut Pair) -> (ConnId, ConnId) {
    let a = connect(p);
    p.step();
    let r = take_request(p);
    accept(p, r.id);
    assert!(
        p.run_until(|p| p.a.ep.state(a) == Some(ConnState::Established)
            && p.b.ep.state(r.id) == Some(ConnState::Established))
    );
    established(&mut p.a);
    established(&mut p.b);
    (a, r.id)
}

/// One REQ try with the default configuration: 2 × T(16) + T(18).
fn req_try() -> Duration {
    iba_time(16) * 2 + iba_time(18)
}

// --- the handshake ---------------------------------------------------------------------------

#[test]
fn handshake_establishes_both_sides_with_the_negotiated_values() {
    let mut p = Pair::new();
    let a = connect(&mut p);
    assert_eq!(p.a.ep.state(a), Some(ConnState::ReqSent));
    assert_eq!(p.step(), 1);

    let r = take_request(&mut p);
    assert_eq!(r.peer, p.a.addr);
    assert_eq!(r.service_id, 0x0000_0000_0106_1144);
    assert_eq!(r.remote_qpn, A_QPN);
    // Linux ib_cm: the REQ carries the PSN A receives with, so B sends with it.
    let a_recv_psn = r.local_psn;
    assert_eq!(r.remote_ca_guid, Guid(0x0A00_00FF_FE00_000A));
    // Seen from B: A's initiator depth is what B must serve.
    assert_eq!((r.responder_resources, r.initiator_depth), (2, 4));
    assert_eq!(r.path_mtu, Mtu::Mtu1024);
    assert_eq!(
        (r.retry_count, r.rnr_retry_count, r.flow_control),
        (7, 7, true)
    );
    assert_eq!(r.cma.src_ip(), p.a.addr.ip());
    assert_eq!(r.cma.dst_ip(), p.b.addr.ip());
    assert!((32768..61000).contains(&r.cma.src_port));
    assert_eq!(r.nvme, Ok(nvme_req()));
    assert_eq!(r.private_data.len(), 56);
    assert_eq!(p.b.ep.state(r.id), Some(ConnState::ReqRcvd));

    accept(&mut p, r.id);
    assert_eq!(p.b.ep.state(r.id), Some(ConnState::RepSent));
    p.step(); // REP, then RTU
    assert_eq!(p.sent(Side::B, "REP"), 1);
    assert_eq!(p.sent(Side::A, "RTU"), 1);

    let ea = established(&mut p.a);
    assert_eq!(ea.id, a);
    assert_eq!(ea.remote_qpn, B_QPN);
    // ... and the REP the PSN B receives with, so A sends with it.
    assert_eq!(ea.local_psn, Psn::new(0x00B0B0));
    assert_eq!(ea.remote_psn, a_recv_psn);
    assert_eq!(Some(ea.local_psn), p.a.ep.local_psn(a));
    assert_eq!(ea.accept, Some(NvmeCmAccept { crqsize: 128 }));
    assert_eq!((ea.responder_resources, ea.initiator_depth), (4, 2));
    assert_eq!((ea.rnr_retry_count, ea.target_ack_delay), (7, 15));
    let eb = established(&mut p.b);
    assert_eq!(eb.id, r.id);
    assert_eq!(eb.remote_qpn, A_QPN);
    assert_eq!(eb.remote_psn, ea.local_psn);
    assert_eq!(eb.local_psn, ea.remote_psn);
    assert_eq!(eb.path_mtu, Mtu::Mtu1024);
    assert_eq!(eb.ack_timeout, ea.ack_timeout);

    assert_eq!(p.a.ep.state(a), Some(ConnState::Established));
    assert_eq!(p.b.ep.state(r.id), Some(ConnState::Established));
    assert_eq!(
        p.a.ep.poll_timeout(),
        None,
        "nothing to wait for once established"
    );
    assert_eq!(p.b.ep.poll_timeout(), None);
    assert!(p.a.events.is_empty() && p.b.events.is_empty());
}

#[test]
fn req_on_the_wire_is_what_rdma_cm_sends_over_roce() {
    let mut p = Pair::new();
    let a = connect(&mut p);
    p.step();
    let mad = p.last_sent(Side::A, "REQ");
    // Common header: base version 1, class CM, version 2, SEND, attribute REQ.
    assert_eq!(&mad[..4], &[1, 0x07, 2, 0x03]);
    assert_eq!(&mad[16..18], &attr::REQ.to_be_bytes());
    let CmMessage::Req(r) = CmMad::parse(&mad).unwrap().message else {
        unreachable!()
    };
    // cm_form_tid: the low half of the transaction ID is the comm ID.
    assert_eq!(CmMad::parse(&mad).unwrap().transaction_id as u32, a.0);
    assert_eq!(r.local_comm_id, a.0);
    assert_eq!(r.service_id, service_id(PORT));
    assert_eq!(
        (r.primary_local_lid, r.primary_remote_lid),
        (0xFFFF, 0xFFFF)
    );
    assert_eq!(r.primary_local_gid, gid_from_ip(p.a.addr.ip()));
    assert_eq!(
        r.primary_remote_gid.to_ipv4_mapped(),
        Some("192.168.1.20".parse().unwrap())
    );
    assert_eq!(r.pkey, 0xFFFF);
    assert_eq!(
        (
            r.remote_cm_response_timeout,
            r.local_cm_response_timeout,
            r.max_cm_retries
        ),
        (18, 18, 15)
    );
    assert_eq!((r.hop_limit, r.subnet_local), (64, false));
    // cma_hdr: version 0, IPv4, then the addresses in the last four bytes of each slot.
    assert_eq!(r.private_data[0], 0);
    assert_eq!(r.private_data[1] >> 4, 4);
    assert_eq!(&r.private_data[16..20], &[192, 168, 1, 10]);
    assert_eq!(&r.private_data[32..36], &[192, 168, 1, 20]);
    assert_eq!(
        NvmeCmRequest::parse(&r.private_data[36..]).unwrap(),
        nvme_req()
    );
}

#[test]
fn lost_req_is_retransmitted_after_the_cm_response_timeout() {
    let mut p = Pair::new();
    p.drop_next(Side::A, "REQ");
    let a = connect(&mut p);
    p.step();
    assert!(p.b.events.is_empty());
    assert_eq!(p.a.ep.poll_timeout(), Some(Instant::ZERO + req_try()));
    assert!(p.advance());
    assert_eq!(p.now, Instant::ZERO + req_try());
    assert_eq!(p.sent(Side::A, "REQ"), 2);
    assert_eq!(p.a.ep.stats().retransmits, 1);
    let r = take_request(&mut p);
    accept(&mut p, r.id);
    p.step();
    assert_eq!(established(&mut p.a).id, a);
    assert_eq!(established(&mut p.b).id, r.id);
}

/// The host gives a connect 5 s (`ConnectOptions::connect_timeout`): a REQ lost twice
/// and a REP lost once still leave time for the fourth exchange to come through.
#[test]
fn a_handshake_that_loses_three_messages_is_established_within_the_hosts_connect_timeout() {
    let mut p = Pair::new();
    p.drop_next(Side::A, "REQ");
    p.drop_next(Side::A, "REQ");
    let a = connect(&mut p);
    p.step();
    while p.b.events.is_empty() {
        assert!(p.advance(), "no REQ retry left");
    }
    let r = take_request(&mut p);
    p.drop_next(Side::B, "REP");
    accept(&mut p, r.id);
    p.step();
    while p.a.events.is_empty() {
        assert!(p.advance(), "no REP retry left");
    }
    assert_eq!(established(&mut p.a).id, a);
    assert!(
        p.now < Instant::ZERO + Duration::from_secs(5),
        "established only at {:?}",
        p.now
    );
}

#[test]
fn lost_rep_is_retransmitted_by_the_passive_side() {
    let mut p = Pair::new();
    let a = connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    p.drop_next(Side::B, "REP");
    let t0 = p.now;
    accept(&mut p, r.id);
    p.step();
    assert_eq!(p.a.ep.state(a), Some(ConnState::ReqSent));
    // B's REP timer is the REQ's local CM response timeout, T(18), shorter than A's REQ timer.
    assert_eq!(p.b.ep.poll_timeout(), Some(t0 + iba_time(18)));
    assert!(p.advance());
    assert_eq!(p.sent(Side::B, "REP"), 2);
    assert_eq!(p.sent(Side::A, "REQ"), 1, "repaired before A's REQ retry");
    assert_eq!(established(&mut p.a).id, a);
    assert_eq!(established(&mut p.b).id, r.id);
}

#[test]
fn lost_rtu_is_repaired_by_rep_retransmission_and_a_resent_rtu() {
    let mut p = Pair::new();
    let a = connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    p.drop_next(Side::A, "RTU");
    accept(&mut p, r.id);
    p.step();
    assert_eq!(established(&mut p.a).id, a);
    assert_eq!(p.b.ep.state(r.id), Some(ConnState::RepSent));
    assert!(p.advance()); // B resends the REP; A answers the duplicate with the RTU again
    assert_eq!(p.sent(Side::A, "RTU"), 2);
    assert_eq!(p.a.ep.stats().rx_duplicates, 1);
    assert_eq!(established(&mut p.b).id, r.id);
    assert!(p.a.events.is_empty(), "A reports Established once");
}

#[test]
fn first_packet_on_the_qp_establishes_without_rtu() {
    let mut p = Pair::new();
    p.drop_all(Side::A, "RTU");
    let _a = connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    accept(&mut p, r.id);
    p.step();
    p.b.ep.notify_comm_est(r.id).unwrap();
    p.collect();
    let e = established(&mut p.b);
    assert!(e.private_data.is_empty());
    assert_eq!(p.b.ep.poll_timeout(), None, "REP retries stop");
    assert!(matches!(
        p.b.ep.notify_comm_est(r.id),
        Err(CmError::InvalidState {
            state: ConnState::Established,
            ..
        })
    ));
}

#[test]
fn mra_extends_the_wait_for_rep() {
    let mut p = Pair::new();
    p.drop_next(Side::A, "REQ");
    let a = connect(&mut p);
    p.step();
    // B (say, busy) answers the REQ with an MRA: service timeout 24 (≈ 69 s).
    let mra = CmMad {
        transaction_id: 0,
        message: CmMessage::Mra(MraRepr {
            local_comm_id: 0x0BBB_0001,
            remote_comm_id: a.0,
            message_mraed: MsgRef::Req,
            service_timeout: 24,
            private_data: [0; MraRepr::PRIVATE_LEN],
        }),
    }
    .emit();
    p.now = p.now + Duration::from_millis(100);
    p.inject(Side::B, &mra);
    assert_eq!(p.a.ep.state(a), Some(ConnState::MraReqRcvd));
    // service timeout + the path's ACK timeout (packet lifetime 16 + 1).
    let wait = iba_time(24) + iba_time(17);
    assert_eq!(p.a.ep.poll_timeout(), Some(p.now + wait));
    // A second MRA is a duplicate and changes nothing.
    p.inject(Side::B, &mra);
    assert_eq!(p.a.ep.stats().rx_unexpected, 1);
    assert!(p.advance());
    assert_eq!(p.sent(Side::A, "REQ"), 2);
    let r = take_request(&mut p);
    accept(&mut p, r.id);
    p.step();
    assert_eq!(established(&mut p.a).id, a);
}

// --- rejects ---------------------------------------------------------------------------------

#[test]
fn req_for_a_service_nobody_listens_on_gets_rej_invalid_service_id() {
    let mut p = Pair::new();
    let params = ConnectParams::new(A_QPN, 4421);
    p.b.ep.listen(service_id(PORT));
    let a = p.a.ep.connect(p.now, p.b.addr, &params, &[]).unwrap();
    p.step();
    assert!(p.b.events.is_empty());
    assert_eq!(p.b.ep.connections(), 0, "no state kept for a refused REQ");
    assert_eq!(p.b.ep.stats().rej_invalid_service, 1);
    let rej = p.last_sent(Side::B, "REJ");
    let CmMessage::Rej(j) = CmMad::parse(&rej).unwrap().message else {
        unreachable!()
    };
    // cm_issue_rej: our comm ID echoed as remote, 0 as local, message REQ.
    assert_eq!((j.local_comm_id, j.remote_comm_id), (0, a.0));
    assert_eq!(j.message_rejected, MsgRef::Req);
    match p.a.events.pop_front() {
        Some(CmEvent::Rejected(Rejected {
            id,
            reason,
            nvme_status,
            ..
        })) => {
            assert_eq!(id, a);
            assert_eq!(reason, RejectReason::INVALID_SERVICE_ID);
            assert_eq!(nvme_status, None);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.a.ep.state(a), None);
    assert_eq!(p.a.ep.poll_timeout(), None);
}

#[test]
fn consumer_reject_carries_the_nvme_status() {
    let mut p = Pair::new();
    let a = connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    let why = NvmeCmReject::new(NvmeRejectStatus::InvalidHsqsize).emit();
    p.b.ep
        .reject(r.id, RejectReason::CONSUMER_DEFINED, &why)
        .unwrap();
    assert_eq!(p.b.ep.state(r.id), None);
    p.step();
    match p.a.events.pop_front() {
        Some(CmEvent::Rejected(j)) => {
            assert_eq!(j.id, a);
            assert_eq!(j.reason, RejectReason::CONSUMER_DEFINED);
            assert_eq!(j.nvme_status, Some(NvmeRejectStatus::InvalidHsqsize));
            assert_eq!(&j.private_data[..4], &why);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.a.ep.state(a), None);
    // Commands on a forgotten connection fail cleanly.
    assert_eq!(
        p.b.ep.accept(p.now, r.id, &AcceptParams::new(B_QPN), &[]),
        Err(CmError::UnknownConnection(r.id))
    );
}

#[test]
fn bad_nvme_record_format_surfaces_the_status_to_answer_with() {
    let mut p = Pair::new();
    p.b.ep.listen(service_id(PORT));
    let mut bad = nvme_req().emit();
    bad[0] = 9; // recfmt 9
    p.a.ep
        .connect(p.now, p.b.addr, &ConnectParams::new(A_QPN, PORT), &bad)
        .unwrap();
    p.step();
    let r = take_request(&mut p);
    let e = r.nvme.unwrap_err();
    assert_eq!(e, PrivateError::BadRecfmt(9));
    assert_eq!(e.nvme_status(), NvmeRejectStatus::InvalidRecfmt);
    p.b.ep
        .reject(
            r.id,
            RejectReason::CONSUMER_DEFINED,
            &NvmeCmReject::new(e.nvme_status()).emit(),
        )
        .unwrap();
    p.step();
    assert!(matches!(
        p.a.events.pop_front(),
        Some(CmEvent::Rejected(Rejected {
            nvme_status: Some(NvmeRejectStatus::InvalidRecfmt),
            ..
        }))
    ));
}

// --- duplicates and stale connections --------------------------------------------------------

#[test]
fn duplicate_req_while_the_owner_decides_is_dropped() {
    let mut p = Pair::new();
    connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    let req = p.last_sent(Side::A, "REQ");
    p.inject(Side::A, &req);
    assert!(p.b.events.is_empty(), "no second ConnectRequest");
    assert_eq!(p.b.ep.poll_transmit(), None);
    assert_eq!(p.b.ep.connections(), 1);
    assert_eq!(p.b.ep.state(r.id), Some(ConnState::ReqRcvd));
}

#[test]
fn duplicate_req_while_rep_is_pending_resends_the_rep() {
    let mut p = Pair::new();
    let a = connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    p.drop_next(Side::B, "REP");
    accept(&mut p, r.id);
    p.step();
    let req = p.last_sent(Side::A, "REQ");
    p.inject(Side::A, &req); // a REQ retransmission crossing our REP
    assert_eq!(p.b.ep.stats().rx_duplicates, 1);
    p.step();
    assert_eq!(p.sent(Side::B, "REP"), 2);
    assert_eq!(established(&mut p.a).id, a);
    assert_eq!(established(&mut p.b).id, r.id);
    assert_eq!(p.now, Instant::ZERO, "repaired without waiting for a timer");
}

#[test]
fn req_with_an_established_comm_id_gets_rej_stale_and_the_connection_survives() {
    let mut p = Pair::new();
    let (a, b) = handshake(&mut p);
    let req = p.log.iter().find(|(s, _)| *s == Side::A).unwrap().1;
    p.inject(Side::A, &req); // a very late duplicate of the first REQ
    p.step();
    assert_eq!(p.b.ep.stats().rej_stale, 1);
    let CmMessage::Rej(j) = CmMad::parse(&p.last_sent(Side::B, "REJ")).unwrap().message else {
        unreachable!()
    };
    assert_eq!(j.reason, RejectReason::STALE_CONN);
    assert_eq!(j.message_rejected, MsgRef::Req);
    assert_eq!(j.remote_comm_id, a.0);
    // A's REQ is long answered: the REJ is ignored, nothing is torn down.
    assert_eq!(p.a.ep.state(a), Some(ConnState::Established));
    assert_eq!(p.b.ep.state(b), Some(ConnState::Established));
    assert_eq!(p.a.ep.stats().rx_unexpected, 1);
    assert!(p.a.events.is_empty() && p.b.events.is_empty());
}

#[test]
fn reset_peer_reusing_its_qpn_is_refused_as_stale_and_the_old_connection_torn_down() {
    let mut p = Pair::new();
    let (_a, b_old) = handshake(&mut p);
    // A resets: same GUID and address, all CM state lost, same QPN on the new QP.
    p.a = node(config("192.168.1.10", 0x0A00_00FF_FE00_000A), 99);
    let params = ConnectParams::new(A_QPN, PORT);
    let a2 =
        p.a.ep
            .connect(p.now, p.b.addr, &params, &nvme_req().emit())
            .unwrap();
    p.step();
    assert!(p
        .b
        .events
        .iter()
        .all(|e| !matches!(e, CmEvent::ConnectRequest(_))));
    match p.a.events.pop_front() {
        Some(CmEvent::Rejected(j)) => {
            assert_eq!(j.id, a2);
            assert_eq!(j.reason, RejectReason::STALE_CONN);
        }
        other => panic!("{other:?}"),
    }
    // cm_rej_handler: stale → TimeWait, so the next attempt uses a fresh ID.
    assert_eq!(p.a.ep.state(a2), Some(ConnState::TimeWait));
    // B sent a DREQ on the old connection; the new A does not know it and answers with a
    // DREP (cm_issue_drep), which completes B's teardown.
    assert_eq!(p.sent(Side::B, "DREQ"), 1);
    assert_eq!(p.a.ep.stats().rx_unmatched, 1);
    assert_eq!(
        p.b.events.pop_front(),
        Some(CmEvent::Disconnected { id: b_old })
    );
    assert_eq!(p.b.ep.state(b_old), Some(ConnState::TimeWait));
    // After TimeWait the reset peer gets through.
    assert!(p.run_until(|p| p.a.ep.connections() == 0 && p.b.ep.connections() == 0));
    let a3 = p.a.ep.connect(p.now, p.b.addr, &params, &[]).unwrap();
    p.step();
    let r =
        p.b.events
            .drain(..)
            .find_map(|e| match e {
                CmEvent::ConnectRequest(r) => Some(r),
                _ => None,
            })
            .expect("ConnectRequest after TimeWait");
    accept(&mut p, r.id);
    p.step();
    let e =
        p.a.events
            .drain(..)
            .find_map(|e| match e {
                CmEvent::Established(e) => Some(e),
                _ => None,
            })
            .unwrap();
    assert_eq!(e.id, a3);
}

// --- timeouts --------------------------------------------------------------------------------

#[test]
fn req_retries_run_out_to_unreachable() {
    let mut p = Pair::new();
    p.drop_all(Side::A, "*");
    let a = connect(&mut p);
    assert!(p.run_until(|p| !p.a.events.is_empty()));
    assert_eq!(p.a.events.pop_front(), Some(CmEvent::Unreachable { id: a }));
    // 1 try + 15 retries (CMA_MAX_CM_RETRIES), each 2 × T(16) + T(20) ≈ 4.83 s.
    assert_eq!(p.sent(Side::A, "REQ"), 16);
    assert_eq!(p.now, Instant::ZERO + req_try() * 16);
    assert_eq!(p.a.ep.stats().retransmits, 15);
    assert_eq!(p.a.ep.stats().timeouts, 1);
    assert_eq!(p.a.ep.state(a), None);
    assert_eq!(p.a.ep.poll_timeout(), None);
}

#[test]
fn timeout_and_retries_are_configurable() {
    let mut a = config("192.168.1.10", 1);
    a.cm_response_timeout = 14;
    a.packet_lifetime = 10;
    a.max_cm_retries = 2;
    let mut p = Pair::with(a, config("192.168.1.20", 2));
    p.drop_all(Side::A, "*");
    let id = connect(&mut p);
    assert!(p.run_until(|p| !p.a.events.is_empty()));
    assert_eq!(p.a.events.pop_front(), Some(CmEvent::Unreachable { id }));
    assert_eq!(p.sent(Side::A, "REQ"), 3);
    assert_eq!(p.now, Instant::ZERO + (iba_time(10) * 2 + iba_time(14)) * 3);
}

#[test]
fn passive_side_gives_up_when_no_rtu_ever_arrives() {
    let mut p = Pair::new();
    let a = connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    p.drop_all(Side::A, "*"); // A goes silent after its REQ
    let t0 = p.now;
    accept(&mut p, r.id);
    assert!(p.run_until(|p| !p.b.events.is_empty()));
    assert_eq!(
        p.b.events.pop_front(),
        Some(CmEvent::Unreachable { id: r.id })
    );
    // REP retried the REQ's max CM retries (15) times, each T(REQ local CM timeout = 18).
    assert_eq!(p.sent(Side::B, "REP"), 16);
    assert_eq!(p.now, t0 + iba_time(18) * 16);
    assert_eq!(p.b.ep.state(r.id), None);
    // A heard the first REP and considers itself connected.
    assert_eq!(established(&mut p.a).id, a);
}

// --- teardown --------------------------------------------------------------------------------

#[test]
fn dreq_drep_teardown_then_timewait_then_forget() {
    let mut p = Pair::new();
    let (a, b) = handshake(&mut p);
    p.a.ep.disconnect(p.now, a, b"bye").unwrap();
    assert_eq!(p.a.ep.state(a), Some(ConnState::DreqSent));
    p.step();
    assert_eq!(
        p.b.events.pop_front(),
        Some(CmEvent::Disconnected { id: b })
    );
    assert_eq!(
        p.a.events.pop_front(),
        Some(CmEvent::Disconnected { id: a })
    );
    assert_eq!(p.a.ep.state(a), Some(ConnState::TimeWait));
    assert_eq!(p.b.ep.state(b), Some(ConnState::TimeWait));
    let CmMessage::Dreq(d) = CmMad::parse(&p.last_sent(Side::A, "DREQ")).unwrap().message else {
        unreachable!()
    };
    assert_eq!(d.remote_qpn, B_QPN);
    assert_eq!(&d.private_data[..3], b"bye");
    assert!(p.run_until(|p| p.a.ep.connections() == 0 && p.b.ep.connections() == 0));
    assert_eq!(
        p.a.events.pop_front(),
        Some(CmEvent::TimewaitExit { id: a })
    );
    assert_eq!(
        p.b.events.pop_front(),
        Some(CmEvent::TimewaitExit { id: b })
    );
    assert_eq!(p.a.ep.poll_timeout(), None);
    assert_eq!(
        p.a.ep.disconnect(p.now, a, &[]),
        Err(CmError::UnknownConnection(a))
    );
}

#[test]
fn lost_drep_is_repaired_from_timewait() {
    // Short handshake timers, long TimeWait: A's DREQ retry reaches B while B lingers.
    let mut ca = config("192.168.1.10", 1);
    ca.cm_response_timeout = 16;
    ca.packet_lifetime = 18;
    // A's advertised ACK delay sets the REQ's local ACK timeout, which is B's TimeWait:
    // T(22) ≈ 17 s against A's DREQ try of 2 × T(18) + T(16) ≈ 2.4 s.
    ca.ack_delay = 22;
    let mut p = Pair::with(ca, config("192.168.1.20", 2));
    let (a, b) = handshake(&mut p);
    p.drop_next(Side::B, "DREP");
    p.a.ep.disconnect(p.now, a, &[]).unwrap();
    p.step();
    assert_eq!(
        p.b.events.pop_front(),
        Some(CmEvent::Disconnected { id: b })
    );
    assert!(p.a.events.is_empty());
    assert!(p.run_until(|p| !p.a.events.is_empty()));
    assert_eq!(
        p.a.events.pop_front(),
        Some(CmEvent::Disconnected { id: a })
    );
    assert_eq!(p.sent(Side::A, "DREQ"), 2);
    assert_eq!(p.sent(Side::B, "DREP"), 2);
    assert_eq!(p.b.ep.stats().rx_duplicates, 1, "answered from TimeWait");
    assert!(p.b.events.is_empty(), "B reports Disconnected once");
}

#[test]
fn dreq_for_a_forgotten_connection_is_answered_with_drep() {
    // Default timers: B's TimeWait (≈ 1 s) ends before A's DREQ retry (≈ 4.8 s).
    let mut p = Pair::new();
    let (a, b) = handshake(&mut p);
    p.drop_next(Side::B, "DREP");
    p.a.ep.disconnect(p.now, a, &[]).unwrap();
    assert!(p.run_until(|p| !p.a.events.is_empty()));
    assert_eq!(
        p.a.events.pop_front(),
        Some(CmEvent::Disconnected { id: a })
    );
    assert_eq!(
        p.b.events.drain(..).collect::<Vec<_>>(),
        vec![
            CmEvent::Disconnected { id: b },
            CmEvent::TimewaitExit { id: b }
        ]
    );
    assert_eq!(p.b.ep.stats().rx_unmatched, 1);
    let CmMessage::Drep(d) = CmMad::parse(&p.last_sent(Side::B, "DREP")).unwrap().message else {
        unreachable!()
    };
    assert_eq!((d.local_comm_id, d.remote_comm_id), (b.0, a.0));
}

#[test]
fn dreq_retries_run_out_and_still_disconnect() {
    let mut p = Pair::new();
    let (a, _b) = handshake(&mut p);
    p.drop_all(Side::A, "DREQ");
    p.a.ep.disconnect(p.now, a, &[]).unwrap();
    assert!(p.run_until(|p| !p.a.events.is_empty()));
    assert_eq!(
        p.a.events.pop_front(),
        Some(CmEvent::Disconnected { id: a })
    );
    assert_eq!(p.sent(Side::A, "DREQ"), 16);
    assert_eq!(p.a.ep.state(a), Some(ConnState::TimeWait));
}

#[test]
fn simultaneous_disconnect() {
    let mut p = Pair::new();
    let (a, b) = handshake(&mut p);
    p.a.ep.disconnect(p.now, a, &[]).unwrap();
    p.b.ep.disconnect(p.now, b, &[]).unwrap();
    p.step();
    assert_eq!(
        p.a.events.drain(..).collect::<Vec<_>>(),
        vec![CmEvent::Disconnected { id: a }]
    );
    assert_eq!(
        p.b.events.drain(..).collect::<Vec<_>>(),
        vec![CmEvent::Disconnected { id: b }]
    );
    assert_eq!(p.a.ep.state(a), Some(ConnState::TimeWait));
    assert_eq!(p.b.ep.state(b), Some(ConnState::TimeWait));
}

#[test]
fn dreq_naming_another_qp_is_ignored() {
    let mut p = Pair::new();
    let (a, b) = handshake(&mut p);
    p.drop_next(Side::A, "DREQ");
    p.a.ep.disconnect(p.now, a, &[]).unwrap();
    p.step();
    let mut m = CmMad::parse(&p.last_sent(Side::A, "DREQ")).unwrap();
    let CmMessage::Dreq(d) = &mut m.message else {
        unreachable!()
    };
    d.remote_qpn = Qpn::new(0x999);
    p.inject(Side::A, &m.emit());
    assert_eq!(p.b.ep.state(b), Some(ConnState::Established));
    assert_eq!(p.b.ep.stats().rx_unexpected, 1);
}

// --- commands --------------------------------------------------------------------------------

#[test]
fn abort_tells_the_peer_and_forgets() {
    // Before the REP: REJ timeout with our GUID, which B matches by comm ID + GUID.
    let mut p = Pair::new();
    let a = connect(&mut p);
    p.step();
    let r = take_request(&mut p);
    p.a.ep.abort(a).unwrap();
    assert_eq!(p.a.ep.state(a), None);
    p.step();
    match p.b.events.pop_front() {
        Some(CmEvent::Rejected(j)) => {
            assert_eq!(j.id, r.id);
            assert_eq!(j.reason, RejectReason::TIMEOUT);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.b.ep.state(r.id), None);
    assert!(p.a.events.is_empty(), "no events after abort");

    // Established: one DREQ, answered by the peer.
    let mut p = Pair::new();
    let (a, b) = handshake(&mut p);
    p.a.ep.abort(a).unwrap();
    p.step();
    assert_eq!(
        p.b.events.pop_front(),
        Some(CmEvent::Disconnected { id: b })
    );
    assert_eq!(p.a.ep.stats().rx_unmatched, 1, "the DREP finds nobody");
    assert!(p.a.events.is_empty());
}

#[test]
fn commands_check_state_and_lengths() {
    let mut p = Pair::new();
    let params = ConnectParams::new(A_QPN, PORT);
    assert_eq!(
        p.a.ep.connect(p.now, p.b.addr, &params, &[0; 57]),
        Err(CmError::PrivateDataTooLong { len: 57, max: 56 })
    );
    let a = connect(&mut p);
    assert!(matches!(
        p.a.ep.disconnect(p.now, a, &[]),
        Err(CmError::InvalidState {
            state: ConnState::ReqSent,
            op: "disconnect",
            ..
        })
    ));
    assert!(matches!(
        p.a.ep.accept(p.now, a, &AcceptParams::new(A_QPN), &[]),
        Err(CmError::InvalidState { .. })
    ));
    p.step();
    let r = take_request(&mut p);
    assert_eq!(
        p.b.ep.reject(r.id, RejectReason::NO_RESOURCES, &[0; 149]),
        Err(CmError::PrivateDataTooLong { len: 149, max: 148 })
    );
    assert_eq!(
        p.b.ep
            .accept(p.now, r.id, &AcceptParams::new(B_QPN), &[0; 197]),
        Err(CmError::PrivateDataTooLong { len: 197, max: 196 })
    );
    assert_eq!(
        p.b.ep.state(r.id),
        Some(ConnState::ReqRcvd),
        "nothing changed"
    );
    assert!(!p.b.ep.listen(service_id(PORT)), "already listening");
    assert!(p.b.ep.unlisten(service_id(PORT)));
}

#[test]
fn garbage_and_unexpected_mads_are_counted_not_fatal() {
    let mut p = Pair::new();
    let (a, _b) = handshake(&mut p);
    p.inject(Side::B, &[0u8; 10]);
    let mut wrong_class = p.last_sent(Side::B, "REP");
    wrong_class[1] = 0x04;
    p.inject(Side::B, &wrong_class);
    let mut unknown_attr = p.last_sent(Side::B, "REP");
    unknown_attr[16..18].copy_from_slice(&attr::LAP.to_be_bytes());
    p.inject(Side::B, &unknown_attr);
    assert_eq!(p.a.ep.stats().rx_malformed, 3);
    // An RTU to the active side matches nothing it expects.
    let rtu = p.last_sent(Side::A, "RTU");
    p.inject(Side::B, &rtu);
    assert_eq!(p.a.ep.stats().rx_unmatched, 1);
    assert_eq!(p.a.ep.state(a), Some(ConnState::Established));
    assert!(p.a.events.is_empty());
}

#[test]
fn the_same_seeds_replay_the_same_bytes() {
    let run = || {
        let mut p = Pair::new();
        p.drop_next(Side::B, "REP");
        let (a, _) = handshake(&mut p);
        p.a.ep.disconnect(p.now, a, &[]).unwrap();
        p.run_until(|p| p.a.ep.connections() == 0 && p.b.ep.connections() == 0);
        (p.log, p.now)
    };
    let (l1, t1) = run();
    let (l2, t2) = run();
    assert_eq!(t1, t2);
    assert_eq!(l1, l2);
    assert!(l1.len() >= 6);
}

#[test]
fn the_transition_table_matches_its_snapshot() {
    snapshot::check_snapshot("cm_transitions.txt", &nvmf_rdma::cm::state::describe());
    snapshot::check_snapshot("cm_transitions.dot", &nvmf_rdma::cm::state::dot());
}

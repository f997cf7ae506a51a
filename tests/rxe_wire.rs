//! Packets captured from Linux rxe (Debian 6.1.0-56 guest, `tests/vm/run.sh`, tcpdump on the
//! host's tap0) parsed by our code: what interop with rxe taught us, pinned as tests.
//!
//! - rxe numbers its IPv4 datagrams and the ICRC covers the identification field: a
//!   receiver that cannot see the IP header (a UDP socket) cannot check rxe's ICRC, so
//!   devices facing RoCEv2 peers use `IcrcCheck::RealHeader`: the driver reads the whole
//!   IPv4 datagram off a raw socket and the device checks against its real header.
//! - rxe sends from a per-QP source port (0xC000 + hash), never from 4791, but receives only
//!   on 4791: replies go to the sender's IP at 4791 (`DeviceConfig::peer_port`).
//! - Linux ib_cm gives the starting PSN of each of REQ and REP to the *other* side's sender:
//!   the REQ carries the active side's receive PSN, the REP the passive side's. Reading it
//!   the other way round (as we first did) makes rxe NAK every packet with "PSN sequence
//!   error".

use std::net::SocketAddr;

use nvmf_rdma::cm::messages::{CmMad, CmMessage};
use nvmf_rdma::cm::{CmConfig, CmEndpoint, CmEvent, ConnectParams, NvmeCmRequest, MAD_LEN};
use nvmf_rdma::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use nvmf_rdma::hca::wire::{
    AethSyndrome, IcrcContext, Ipv4Udp, NakCode, Opcode, ParsedPacket, WireError,
};
use nvmf_rdma::hca::Device;
use nvmf_rdma::verbs::{Guid, Instant, Mtu, PciAddr, Psn, Qpn};
use rand::rngs::SmallRng;
use rand::SeedableRng;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A NAK (PSN sequence error) rxe sent to our QP 0x9fa: UDP payload from
/// 192.168.100.2:64908 to 192.168.100.1:4791, IPv4 identification 0x68e5, DF.
const RXE_NAK: &str = "1100ffff000009fa00cfd2076000000043d70fb0";
const RXE_NAK_IP_ID: u16 = 0x68e5;

fn rxe_nak_ctx(ip_id: u16) -> IcrcContext {
    let mut c = IcrcContext::new(
        "192.168.100.2:64908".parse().unwrap(),
        "192.168.100.1:4791".parse().unwrap(),
    );
    c.ip_id = ip_id;
    c
}

#[test]
fn rxe_icrc_verifies_with_its_real_ip_identification() {
    let pkt = unhex(RXE_NAK);
    let p = ParsedPacket::parse(&pkt, Some(&rxe_nak_ctx(RXE_NAK_IP_ID))).expect("rxe's ICRC");
    assert_eq!(p.hdrs.bth.opcode, Opcode::RC_ACKNOWLEDGE);
    assert_eq!(p.hdrs.bth.dest_qp, Qpn::new(0x9fa));
    assert_eq!(p.hdrs.bth.psn, Psn::new(0xcfd207));
    let aeth = p.hdrs.aeth.expect("AETH");
    assert_eq!(aeth.syndrome, AethSyndrome::Nak(NakCode::PsnSequenceError));
    assert_eq!(aeth.msn, 0);
}

#[test]
fn rxe_icrc_does_not_verify_with_identification_zero() {
    // What `IcrcCheck::Verify` assumes for a UDP payload; hence `RealHeader` towards rxe.
    let pkt = unhex(RXE_NAK);
    assert!(matches!(
        ParsedPacket::parse(&pkt, Some(&rxe_nak_ctx(0))),
        Err(WireError::IcrcMismatch { .. })
    ));
    assert!(ParsedPacket::parse(&pkt, None).is_ok());
}

/// The NAK as the host's raw socket receives it: rxe's IPv4 header (ID 0x68e5, DF; TTL
/// and header checksum, which the ICRC masks, as Linux would send them) and UDP header.
fn rxe_nak_datagram() -> Vec<u8> {
    let payload = unhex(RXE_NAK);
    let total = (20 + 8 + payload.len()) as u16;
    let mut d = vec![0x45, 0x00];
    d.extend_from_slice(&total.to_be_bytes());
    d.extend_from_slice(&RXE_NAK_IP_ID.to_be_bytes());
    d.extend_from_slice(&[
        0x40, 0x00, 64, 17, 0x52, 0x9b, 192, 168, 100, 2, 192, 168, 100, 1,
    ]);
    d.extend_from_slice(&64908u16.to_be_bytes());
    d.extend_from_slice(&4791u16.to_be_bytes());
    d.extend_from_slice(&(total - 20).to_be_bytes());
    d.extend_from_slice(&[0x12, 0x34]);
    d.extend_from_slice(&payload);
    d
}

fn device(icrc: IcrcCheck) -> Device {
    Device::new(DeviceConfig {
        identity: DeviceIdentity::from_mac(
            "srxe0",
            [2, 0, 0, 0, 0, 1],
            PciAddr::new(0, 0x30, 1, 0),
        ),
        addr: "192.168.100.1:4791".parse().unwrap(),
        icrc,
        peer_port: Some(4791),
        seed: 0,
    })
}

#[test]
fn a_device_checks_rxes_icrc_against_the_ipv4_header_it_came_with() {
    let datagram = rxe_nak_datagram();
    let p = Ipv4Udp::parse(&datagram).expect("rxe's IPv4/UDP header");
    assert_eq!(p.icrc, rxe_nak_ctx(RXE_NAK_IP_ID));
    assert!(ParsedPacket::parse(p.payload, Some(&p.icrc)).is_ok());

    let mut d = device(IcrcCheck::RealHeader { required: false });
    d.handle_ipv4(Instant(0), &datagram);
    assert_eq!(
        (d.stats().rx_icrc_verified, d.stats().rx_icrc_errors),
        (1, 0)
    );
    // Another identification (the bytes on the wire otherwise the same): dropped.
    let mut other = datagram.clone();
    other[5] ^= 1;
    d.handle_ipv4(Instant(0), &other);
    assert_eq!(
        (d.stats().rx_icrc_verified, d.stats().rx_icrc_errors),
        (1, 1)
    );
    // The UDP payload alone (no raw socket): accepted unchecked, and counted.
    d.handle_datagram(
        Instant(0),
        "192.168.100.2:64908".parse().unwrap(),
        p.payload,
    );
    assert_eq!(d.stats().rx_icrc_unchecked, 1);
    // A header RoCEv2 never sends (IP options): malformed, not a panic.
    let mut opts = datagram.clone();
    opts[0] = 0x46;
    d.handle_ipv4(Instant(0), &opts);
    assert_eq!(d.stats().rx_malformed, 1);
    // `Verify` assumes identification 0 for a UDP payload: rxe's fails.
    let mut v = device(IcrcCheck::Verify);
    v.handle_datagram(
        Instant(0),
        "192.168.100.2:64908".parse().unwrap(),
        p.payload,
    );
    assert_eq!(v.stats().rx_icrc_errors, 1);
    // The same bytes from a loopback address (the kernel's loopback, no wire): not checked.
    v.handle_host_datagram(Instant(0), "127.0.0.1:64908".parse().unwrap(), p.payload);
    assert_eq!(
        (v.stats().rx_icrc_errors, v.stats().rx_icrc_unchecked),
        (1, 1)
    );
}

/// The REP nvmet-rdma's rxe answered our REQ with (BTH + DETH + MAD; the capture stopped at
/// 300 bytes of frame, so the MAD's last 18 bytes, private data that nvmet leaves zero,
/// are zero-filled here). REP: local comm ID 0xe658505a, remote comm ID 0xf7dee01f, QPN
/// 0x13, starting PSN 0xcfd207, target ACK delay 15, RNR retry 7, CA GUID of the guest NIC.
const RXE_REP: &str = "6400ffff000000018000000280010000000000010107020300000000a83ecd4cf7dee01f0013000000000000e658505af7dee01f000000000000130000000000cfd20700001079e0505400fffe12345600002000";

fn rxe_rep_mad() -> [u8; MAD_LEN] {
    let pkt = unhex(RXE_REP);
    let mut mad = [0u8; MAD_LEN];
    let body = &pkt[20..];
    mad[..body.len()].copy_from_slice(body);
    mad
}

#[test]
fn rxe_rep_parses() {
    let mad = CmMad::parse(&rxe_rep_mad()).expect("REP");
    let CmMessage::Rep(r) = mad.message else {
        panic!("not a REP: {:?}", mad.message)
    };
    assert_eq!(r.local_comm_id, 0xe658_505a);
    assert_eq!(r.remote_comm_id, 0xf7de_e01f);
    assert_eq!(r.local_qpn, Qpn::new(0x13));
    assert_eq!(r.starting_psn, Psn::new(0xcfd207));
    assert_eq!(r.target_ack_delay, 15);
    assert_eq!(r.rnr_retry_count, 7);
    assert_eq!(r.local_ca_guid, Guid(0x5054_00ff_fe12_3456));
}

#[test]
fn rxe_rep_starting_psn_is_what_the_active_side_sends_with() {
    let peer: SocketAddr = "192.168.100.2:4791".parse().unwrap();
    let mut ep = CmEndpoint::new(
        CmConfig::new(
            "192.168.100.1".parse().unwrap(),
            Guid(0x5054_00ff_fe30_d201),
        ),
        SmallRng::seed_from_u64(7),
    );
    let mut params = ConnectParams::new(Qpn::new(0x9fa), 4420);
    params.path_mtu = Mtu::Mtu1024;
    let ulp = NvmeCmRequest {
        qid: 0,
        hrqsize: 32,
        hsqsize: 31,
        cntlid: 0xffff,
    }
    .emit();
    let id = ep.connect(Instant::ZERO, peer, &params, &ulp).unwrap();
    let (to, req) = ep.poll_transmit().expect("REQ");
    assert_eq!(to, peer);
    let CmMessage::Req(r) = CmMad::parse(&req).unwrap().message else {
        panic!("not a REQ")
    };
    let our_recv_psn = r.starting_psn;
    // rxe's REP, re-addressed to this REQ (our comm ID and transaction ID).
    let mut rep = rxe_rep_mad();
    rep[8..16].copy_from_slice(&req[8..16]);
    rep[28..32].copy_from_slice(&r.local_comm_id.to_be_bytes());
    ep.handle_mad(Instant::ZERO, peer, &rep);
    let est = loop {
        match ep.poll_event() {
            Some(CmEvent::Established(e)) => break e,
            Some(_) => continue,
            None => panic!("no Established"),
        }
    };
    assert_eq!(est.id, id);
    assert_eq!(est.remote_qpn, Qpn::new(0x13));
    // rxe expects our first packet at the PSN its REP carries ...
    assert_eq!(est.local_psn, Psn::new(0xcfd207));
    // ... and sends to us from the PSN our REQ carried.
    assert_eq!(est.remote_psn, our_recv_psn);
    assert_eq!(
        ep.poll_transmit().map(|(to, _)| to),
        Some(peer),
        "RTU to 4791"
    );
}

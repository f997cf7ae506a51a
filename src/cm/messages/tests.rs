//! Deconstruct, construct, parse and emit of the MAD header and each CM message, and what a
//! malformed MAD gets.

use super::*;
use crate::cm::mad::*;

const TID: u64 = 0x0102_0304_0506_0708;

/// A MAD with a CM SEND header for `attr` and transaction ID `TID`.
fn hdr(attr: u16) -> [u8; MAD_LEN] {
    let mut b = [0u8; MAD_LEN];
    b[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    b[8..16].copy_from_slice(&TID.to_be_bytes());
    b[16..18].copy_from_slice(&attr.to_be_bytes());
    b
}

fn pattern<const N: usize>(seed: u8) -> [u8; N] {
    let mut a = [0u8; N];
    for (i, x) in a.iter_mut().enumerate() {
        *x = seed.wrapping_add(i as u8);
    }
    a
}

// --- header ------------------------------------------------------------------------------

#[test]
fn header_deconstruct_construct() {
    let mut b = hdr(attr::REQ);
    b[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
    b[6..8].copy_from_slice(&0x5678u16.to_be_bytes());
    b[20..24].copy_from_slice(&0x9ABC_DEF0u32.to_be_bytes());
    let v = Mad::new_checked(&b[..]).unwrap();
    assert_eq!(
        (
            v.base_version(),
            v.mgmt_class(),
            v.class_version(),
            v.method()
        ),
        (1, 0x07, 2, 0x03)
    );
    assert_eq!(v.status(), 0x1234);
    assert_eq!(v.class_specific(), 0x5678);
    assert_eq!(v.transaction_id(), TID);
    assert_eq!(v.attribute_id(), 0x0010);
    assert_eq!(v.attribute_modifier(), 0x9ABC_DEF0);
    assert_eq!(v.data().len(), CM_DATA_LEN);
    let r = MadHdrRepr::parse(&v);
    let mut out = [0u8; MAD_LEN];
    r.emit(&mut out);
    assert_eq!(out[..24], b[..24]);
    assert!(v.check_cm_header().is_ok());
}

#[test]
fn header_rejects_wrong_class_version_method_and_length() {
    assert_eq!(
        Mad::new_checked(&[0u8; 255][..]).unwrap_err(),
        MadError::Truncated(255)
    );
    assert_eq!(
        Mad::new_checked(&[0u8; 257][..]).unwrap_err(),
        MadError::TooLong(257)
    );
    for (at, val, want) in [
        (0, 2, MadError::BadBaseVersion(2)),
        (1, 0x03, MadError::NotCm(0x03)),
        (2, 1, MadError::BadClassVersion(1)),
        (3, 0x81, MadError::BadMethod(0x81)),
    ] {
        let mut b = hdr(attr::RTU);
        b[at] = val;
        assert_eq!(CmMad::parse(&b).unwrap_err(), want);
    }
    for a in [0u16, 0x0F, attr::SIDR_REQ, attr::LAP, attr::APR, 0xFFFF] {
        assert_eq!(
            CmMad::parse(&hdr(a)).unwrap_err(),
            MadError::UnknownAttribute(a)
        );
    }
}

// --- REQ -----------------------------------------------------------------------------------

fn req_repr() -> ReqRepr {
    ReqRepr {
        local_comm_id: 0xA1B2_C3D4,
        service_id: 0x0000_0000_0106_1144,
        local_ca_guid: Guid(0x5054_00FF_FE12_3456),
        local_qkey: 0,
        local_qpn: Qpn::new(0x00_0011),
        responder_resources: 16,
        initiator_depth: 8,
        remote_cm_response_timeout: 20,
        transport: TransportType::Rc,
        flow_control: true,
        starting_psn: Psn::new(0xAB_CDEF),
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: Mtu::Mtu1024,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        primary_local_lid: 0xFFFF,
        primary_remote_lid: 0xFFFF,
        primary_local_gid: "::ffff:192.168.1.10".parse().unwrap(),
        primary_remote_gid: "::ffff:192.168.1.20".parse().unwrap(),
        flow_label: 0xF_1234,
        packet_rate: 0x3F,
        traffic_class: 0x20,
        hop_limit: 64,
        sl: 3,
        subnet_local: false,
        local_ack_timeout: 18,
        private_data: pattern(0x40),
    }
}

fn req_bytes() -> [u8; MAD_LEN] {
    let mut b = hdr(attr::REQ);
    let d = &mut b[24..];
    d[0..4].copy_from_slice(&[0xA1, 0xB2, 0xC3, 0xD4]);
    d[8..16].copy_from_slice(&[0, 0, 0, 0, 0x01, 0x06, 0x11, 0x44]);
    d[16..24].copy_from_slice(&[0x50, 0x54, 0x00, 0xFF, 0xFE, 0x12, 0x34, 0x56]);
    d[32..36].copy_from_slice(&[0x00, 0x00, 0x11, 16]); // QPN | responder resources
    d[39] = 8; // initiator depth
    d[43] = (20 << 3) | 1; // remote CM timeout | RC (0) | flow control
    d[44..48].copy_from_slice(&[0xAB, 0xCD, 0xEF, (20 << 3) | 7]);
    d[48..50].copy_from_slice(&[0xFF, 0xFF]);
    d[50] = (3 << 4) | 7; // MTU 1024 | RNR retry
    d[51] = 15 << 4; // max CM retries
    d[52..56].copy_from_slice(&[0xFF; 4]);
    d[56..72].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 192, 168, 1, 10]);
    d[72..88].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 192, 168, 1, 20]);
    d[88..92].copy_from_slice(&[0xF1, 0x23, 0x40, 0x3F]); // flow label | rate
    d[92] = 0x20;
    d[93] = 64;
    d[94] = 3 << 4;
    d[95] = 18 << 3;
    d[140..232].copy_from_slice(&pattern::<92>(0x40));
    b
}

#[test]
fn req_deconstruct() {
    let b = req_bytes();
    let v = Mad::new_checked(&b[..]).unwrap();
    assert_eq!(v.attribute_id(), ReqRepr::ATTR_ID);
    let r = ReqRepr::parse(&v).unwrap();
    assert_eq!(r.local_comm_id, 0xA1B2_C3D4);
    assert_eq!(r.service_id, 0x0106_1144);
    assert_eq!(r.local_qpn, Qpn::new(0x11));
    assert_eq!((r.responder_resources, r.initiator_depth), (16, 8));
    assert_eq!(r.starting_psn, Psn::new(0xAB_CDEF));
    assert_eq!(r.path_mtu, Mtu::Mtu1024);
    assert_eq!(r.flow_label, 0xF_1234);
    assert_eq!(r.packet_rate, 0x3F);
    assert_eq!(
        r.primary_remote_gid.to_ipv4_mapped(),
        Some([192, 168, 1, 20].into())
    );
}

#[test]
fn req_construct() {
    let m = CmMad {
        transaction_id: TID,
        message: CmMessage::Req(req_repr()),
    };
    assert_eq!(m.emit(), req_bytes());
}

#[test]
fn req_parse() {
    assert_eq!(
        CmMad::parse(&req_bytes()).unwrap(),
        CmMad {
            transaction_id: TID,
            message: CmMessage::Req(req_repr()),
        }
    );
}

#[test]
fn req_emit_round_trips_and_masks() {
    let mut r = req_repr();
    r.transport = TransportType::Uc;
    r.srq = true;
    r.subnet_local = true;
    r.path_mtu = Mtu::Mtu4096;
    let mut out = [0u8; MAD_LEN];
    MadHdrRepr::cm(attr::REQ, 1).emit(&mut out);
    r.emit(&mut out);
    assert_eq!(
        ReqRepr::parse(&Mad::new_checked(&out[..]).unwrap()).unwrap(),
        r
    );
    // Oversized values are masked to their widths instead of spilling into neighbours.
    r.retry_count = 0xFF;
    r.remote_cm_response_timeout = 0xFF;
    r.flow_label = u32::MAX;
    r.emit(&mut out);
    let p = ReqRepr::parse(&Mad::new_checked(&out[..]).unwrap()).unwrap();
    assert_eq!((p.retry_count, p.remote_cm_response_timeout), (7, 31));
    assert_eq!((p.flow_label, p.packet_rate), (0xF_FFFF, r.packet_rate));
    assert_eq!(p.local_cm_response_timeout, r.local_cm_response_timeout);
}

#[test]
fn req_bad_length_and_mtu() {
    let b = req_bytes();
    assert_eq!(CmMad::parse(&b[..200]), Err(MadError::Truncated(200)));
    let mut b = req_bytes();
    b[24 + 50] = 0x67; // MTU code 6
    assert_eq!(CmMad::parse(&b), Err(MadError::BadMtu(6)));
}

// --- REP -----------------------------------------------------------------------------------

fn rep_repr() -> RepRepr {
    RepRepr {
        local_comm_id: 0x1111_2222,
        remote_comm_id: 0xA1B2_C3D4,
        local_qkey: 0,
        local_qpn: Qpn::new(0x12_3456),
        starting_psn: Psn::new(0x65_4321),
        responder_resources: 4,
        initiator_depth: 2,
        target_ack_delay: 15,
        failover: 1,
        flow_control: true,
        rnr_retry_count: 6,
        srq: true,
        local_ca_guid: Guid(0x0002_C903_0000_0001),
        private_data: pattern(0x80),
    }
}

fn rep_bytes() -> [u8; MAD_LEN] {
    let mut b = hdr(attr::REP);
    let d = &mut b[24..];
    d[0..4].copy_from_slice(&[0x11, 0x11, 0x22, 0x22]);
    d[4..8].copy_from_slice(&[0xA1, 0xB2, 0xC3, 0xD4]);
    d[12..15].copy_from_slice(&[0x12, 0x34, 0x56]);
    d[20..23].copy_from_slice(&[0x65, 0x43, 0x21]);
    d[24] = 4;
    d[25] = 2;
    d[26] = (15 << 3) | (1 << 1) | 1;
    d[27] = (6 << 5) | 0x10;
    d[28..36].copy_from_slice(&[0x00, 0x02, 0xC9, 0x03, 0, 0, 0, 1]);
    d[36..232].copy_from_slice(&pattern::<196>(0x80));
    b
}

#[test]
fn rep_deconstruct() {
    let b = rep_bytes();
    let r = RepRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
    assert_eq!(r.local_qpn, Qpn::new(0x12_3456));
    assert_eq!(r.starting_psn, Psn::new(0x65_4321));
    assert_eq!(
        (r.target_ack_delay, r.failover, r.flow_control),
        (15, 1, true)
    );
    assert_eq!((r.rnr_retry_count, r.srq), (6, true));
}
#[test]
fn rep_construct() {
    let m = CmMad {
        transaction_id: TID,
        message: CmMessage::Rep(rep_repr()),
    };
    assert_eq!(m.emit(), rep_bytes());
}
#[test]
fn rep_parse() {
    assert_eq!(
        CmMad::parse(&rep_bytes()).unwrap().message,
        CmMessage::Rep(rep_repr())
    );
}
#[test]
fn rep_emit_round_trip() {
    let mut r = rep_repr();
    r.failover = 2;
    r.srq = false;
    r.local_qpn = Qpn::new(0xFF_FFFF);
    let m = CmMad {
        transaction_id: 7,
        message: CmMessage::Rep(r),
    };
    assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
}
#[test]
fn rep_bad_length() {
    assert_eq!(
        CmMad::parse(&rep_bytes()[..MAD_LEN - 1]),
        Err(MadError::Truncated(255))
    );
}

// --- RTU -----------------------------------------------------------------------------------

fn rtu_bytes() -> [u8; MAD_LEN] {
    let mut b = hdr(attr::RTU);
    b[24..28].copy_from_slice(&[0, 0, 0, 5]);
    b[28..32].copy_from_slice(&[0, 0, 0, 9]);
    b[32..].copy_from_slice(&pattern::<224>(3));
    b
}
fn rtu_repr() -> RtuRepr {
    RtuRepr {
        local_comm_id: 5,
        remote_comm_id: 9,
        private_data: pattern(3),
    }
}
#[test]
fn rtu_deconstruct() {
    let b = rtu_bytes();
    let r = RtuRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
    assert_eq!((r.local_comm_id, r.remote_comm_id), (5, 9));
    assert_eq!(r.private_data[0], 3);
}
#[test]
fn rtu_construct() {
    let m = CmMad {
        transaction_id: TID,
        message: CmMessage::Rtu(rtu_repr()),
    };
    assert_eq!(m.emit(), rtu_bytes());
}
#[test]
fn rtu_parse() {
    assert_eq!(
        CmMad::parse(&rtu_bytes()).unwrap().message,
        CmMessage::Rtu(rtu_repr())
    );
}
#[test]
fn rtu_emit_round_trip() {
    let m = CmMad {
        transaction_id: u64::MAX,
        message: CmMessage::Rtu(rtu_repr()),
    };
    assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
}
#[test]
fn rtu_bad_length() {
    assert!(CmMad::parse(&rtu_bytes()[..24]).is_err());
    assert!(CmMad::parse(&[]).is_err());
}

// --- REJ -----------------------------------------------------------------------------------

fn rej_repr() -> RejRepr {
    let mut ari_bytes = [0u8; 72];
    ari_bytes[..8].copy_from_slice(&0x0002_C903_0000_0001u64.to_be_bytes());
    let mut private_data = [0u8; 148];
    private_data[..4].copy_from_slice(&[0, 0, 6, 0]); // nvme_rdma_cm_rej: NO_RSC
    RejRepr {
        local_comm_id: 0,
        remote_comm_id: 0xA1B2_C3D4,
        message_rejected: MsgRef::Req,
        ari_length: 8,
        reason: RejectReason::CONSUMER_DEFINED,
        ari_bytes,
        private_data,
    }
}
fn rej_bytes() -> [u8; MAD_LEN] {
    let mut b = hdr(attr::REJ);
    b[28..32].copy_from_slice(&[0xA1, 0xB2, 0xC3, 0xD4]);
    b[32] = 0; // REQ
    b[33] = 8 << 1;
    b[34..36].copy_from_slice(&[0, 28]);
    b[36..44].copy_from_slice(&[0x00, 0x02, 0xC9, 0x03, 0, 0, 0, 1]);
    b[108..112].copy_from_slice(&[0, 0, 6, 0]);
    b
}
#[test]
fn rej_deconstruct() {
    let b = rej_bytes();
    let r = RejRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
    assert_eq!(r.reason, RejectReason::CONSUMER_DEFINED);
    assert_eq!(r.message_rejected, MsgRef::Req);
    assert_eq!(r.ari().len(), 8);
    assert_eq!(&r.private_data[..4], &[0, 0, 6, 0]);
    assert_eq!(r.reason.to_string(), "28 (consumer defined)");
}
#[test]
fn rej_construct() {
    let m = CmMad {
        transaction_id: TID,
        message: CmMessage::Rej(rej_repr()),
    };
    assert_eq!(m.emit(), rej_bytes());
}
#[test]
fn rej_parse() {
    assert_eq!(
        CmMad::parse(&rej_bytes()).unwrap().message,
        CmMessage::Rej(rej_repr())
    );
}
#[test]
fn rej_emit_round_trip_and_long_ari_length() {
    let mut r = rej_repr();
    r.message_rejected = MsgRef::Other;
    r.ari_length = 127; // longer than the field: ari() clamps
    r.reason = RejectReason::STALE_CONN;
    let m = CmMad {
        transaction_id: 1,
        message: CmMessage::Rej(r),
    };
    let p = CmMad::parse(&m.emit()).unwrap();
    assert_eq!(p, m);
    let CmMessage::Rej(p) = p.message else {
        unreachable!()
    };
    assert_eq!(p.ari().len(), 72);
}
#[test]
fn rej_bad_length_and_reserved_msg_ref() {
    assert!(CmMad::parse(&rej_bytes()[..100]).is_err());
    let mut b = rej_bytes();
    b[32] = 3 << 6;
    assert_eq!(CmMad::parse(&b), Err(MadError::BadMsgRef(3)));
}

// --- DREQ / DREP ----------------------------------------------------------------------------

fn dreq_bytes() -> [u8; MAD_LEN] {
    let mut b = hdr(attr::DREQ);
    b[24..28].copy_from_slice(&[0, 0, 1, 0]);
    b[28..32].copy_from_slice(&[0, 0, 2, 0]);
    b[32..36].copy_from_slice(&[0xAB, 0xCD, 0xEF, 0]);
    b[36..].copy_from_slice(&pattern::<220>(9));
    b
}
fn dreq_repr() -> DreqRepr {
    DreqRepr {
        local_comm_id: 0x100,
        remote_comm_id: 0x200,
        remote_qpn: Qpn::new(0xAB_CDEF),
        private_data: pattern(9),
    }
}
#[test]
fn dreq_deconstruct() {
    let b = dreq_bytes();
    let r = DreqRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
    assert_eq!(r.remote_qpn, Qpn::new(0xAB_CDEF));
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0x100, 0x200));
}
#[test]
fn dreq_construct() {
    let m = CmMad {
        transaction_id: TID,
        message: CmMessage::Dreq(dreq_repr()),
    };
    assert_eq!(m.emit(), dreq_bytes());
}
#[test]
fn dreq_parse() {
    assert_eq!(
        CmMad::parse(&dreq_bytes()).unwrap().message,
        CmMessage::Dreq(dreq_repr())
    );
}
#[test]
fn dreq_emit_round_trip() {
    let m = CmMad {
        transaction_id: 3,
        message: CmMessage::Dreq(dreq_repr()),
    };
    assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
}
#[test]
fn dreq_bad_length() {
    assert_eq!(
        CmMad::parse(&dreq_bytes()[..255]),
        Err(MadError::Truncated(255))
    );
}

fn drep_bytes() -> [u8; MAD_LEN] {
    let mut b = hdr(attr::DREP);
    b[24..28].copy_from_slice(&[0, 0, 2, 0]);
    b[28..32].copy_from_slice(&[0, 0, 1, 0]);
    b[32..].copy_from_slice(&pattern::<224>(1));
    b
}
fn drep_repr() -> DrepRepr {
    DrepRepr {
        local_comm_id: 0x200,
        remote_comm_id: 0x100,
        private_data: pattern(1),
    }
}
#[test]
fn drep_deconstruct() {
    let b = drep_bytes();
    let r = DrepRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0x200, 0x100));
}
#[test]
fn drep_construct() {
    let m = CmMad {
        transaction_id: TID,
        message: CmMessage::Drep(drep_repr()),
    };
    assert_eq!(m.emit(), drep_bytes());
}
#[test]
fn drep_parse() {
    assert_eq!(
        CmMad::parse(&drep_bytes()).unwrap().message,
        CmMessage::Drep(drep_repr())
    );
}
#[test]
fn drep_emit_round_trip() {
    let m = CmMad {
        transaction_id: 4,
        message: CmMessage::Drep(drep_repr()),
    };
    assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
}
#[test]
fn drep_bad_length() {
    assert!(CmMad::parse(&drep_bytes()[..128]).is_err());
}

// --- MRA -----------------------------------------------------------------------------------

fn mra_bytes() -> [u8; MAD_LEN] {
    let mut b = hdr(attr::MRA);
    b[24..28].copy_from_slice(&[0, 0, 0, 7]);
    b[28..32].copy_from_slice(&[0, 0, 0, 8]);
    b[32] = 1 << 6; // REP MRAed
    b[33] = 24 << 3;
    b[34..].copy_from_slice(&pattern::<222>(5));
    b
}
fn mra_repr() -> MraRepr {
    MraRepr {
        local_comm_id: 7,
        remote_comm_id: 8,
        message_mraed: MsgRef::Rep,
        service_timeout: 24,
        private_data: pattern(5),
    }
}
#[test]
fn mra_deconstruct() {
    let b = mra_bytes();
    let r = MraRepr::parse(&Mad::new_checked(&b[..]).unwrap()).unwrap();
    assert_eq!((r.message_mraed, r.service_timeout), (MsgRef::Rep, 24));
}
#[test]
fn mra_construct() {
    let m = CmMad {
        transaction_id: TID,
        message: CmMessage::Mra(mra_repr()),
    };
    assert_eq!(m.emit(), mra_bytes());
}
#[test]
fn mra_parse() {
    assert_eq!(
        CmMad::parse(&mra_bytes()).unwrap().message,
        CmMessage::Mra(mra_repr())
    );
}
#[test]
fn mra_emit_round_trip() {
    let mut r = mra_repr();
    r.message_mraed = MsgRef::Req;
    let m = CmMad {
        transaction_id: 5,
        message: CmMessage::Mra(r),
    };
    assert_eq!(CmMad::parse(&m.emit()).unwrap(), m);
}
#[test]
fn mra_bad_length_and_reserved_msg_ref() {
    assert!(CmMad::parse(&mra_bytes()[..30]).is_err());
    let mut b = mra_bytes();
    b[32] = 0xC0;
    assert_eq!(CmMad::parse(&b), Err(MadError::BadMsgRef(3)));
}

#[test]
fn reject_reason_names() {
    assert_eq!(RejectReason::INVALID_SERVICE_ID.0, 8);
    assert_eq!(RejectReason::STALE_CONN.0, 10);
    assert_eq!(RejectReason(34).describe(), "unrecognised reason");
}

//! Property tests for the NVMe / NVMe-oF data structures (`nvmf_rdma::nvme`):
//!
//! * every parser takes arbitrary bytes (any length) without panicking;
//! * every structure round-trips value -> emit -> parse exactly, for arbitrary field values;
//! * whatever parses re-emits to bytes that parse to the same value, and those bytes equal
//!   the input except in reserved positions;
//! * the command builders and register helpers put values where the decoders find them.

use nvmf_rdma::nvme::admin::{self, DsmRange, MAX_BLOCKS};
use nvmf_rdma::nvme::discovery::{DiscoveryLogEntry, DiscoveryLogHeader, RdmaTsas};
use nvmf_rdma::nvme::fabrics::{
    ConnectData, ConnectResult, FabricsCmd, FixedStr, Nqn, NQN_MAX_LEN,
};
use nvmf_rdma::nvme::identify::{
    active_namespace_ids, emit_active_namespace_ids, IdentifyController, IdentifyNamespace,
    LbaFormat, LBAF_ENTRIES,
};
use nvmf_rdma::nvme::registers::{Cap, Cc, Csts, Vs};
use nvmf_rdma::nvme::sgl::MAX_KEYED_LEN;
use nvmf_rdma::nvme::{Cqe, Fuse, NvmeError, NvmeWireError, SglDescriptor, Sqe, Status};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..max)
}

fn arr<const N: usize>() -> impl Strategy<Value = [u8; N]> {
    vec(any::<u8>(), N).prop_map(|v| {
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        a
    })
}

fn any_fuse() -> impl Strategy<Value = Fuse> {
    select(vec![Fuse::Normal, Fuse::First, Fuse::Second])
}

fn any_sqe() -> impl Strategy<Value = Sqe> {
    (
        (any::<u8>(), any_fuse(), any::<u16>(), any::<u32>()),
        (any::<u32>(), any::<u32>(), any::<u64>(), any::<[u8; 16]>()),
        any::<[u32; 6]>(),
    )
        .prop_map(
            |((opcode, fuse, cid, nsid), (cdw2, cdw3, mptr, dptr), c)| Sqe {
                opcode,
                fuse,
                cid,
                nsid,
                cdw2,
                cdw3,
                mptr,
                dptr,
                cdw10: c[0],
                cdw11: c[1],
                cdw12: c[2],
                cdw13: c[3],
                cdw14: c[4],
                cdw15: c[5],
            },
        )
}

fn any_sgl() -> impl Strategy<Value = SglDescriptor> {
    prop_oneof![
        (any::<u64>(), 0..=MAX_KEYED_LEN, any::<u32>(), any::<bool>()).prop_map(
            |(addr, len, key, invalidate)| SglDescriptor::Keyed {
                addr,
                len,
                key,
                invalidate
            }
        ),
        (any::<u64>(), any::<u32>())
            .prop_map(|(offset, len)| SglDescriptor::InCapsule { offset, len }),
    ]
}

fn any_nqn() -> impl Strategy<Value = Nqn> {
    "[ -~]{1,223}".prop_map(|s| Nqn::new(&s).unwrap())
}

fn any_fabrics() -> impl Strategy<Value = FabricsCmd> {
    prop_oneof![
        (
            any::<u16>(),
            any::<u16>(),
            any::<u16>(),
            any::<u8>(),
            any::<u32>()
        )
            .prop_map(
                |(recfmt, qid, sqsize, cattr, kato_ms)| FabricsCmd::Connect {
                    recfmt,
                    qid,
                    sqsize,
                    cattr,
                    kato_ms
                }
            ),
        (any::<bool>(), any::<u32>())
            .prop_map(|(size8, offset)| FabricsCmd::PropertyGet { size8, offset }),
        (any::<bool>(), any::<u32>(), any::<u64>()).prop_map(|(size8, offset, value)| {
            FabricsCmd::PropertySet {
                size8,
                offset,
                value,
            }
        }),
    ]
}

fn any_ctrl() -> impl Strategy<Value = IdentifyController> {
    (
        (
            any::<u16>(),
            any::<u16>(),
            arr::<20>(),
            arr::<40>(),
            arr::<8>(),
            any::<u8>(),
            any::<u16>(),
            any::<u32>(),
        ),
        (
            any::<u32>(),
            any::<u16>(),
            any::<u8>(),
            any::<u8>(),
            any::<u16>(),
            any::<u32>(),
            any::<u16>(),
            any::<u8>(),
        ),
        (
            any::<u32>(),
            arr::<256>(),
            any::<u32>(),
            any::<u32>(),
            any::<u16>(),
            any::<u8>(),
            any::<u8>(),
        ),
        (any::<u8>(), any::<u64>(), any::<u16>(), any::<u8>()),
    )
        .prop_map(
            |(
                (vid, ssvid, sn, mn, fr, mdts, cntlid, ver),
                (ctratt, kas, sqes, cqes, maxcmd, nn, oncs, vwc),
                (sgls, subnqn, ioccsz, iorcsz, icdoff, fcatt, msdbd),
                (ciu, cirn, cqt, ccrl),
            )| IdentifyController {
                vid,
                ssvid,
                sn: FixedStr(sn),
                mn: FixedStr(mn),
                fr: FixedStr(fr),
                mdts,
                cntlid,
                ver,
                ctratt,
                ciu,
                cirn,
                kas,
                cqt,
                sqes,
                cqes,
                maxcmd,
                nn,
                oncs,
                vwc,
                sgls,
                subnqn: FixedStr(subnqn),
                ioccsz,
                iorcsz,
                icdoff,
                fcatt,
                msdbd,
                ccrl,
            },
        )
}

fn any_ns() -> impl Strategy<Value = IdentifyNamespace> {
    (
        any::<[u64; 3]>(),
        any::<[u8; 3]>(),
        vec(any::<(u16, u8, u8)>(), LBAF_ENTRIES),
    )
        .prop_map(|(n, b, l)| {
            let mut ns = IdentifyNamespace {
                nsze: n[0],
                ncap: n[1],
                nuse: n[2],
                nsfeat: b[0],
                nlbaf: b[1],
                flbas: b[2],
                ..IdentifyNamespace::default()
            };
            for (slot, (ms, lbads, rp)) in ns.lbaf.iter_mut().zip(l) {
                *slot = LbaFormat { ms, lbads, rp };
            }
            ns
        })
}

fn any_entry() -> impl Strategy<Value = DiscoveryLogEntry> {
    (
        any::<[u8; 4]>(),
        any::<[u16; 3]>(),
        arr::<32>(),
        arr::<256>(),
        arr::<256>(),
        arr::<256>(),
    )
        .prop_map(|(b, w, trsvcid, subnqn, traddr, tsas)| DiscoveryLogEntry {
            trtype: b[0],
            adrfam: b[1],
            subtype: b[2],
            treq: b[3],
            portid: w[0],
            cntlid: w[1],
            asqsz: w[2],
            trsvcid: FixedStr(trsvcid),
            subnqn: FixedStr(subnqn),
            traddr: FixedStr(traddr),
            tsas,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    // ---------------------------------------------------------------- SQE

    #[test]
    fn sqe_round_trip(s in any_sqe()) {
        let b = s.to_bytes();
        prop_assert_eq!(b[1] & 0xC0, 0x40, "PSDT must be SGL");
        prop_assert_eq!(Sqe::parse(&b).unwrap(), s);
    }

    #[test]
    fn sqe_parse_never_panics(b in bytes(130)) {
        match Sqe::parse(&b) {
            Ok(s) => {
                // Re-emitted bytes equal the input except reserved flag bits 5:2.
                let out = s.to_bytes();
                prop_assert_eq!(out[1], b[1] & 0xC3);
                prop_assert_eq!(&out[2..], &b[2..64]);
                prop_assert_eq!(out[0], b[0]);
                prop_assert_eq!(Sqe::parse(&out).unwrap(), s);
                let _ = s.sgl();
                let _ = FabricsCmd::from_sqe(&s);
            }
            Err(e) => {
                if b.len() >= 64 {
                    prop_assert!(matches!(e, NvmeWireError::BadFlags { .. }), "{:?}", e);
                    prop_assert_eq!(e.cid(), Sqe::peek_cid(&b));
                } else {
                    prop_assert!(matches!(e, NvmeWireError::Truncated { .. }), "{:?}", e);
                }
            }
        }
    }

    #[test]
    fn sqe_flags_rule(mut b in arr::<64>(), flags in any::<u8>()) {
        b[1] = flags;
        let ok = flags & 0xC0 == 0x40 && flags & 0x03 != 0x03;
        prop_assert_eq!(Sqe::parse(&b).is_ok(), ok);
    }

    // ---------------------------------------------------------------- CQE and status

    #[test]
    fn cqe_round_trip(result in any::<u64>(), w in any::<[u16; 4]>()) {
        let c = Cqe { result, sq_head: w[0], sq_id: w[1], cid: w[2], status: w[3] };
        prop_assert_eq!(Cqe::parse(&c.to_bytes()).unwrap(), c);
        prop_assert_eq!(c.nvme_status().to_word(c.phase()), c.status);
    }

    #[test]
    fn cqe_parse_never_panics(b in bytes(40)) {
        match Cqe::parse(&b) {
            Ok(c) => prop_assert_eq!(&c.to_bytes()[..], &b[..16]),
            Err(_) => prop_assert!(b.len() < 16),
        }
    }

    #[test]
    fn status_round_trip(w in any::<u16>(), op in proptest::option::of(any::<u8>())) {
        let s = Status::from_word(w);
        prop_assert_eq!(s.to_word(w & 1 != 0), w);
        prop_assert_eq!(s.is_success(), w & 0x0FFE == 0);
        let msg = s.message(op);
        prop_assert!(!msg.is_empty());
        match s.into_result(op) {
            Ok(()) => prop_assert!(s.is_success()),
            Err(e) => {
                let text = e.to_string();
                prop_assert!(text.starts_with(msg));
                prop_assert_eq!(e.is_retryable(), !s.dnr);
                prop_assert_eq!(text.contains("do not retry"), s.dnr);
                let _: NvmeError = e;
            }
        }
    }

    // ---------------------------------------------------------------- SGL

    #[test]
    fn sgl_round_trip(d in any_sgl()) {
        let b = d.to_bytes().unwrap();
        prop_assert_eq!(SglDescriptor::parse(&b).unwrap(), d);
        let mut s = Sqe::new(0x01, 1);
        s.set_sgl(&d).unwrap();
        prop_assert_eq!(Sqe::parse(&s.to_bytes()).unwrap().sgl().unwrap(), d);
    }

    #[test]
    fn sgl_parse_never_panics(b in bytes(24)) {
        match SglDescriptor::parse(&b) {
            Ok(d) => {
                let out = d.to_bytes().unwrap();
                prop_assert_eq!(SglDescriptor::parse(&out).unwrap(), d);
                match d {
                    // Keyed descriptors have no reserved bytes.
                    SglDescriptor::Keyed { .. } => prop_assert_eq!(&out[..], &b[..16]),
                    // In-capsule: bytes 12..15 are reserved.
                    SglDescriptor::InCapsule { .. } => {
                        prop_assert_eq!(&out[..12], &b[..12]);
                        prop_assert_eq!(out[15], b[15]);
                    }
                }
            }
            Err(NvmeWireError::BadSglType(t)) => {
                prop_assert!(!matches!(t, 0x40 | 0x4F | 0x01));
            }
            Err(e) => prop_assert!(b.len() < 16, "{:?}", e),
        }
    }

    #[test]
    fn sgl_keyed_limit(len in any::<u64>()) {
        let r = SglDescriptor::keyed(0, len, 0, false);
        prop_assert_eq!(r.is_ok(), len <= u64::from(MAX_KEYED_LEN));
        let raw = SglDescriptor::Keyed { addr: 0, len: len as u32, key: 0, invalidate: true };
        prop_assert_eq!(raw.to_bytes().is_ok(), (len as u32) <= MAX_KEYED_LEN);
    }

    // ---------------------------------------------------------------- Fabrics

    #[test]
    fn fabrics_round_trip(c in any_fabrics(), cid in any::<u16>()) {
        let s = c.to_sqe(cid);
        prop_assert_eq!(s.to_bytes()[4], c.fctype());
        prop_assert_eq!(FabricsCmd::parse(&s.to_bytes()).unwrap(), c);
    }

    #[test]
    fn fabrics_parse_never_panics(
        mut b in bytes(80),
        fctype in select(vec![0u8, 1, 4, 5, 8, 0xFF]),
    ) {
        if b.len() > 4 {
            b[0] = 0x7F;
            b[1] = 0x40;
            b[4] = fctype;
        }
        if let Ok(c) = FabricsCmd::parse(&b) {
            let s = c.to_sqe(Sqe::peek_cid(&b).unwrap());
            prop_assert_eq!(FabricsCmd::from_sqe(&s).unwrap(), c);
        }
    }

    #[test]
    fn connect_result_round_trip(
        cntlid in any::<u16>(),
        authreq in any::<u16>(),
        iattr in any::<u8>(),
    ) {
        let ok = ConnectResult::Ok { cntlid, authreq };
        prop_assert_eq!(ConnectResult::from_result(ok.to_result(), true), ok);
        let bad = ConnectResult::InvalidParameter { ipo: cntlid, iattr };
        prop_assert_eq!(ConnectResult::from_result(bad.to_result(), false), bad);
    }

    #[test]
    fn connect_data_round_trip(
        hostid in any::<[u8; 16]>(),
        cntlid in any::<u16>(),
        subnqn in any_nqn(),
        hostnqn in any_nqn(),
    ) {
        let d = ConnectData { hostid, cntlid, subnqn, hostnqn };
        prop_assert_eq!(ConnectData::parse(&d.to_bytes()).unwrap(), d);
    }

    #[test]
    fn connect_data_parse_never_panics(
        b in bytes(1100),
        nqn_bytes in vec(any::<u8>(), 0..300),
    ) {
        let _ = ConnectData::parse(&b);
        // Aim at the NQN checks: a full-size buffer with arbitrary NQN field content.
        let mut full = [0u8; 1024];
        let n = nqn_bytes.len().min(256);
        full[256..256 + n].copy_from_slice(&nqn_bytes[..n]);
        full[512..540].copy_from_slice(b"nqn.2014-08.org.example:host");
        if let Ok(d) = ConnectData::parse(&full) {
            let again = ConnectData::parse(&d.to_bytes()).unwrap();
            prop_assert_eq!(again, d);
            prop_assert!(!d.subnqn.as_bytes().is_empty());
            prop_assert!(d.subnqn.as_bytes().len() <= NQN_MAX_LEN);
        }
    }

    #[test]
    fn nqn_validation(s in ".{0,260}") {
        let valid = !s.is_empty()
            && s.len() <= NQN_MAX_LEN
            && s.bytes().all(|c| (0x20..=0x7E).contains(&c));
        match Nqn::new(&s) {
            Ok(n) => {
                prop_assert!(valid);
                prop_assert_eq!(n.as_str(), s.as_str());
            }
            Err(_) => prop_assert!(!valid),
        }
    }

    #[test]
    fn host_nqn_from_uuid(u in any::<[u8; 16]>()) {
        let n = Nqn::from_uuid(&u);
        let s = n.as_str();
        prop_assert!(s.starts_with("nqn.2014-08.org.nvmexpress:uuid:"));
        let hex: String = s[32..].chars().filter(|c| *c != '-').collect();
        let want: String = u.iter().map(|b| format!("{b:02x}")).collect();
        prop_assert_eq!(hex, want);
        prop_assert_eq!(Nqn::new(s).unwrap(), n);
    }

    #[test]
    fn fixed_str_never_panics(b in arr::<32>(), s in "[ -~]{0,40}") {
        let f = FixedStr(b);
        let t = f.text();
        prop_assert!(t.len() <= 32);
        match FixedStr::<32>::new(&s) {
            Ok(f) => prop_assert_eq!(f.text(), s.trim_end_matches(' ')),
            Err(_) => prop_assert!(s.len() > 32),
        }
    }

    #[test]
    fn registers(v64 in any::<u64>(), v32 in any::<u32>(), x in any::<u8>(), on in any::<bool>()) {
        let cap = Cap(v64);
        prop_assert_eq!(cap.with_mqes(x.into()).mqes(), u16::from(x));
        prop_assert_eq!(cap.with_to(x).to(), x);
        prop_assert_eq!(cap.with_css(x).css(), x);
        prop_assert_eq!(cap.with_mpsmin(x).mpsmin(), x & 0xF);
        prop_assert_eq!(cap.with_mpsmax(x).mpsmax(), x & 0xF);
        prop_assert_eq!(cap.with_cqr(on).cqr(), on);
        prop_assert!(cap.min_page_size() >= 4096);
        let _ = (cap.ams(), cap.dstrd(), cap.nssrs(), cap.timeout_ms(), cap.max_queue_entries());
        // Setting a field leaves the others alone.
        prop_assert_eq!(cap.with_to(cap.to()), cap);

        let cc = Cc(v32);
        prop_assert_eq!(cc.with_en(on).en(), on);
        prop_assert_eq!(cc.with_css(x).css(), x & 7);
        prop_assert_eq!(cc.with_mps(x).mps(), x & 0xF);
        prop_assert_eq!(cc.with_ams(x).ams(), x & 7);
        prop_assert_eq!(cc.with_shn(x).shn(), x & 3);
        prop_assert_eq!(cc.with_iosqes(x).iosqes(), x & 0xF);
        prop_assert_eq!(cc.with_iocqes(x).iocqes(), x & 0xF);
        prop_assert_eq!(cc.with_shn(cc.shn()).with_iosqes(cc.iosqes()), cc);

        let csts = Csts(v32);
        prop_assert_eq!(csts.with_rdy(on).rdy(), on);
        prop_assert_eq!(csts.with_cfs(on).cfs(), on);
        prop_assert_eq!(csts.with_shst(x).shst(), x & 3);
        let _ = csts.nssro();

        let vs = Vs(v32);
        prop_assert_eq!(Vs::new(vs.major(), vs.minor(), vs.tertiary()), vs);
    }

    // ---------------------------------------------------------------- Identify

    #[test]
    fn identify_ctrl_round_trip(c in any_ctrl()) {
        prop_assert_eq!(IdentifyController::parse(&c.to_bytes()[..]).unwrap(), c);
        let _ = (c.subnqn(), c.max_transfer_bytes(u32::MAX), c.in_capsule_data_bytes());
        let _ = (c.kas_ms(), c.icdoff_bytes(), c.sn.text(), c.mn.text(), c.fr.text());
    }

    #[test]
    fn identify_ctrl_parse_never_panics(b in bytes(5000)) {
        match IdentifyController::parse(&b) {
            Ok(c) => {
                let again = IdentifyController::parse(&c.to_bytes()[..]).unwrap();
                prop_assert_eq!(again, c);
                let _ = (c.subnqn(), c.max_transfer_bytes(4096), c.supports_keyed_sgl());
            }
            Err(_) => prop_assert!(b.len() < 4096),
        }
    }

    #[test]
    fn identify_ns_round_trip(n in any_ns()) {
        prop_assert_eq!(IdentifyNamespace::parse(&n.to_bytes()[..]).unwrap(), n);
        prop_assert!(n.format_index() < LBAF_ENTRIES);
        let bs = n.block_size();
        if let Some(bs) = bs {
            prop_assert!(bs.is_power_of_two() && bs >= 512);
        }
        let _ = (n.capacity_bytes(), n.extended_lba(), n.active_format());
    }

    #[test]
    fn identify_ns_parse_never_panics(b in bytes(4200)) {
        if let Ok(n) = IdentifyNamespace::parse(&b) {
            let _ = (n.block_size(), n.capacity_bytes());
            prop_assert_eq!(IdentifyNamespace::parse(&n.to_bytes()[..]).unwrap(), n);
        }
    }

    #[test]
    fn ns_list(ids in vec(1..=u32::MAX, 0..1100), b in bytes(5000)) {
        let mut out = [0u8; 4096];
        let n = emit_active_namespace_ids(&ids, &mut out);
        prop_assert_eq!(n, ids.len().min(1024));
        prop_assert_eq!(active_namespace_ids(&out).collect::<Vec<_>>(), ids[..n].to_vec());
        prop_assert!(active_namespace_ids(&b).count() <= b.len() / 4);
    }

    // ---------------------------------------------------------------- Discovery

    #[test]
    fn discovery_entry_round_trip(e in any_entry()) {
        prop_assert_eq!(DiscoveryLogEntry::parse(&e.to_bytes()).unwrap(), e);
        let _ = (e.subnqn(), e.rdma_tsas(), e.traddr.text(), e.trsvcid.text());
    }

    #[test]
    fn discovery_parse_never_panics(b in bytes(4200), numrec in any::<u64>()) {
        let _ = DiscoveryLogEntry::parse(&b);
        if let Ok(h) = DiscoveryLogHeader::parse(&b) {
            let n = h.entries(&b).count();
            prop_assert!(n <= (b.len().saturating_sub(1024)) / 1024);
            let h = DiscoveryLogHeader { numrec, ..h };
            prop_assert!(h.entries(&b).count() as u64 <= numrec);
            let mut out = [0u8; 1024];
            h.emit(&mut out);
            prop_assert_eq!(DiscoveryLogHeader::parse(&out).unwrap(), h);
        }
    }

    #[test]
    fn rdma_tsas_round_trip(t in any::<[u8; 3]>(), pkey in any::<u16>()) {
        let t = RdmaTsas { qptype: t[0], prtype: t[1], cms: t[2], pkey };
        prop_assert_eq!(RdmaTsas::from_tsas(&t.to_tsas()), t);
    }

    // ---------------------------------------------------------------- Admin / I/O builders

    #[test]
    fn read_write_builders(
        cid in any::<u16>(),
        nsid in any::<u32>(),
        slba in any::<u64>(),
        blocks in 0..=MAX_BLOCKS + 2,
        fua in any::<bool>(),
    ) {
        let valid = (1..=MAX_BLOCKS).contains(&blocks);
        for r in [
            admin::read(cid, nsid, slba, blocks),
            admin::write(cid, nsid, slba, blocks, fua),
            admin::write_zeroes(cid, nsid, slba, blocks, fua),
        ] {
            prop_assert_eq!(r.is_ok(), valid);
            if let Ok(s) = r {
                let s = Sqe::parse(&s.to_bytes()).unwrap();
                prop_assert_eq!((s.cid, s.nsid), (cid, nsid));
                prop_assert_eq!(u64::from(s.cdw10) | u64::from(s.cdw11) << 32, slba);
                prop_assert_eq!((s.cdw12 & 0xFFFF) + 1, blocks);
                prop_assert!(s.sgl().unwrap().is_null());
            }
        }
    }

    #[test]
    fn log_page_builder(offset in any::<u64>(), len in any::<u64>(), lid in any::<u8>()) {
        let len = len % ((4u64 << 32) + 8);
        match admin::get_log_page(1, 0, lid, offset, len) {
            Ok(s) => {
                prop_assert!(len % 4 == 0 && len > 0 && offset % 4 == 0);
                prop_assert_eq!(s.cdw10 as u8, lid);
                let numd = u64::from(s.cdw10 >> 16) | u64::from(s.cdw11 & 0xFFFF) << 16;
                prop_assert_eq!((numd + 1) * 4, len);
                prop_assert_eq!(u64::from(s.cdw12) | u64::from(s.cdw13) << 32, offset);
            }
            Err(_) => prop_assert!(len % 4 != 0 || len == 0 || offset % 4 != 0 || len > 4 << 32),
        }
    }

    #[test]
    fn queue_count_builder(sq in 0u32..0x1_0002, cq in 0u32..0x1_0002) {
        match admin::set_num_queues(1, sq, cq) {
            Ok(s) => prop_assert_eq!(admin::num_queues_allocated(s.cdw11), (sq, cq)),
            Err(_) => prop_assert!(sq == 0 || cq == 0 || sq > 0xFFFF || cq > 0xFFFF),
        }
    }

    #[test]
    fn dsm_ranges(ranges in vec(any::<(u32, u32, u64)>(), 1..=256), b in bytes(200)) {
        let ranges: Vec<DsmRange> = ranges
            .into_iter()
            .map(|(cattr, nlb, slba)| DsmRange { cattr, nlb, slba })
            .collect();
        let mut buf = vec![0u8; 256 * 16];
        let n = DsmRange::emit_all(&ranges, &mut buf).unwrap();
        prop_assert_eq!(n, ranges.len() * 16);
        prop_assert_eq!(DsmRange::parse_all(&buf[..n]).collect::<Vec<_>>(), ranges.clone());
        let s = admin::dsm_deallocate(1, 1, ranges.len()).unwrap();
        prop_assert_eq!(s.cdw10 as usize + 1, ranges.len());
        // Arbitrary bytes: whole ranges parse and round-trip.
        for r in DsmRange::parse_all(&b) {
            prop_assert_eq!(DsmRange::parse(&r.to_bytes()).unwrap(), r);
        }
        prop_assert_eq!(DsmRange::parse(&b).is_ok(), b.len() >= 16);
    }
}

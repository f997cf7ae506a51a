//! Feed arbitrary bytes to every NVMe / NVMe-oF parser in `nvmf_rdma::nvme`: command capsules
//! (SQE, SGL, Fabrics commands), response capsules (CQE, status), Connect data, Identify
//! data, the discovery log, DSM ranges and namespace lists. None may panic, and whatever
//! parses must re-emit to bytes that parse back to the same value.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmf_rdma::nvme::admin::DsmRange;
use nvmf_rdma::nvme::discovery::{DiscoveryLogEntry, DiscoveryLogHeader};
use nvmf_rdma::nvme::fabrics::{ConnectData, FabricsCmd, Nqn};
use nvmf_rdma::nvme::identify::{active_namespace_ids, IdentifyController, IdentifyNamespace};
use nvmf_rdma::nvme::{Cqe, SglDescriptor, Sqe, Status};

fn capsule(data: &[u8]) {
    let Ok(s) = Sqe::parse(data) else {
        return;
    };
    let out = s.to_bytes();
    assert_eq!(Sqe::parse(&out).expect("re-emitted SQE does not parse"), s);
    if let Ok(d) = s.sgl() {
        let b = d.to_bytes().expect("parsed SGL does not emit");
        assert_eq!(
            SglDescriptor::parse(&b).unwrap(),
            d,
            "SGL changed in emit -> parse"
        );
        let _ = (d.data_len(), d.is_null());
    }
    if let Ok(c) = FabricsCmd::from_sqe(&s) {
        let again = FabricsCmd::from_sqe(&c.to_sqe(s.cid)).expect("re-encoded Fabrics command");
        assert_eq!(again, c, "Fabrics command changed in encode -> decode");
    }
}

fn response(data: &[u8]) {
    if let Ok(c) = Cqe::parse(data) {
        assert_eq!(&c.to_bytes()[..], &data[..16], "CQE bytes changed");
        let s = c.nvme_status();
        assert_eq!(Status::from_word(s.to_word(c.phase())), s);
        for op in [None, Some(0x7F), Some(0x02)] {
            let _ = s.into_result(op).map_err(|e| e.to_string());
        }
    }
}

fn data_structures(data: &[u8]) {
    if let Ok(d) = SglDescriptor::parse(data) {
        assert_eq!(SglDescriptor::parse(&d.to_bytes().unwrap()).unwrap(), d);
    }
    if let Ok(d) = ConnectData::parse(data) {
        assert_eq!(ConnectData::parse(&d.to_bytes()).unwrap(), d);
    }
    if data.len() >= 256 {
        if let Ok(n) = Nqn::parse_field("fuzz", data) {
            let mut f = [0u8; 256];
            n.emit_field(&mut f);
            assert_eq!(Nqn::parse_field("fuzz", &f).unwrap(), n);
        }
    }
    if let Ok(c) = IdentifyController::parse(data) {
        assert_eq!(IdentifyController::parse(&c.to_bytes()[..]).unwrap(), c);
        let _ = (
            c.subnqn(),
            c.max_transfer_bytes(4096),
            c.in_capsule_data_bytes(),
        );
        let _ = (c.sn.text(), c.mn.text(), c.fr.text());
    }
    if let Ok(n) = IdentifyNamespace::parse(data) {
        assert_eq!(IdentifyNamespace::parse(&n.to_bytes()[..]).unwrap(), n);
        let _ = (n.block_size(), n.capacity_bytes(), n.active_format());
    }
    let _ = active_namespace_ids(data).count();
    if let Ok(h) = DiscoveryLogHeader::parse(data) {
        for e in h.entries(data) {
            assert_eq!(DiscoveryLogEntry::parse(&e.to_bytes()).unwrap(), e);
            let _ = (e.subnqn(), e.rdma_tsas(), e.traddr.text(), e.trsvcid.text());
        }
    }
    if let Ok(e) = DiscoveryLogEntry::parse(data) {
        assert_eq!(DiscoveryLogEntry::parse(&e.to_bytes()).unwrap(), e);
    }
    for r in DsmRange::parse_all(data) {
        assert_eq!(DsmRange::parse(&r.to_bytes()).unwrap(), r);
    }
}

fuzz_target!(|data: &[u8]| {
    capsule(data);
    response(data);
    data_structures(data);
    // The same bytes as a capsule with its SQE flags made valid, to reach the SGL and
    // Fabrics decoders more often.
    if data.len() >= 64 {
        let mut v = data.to_vec();
        v[1] = 0x40;
        capsule(&v);
        v[0] = 0x7F;
        capsule(&v);
    }
});

//! Feed arbitrary bytes to every CM parser in `nvmf_rdma::cm` — the MAD view and header, each
//! CM message, the rdma_cm IP header, the NVMe-oF request / accept / reject records — and to
//! `CmEndpoint`s in several phases of a connection. Nothing may panic; whatever parses must
//! re-emit to bytes that parse back to the same value.
//!
//! The input is also cut into 256-byte MADs, delivered in turn to a listening endpoint, an
//! endpoint waiting for a REP and an endpoint waiting for an RTU, with the clock moved on and
//! the timers fired between MADs.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmf_rdma::cm::mad::{Mad, MadHdrRepr, MAD_LEN};
use nvmf_rdma::cm::messages::{
    CmMad, DrepRepr, DreqRepr, MraRepr, RejRepr, RepRepr, ReqRepr, RtuRepr,
};
use nvmf_rdma::cm::private::{
    build_req_private, service_id, split_req_private, CmaHdr, CmaHdrRepr, NvmeCmAccept,
    NvmeCmReject, NvmeCmRequest, CMA_HDR_LEN,
};
use nvmf_rdma::cm::{AcceptParams, CmConfig, CmEndpoint, CmEvent, ConnectParams};
use nvmf_rdma::verbs::{Guid, Instant, Qpn};
use std::net::SocketAddr;
use std::time::Duration;

fn parsers(data: &[u8]) {
    if let Ok(m) = CmMad::parse(data) {
        let again = CmMad::parse(&m.emit()).expect("re-emitted CM MAD does not parse");
        assert_eq!(again, m, "CM MAD changed in emit -> parse");
    }
    if let Ok(v) = Mad::new_checked(data) {
        let h = MadHdrRepr::parse(&v);
        let mut out = [0u8; MAD_LEN];
        h.emit(&mut out);
        // Everything but the reserved 16 bits at 18, which emit zeroes.
        assert_eq!(out[..18], data[..18], "MAD header changed in emit");
        assert_eq!(out[20..24], data[20..24], "MAD header changed in emit");
        assert_eq!(MadHdrRepr::parse(&Mad::new_checked(&out[..]).unwrap()), h);
        // Each message parser on its own, whatever the attribute says.
        let _ = ReqRepr::parse(&v);
        let _ = RepRepr::parse(&v);
        let _ = RtuRepr::parse(&v);
        let _ = RejRepr::parse(&v).map(|r| r.ari().len());
        let _ = MraRepr::parse(&v);
        let _ = DreqRepr::parse(&v);
        let _ = DrepRepr::parse(&v);
    }
    if let Ok(v) = CmaHdr::new_checked(data) {
        if let Ok(r) = CmaHdrRepr::parse(&v) {
            let mut out = [0u8; CMA_HDR_LEN];
            r.emit(&mut out);
            let back = CmaHdrRepr::parse(&CmaHdr::new_checked(&out[..]).unwrap())
                .expect("re-emitted cma_hdr does not parse");
            assert_eq!(back, r);
        }
    }
    if let Ok((h, ulp)) = split_req_private(data) {
        let p = build_req_private(&h, ulp);
        assert_eq!(split_req_private(&p).unwrap().0, h);
    }
    if let Ok(r) = NvmeCmRequest::parse(data) {
        assert_eq!(NvmeCmRequest::parse(&r.emit()).unwrap(), r);
    }
    if let Ok(a) = NvmeCmAccept::parse(data) {
        assert_eq!(NvmeCmAccept::parse(&a.emit()).unwrap(), a);
    }
    if let Ok(j) = NvmeCmReject::parse(data) {
        assert_eq!(NvmeCmReject::parse(&j.emit()).unwrap(), j);
        let _ = j.status.to_string();
    }
}

fn endpoint(ip: &str, seed: u64) -> CmEndpoint {
    CmEndpoint::from_seed(CmConfig::new(ip.parse().unwrap(), Guid(seed)), seed)
}

fn endpoints(data: &[u8]) {
    let a: SocketAddr = "10.0.0.1:4791".parse().unwrap();
    let b: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let mut now = Instant::ZERO;

    // Listening.
    let mut listener = endpoint("10.0.0.2", 2);
    listener.listen(service_id(4420));
    // Waiting for a REP.
    let mut active = endpoint("10.0.0.1", 1);
    active
        .connect(now, b, &ConnectParams::new(Qpn::new(5), 4420), &[])
        .unwrap();
    // Waiting for an RTU: take the active side's REQ and accept it.
    let mut passive = endpoint("10.0.0.2", 3);
    passive.listen(service_id(4420));
    while let Some((_, m)) = active.poll_transmit() {
        passive.handle_mad(now, a, &m);
    }
    while let Some(e) = passive.poll_event() {
        if let CmEvent::ConnectRequest(r) = e {
            passive
                .accept(now, r.id, &AcceptParams::new(Qpn::new(6)), &[])
                .unwrap();
        }
    }

    for (i, chunk) in data.chunks(MAD_LEN).enumerate() {
        let from = if i % 2 == 0 { a } else { b };
        for ep in [&mut listener, &mut active, &mut passive] {
            ep.handle_mad(now, from, chunk);
            while ep.poll_transmit().is_some() {}
            while let Some(e) = ep.poll_event() {
                let _ = e.id();
            }
        }
        now = now + Duration::from_millis(u64::from(chunk[0]) * 100);
        for ep in [&mut listener, &mut active, &mut passive] {
            ep.handle_timeout(now);
            if let Some(t) = ep.poll_timeout() {
                assert!(t > now, "timer not after the time it was fired at");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    parsers(data);
    endpoints(data);
});

//! Feed arbitrary bytes to the RoCEv2 packet parser, with and without ICRC verification. Any
//! packet that parses must survive emit -> parse with the same headers (up to the pad count,
//! which the emitter recomputes from the payload length) and the same payload. The same
//! bytes also go in as an IPv4 datagram off a raw socket (`Ipv4Udp`), whose packet is then
//! checked against the header it came with.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nvmf_rdma::hca::wire::{emit_packet, IcrcContext, Ipv4Udp, ParsedPacket};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

fn ctx() -> IcrcContext {
    IcrcContext::new(
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 168, 1, 10)), 49152),
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 168, 1, 20)), 4791),
    )
}

fn check(data: &[u8], ctx: &IcrcContext, verify: bool) {
    let Ok(p) = ParsedPacket::parse(data, verify.then_some(ctx)) else {
        return;
    };
    let mut out = Vec::new();
    emit_packet(&p.hdrs, p.payload, ctx, &mut out);
    assert_eq!(out.len() % 4, 0, "emitted packet is not 4-byte aligned");
    let q = ParsedPacket::parse(&out, Some(ctx)).expect("re-emitted packet does not parse");
    let mut want = p.hdrs;
    want.bth.pad_count = ((4 - p.payload.len() % 4) % 4) as u8;
    assert_eq!(q.hdrs, want, "headers changed in emit -> parse");
    assert_eq!(q.payload, p.payload, "payload changed in emit -> parse");
}

fuzz_target!(|data: &[u8]| {
    let ctx = ctx();
    check(data, &ctx, false);
    check(data, &ctx, true);
    if let Ok(d) = Ipv4Udp::parse(data) {
        assert!(d.payload.len() + 28 <= data.len(), "payload beyond the datagram");
        check(d.payload, &d.icrc, true);
    }
});

//! Property tests for the RoCEv2 wire format (`nvmf_rdma::hca::wire`):
//!
//! * the packet parser never panics, whatever the bytes, with or without ICRC verification;
//! * every valid non-atomic opcode round-trips emit -> parse exactly, for arbitrary header
//!   field values and payloads;
//! * the ICRC catches every single-bit flip except in the masked BTH byte 4 (FECN, BECN,
//!   resv6a), which a switch may rewrite in flight.

use nvmf_rdma::hca::wire::{
    emit_packet, AethRepr, AethSyndrome, BthRepr, DethRepr, HdrMask, IcrcContext, Opcode,
    PacketHeaders, ParsedPacket, RethRepr, ICRC_LEN, OPCODE_TABLE,
};
use nvmf_rdma::verbs::{MemKey, Psn, Qpn};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{select, Index};

/// The byte of the BTH whose bits the ICRC masks.
const MASKED_BTH_BYTE: usize = 4;
const MAX_PAYLOAD: usize = 4096;

fn contexts() -> Vec<IcrcContext> {
    vec![
        IcrcContext::new(
            "192.168.1.10:49152".parse().unwrap(),
            "192.168.1.20:4791".parse().unwrap(),
        ),
        IcrcContext::new(
            "[fe80::1]:50000".parse().unwrap(),
            "[2001:db8::2]:4791".parse().unwrap(),
        ),
        // Mixed families take the IPv6 pseudo-header path with a v4-mapped address.
        IcrcContext::new("10.0.0.1:1".parse().unwrap(), "[::1]:4791".parse().unwrap()),
    ]
}

fn any_ctx() -> impl Strategy<Value = IcrcContext> {
    select(contexts())
}

fn valid_opcodes() -> Vec<Opcode> {
    (0..=255u8).filter_map(Opcode::from_u8).collect()
}

/// Valid opcodes without atomic headers, which `PacketHeaders` does not model.
fn non_atomic_opcodes() -> Vec<Opcode> {
    OPCODE_TABLE
        .iter()
        .enumerate()
        .filter(|(_, i)| {
            i.valid && !i.hdrs.contains(HdrMask::ATMETH) && !i.hdrs.contains(HdrMask::ATMACK)
        })
        .map(|(code, _)| Opcode(code as u8))
        .collect()
}

fn any_bth(op: Opcode) -> impl Strategy<Value = BthRepr> {
    (
        any::<[bool; 5]>(),
        0u8..4,
        any::<u16>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(move |(f, pad_count, pkey, qpn, psn)| BthRepr {
            opcode: op,
            solicited: f[0],
            mig_req: f[1],
            pad_count,
            pkey,
            fecn: f[2],
            becn: f[3],
            dest_qp: Qpn::new(qpn),
            ack_req: f[4],
            psn: Psn::new(psn),
        })
}

/// Headers for `op` with every field arbitrary; only the extension headers the opcode carries
/// are `Some`, as the parser reports them. AETH syndromes are drawn from their canonical forms
/// (`from_byte` of any byte), the only ones that survive a trip through the wire.
fn any_headers(op: Opcode) -> impl Strategy<Value = PacketHeaders> {
    let m = op.info().hdrs;
    (
        any_bth(op),
        (any::<u32>(), any::<u32>()),
        (any::<u64>(), any::<u32>(), any::<u32>()),
        (any::<u8>(), 0u32..=0x00FF_FFFF),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(
            move |(bth, (qkey, src_qp), (va, rkey, dma_len), (syn, msn), imm, ieth)| {
                let mut h = PacketHeaders::new(bth);
                if m.contains(HdrMask::DETH) {
                    h.deth = Some(DethRepr {
                        qkey,
                        src_qp: Qpn::new(src_qp),
                    });
                }
                if m.contains(HdrMask::RETH) {
                    h.reth = Some(RethRepr {
                        va,
                        rkey: MemKey(rkey),
                        dma_len,
                    });
                }
                if m.contains(HdrMask::AETH) {
                    h.aeth = Some(AethRepr {
                        syndrome: AethSyndrome::from_byte(syn),
                        msn,
                    });
                }
                if m.contains(HdrMask::IMMDT) {
                    h.imm = Some(imm);
                }
                if m.contains(HdrMask::IETH) {
                    h.ieth = Some(MemKey(ieth));
                }
                h
            },
        )
}

fn any_payload(max: usize) -> impl Strategy<Value = Vec<u8>> {
    // Short payloads often enough that every length mod 4 shows up near zero, too.
    prop_oneof![vec(any::<u8>(), 0..=8), vec(any::<u8>(), 0..=max)]
}

/// A well-formed packet description: headers for a non-atomic opcode, and a payload that is
/// empty unless the opcode carries one.
fn any_packet(max_payload: usize) -> impl Strategy<Value = (PacketHeaders, Vec<u8>)> {
    select(non_atomic_opcodes()).prop_flat_map(move |op| {
        let carries = op.info().hdrs.contains(HdrMask::PAYLOAD);
        (
            any_headers(op),
            any_payload(max_payload).prop_map(move |p| if carries { p } else { Vec::new() }),
        )
    })
}

fn emit(h: &PacketHeaders, payload: &[u8], ctx: &IcrcContext) -> Vec<u8> {
    let mut out = Vec::new();
    emit_packet(h, payload, ctx, &mut out);
    out
}

/// Bytes for the never-panic property: pure noise, noise behind a plausible BTH start (a valid
/// opcode and TVer 0, so parsing gets past the BTH), and emitted packets cut short, extended
/// or overwritten.
fn any_bytes() -> impl Strategy<Value = Vec<u8>> {
    let noise = vec(any::<u8>(), 0..=5000);
    let bth_like = (
        select(valid_opcodes()),
        any::<u8>(),
        vec(any::<u8>(), 0..=5000),
    )
        .prop_map(|(op, flags, mut v)| {
            if let Some(b) = v.get_mut(0) {
                *b = op.0;
            }
            if let Some(b) = v.get_mut(1) {
                *b = flags & 0xF0;
            }
            v
        });
    let mangled = (
        any_packet(MAX_PAYLOAD),
        any_ctx(),
        any::<Index>(),
        vec(any::<u8>(), 0..=8),
        0u8..3,
    )
        .prop_map(|((h, p), ctx, at, bytes, how)| {
            let mut v = emit(&h, &p, &ctx);
            let i = at.index(v.len() + 1);
            match how {
                0 => v.truncate(i),
                1 => {
                    v.splice(i..i, bytes);
                }
                _ => {
                    for (j, b) in bytes.into_iter().enumerate() {
                        if let Some(x) = v.get_mut(i + j) {
                            *x = b;
                        }
                    }
                }
            }
            v
        });
    prop_oneof![noise, bth_like, mangled]
}

/// `want`, with the pad count the emitter derives from the payload length.
fn expected(mut want: PacketHeaders, payload_len: usize) -> PacketHeaders {
    want.bth.pad_count = ((4 - payload_len % 4) % 4) as u8;
    want
}

proptest! {
    #[test]
    fn parse_never_panics(data in any_bytes(), ctx in any_ctx()) {
        let unchecked = ParsedPacket::parse(&data, None);
        let checked = ParsedPacket::parse(&data, Some(&ctx));
        // Verifying the ICRC only ever narrows what is accepted, and changes nothing else.
        if let Ok(p) = checked {
            prop_assert_eq!(unchecked, Ok(p));
        }
    }

    #[test]
    fn emit_parse_round_trips((h, payload) in any_packet(MAX_PAYLOAD), ctx in any_ctx()) {
        let out = emit(&h, &payload, &ctx);
        prop_assert_eq!(out.len() % 4, 0);
        prop_assert_eq!(
            out.len(),
            h.header_len() + payload.len() + (4 - payload.len() % 4) % 4 + ICRC_LEN
        );
        let want = expected(h, payload.len());
        for c in [Some(&ctx), None] {
            let p = ParsedPacket::parse(&out, c).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(p.hdrs, want);
            prop_assert_eq!(p.payload, &payload[..]);
        }
    }

    #[test]
    fn single_bit_flip_is_caught(
        (h, payload) in any_packet(MAX_PAYLOAD),
        ctx in any_ctx(),
        at in any::<Index>(),
    ) {
        let out = emit(&h, &payload, &ctx);
        // Any bit outside the masked byte.
        let mut bit = at.index(out.len() * 8 - 8);
        if bit >= MASKED_BTH_BYTE * 8 {
            bit += 8;
        }
        let mut bad = out;
        bad[bit / 8] ^= 1 << (bit % 8);
        let r = ParsedPacket::parse(&bad, Some(&ctx));
        prop_assert!(r.is_err(), "flip of bit {} (byte {}) accepted: {:?}", bit, bit / 8, r);
    }

    /// Every bit of small packets, and the masked byte: flips there must still parse, and only
    /// FECN/BECN (the top two bits) show in the headers.
    #[test]
    fn every_single_bit_flip_of_small_packets(
        (h, payload) in any_packet(48),
        ctx in any_ctx(),
    ) {
        let out = emit(&h, &payload, &ctx);
        let want = expected(h, payload.len());
        for bit in 0..out.len() * 8 {
            let (byte, mask) = (bit / 8, 1u8 << (bit % 8));
            let mut bad = out.clone();
            bad[byte] ^= mask;
            let r = ParsedPacket::parse(&bad, Some(&ctx));
            if byte != MASKED_BTH_BYTE {
                prop_assert!(r.is_err(), "flip of bit {} (byte {}) accepted: {:?}", bit, byte, r);
                continue;
            }
            let p = r.map_err(|e| TestCaseError::fail(format!("masked bit {bit}: {e}")))?;
            let mut w = want;
            w.bth.fecn ^= mask == 0x80;
            w.bth.becn ^= mask == 0x40;
            prop_assert_eq!(p.hdrs, w);
            prop_assert_eq!(p.payload, &payload[..]);
        }
    }
}

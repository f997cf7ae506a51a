//! A whole RoCEv2 packet (the UDP payload): BTH, the extension headers the opcode table names,
//! payload, pad and ICRC.

use super::{
    check_len, icrc, Aeth, AethRepr, Bth, BthRepr, Deth, DethRepr, HdrMask, IcrcContext, Ieth,
    ImmDt, Reth, WireError, ICRC_LEN,
};
use crate::verbs::MemKey;

use super::reth::RethRepr;

/// The largest payload a packet may carry: 16 KiB, on the in-memory path between two
/// contexts of one process (`QpAttr::in_memory_seg`); on a wire the path MTU (at most 4096),
/// which each QP checks against its own.
pub const MAX_PAYLOAD: usize = 16 << 10;

/// The largest payload plus the largest header stack.
const MAX_PACKET: usize = MAX_PAYLOAD + 80 + ICRC_LEN;

/// All headers of one packet as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketHeaders {
    pub bth: BthRepr,
    pub deth: Option<DethRepr>,
    pub reth: Option<RethRepr>,
    pub aeth: Option<AethRepr>,
    pub imm: Option<u32>,
    pub ieth: Option<MemKey>,
}

impl PacketHeaders {
    pub fn new(bth: BthRepr) -> PacketHeaders {
        PacketHeaders {
            bth,
            deth: None,
            reth: None,
            aeth: None,
            imm: None,
            ieth: None,
        }
    }

    pub fn header_len(&self) -> usize {
        Bth::<&[u8]>::LEN + self.bth.opcode.info().hdrs.ext_len()
    }

    /// Append the headers to `out`. Headers the opcode does not carry are not written, and
    /// ones it carries but that are `None` are written as zeros, so the layout always follows
    /// the opcode table.
    pub fn emit_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + self.header_len(), 0);
        let b = &mut out[start..];
        self.bth.emit(b);
        let hdrs = self.bth.opcode.info().hdrs;
        let mut at = Bth::<&[u8]>::LEN;
        if hdrs.contains(HdrMask::DETH) {
            if let Some(d) = self.deth {
                d.emit(&mut b[at..]);
            }
            at += 8;
        }
        if hdrs.contains(HdrMask::RETH) {
            if let Some(r) = self.reth {
                r.emit(&mut b[at..]);
            }
            at += 16;
        }
        if hdrs.contains(HdrMask::ATMETH) {
            at += 28;
        }
        if hdrs.contains(HdrMask::AETH) {
            if let Some(a) = self.aeth {
                a.emit(&mut b[at..]);
            }
            at += 4;
        }
        if hdrs.contains(HdrMask::ATMACK) {
            at += 8;
        }
        if hdrs.contains(HdrMask::IMMDT) {
            ImmDt::<&[u8]>::emit(self.imm.unwrap_or(0), &mut b[at..]);
            at += 4;
        }
        if hdrs.contains(HdrMask::IETH) {
            Ieth::<&[u8]>::emit(self.ieth.unwrap_or_default(), &mut b[at..]);
        }
    }
}

/// Pad the packet that starts at `out[start]` to a 4-byte boundary, record the pad count in
/// its BTH and append the ICRC; with no `ctx`, append zeros where the ICRC goes, for whoever
/// sends the packet to fill in with [`fill_icrc`] (as a NIC computes it on the way out).
pub fn finish_packet(out: &mut Vec<u8>, start: usize, ctx: Option<&IcrcContext>) {
    let pad = (4 - (out.len() - start) % 4) % 4;
    out.resize(out.len() + pad, 0);
    if let Ok(mut bth) = Bth::new_checked(&mut out[start..]) {
        bth.set_pad_count(pad as u8);
    }
    out.extend_from_slice(&[0; ICRC_LEN]);
    if let Some(ctx) = ctx {
        fill_icrc(ctx, &mut out[start..]);
    }
}

/// Write the ICRC of `packet` (a whole packet as [`finish_packet`] leaves it, ICRC last)
/// into its last four bytes. Does nothing to a packet too short to have one.
pub fn fill_icrc(ctx: &IcrcContext, packet: &mut [u8]) {
    let Some(body) = packet.len().checked_sub(ICRC_LEN) else {
        return;
    };
    let crc = icrc(ctx, &packet[..body]);
    packet[body..].copy_from_slice(&crc.to_le_bytes());
}

/// Append a whole packet (headers, payload, pad, ICRC) to `out`.
pub fn emit_packet(hdrs: &PacketHeaders, payload: &[u8], ctx: &IcrcContext, out: &mut Vec<u8>) {
    let start = out.len();
    hdrs.emit_into(out);
    out.extend_from_slice(payload);
    finish_packet(out, start, Some(ctx));
}

/// A received packet: its headers and a borrowed payload with the pad removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParsedPacket<'a> {
    pub hdrs: PacketHeaders,
    pub payload: &'a [u8],
}

impl<'a> ParsedPacket<'a> {
    /// Parse a UDP payload. With `ctx`, the ICRC is verified; without, it is only skipped
    /// (for peers whose IP identification we cannot see).
    pub fn parse(data: &'a [u8], ctx: Option<&IcrcContext>) -> Result<Self, WireError> {
        if data.len() > MAX_PACKET {
            return Err(WireError::TooLong(data.len()));
        }
        check_len("packet", data, Bth::<&[u8]>::LEN + ICRC_LEN)?;
        let bth = BthRepr::parse(&Bth::new_checked(data)?)?;
        let info = bth.opcode.info();
        let hdr_len = Bth::<&[u8]>::LEN + info.hdrs.ext_len();
        check_len(info.name, data, hdr_len + ICRC_LEN)?;
        let body_end = data.len() - ICRC_LEN;
        if let Some(ctx) = ctx {
            let carried = u32::from_le_bytes([
                data[body_end],
                data[body_end + 1],
                data[body_end + 2],
                data[body_end + 3],
            ]);
            let computed = icrc(ctx, &data[..body_end]);
            if computed != carried {
                return Err(WireError::IcrcMismatch { computed, carried });
            }
        }
        let with_pad = &data[hdr_len..body_end];
        let pad = bth.pad_count as usize;
        if pad > with_pad.len() || (!info.hdrs.contains(HdrMask::PAYLOAD) && with_pad.len() != pad)
        {
            return Err(WireError::BadPad {
                pad,
                payload: with_pad.len(),
            });
        }
        let payload = &with_pad[..with_pad.len() - pad];

        let mut hdrs = PacketHeaders::new(bth);
        let mut at = Bth::<&[u8]>::LEN;
        if info.hdrs.contains(HdrMask::DETH) {
            hdrs.deth = Some(DethRepr::parse(&Deth::new_checked(&data[at..])?));
            at += 8;
        }
        if info.hdrs.contains(HdrMask::RETH) {
            hdrs.reth = Some(RethRepr::parse(&Reth::new_checked(&data[at..])?));
            at += 16;
        }
        if info.hdrs.contains(HdrMask::ATMETH) {
            at += 28;
        }
        if info.hdrs.contains(HdrMask::AETH) {
            hdrs.aeth = Some(AethRepr::parse(&Aeth::new_checked(&data[at..])?));
            at += 4;
        }
        if info.hdrs.contains(HdrMask::ATMACK) {
            at += 8;
        }
        if info.hdrs.contains(HdrMask::IMMDT) {
            hdrs.imm = Some(ImmDt::new_checked(&data[at..])?.imm());
            at += 4;
        }
        if info.hdrs.contains(HdrMask::IETH) {
            hdrs.ieth = Some(Ieth::new_checked(&data[at..])?.rkey());
        }
        Ok(ParsedPacket { hdrs, payload })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hca::wire::{AethSyndrome, NakCode, Opcode, OPCODE_TABLE};
    use crate::verbs::{Psn, Qpn};

    fn ctx() -> IcrcContext {
        IcrcContext::new(
            "127.0.0.1:5000".parse().unwrap(),
            "127.0.0.2:4791".parse().unwrap(),
        )
    }

    fn full(op: Opcode) -> PacketHeaders {
        let mut h = PacketHeaders::new(BthRepr::new(op, Qpn::new(0x12), Psn::new(77)));
        let m = op.info().hdrs;
        if m.contains(HdrMask::DETH) {
            h.deth = Some(DethRepr {
                qkey: 0x8001_0000,
                src_qp: Qpn::new(1),
            });
        }
        if m.contains(HdrMask::RETH) {
            h.reth = Some(RethRepr {
                va: 0x1000,
                rkey: MemKey(0xabcd),
                dma_len: 5,
            });
        }
        if m.contains(HdrMask::AETH) {
            h.aeth = Some(AethRepr {
                syndrome: AethSyndrome::Nak(NakCode::RemoteAccessError),
                msn: 3,
            });
        }
        if m.contains(HdrMask::IMMDT) {
            h.imm = Some(0xfeed);
        }
        if m.contains(HdrMask::IETH) {
            h.ieth = Some(MemKey(0x55));
        }
        h
    }

    #[test]
    fn every_valid_opcode_round_trips_with_every_pad() {
        for (code, info) in OPCODE_TABLE.iter().enumerate() {
            if !info.valid
                || info.hdrs.contains(HdrMask::ATMETH)
                || info.hdrs.contains(HdrMask::ATMACK)
            {
                continue;
            }
            let op = Opcode(code as u8);
            for len in 0..6usize {
                let payload: Vec<u8> = (0..len as u8).collect();
                let payload = if info.hdrs.contains(HdrMask::PAYLOAD) {
                    &payload[..]
                } else {
                    &[][..]
                };
                let mut out = Vec::new();
                emit_packet(&full(op), payload, &ctx(), &mut out);
                assert_eq!(out.len() % 4, 0);
                let p = ParsedPacket::parse(&out, Some(&ctx())).unwrap();
                let mut want = full(op);
                want.bth.pad_count = ((4 - (payload.len() % 4)) % 4) as u8;
                assert_eq!(p.hdrs, want, "{}", info.name);
                assert_eq!(p.payload, payload);
            }
        }
    }

    /// A packet finished without its ICRC and filled in later is the packet finished with
    /// it, whatever its length and pad.
    #[test]
    fn an_icrc_filled_in_later_is_the_same() {
        for len in 0..9usize {
            let payload: Vec<u8> = (0..len as u8).collect();
            let mut whole = Vec::new();
            emit_packet(&full(Opcode::RC_SEND_ONLY), &payload, &ctx(), &mut whole);
            let mut later = vec![0xAA; 3];
            full(Opcode::RC_SEND_ONLY).emit_into(&mut later);
            later.extend_from_slice(&payload);
            finish_packet(&mut later, 3, None);
            assert_eq!(later[later.len() - ICRC_LEN..], [0; ICRC_LEN]);
            assert!(ParsedPacket::parse(&later[3..], Some(&ctx())).is_err());
            fill_icrc(&ctx(), &mut later[3..]);
            assert_eq!(later[3..], whole[..], "{len} B");
        }
        fill_icrc(&ctx(), &mut [1, 2, 3]);
    }

    #[test]
    fn corruption_is_caught_by_icrc() {
        let mut out = Vec::new();
        emit_packet(&full(Opcode::RC_SEND_ONLY), b"hello", &ctx(), &mut out);
        for i in 0..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 0x01;
            let r = ParsedPacket::parse(&bad, Some(&ctx()));
            if i == 4 {
                // FECN/BECN/resv6a are masked: flipping them is legal in flight.
                continue;
            }
            assert!(r.is_err(), "flip at byte {i} not caught");
        }
        // From the wrong address the ICRC does not match either.
        assert!(matches!(
            ParsedPacket::parse(&out, Some(&ctx().reversed())),
            Err(WireError::IcrcMismatch { .. })
        ));
        assert!(ParsedPacket::parse(&out, None).is_ok());
    }

    #[test]
    fn bad_lengths_are_errors_not_panics() {
        let mut out = Vec::new();
        emit_packet(
            &full(Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE),
            b"x",
            &ctx(),
            &mut out,
        );
        for n in 0..out.len() {
            assert!(
                ParsedPacket::parse(&out[..n], Some(&ctx())).is_err(),
                "len {n}"
            );
        }
        // Without the ICRC only structure is checked: anything shorter than the headers and
        // the trailer fails.
        for n in 0..12 + 20 + ICRC_LEN {
            assert!(ParsedPacket::parse(&out[..n], None).is_err(), "len {n}");
        }
        assert!(matches!(
            ParsedPacket::parse(&vec![0u8; MAX_PACKET + 1], None),
            Err(WireError::TooLong(_))
        ));
    }

    #[test]
    fn payload_on_an_ack_is_rejected() {
        let mut out = Vec::new();
        emit_packet(&full(Opcode::RC_ACKNOWLEDGE), b"zz", &ctx(), &mut out);
        assert!(matches!(
            ParsedPacket::parse(&out, Some(&ctx())),
            Err(WireError::BadPad { .. })
        ));
    }
}

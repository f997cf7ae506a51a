//! Invariant CRC (IBA Annex A17.3.3; rxe_icrc.c). CRC-32 over a pseudo copy of the IP and
//! UDP headers and the BTH with the variant fields set to all-ones, then the remaining
//! transport headers, payload and pad. The 8 all-ones bytes that stand in for the masked LRH
//! are why rxe seeds with 0xDEBB20E3: that is the CRC-32 state after those 8 bytes.
//!
//! A UDP socket neither shows nor lets us choose the IP header, so the context carries the
//! fields we know (addresses, ports) and the ones we rely on: Linux sends DF-marked datagrams
//! from an unconnected UDP socket with IP identification 0 (`ip_select_ident_segs`).

use std::net::{IpAddr, SocketAddr};

/// The IP/UDP facts the ICRC covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcrcContext {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// IPv4 identification field (not masked by the ICRC).
    pub ip_id: u16,
    /// IPv4 Don't Fragment flag (rxe and we set it).
    pub dont_fragment: bool,
}

impl IcrcContext {
    pub fn new(src: SocketAddr, dst: SocketAddr) -> IcrcContext {
        IcrcContext {
            src,
            dst,
            ip_id: 0,
            dont_fragment: true,
        }
    }
    /// The same flow seen from the other end.
    pub fn reversed(self) -> IcrcContext {
        IcrcContext {
            src: self.dst,
            dst: self.src,
            ..self
        }
    }
}

const IPV4_HDR: usize = 20;
const IPV6_HDR: usize = 40;
const UDP_HDR: usize = 8;

/// ICRC of `roce` (the UDP payload from the BTH up to, not including, the ICRC trailer).
/// Returned as the value whose little-endian bytes go on the wire, as rxe stores it.
pub fn icrc(ctx: &IcrcContext, roce: &[u8]) -> u32 {
    let udp_len = (UDP_HDR + roce.len() + super::ICRC_LEN) as u16;
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xFF; 8]);
    match (ctx.src.ip(), ctx.dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut ip = [0u8; IPV4_HDR];
            ip[0] = 0x45;
            ip[1] = 0xFF; // TOS masked
            ip[2..4].copy_from_slice(&(udp_len + IPV4_HDR as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&ctx.ip_id.to_be_bytes());
            if ctx.dont_fragment {
                ip[6] = 0x40;
            }
            ip[8] = 0xFF; // TTL masked
            ip[9] = 17;
            ip[10] = 0xFF; // header checksum masked
            ip[11] = 0xFF;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            h.update(&ip);
        }
        (s, d) => {
            let to6 = |a: IpAddr| match a {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            let mut ip = [0u8; IPV6_HDR];
            // Version 6, traffic class and flow label masked.
            ip[0] = 0x6F;
            ip[1] = 0xFF;
            ip[2] = 0xFF;
            ip[3] = 0xFF;
            ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
            ip[6] = 17;
            ip[7] = 0xFF; // hop limit masked
            ip[8..24].copy_from_slice(&to6(s).octets());
            ip[24..40].copy_from_slice(&to6(d).octets());
            h.update(&ip);
        }
    }
    let mut udp = [0u8; UDP_HDR];
    udp[0..2].copy_from_slice(&ctx.src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&ctx.dst.port().to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    udp[6] = 0xFF; // UDP checksum masked
    udp[7] = 0xFF;
    h.update(&udp);
    if roce.len() >= 12 {
        let mut bth = [0u8; 12];
        bth.copy_from_slice(&roce[..12]);
        bth[4] = 0xFF; // FECN, BECN and resv6a
        h.update(&bth);
        h.update(&roce[12..]);
    } else {
        h.update(roce);
    }
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> IcrcContext {
        IcrcContext::new(
            "192.168.1.10:49152".parse().unwrap(),
            "192.168.1.20:4791".parse().unwrap(),
        )
    }

    #[test]
    fn seed_matches_rxe_constant() {
        // rxe seeds crc32_le (no pre/post inversion) with 0xDEBB20E3: the state after eight
        // 0xFF bytes from the usual all-ones start.
        let mut state: u32 = 0xFFFF_FFFF;
        for _ in 0..8 {
            state ^= 0xFF;
            for _ in 0..8 {
                state = if state & 1 != 0 {
                    (state >> 1) ^ 0xEDB8_8320
                } else {
                    state >> 1
                };
            }
        }
        assert_eq!(state, 0xDEBB_20E3);
    }

    #[test]
    fn masked_fields_do_not_change_the_crc() {
        let mut pkt = [0u8; 28];
        pkt[0] = 0x04;
        pkt[7] = 0x11;
        let a = icrc(&ctx(), &pkt);
        pkt[4] = 0xC0; // FECN|BECN
        assert_eq!(icrc(&ctx(), &pkt), a);
        pkt[5] = 1; // part of the QPN: covered
        assert_ne!(icrc(&ctx(), &pkt), a);
    }

    #[test]
    fn covered_ip_fields_change_the_crc() {
        let pkt = [0u8; 16];
        let a = icrc(&ctx(), &pkt);
        let mut c = ctx();
        c.ip_id = 1;
        assert_ne!(icrc(&c, &pkt), a);
        let mut c = ctx();
        c.src.set_port(49153);
        assert_ne!(icrc(&c, &pkt), a);
        assert_ne!(icrc(&ctx(), &pkt[..12]), a, "length is covered");
    }

    /// A captured rxe packet would be the best vector (tests/rxe_wire.rs checks against rxe);
    /// here, pin an independently computed value (python: zlib.crc32 over the same bytes).
    #[test]
    fn known_vector() {
        let mut pkt = [0u8; 12];
        BthBytes::send_only(&mut pkt);
        assert_eq!(icrc(&ctx(), &pkt), KNOWN);
    }
    struct BthBytes;
    impl BthBytes {
        fn send_only(b: &mut [u8; 12]) {
            *b = [0x04, 0x40, 0xFF, 0xFF, 0, 0, 0, 0x11, 0x80, 0, 0, 1];
        }
    }
    const KNOWN: u32 = 0xccdc_3ab8;
}

//! An IPv4 datagram carrying UDP, as a raw socket receives it (RFC 791, RFC 768): the one
//! place the IPv4 identification and DF flag, which the ICRC covers, can be read. Parsing
//! gives the [`IcrcContext`] of the real header and the UDP payload (the RoCEv2 packet).
//!
//! Only what RoCEv2 sends is accepted: a 20-byte header (rxe's ICRC takes `struct iphdr`
//! with the UDP header right behind it, so options have no defined ICRC), UDP, not a
//! fragment. Anything else is an error for the caller to count.

use std::net::{Ipv4Addr, SocketAddr};

use super::{be16, check_len, IcrcContext, WireError};

/// Field offsets of the IPv4 header.
mod field {
    pub const VER_IHL: usize = 0;
    pub const TOTAL_LEN: usize = 2;
    pub const IDENT: usize = 4;
    pub const FLAGS_FRAG: usize = 6;
    pub const PROTOCOL: usize = 9;
    pub const SRC: usize = 12;
    pub const DST: usize = 16;
    pub const LEN: usize = 20;
}
const UDP_HDR: usize = 8;
const PROTO_UDP: u8 = 17;
const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const FRAG_OFFSET: u16 = 0x1FFF;

/// A received IPv4/UDP datagram: its addresses, ports and the covered IP fields, and the UDP
/// payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Udp<'a> {
    pub icrc: IcrcContext,
    pub payload: &'a [u8],
}

impl<'a> Ipv4Udp<'a> {
    /// Parse `data`, which starts at the IPv4 header. Bytes beyond the IP total length
    /// (link padding) are ignored; a UDP length that disagrees with the IP length is an
    /// error, as is anything the ICRC is not defined over (options, fragments).
    pub fn parse(data: &'a [u8]) -> Result<Ipv4Udp<'a>, WireError> {
        check_len("IPv4 header", data, field::LEN)?;
        let ver_ihl = data[field::VER_IHL];
        if ver_ihl >> 4 != 4 {
            return Err(WireError::BadIpHeader("not IPv4"));
        }
        if ver_ihl & 0x0F != 5 {
            return Err(WireError::BadIpHeader("IPv4 options"));
        }
        if data[field::PROTOCOL] != PROTO_UDP {
            return Err(WireError::BadIpHeader("not UDP"));
        }
        let flags = be16(data, field::FLAGS_FRAG);
        if flags & (FLAG_MF | FRAG_OFFSET) != 0 {
            return Err(WireError::BadIpHeader("a fragment"));
        }
        let total = be16(data, field::TOTAL_LEN) as usize;
        check_len("IPv4 datagram", data, total)?;
        if total < field::LEN + UDP_HDR {
            return Err(WireError::BadIpHeader("shorter than IPv4 + UDP headers"));
        }
        let udp = &data[field::LEN..total];
        let udp_len = be16(udp, 4) as usize;
        if udp_len != udp.len() {
            return Err(WireError::BadIpHeader(
                "UDP length disagrees with IPv4 length",
            ));
        }
        let ip = |at: usize| Ipv4Addr::new(data[at], data[at + 1], data[at + 2], data[at + 3]);
        let src = SocketAddr::new(ip(field::SRC).into(), be16(udp, 0));
        let dst = SocketAddr::new(ip(field::DST).into(), be16(udp, 2));
        Ok(Ipv4Udp {
            icrc: IcrcContext {
                src,
                dst,
                ip_id: be16(data, field::IDENT),
                dont_fragment: flags & FLAG_DF != 0,
            },
            payload: &udp[UDP_HDR..],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram as Linux sends it: 10.0.0.1:49152 -> 10.0.0.2:4791, ID 0x1234, DF.
    fn datagram(payload: &[u8]) -> Vec<u8> {
        let total = (20 + 8 + payload.len()) as u16;
        let mut d = vec![0x45, 0x02];
        d.extend_from_slice(&total.to_be_bytes());
        d.extend_from_slice(&[0x12, 0x34, 0x40, 0x00, 64, 17, 0xAB, 0xCD]);
        d.extend_from_slice(&[10, 0, 0, 1, 10, 0, 0, 2]);
        d.extend_from_slice(&49152u16.to_be_bytes());
        d.extend_from_slice(&4791u16.to_be_bytes());
        d.extend_from_slice(&(total - 20).to_be_bytes());
        d.extend_from_slice(&[0, 0]);
        d.extend_from_slice(payload);
        d
    }

    #[test]
    fn parses_the_fields_the_icrc_covers() {
        let d = datagram(b"roce");
        let p = Ipv4Udp::parse(&d).unwrap();
        assert_eq!(p.icrc.src, "10.0.0.1:49152".parse().unwrap());
        assert_eq!(p.icrc.dst, "10.0.0.2:4791".parse().unwrap());
        assert_eq!(p.icrc.ip_id, 0x1234);
        assert!(p.icrc.dont_fragment);
        assert_eq!(p.payload, b"roce");
        // Ethernet pads short frames: bytes past the IP total length are not payload.
        let mut padded = d.clone();
        padded.extend_from_slice(&[0; 6]);
        assert_eq!(Ipv4Udp::parse(&padded).unwrap().payload, b"roce");
        let mut no_df = d;
        no_df[6] = 0;
        assert!(!Ipv4Udp::parse(&no_df).unwrap().icrc.dont_fragment);
    }

    #[test]
    fn refuses_what_the_icrc_is_not_defined_over() {
        let good = datagram(b"roce");
        let bad = |f: fn(&mut Vec<u8>)| {
            let mut d = good.clone();
            f(&mut d);
            Ipv4Udp::parse(&d).unwrap_err()
        };
        assert!(matches!(bad(|d| d[0] = 0x46), WireError::BadIpHeader(_)));
        assert!(matches!(bad(|d| d[0] = 0x65), WireError::BadIpHeader(_)));
        assert!(matches!(bad(|d| d[9] = 6), WireError::BadIpHeader(_)));
        assert!(matches!(bad(|d| d[6] = 0x20), WireError::BadIpHeader(_)));
        assert!(matches!(bad(|d| d[7] = 1), WireError::BadIpHeader(_)));
        assert!(matches!(bad(|d| d[3] += 1), WireError::Truncated { .. }));
        assert!(matches!(bad(|d| d[25] += 1), WireError::BadIpHeader(_)));
        assert!(matches!(bad(|d| d[3] = 27), WireError::BadIpHeader(_)));
        for n in 0..good.len() {
            assert!(Ipv4Udp::parse(&good[..n]).is_err(), "{n} bytes");
        }
    }
}

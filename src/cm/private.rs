//! What rides inside CM private data when rdma_cm carries NVMe-oF:
//!
//! - the rdma_cm IP header (drivers/infiniband/core/cma.c `struct cma_hdr`, filled by
//!   `cma_format_hdr`), 36 bytes at the start of every REQ's private data for IP port spaces;
//!   the passive rdma_cm strips it before the ULP sees the rest (`cma_user_data_offset`);
//! - the NVMe-oF RDMA records (include/linux/nvme-rdma.h; NVMe-oF RDMA transport binding):
//!   the connect request after that header, the accept in the REP, the reject in a
//!   consumer-defined REJ. These are **little-endian**, unlike everything else in a MAD;
//! - the service ID an rdma_cm listener on an RDMA_PS_TCP port answers to.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// rdma_cm's TCP port space (`RDMA_PS_TCP`, include/rdma/rdma_cm.h).
pub const RDMA_PS_TCP: u16 = 0x0106;
/// `RDMA_IB_IP_PS_TCP`: the service-ID prefix of the TCP port space.
pub const RDMA_IB_IP_PS_TCP: u64 = (RDMA_PS_TCP as u64) << 16;
const PS_MASK: u64 = !0xFFFF;

/// The IB service ID an rdma_cm listener on TCP-space `port` answers (cma.c
/// `cma_get_service_id`: port space << 16 | port). 4420 → 0x0000000001061144.
pub const fn service_id(port: u16) -> u64 {
    RDMA_IB_IP_PS_TCP | port as u64
}

/// The TCP-space port a service ID names, if it is in the RDMA_PS_TCP space.
pub const fn service_port(service_id: u64) -> Option<u16> {
    if service_id & PS_MASK == RDMA_IB_IP_PS_TCP {
        Some(service_id as u16)
    } else {
        None
    }
}

/// Why private data did not hold the record we expected. Permanent for the message at hand.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrivateError {
    #[error("{what} truncated: need {need} bytes, have {have}")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("rdma_cm header version {0} is not 0")]
    BadCmaVersion(u8),
    #[error("rdma_cm header IP version {0} is neither 4 nor 6")]
    BadIpVersion(u8),
    #[error("NVMe-oF record format {0} is not 0 (NVME_RDMA_CM_FMT_1_0)")]
    BadRecfmt(u16),
}

impl PrivateError {
    /// The NVMe reject status a target answers a bad connect request with (Linux nvmet-rdma
    /// `nvmet_rdma_parse_cm_connect_req`: missing data → invalid length, wrong format →
    /// invalid record format).
    pub fn nvme_status(&self) -> NvmeRejectStatus {
        match self {
            PrivateError::BadRecfmt(_) => NvmeRejectStatus::InvalidRecfmt,
            _ => NvmeRejectStatus::InvalidLength,
        }
    }
}

fn need(what: &'static str, b: &[u8], n: usize) -> Result<(), PrivateError> {
    if b.len() < n {
        Err(PrivateError::Truncated {
            what,
            need: n,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

// ---------------------------------------------------------------------------------------------
// struct cma_hdr

/// `CMA_VERSION`.
pub const CMA_VERSION: u8 = 0;
/// `sizeof(struct cma_hdr)`.
pub const CMA_HDR_LEN: usize = 36;

mod cma_field {
    pub const VERSION: usize = 0;
    /// IP version in bits [7:4] (`cma_get_ip_ver`).
    pub const IP_VERSION: usize = 1;
    /// Big-endian, the active side's source port.
    pub const PORT: usize = 2;
    /// `union cma_ip_addr`: an IPv6 address, or for IPv4 three zero words then the address.
    pub const SRC_ADDR: usize = 4;
    pub const DST_ADDR: usize = 20;
    pub const LEN: usize = super::CMA_HDR_LEN;
}

/// A checked view of a `cma_hdr` at the start of `buffer`.
#[derive(Debug, Clone, Copy)]
pub struct CmaHdr<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> CmaHdr<T> {
    pub const LEN: usize = cma_field::LEN;

    pub fn new_checked(buffer: T) -> Result<Self, PrivateError> {
        need("rdma_cm header", buffer.as_ref(), cma_field::LEN)?;
        Ok(CmaHdr { buffer })
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    pub fn cma_version(&self) -> u8 {
        self.b()[cma_field::VERSION]
    }
    pub fn ip_version(&self) -> u8 {
        self.b()[cma_field::IP_VERSION] >> 4
    }
    pub fn port(&self) -> u16 {
        u16::from_be_bytes([self.b()[cma_field::PORT], self.b()[cma_field::PORT + 1]])
    }
    pub fn src_addr_raw(&self) -> [u8; 16] {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.b()[cma_field::SRC_ADDR..cma_field::SRC_ADDR + 16]);
        a
    }
    pub fn dst_addr_raw(&self) -> [u8; 16] {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.b()[cma_field::DST_ADDR..cma_field::DST_ADDR + 16]);
        a
    }
}

/// The addresses of a `cma_hdr`; one IP version covers both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmaAddrs {
    V4 { src: Ipv4Addr, dst: Ipv4Addr },
    V6 { src: Ipv6Addr, dst: Ipv6Addr },
}

/// The rdma_cm IP header as plain values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaHdrRepr {
    /// The active side's source port (`cma_hdr.port` = `src4->sin_port`).
    pub src_port: u16,
    pub addrs: CmaAddrs,
}

impl CmaHdrRepr {
    /// The header an active side at `src` sends to `dst`. Mixed families are carried as IPv6
    /// with the IPv4 side mapped, since one header has one IP version.
    pub fn new(src: SocketAddr, dst: IpAddr) -> CmaHdrRepr {
        let addrs = match (src.ip(), dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => CmaAddrs::V4 { src: s, dst: d },
            (s, d) => CmaAddrs::V6 {
                src: to_v6(s),
                dst: to_v6(d),
            },
        };
        CmaHdrRepr {
            src_port: src.port(),
            addrs,
        }
    }
    pub fn src_ip(&self) -> IpAddr {
        match self.addrs {
            CmaAddrs::V4 { src, .. } => IpAddr::V4(src),
            CmaAddrs::V6 { src, .. } => IpAddr::V6(src),
        }
    }
    pub fn dst_ip(&self) -> IpAddr {
        match self.addrs {
            CmaAddrs::V4 { dst, .. } => IpAddr::V4(dst),
            CmaAddrs::V6 { dst, .. } => IpAddr::V6(dst),
        }
    }
    /// The active side's address as rdma_cm reports it to the listener (`cma_save_ip4_info`).
    pub fn src(&self) -> SocketAddr {
        SocketAddr::new(self.src_ip(), self.src_port)
    }

    /// Parse, as the passive rdma_cm does before accepting (`cma_save_net_info` refuses a
    /// version other than 0 and IP versions other than 4 and 6). For IPv4 only the last four
    /// bytes of each address are read, as `cma_save_ip4_info` does.
    pub fn parse<T: AsRef<[u8]>>(v: &CmaHdr<T>) -> Result<CmaHdrRepr, PrivateError> {
        if v.cma_version() != CMA_VERSION {
            return Err(PrivateError::BadCmaVersion(v.cma_version()));
        }
        let (s, d) = (v.src_addr_raw(), v.dst_addr_raw());
        let addrs = match v.ip_version() {
            4 => CmaAddrs::V4 {
                src: Ipv4Addr::new(s[12], s[13], s[14], s[15]),
                dst: Ipv4Addr::new(d[12], d[13], d[14], d[15]),
            },
            6 => CmaAddrs::V6 {
                src: Ipv6Addr::from(s),
                dst: Ipv6Addr::from(d),
            },
            n => return Err(PrivateError::BadIpVersion(n)),
        };
        Ok(CmaHdrRepr {
            src_port: v.port(),
            addrs,
        })
    }

    pub fn emit(&self, out: &mut [u8; cma_field::LEN]) {
        out.fill(0);
        out[cma_field::VERSION] = CMA_VERSION;
        out[cma_field::PORT..cma_field::PORT + 2].copy_from_slice(&self.src_port.to_be_bytes());
        let (s, d) = (cma_field::SRC_ADDR, cma_field::DST_ADDR);
        match self.addrs {
            CmaAddrs::V4 { src, dst } => {
                out[cma_field::IP_VERSION] = 4 << 4;
                out[s + 12..s + 16].copy_from_slice(&src.octets());
                out[d + 12..d + 16].copy_from_slice(&dst.octets());
            }
            CmaAddrs::V6 { src, dst } => {
                out[cma_field::IP_VERSION] = 6 << 4;
                out[s..s + 16].copy_from_slice(&src.octets());
                out[d..d + 16].copy_from_slice(&dst.octets());
            }
        }
    }
}

fn to_v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    }
}

/// The GID of an IP address on RoCE: IPv4-mapped for IPv4 (include/rdma/ib_addr.h
/// `rdma_ip2gid` → `ipv6_addr_set_v4mapped`), the address itself for IPv6.
pub fn gid_from_ip(ip: IpAddr) -> Ipv6Addr {
    to_v6(ip)
}

/// The IP address a RoCE GID stands for (`rdma_gid2ip`).
pub fn ip_from_gid(gid: Ipv6Addr) -> IpAddr {
    match gid.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(gid),
    }
}

/// REQ private data is 92 bytes; the ULP gets what follows the 36-byte IP header.
pub const REQ_ULP_LEN: usize = 92 - cma_field::LEN;

/// Build a REQ's private data: IP header then up to [`REQ_ULP_LEN`] ULP bytes, zero-filled.
pub fn build_req_private(hdr: &CmaHdrRepr, ulp: &[u8]) -> [u8; 92] {
    let mut out = [0u8; 92];
    let mut h = [0u8; cma_field::LEN];
    hdr.emit(&mut h);
    out[..cma_field::LEN].copy_from_slice(&h);
    super::fill_private(&mut out[cma_field::LEN..], ulp);
    out
}

/// Split a REQ's private data into its IP header and the ULP bytes after it.
pub fn split_req_private(private: &[u8]) -> Result<(CmaHdrRepr, &[u8]), PrivateError> {
    let hdr = CmaHdrRepr::parse(&CmaHdr::new_checked(private)?)?;
    Ok((hdr, &private[cma_field::LEN..]))
}

// ---------------------------------------------------------------------------------------------
// NVMe-oF RDMA private data (little-endian)

/// `NVME_RDMA_CM_FMT_1_0`, the only record format.
pub const NVME_RDMA_CM_FMT_1_0: u16 = 0;

/// The NVMe-oF RDMA connect request (`struct nvme_rdma_cm_req`, 32 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NvmeCmRequest {
    /// 0 for the admin queue.
    pub qid: u16,
    /// Host receive queue size (entries).
    pub hrqsize: u16,
    /// Host send queue size, 0's based (Linux admin queue: 31 for a depth of 32).
    pub hsqsize: u16,
    /// Controller ID (newer spec revision / SPDK; Linux leaves these bytes reserved = 0).
    pub cntlid: u16,
}

impl NvmeCmRequest {
    pub const LEN: usize = 32;

    pub fn parse(b: &[u8]) -> Result<NvmeCmRequest, PrivateError> {
        need("NVMe-oF connect request", b, Self::LEN)?;
        let recfmt = le16(b, 0);
        if recfmt != NVME_RDMA_CM_FMT_1_0 {
            return Err(PrivateError::BadRecfmt(recfmt));
        }
        Ok(NvmeCmRequest {
            qid: le16(b, 2),
            hrqsize: le16(b, 4),
            hsqsize: le16(b, 6),
            cntlid: le16(b, 8),
        })
    }
    pub fn emit(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..2].copy_from_slice(&NVME_RDMA_CM_FMT_1_0.to_le_bytes());
        out[2..4].copy_from_slice(&self.qid.to_le_bytes());
        out[4..6].copy_from_slice(&self.hrqsize.to_le_bytes());
        out[6..8].copy_from_slice(&self.hsqsize.to_le_bytes());
        out[8..10].copy_from_slice(&self.cntlid.to_le_bytes());
        out
    }
}

/// The NVMe-oF RDMA accept (`struct nvme_rdma_cm_rep`, 32 bytes) in the REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NvmeCmAccept {
    /// Controller receive queue size.
    pub crqsize: u16,
}

impl NvmeCmAccept {
    pub const LEN: usize = 32;

    pub fn parse(b: &[u8]) -> Result<NvmeCmAccept, PrivateError> {
        need("NVMe-oF accept", b, Self::LEN)?;
        let recfmt = le16(b, 0);
        if recfmt != NVME_RDMA_CM_FMT_1_0 {
            return Err(PrivateError::BadRecfmt(recfmt));
        }
        Ok(NvmeCmAccept {
            crqsize: le16(b, 2),
        })
    }
    pub fn emit(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..2].copy_from_slice(&NVME_RDMA_CM_FMT_1_0.to_le_bytes());
        out[2..4].copy_from_slice(&self.crqsize.to_le_bytes());
        out
    }
}

/// Why an NVMe-oF target refused a connect (`enum nvme_rdma_cm_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NvmeRejectStatus {
    InvalidLength,
    InvalidRecfmt,
    InvalidQid,
    InvalidHsqsize,
    InvalidHrqsize,
    NoResources,
    InvalidIrd,
    InvalidOrd,
    /// A code this implementation does not know (newer revisions add some).
    Unknown(u16),
}

impl NvmeRejectStatus {
    pub fn from_u16(v: u16) -> NvmeRejectStatus {
        match v {
            1 => NvmeRejectStatus::InvalidLength,
            2 => NvmeRejectStatus::InvalidRecfmt,
            3 => NvmeRejectStatus::InvalidQid,
            4 => NvmeRejectStatus::InvalidHsqsize,
            5 => NvmeRejectStatus::InvalidHrqsize,
            6 => NvmeRejectStatus::NoResources,
            7 => NvmeRejectStatus::InvalidIrd,
            8 => NvmeRejectStatus::InvalidOrd,
            n => NvmeRejectStatus::Unknown(n),
        }
    }
    pub fn as_u16(self) -> u16 {
        match self {
            NvmeRejectStatus::InvalidLength => 1,
            NvmeRejectStatus::InvalidRecfmt => 2,
            NvmeRejectStatus::InvalidQid => 3,
            NvmeRejectStatus::InvalidHsqsize => 4,
            NvmeRejectStatus::InvalidHrqsize => 5,
            NvmeRejectStatus::NoResources => 6,
            NvmeRejectStatus::InvalidIrd => 7,
            NvmeRejectStatus::InvalidOrd => 8,
            NvmeRejectStatus::Unknown(n) => n,
        }
    }
    /// What the status means, for people.
    pub fn message(self) -> &'static str {
        match self {
            NvmeRejectStatus::InvalidLength => "the connect private data has an invalid length",
            NvmeRejectStatus::InvalidRecfmt => {
                "the connect private data uses a record format the target does not support"
            }
            NvmeRejectStatus::InvalidQid => "the queue ID is invalid",
            NvmeRejectStatus::InvalidHsqsize => "the host send queue size is invalid",
            NvmeRejectStatus::InvalidHrqsize => "the host receive queue size is invalid",
            NvmeRejectStatus::NoResources => "the target has no resources for the queue",
            NvmeRejectStatus::InvalidIrd => {
                "the inbound RDMA read depth (IRD) is invalid for the target"
            }
            NvmeRejectStatus::InvalidOrd => {
                "the outbound RDMA read depth (ORD) is invalid for the target"
            }
            NvmeRejectStatus::Unknown(_) => "unrecognised NVMe-oF reject status",
        }
    }
}

impl fmt::Display for NvmeRejectStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (status {})", self.message(), self.as_u16())
    }
}

/// The NVMe-oF RDMA reject (`struct nvme_rdma_cm_rej`, 4 bytes) in a consumer-defined REJ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NvmeCmReject {
    pub recfmt: u16,
    pub status: NvmeRejectStatus,
}

impl NvmeCmReject {
    pub const LEN: usize = 4;

    pub fn new(status: NvmeRejectStatus) -> NvmeCmReject {
        NvmeCmReject {
            recfmt: NVME_RDMA_CM_FMT_1_0,
            status,
        }
    }
    /// No record-format check: the Linux host reads `sts` whatever `recfmt` says
    /// (rdma.c `nvme_rdma_conn_rejected`).
    pub fn parse(b: &[u8]) -> Result<NvmeCmReject, PrivateError> {
        need("NVMe-oF reject", b, Self::LEN)?;
        Ok(NvmeCmReject {
            recfmt: le16(b, 0),
            status: NvmeRejectStatus::from_u16(le16(b, 2)),
        })
    }
    pub fn emit(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..2].copy_from_slice(&self.recfmt.to_le_bytes());
        out[2..4].copy_from_slice(&self.status.as_u16().to_le_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_ids() {
        assert_eq!(service_id(4420), 0x0000_0000_0106_1144);
        assert_eq!(service_port(0x0000_0000_0106_1144), Some(4420));
        assert_eq!(service_port(0x0000_0000_0111_1144), None); // RDMA_PS_UDP space
        assert_eq!(RDMA_IB_IP_PS_TCP, 0x0000_0000_0106_0000);
    }

    // --- cma_hdr ------------------------------------------------------------------------------

    const CMA_V4: [u8; 36] = [
        0x00, 0x40, 0xC0, 0x01, // version 0, IPv4, port 49153
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 168, 1, 10, // src
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 168, 1, 20, // dst
    ];

    fn cma_v4() -> CmaHdrRepr {
        CmaHdrRepr::new(
            "192.168.1.10:49153".parse().unwrap(),
            "192.168.1.20".parse().unwrap(),
        )
    }

    #[test]
    fn cma_deconstruct() {
        let v = CmaHdr::new_checked(&CMA_V4[..]).unwrap();
        assert_eq!((v.cma_version(), v.ip_version(), v.port()), (0, 4, 49153));
        assert_eq!(v.src_addr_raw()[12..], [192, 168, 1, 10]);
        assert_eq!(v.dst_addr_raw()[12..], [192, 168, 1, 20]);
    }
    #[test]
    fn cma_construct() {
        let mut out = [0xAAu8; 36];
        cma_v4().emit(&mut out);
        assert_eq!(out, CMA_V4);
    }
    #[test]
    fn cma_parse_and_round_trip_v6() {
        let v = CmaHdr::new_checked(&CMA_V4[..]).unwrap();
        let r = CmaHdrRepr::parse(&v).unwrap();
        assert_eq!(r, cma_v4());
        assert_eq!(r.src(), "192.168.1.10:49153".parse().unwrap());
        let r6 = CmaHdrRepr::new(
            "[fe80::1]:5".parse().unwrap(),
            "2001:db8::2".parse().unwrap(),
        );
        let mut out = [0u8; 36];
        r6.emit(&mut out);
        assert_eq!(out[1], 0x60);
        assert_eq!(
            CmaHdrRepr::parse(&CmaHdr::new_checked(&out[..]).unwrap()).unwrap(),
            r6
        );
        // Mixed families travel as IPv6 with the IPv4 side mapped.
        let m = CmaHdrRepr::new("10.0.0.1:1".parse().unwrap(), "::1".parse().unwrap());
        assert_eq!(m.src_ip(), "::ffff:10.0.0.1".parse::<IpAddr>().unwrap());
    }
    #[test]
    fn cma_bad_length_version_and_ip_version() {
        assert!(matches!(
            CmaHdr::new_checked(&CMA_V4[..35]),
            Err(PrivateError::Truncated {
                need: 36,
                have: 35,
                ..
            })
        ));
        let mut b = CMA_V4;
        b[0] = 1;
        assert_eq!(
            CmaHdrRepr::parse(&CmaHdr::new_checked(&b[..]).unwrap()),
            Err(PrivateError::BadCmaVersion(1))
        );
        b = CMA_V4;
        b[1] = 0x50;
        assert_eq!(
            CmaHdrRepr::parse(&CmaHdr::new_checked(&b[..]).unwrap()),
            Err(PrivateError::BadIpVersion(5))
        );
    }
    #[test]
    fn req_private_layout() {
        let ulp = NvmeCmRequest {
            qid: 1,
            hrqsize: 128,
            hsqsize: 127,
            cntlid: 0,
        }
        .emit();
        let p = build_req_private(&cma_v4(), &ulp);
        assert_eq!(p[..36], CMA_V4);
        assert_eq!(p[36..68], ulp);
        assert!(p[68..].iter().all(|&b| b == 0));
        let (h, rest) = split_req_private(&p).unwrap();
        assert_eq!(h, cma_v4());
        assert_eq!(rest.len(), REQ_ULP_LEN);
        assert_eq!(NvmeCmRequest::parse(rest).unwrap().hrqsize, 128);
    }
    #[test]
    fn gids() {
        let ip: IpAddr = "192.168.1.20".parse().unwrap();
        assert_eq!(
            gid_from_ip(ip),
            "::ffff:192.168.1.20".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(ip_from_gid(gid_from_ip(ip)), ip);
        let ip6: IpAddr = "2001:db8::7".parse().unwrap();
        assert_eq!(ip_from_gid(gid_from_ip(ip6)), ip6);
    }

    // --- NVMe records --------------------------------------------------------------------------

    // recfmt 0, qid 1, hrqsize 128, hsqsize 127, cntlid 0x0102, reserved.
    const NVME_REQ: [u8; 32] = [
        0, 0, 1, 0, 128, 0, 127, 0, 0x02, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0,
    ];
    const NVME_REQ_REPR: NvmeCmRequest = NvmeCmRequest {
        qid: 1,
        hrqsize: 128,
        hsqsize: 127,
        cntlid: 0x0102,
    };

    #[test]
    fn nvme_req_deconstruct() {
        assert_eq!(le16(&NVME_REQ, 4), 128);
        assert_eq!(le16(&NVME_REQ, 8), 0x0102);
    }
    #[test]
    fn nvme_req_construct() {
        assert_eq!(NVME_REQ_REPR.emit(), NVME_REQ);
    }
    #[test]
    fn nvme_req_parse_round_trip() {
        assert_eq!(NvmeCmRequest::parse(&NVME_REQ).unwrap(), NVME_REQ_REPR);
        let r = NvmeCmRequest {
            qid: 0xFFFF,
            hrqsize: 0x1234,
            hsqsize: 31,
            cntlid: 0xFFFF,
        };
        assert_eq!(NvmeCmRequest::parse(&r.emit()).unwrap(), r);
    }
    #[test]
    fn nvme_req_bad_length_and_recfmt() {
        let e = NvmeCmRequest::parse(&NVME_REQ[..31]).unwrap_err();
        assert_eq!(e.nvme_status(), NvmeRejectStatus::InvalidLength);
        let mut b = NVME_REQ;
        b[0] = 1;
        let e = NvmeCmRequest::parse(&b).unwrap_err();
        assert_eq!(e, PrivateError::BadRecfmt(1));
        assert_eq!(e.nvme_status(), NvmeRejectStatus::InvalidRecfmt);
    }

    #[test]
    fn nvme_accept_deconstruct_construct() {
        let mut b = [0u8; 32];
        b[2] = 0x80;
        assert_eq!(NvmeCmAccept { crqsize: 128 }.emit(), b);
        assert_eq!(le16(&b, 2), 128);
    }
    #[test]
    fn nvme_accept_parse_round_trip() {
        let a = NvmeCmAccept { crqsize: 0xBEEF };
        assert_eq!(NvmeCmAccept::parse(&a.emit()).unwrap(), a);
    }
    #[test]
    fn nvme_accept_bad_length_and_recfmt() {
        assert!(NvmeCmAccept::parse(&[0u8; 31]).is_err());
        let mut b = [0u8; 32];
        b[1] = 1;
        assert_eq!(NvmeCmAccept::parse(&b), Err(PrivateError::BadRecfmt(256)));
    }

    #[test]
    fn nvme_reject_deconstruct_construct() {
        let b = [0, 0, 6, 0];
        assert_eq!(NvmeCmReject::new(NvmeRejectStatus::NoResources).emit(), b);
        let r = NvmeCmReject::parse(&b).unwrap();
        assert_eq!(r.status, NvmeRejectStatus::NoResources);
    }
    #[test]
    fn nvme_reject_parse_round_trip_every_code() {
        for code in 0..=10u16 {
            let s = NvmeRejectStatus::from_u16(code);
            assert_eq!(s.as_u16(), code);
            let r = NvmeCmReject {
                recfmt: 7,
                status: s,
            };
            assert_eq!(NvmeCmReject::parse(&r.emit()).unwrap(), r);
        }
        assert_eq!(
            NvmeRejectStatus::InvalidHsqsize.to_string(),
            "the host send queue size is invalid (status 4)"
        );
        assert!(matches!(
            NvmeRejectStatus::from_u16(9),
            NvmeRejectStatus::Unknown(9)
        ));
    }
    #[test]
    fn nvme_reject_bad_length() {
        assert!(NvmeCmReject::parse(&[0, 0, 6]).is_err());
    }
}

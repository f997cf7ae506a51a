//! Newtypes of the seam, shared by every backend: queue pair numbers, packet sequence
//! numbers, memory keys, virtual time, device identity, and what a connection tells each
//! side about the other.

use std::fmt;
use std::net::SocketAddr;

/// A 24-bit queue pair number (IBA 9.2: DestQP is 24 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Qpn(u32);

impl Qpn {
    pub const MASK: u32 = 0x00FF_FFFF;
    /// QP1, the general services interface that carries CM MADs.
    pub const GSI: Qpn = Qpn(1);

    pub const fn new(v: u32) -> Qpn {
        Qpn(v & Self::MASK)
    }
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A 24-bit packet sequence number. All comparisons are modulo 2^24 (IBA 9.7.1), done the
/// way rxe's `psn_compare` does: shift the difference into the top bits and read the sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    pub const MASK: u32 = 0x00FF_FFFF;

    pub const fn new(v: u32) -> Psn {
        Psn(v & Self::MASK)
    }
    pub const fn get(self) -> u32 {
        self.0
    }
    /// `self + n` modulo 2^24.
    pub const fn add(self, n: u32) -> Psn {
        Psn(self.0.wrapping_add(n) & Self::MASK)
    }
    /// Signed distance `self - other` modulo 2^24, in -2^23..2^23.
    pub const fn diff(self, other: Psn) -> i32 {
        ((self.0.wrapping_sub(other.0)) << 8) as i32 >> 8
    }
    pub const fn before(self, other: Psn) -> bool {
        self.diff(other) < 0
    }
    pub const fn after(self, other: Psn) -> bool {
        self.diff(other) > 0
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A memory key. The low byte is the "key" part a consumer may change; the rest indexes the
/// MR table. Local and remote keys share the type because on the wire they are both 32 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MemKey(pub u32);

impl fmt::Display for MemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#010x}", self.0)
    }
}

/// Virtual time in nanoseconds since an arbitrary epoch. The sans-I/O core never reads a
/// clock: the driver (or the simulator) hands it `now` with every input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(pub u64);

impl Instant {
    pub const ZERO: Instant = Instant(0);

    pub const fn from_nanos(n: u64) -> Instant {
        Instant(n)
    }
    pub const fn as_nanos(self) -> u64 {
        self.0
    }
    pub fn saturating_since(self, earlier: Instant) -> std::time::Duration {
        std::time::Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl std::ops::Add<std::time::Duration> for Instant {
    type Output = Instant;
    fn add(self, d: std::time::Duration) -> Instant {
        Instant(
            self.0
                .saturating_add(d.as_nanos().min(u64::MAX as u128) as u64),
        )
    }
}

/// A node GUID in EUI-64 form.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Guid(pub u64);

impl Guid {
    /// EUI-64 from a 48-bit MAC the way Linux builds RoCE node GUIDs
    /// (`addrconf_addr_eui48`): insert FF:FE in the middle and flip the universal/local bit.
    pub fn from_mac(mac: [u8; 6]) -> Guid {
        let b = [
            mac[0] ^ 0x02,
            mac[1],
            mac[2],
            0xFF,
            0xFE,
            mac[3],
            mac[4],
            mac[5],
        ];
        Guid(u64::from_be_bytes(b))
    }
    pub fn to_bytes(self) -> [u8; 8] {
        self.0.to_be_bytes()
    }
}

impl fmt::Display for Guid {
    /// `ibv_devinfo` style: four groups of four hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.to_bytes();
        write!(
            f,
            "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
        )
    }
}

impl fmt::Debug for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Guid({self})")
    }
}

/// A PCI address, `domain:bus:device.function`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PciAddr {
    pub domain: u16,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl PciAddr {
    pub const fn new(domain: u16, bus: u8, device: u8, function: u8) -> PciAddr {
        PciAddr {
            domain,
            bus,
            device: device & 0x1F,
            function: function & 0x07,
        }
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl fmt::Debug for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PciAddr({self})")
    }
}

/// Parse error for [`PciAddr`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid PCI address {0:?}: expected dddd:bb:dd.f")]
pub struct PciAddrParseError(pub String);

impl std::str::FromStr for PciAddr {
    type Err = PciAddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || PciAddrParseError(s.to_string());
        let (dom, rest) = s.split_once(':').ok_or_else(err)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(err)?;
        let (dev, func) = rest.split_once('.').ok_or_else(err)?;
        let domain = u16::from_str_radix(dom, 16).map_err(|_| err())?;
        let bus = u8::from_str_radix(bus, 16).map_err(|_| err())?;
        let device = u8::from_str_radix(dev, 16).map_err(|_| err())?;
        let function = u8::from_str_radix(func, 16).map_err(|_| err())?;
        if device > 0x1F || function > 7 || dom.len() > 4 {
            return Err(err());
        }
        Ok(PciAddr::new(domain, bus, device, function))
    }
}

/// What one side learns about the other when a connection is made (by CM or by hand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    pub addr: SocketAddr,
    pub qpn: Qpn,
    /// The peer's first send PSN: our expected receive PSN.
    pub psn: Psn,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_wraps_modulo_2_24() {
        let a = Psn::new(0xFF_FFFF);
        assert_eq!(a.add(1), Psn::new(0));
        assert_eq!(Psn::new(0).diff(a), 1);
        assert!(a.before(Psn::new(5)));
        assert!(Psn::new(5).after(a));
        assert_eq!(Psn::new(10).diff(Psn::new(3)), 7);
        assert_eq!(Psn::new(3).diff(Psn::new(10)), -7);
    }

    #[test]
    fn guid_is_eui64_of_mac() {
        let g = Guid::from_mac([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
        assert_eq!(g.0, 0x5054_00ff_fe12_3456);
        assert_eq!(g.to_string(), "5054:00ff:fe12:3456");
    }

    #[test]
    fn pci_addr_round_trips_and_rejects_garbage() {
        let p: PciAddr = "0000:3b:00.1".parse().unwrap();
        assert_eq!(p, PciAddr::new(0, 0x3b, 0, 1));
        assert_eq!(p.to_string(), "0000:3b:00.1");
        for bad in [
            "",
            "0000:3b:00",
            "zz:00:00.0",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "00000:0:0.0",
        ] {
            assert!(bad.parse::<PciAddr>().is_err(), "{bad}");
        }
    }
}

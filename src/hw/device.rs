//! RDMA device enumeration and an opened device, over `sideway`.
//!
//! Verbs resources (context, PD, MR, CQ + completion channel, RC QP) are sideway objects; where
//! we need a raw handle (the context's `async_fd`, `ibv_req_notify_cq`, `ibv_get_cq_event`) we
//! take it from the `unsafe fn pd()/cq()/comp_channel()` accessors sideway provides and keep
//! the owning sideway object alive next to it.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePairType};
use sideway::ibverbs::AccessFlags;

use super::map;
use super::HwError;
use crate::hca::DeviceIdentity;
use crate::verbs::{Access, Guid, MemKey, PciAddr};

/// What enumeration tells about one RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HwDeviceInfo {
    /// Kernel name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Node GUID.
    pub guid: Guid,
    /// PCI function of the HCA, or of the NIC a software device is bound to.
    pub pci: Option<PciAddr>,
    /// The netdev a RoCE / software device is bound to.
    pub netdev: Option<String>,
}

impl HwDeviceInfo {
    /// The soft-HCA's identity type; devices with no PCI ancestor get `0000:00:00.0`.
    pub fn identity(&self) -> DeviceIdentity {
        DeviceIdentity {
            name: self.name.clone(),
            guid: self.guid,
            pci: self.pci.unwrap_or_default(),
        }
    }
}

impl fmt::Display for HwDeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} guid {}", self.name, self.guid)?;
        match self.pci {
            Some(p) => write!(f, " pci {p}")?,
            None => write!(f, " pci -")?,
        }
        if let Some(n) = &self.netdev {
            write!(f, " netdev {n}")?;
        }
        Ok(())
    }
}

/// Which device to use.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Selector {
    /// Whatever rdma_cm binds the target address to.
    #[default]
    Any,
    Guid(Guid),
    Pci(PciAddr),
    Name(String),
}

impl std::str::FromStr for Selector {
    type Err = String;
    /// `any`, `guid:<16 hex>` (colons allowed), `pci:<dddd:bb:dd.f>`, `name:<dev>`, or a bare
    /// device name.
    fn from_str(s: &str) -> Result<Selector, String> {
        if s == "any" || s.is_empty() {
            return Ok(Selector::Any);
        }
        if let Some(g) = s.strip_prefix("guid:") {
            return map::parse_guid(g)
                .map(Selector::Guid)
                .ok_or_else(|| format!("bad GUID {g:?}"));
        }
        if let Some(p) = s.strip_prefix("pci:") {
            return p
                .parse()
                .map(Selector::Pci)
                .map_err(|_| format!("bad PCI address {p:?}"));
        }
        Ok(Selector::Name(
            s.strip_prefix("name:").unwrap_or(s).to_string(),
        ))
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Any => write!(f, "any"),
            Selector::Guid(g) => write!(f, "guid:{g}"),
            Selector::Pci(p) => write!(f, "pci:{p}"),
            Selector::Name(n) => write!(f, "name:{n}"),
        }
    }
}

impl Selector {
    pub fn matches(&self, d: &HwDeviceInfo) -> bool {
        match self {
            Selector::Any => true,
            Selector::Guid(g) => d.guid == *g,
            Selector::Pci(p) => d.pci == Some(*p),
            Selector::Name(n) => d.name == *n,
        }
    }

    /// The first device of `devs` this selector names.
    pub fn select<'a>(&self, devs: &'a [HwDeviceInfo]) -> Option<&'a HwDeviceInfo> {
        devs.iter().find(|d| self.matches(d))
    }
}

/// List the RDMA devices libibverbs sees, with their GUID and PCI address.
///
/// A host without RDMA support (no `/sys/class/infiniband`, or libibverbs missing) yields
/// [`HwError::NoVerbs`]; a host with RDMA support but no device yields an empty list.
pub fn list_devices() -> Result<Vec<HwDeviceInfo>, HwError> {
    let list = DeviceList::new().map_err(|e| HwError::NoVerbs(std::io::Error::other(e)))?;
    let sys = Path::new("/sys");
    Ok(list
        .iter()
        .map(|d| {
            let name = d.name();
            let ib = sys.join("class/infiniband").join(&name);
            HwDeviceInfo {
                pci: map::pci_from_sysfs(sys, &name),
                netdev: map::netdev_of(&ib),
                guid: map::guid_from_be64(d.guid().as_u64()),
                name,
            }
        })
        .collect())
}

/// An opened device: context + one protection domain.
pub struct HwDevice {
    info: HwDeviceInfo,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
}

impl fmt::Debug for HwDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HwDevice")
            .field("info", &self.info)
            .finish()
    }
}

impl HwDevice {
    /// Open the device `sel` names.
    pub fn open(sel: &Selector) -> Result<HwDevice, HwError> {
        let devs = list_devices()?;
        let info = sel
            .select(&devs)
            .cloned()
            .ok_or_else(|| HwError::NoSuchDevice(sel.to_string()))?;
        Self::open_info(info)
    }

    /// Open the device described by `info` (found again by GUID).
    pub fn open_info(info: HwDeviceInfo) -> Result<HwDevice, HwError> {
        let list = DeviceList::new().map_err(|e| HwError::NoVerbs(std::io::Error::other(e)))?;
        let dev = list
            .iter()
            .find(|d| map::guid_from_be64(d.guid().as_u64()) == info.guid)
            .ok_or_else(|| HwError::NoSuchDevice(format!("guid:{}", info.guid)))?;
        let ctx = dev
            .open()
            .map_err(|e| HwError::sideway("ibv_open_device", e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| HwError::sideway("ibv_alloc_pd", e))?;
        Ok(HwDevice { info, pd, ctx })
    }

    pub fn info(&self) -> &HwDeviceInfo {
        &self.info
    }

    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.ctx
    }

    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The raw `ibv_context` (owned by `self.ctx`; valid while `self` lives).
    pub(crate) fn raw_context(&self) -> *mut rdma_mummy_sys::ibv_context {
        // SAFETY: sideway hands out the PD pointer it owns; `context` is set by ibv_alloc_pd.
        unsafe { (*self.pd.pd().as_ptr()).context }
    }

    /// Maximum RDMA READ depth the device supports as a responder (what a target may issue
    /// against our buffers at once).
    pub fn max_qp_rd_atom(&self) -> Result<u8, HwError> {
        let a = self
            .ctx
            .query_device()
            .map_err(|e| HwError::sideway("ibv_query_device", e))?;
        Ok(a.max_qp_rd_atom().clamp(0, 255) as u8)
    }

    /// Register `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// The memory must stay allocated, and not move, until the returned region is dropped.
    pub unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<HwMr, HwError> {
        let mr = self
            .pd
            .reg_mr(addr as usize, len, access_flags(access))
            .map_err(|e| HwError::sideway("ibv_reg_mr", e))?;
        Ok(HwMr { mr })
    }

    /// A CQ of `cqe` entries with its own completion channel (non-blocking fd).
    pub fn create_cq(&self, cqe: u32) -> Result<HwCq, HwError> {
        let chan = CompletionChannel::new(&self.ctx)
            .map_err(|e| HwError::sideway("ibv_create_comp_channel", e))?;
        chan.set_nonblocking(true)?;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe)
            .setup_comp_channel(&chan, 0)
            .build()
            .map_err(|e| HwError::sideway("ibv_create_cq", e))?;
        Ok(HwCq { cq, chan })
    }

    /// An RC QP in RESET with `cq` for both queues.
    pub fn create_rc_qp(
        &self,
        cq: &HwCq,
        max_send_wr: u32,
        max_recv_wr: u32,
    ) -> Result<BasicQueuePair, HwError> {
        self.create_rc_qp_sge(cq, max_send_wr, max_recv_wr, 1)
    }

    /// [`HwDevice::create_rc_qp`] with `max_sge` scatter/gather entries per work request.
    pub fn create_rc_qp_sge(
        &self,
        cq: &HwCq,
        max_send_wr: u32,
        max_recv_wr: u32,
        max_sge: u32,
    ) -> Result<BasicQueuePair, HwError> {
        self.pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(max_send_wr)
            .setup_max_recv_wr(max_recv_wr)
            .setup_max_send_sge(max_sge)
            .setup_max_recv_sge(max_sge)
            .setup_max_inline_data(0)
            .setup_send_cq(cq.cq.clone())
            .setup_recv_cq(cq.cq.clone())
            .build()
            .map_err(|e| HwError::sideway("ibv_create_qp", e))
    }
}

pub(crate) fn access_flags(a: Access) -> AccessFlags {
    let mut f = AccessFlags::none();
    let bits = map::access_bits(a);
    if bits & 1 != 0 {
        f |= AccessFlags::LocalWrite;
    }
    if bits & 2 != 0 {
        f |= AccessFlags::RemoteWrite;
    }
    if bits & 4 != 0 {
        f |= AccessFlags::RemoteRead;
    }
    if bits & 8 != 0 {
        f |= AccessFlags::RemoteAtomic;
    }
    f
}

/// A registered memory region.
pub struct HwMr {
    mr: Arc<MemoryRegion>,
}

impl HwMr {
    pub fn lkey(&self) -> MemKey {
        MemKey(self.mr.lkey())
    }
    pub fn rkey(&self) -> MemKey {
        MemKey(self.mr.rkey())
    }
}

/// A CQ and the completion channel it signals.
pub struct HwCq {
    pub(crate) cq: Arc<BasicCompletionQueue>,
    pub(crate) chan: Arc<CompletionChannel>,
}

impl HwCq {
    pub(crate) fn raw_cq(&self) -> *mut rdma_mummy_sys::ibv_cq {
        // SAFETY: the pointer stays valid while `self.cq` lives.
        unsafe { self.cq.cq().as_ptr() }
    }
    pub(crate) fn raw_channel(&self) -> *mut rdma_mummy_sys::ibv_comp_channel {
        // SAFETY: as above, owned by `self.chan`.
        unsafe { self.chan.comp_channel().as_ptr() }
    }
}

/// The GID index of the first RoCE v2 GID holding an IPv4-mapped address on port 1 of
/// `ibdev`, from sysfs under `sysfs` (ibverbs' own GID-type query panics in sideway on types
/// it does not know, so sysfs is read instead).
pub fn roce_v2_ipv4_gid(sysfs: &Path, ibdev: &str) -> Option<(u8, [u8; 16])> {
    let port = sysfs.join("class/infiniband").join(ibdev).join("ports/1");
    (0u8..=254).find_map(|i| {
        let ty = std::fs::read_to_string(port.join(format!("gid_attrs/types/{i}"))).ok()?;
        if ty.trim() != "RoCE v2" {
            return None;
        }
        let g = std::fs::read_to_string(port.join(format!("gids/{i}"))).ok()?;
        let ip: std::net::Ipv6Addr = g.trim().parse().ok()?;
        ip.to_ipv4_mapped().map(|_| (i, ip.octets()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, guid: u64, pci: Option<PciAddr>) -> HwDeviceInfo {
        HwDeviceInfo {
            name: name.into(),
            guid: Guid(guid),
            pci,
            netdev: None,
        }
    }

    #[test]
    fn selectors_parse_and_pick() {
        let devs = vec![
            dev(
                "mlx5_0",
                0x0c42_a103_00aa_bb01,
                Some(PciAddr::new(0, 0x3b, 0, 0)),
            ),
            dev(
                "mlx5_1",
                0x0c42_a103_00aa_bb02,
                Some(PciAddr::new(0, 0x3b, 0, 1)),
            ),
            dev("rxe0", 0x5054_00ff_fe12_3456, None),
        ];
        let pick = |s: &str| {
            s.parse::<Selector>()
                .unwrap()
                .select(&devs)
                .map(|d| d.name.clone())
        };
        assert_eq!(pick("any").as_deref(), Some("mlx5_0"));
        assert_eq!(pick("pci:0000:3b:00.1").as_deref(), Some("mlx5_1"));
        assert_eq!(pick("guid:505400fffe123456").as_deref(), Some("rxe0"));
        assert_eq!(pick("guid:0c42:a103:00aa:bb02").as_deref(), Some("mlx5_1"));
        assert_eq!(pick("rxe0").as_deref(), Some("rxe0"));
        assert_eq!(pick("name:mlx5_0").as_deref(), Some("mlx5_0"));
        assert_eq!(pick("pci:0000:99:00.0"), None);
        assert!("guid:xyz".parse::<Selector>().is_err());
        assert!("pci:nope".parse::<Selector>().is_err());
        assert_eq!(
            "guid:505400fffe123456"
                .parse::<Selector>()
                .unwrap()
                .to_string(),
            "guid:5054:00ff:fe12:3456"
        );
    }

    #[test]
    fn identity_carries_guid_and_pci() {
        let d = dev(
            "mlx5_0",
            0x0c42_a103_00aa_bb01,
            Some(PciAddr::new(0, 0x3b, 0, 0)),
        );
        let id = d.identity();
        assert_eq!(id.guid, Guid(0x0c42_a103_00aa_bb01));
        assert_eq!(id.pci, PciAddr::new(0, 0x3b, 0, 0));
        assert_eq!(dev("rxe0", 1, None).identity().pci, PciAddr::default());
    }

    #[test]
    fn access_flags_follow_access() {
        let f = access_flags(Access::LOCAL_WRITE | Access::REMOTE_READ);
        assert!(f.contains(AccessFlags::LocalWrite));
        assert!(f.contains(AccessFlags::RemoteRead));
        assert!(!f.contains(AccessFlags::RemoteWrite));
    }

    #[test]
    fn finds_the_roce_v2_ipv4_gid_in_sysfs() {
        let root = std::env::temp_dir().join(format!("nvmf-hw-gid-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let port = root.join("class/infiniband/rxe0/ports/1");
        std::fs::create_dir_all(port.join("gid_attrs/types")).unwrap();
        std::fs::create_dir_all(port.join("gids")).unwrap();
        let put = |i: u8, ty: &str, gid: &str| {
            std::fs::write(port.join(format!("gid_attrs/types/{i}")), format!("{ty}\n")).unwrap();
            std::fs::write(port.join(format!("gids/{i}")), format!("{gid}\n")).unwrap();
        };
        put(0, "RoCE v2", "fe80:0000:0000:0000:5054:00ff:fe12:3456");
        put(1, "IB/RoCE v1", "0000:0000:0000:0000:0000:ffff:0a00:020f");
        put(2, "RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:020f");
        let (i, gid) = roce_v2_ipv4_gid(&root, "rxe0").unwrap();
        assert_eq!(i, 2);
        assert_eq!(&gid[12..], &[10, 0, 2, 15]);
        assert_eq!(roce_v2_ipv4_gid(&root, "mlx5_0"), None);
        let _ = std::fs::remove_dir_all(&root);
    }
}

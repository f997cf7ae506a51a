//! Pure conversions between ibverbs / rdma_cm values and the seam's vocabulary, plus the
//! sysfs lookup of a device's PCI address. Nothing here touches a device, so all of it is
//! unit-tested on machines without RDMA.

use std::path::{Path, PathBuf};

use sideway::ibverbs::device_context::Mtu as IbMtu;

use crate::verbs::{Access, AsyncEvent, CqId, Guid, Mtu, PciAddr, Qpn, WcOpcode, WcStatus};

/// `ibv_access_flags` bits of an [`Access`] (the soft-HCA uses the same bit positions).
pub fn access_bits(a: Access) -> u32 {
    let mut bits = 0;
    if a.contains(Access::LOCAL_WRITE) {
        bits |= 1;
    }
    if a.contains(Access::REMOTE_WRITE) {
        bits |= 2;
    }
    if a.contains(Access::REMOTE_READ) {
        bits |= 4;
    }
    if a.contains(Access::REMOTE_ATOMIC) {
        bits |= 8;
    }
    bits
}

/// Our [`WcStatus`] for an `ibv_wc_status`. Statuses the soft-HCA has no name for (EEC,
/// memory-window, tag-matching, general errors) become [`WcStatus::FatalErr`]; the raw value
/// stays available to the caller.
pub fn wc_status(raw: u32) -> WcStatus {
    match raw {
        0 => WcStatus::Success,
        1 => WcStatus::LocLenErr,
        2 => WcStatus::LocQpOpErr,
        4 => WcStatus::LocProtErr,
        5 => WcStatus::WrFlushErr,
        7 => WcStatus::BadRespErr,
        8 => WcStatus::LocAccessErr,
        9 => WcStatus::RemInvReqErr,
        10 => WcStatus::RemAccessErr,
        11 => WcStatus::RemOpErr,
        12 => WcStatus::RetryExcErr,
        13 => WcStatus::RnrRetryExcErr,
        _ => WcStatus::FatalErr,
    }
}

/// Our [`WcOpcode`] for an `ibv_wc_opcode`; `None` for atomics, memory-window binds, local
/// invalidates and TSO, which the NVMe-oF host never posts.
pub fn wc_opcode(raw: u32) -> Option<WcOpcode> {
    match raw {
        0 => Some(WcOpcode::Send),
        1 => Some(WcOpcode::RdmaWrite),
        2 => Some(WcOpcode::RdmaRead),
        128 => Some(WcOpcode::Recv),
        129 => Some(WcOpcode::RecvRdmaWithImm),
        _ => None,
    }
}

/// Our [`Mtu`] for an `ibv_mtu` (what rdma_cm puts in a QP's path).
pub fn mtu_of(raw: u32) -> Mtu {
    match raw {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// sideway's name for an [`Mtu`].
pub fn ib_mtu(m: Mtu) -> IbMtu {
    match m {
        Mtu::Mtu256 => IbMtu::Mtu256,
        Mtu::Mtu512 => IbMtu::Mtu512,
        Mtu::Mtu1024 => IbMtu::Mtu1024,
        Mtu::Mtu2048 => IbMtu::Mtu2048,
        Mtu::Mtu4096 => IbMtu::Mtu4096,
    }
}

/// One asynchronous event of a hardware device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HwEvent {
    /// An event the soft-HCA also raises.
    Known(AsyncEvent),
    /// An event with no soft-HCA counterpart (LID/GID/PKEY change, COMM_EST, SQ drained, ...),
    /// by its ibverbs name.
    Other(&'static str),
}

/// Decode an `ibv_event_type` value. `qpn` is the QP number of QP events, `cq` a handle of the
/// CQ of CQ events. Unknown values (a newer libibverbs) are reported, not trusted.
pub fn async_event(raw: u32, qpn: u32, cq: u32) -> HwEvent {
    use HwEvent::{Known, Other};
    match raw {
        0 => Known(AsyncEvent::CqError(CqId(cq))),
        1 => Known(AsyncEvent::QpFatal(Qpn::new(qpn))),
        2 => Other("QP_REQ_ERR"),
        3 => Known(AsyncEvent::QpAccessError(Qpn::new(qpn))),
        4 => Other("COMM_EST"),
        5 => Other("SQ_DRAINED"),
        6 => Other("PATH_MIG"),
        7 => Other("PATH_MIG_ERR"),
        8 => Known(AsyncEvent::DeviceFatal),
        9 => Known(AsyncEvent::PortActive),
        10 => Known(AsyncEvent::PortError),
        11 => Other("LID_CHANGE"),
        12 => Other("PKEY_CHANGE"),
        13 => Other("SM_CHANGE"),
        14 => Other("SRQ_ERR"),
        15 => Other("SRQ_LIMIT_REACHED"),
        16 => Other("QP_LAST_WQE_REACHED"),
        17 => Other("CLIENT_REREGISTER"),
        18 => Other("GID_CHANGE"),
        19 => Other("WQ_FATAL"),
        20 => Other("DEVICE_SPEED_CHANGE"),
        _ => Other("UNKNOWN"),
    }
}

/// Whether `raw` is an ibverbs event type that carries a QP in its element union.
pub fn event_has_qp(raw: u32) -> bool {
    matches!(raw, 1..=7 | 16)
}

/// Whether `raw` is an ibverbs event type that carries a CQ in its element union.
pub fn event_has_cq(raw: u32) -> bool {
    raw == 0
}

/// The name of an `rdma_cm_event_type`.
pub fn cm_event_name(raw: u32) -> &'static str {
    match raw {
        0 => "ADDR_RESOLVED",
        1 => "ADDR_ERROR",
        2 => "ROUTE_RESOLVED",
        3 => "ROUTE_ERROR",
        4 => "CONNECT_REQUEST",
        5 => "CONNECT_RESPONSE",
        6 => "CONNECT_ERROR",
        7 => "UNREACHABLE",
        8 => "REJECTED",
        9 => "ESTABLISHED",
        10 => "DISCONNECTED",
        11 => "DEVICE_REMOVAL",
        12 => "MULTICAST_JOIN",
        13 => "MULTICAST_ERROR",
        14 => "ADDR_CHANGE",
        15 => "TIMEWAIT_EXIT",
        _ => "UNKNOWN",
    }
}

/// The soft-HCA event an rdma_cm event stands for: DEVICE_REMOVAL is how librdmacm reports a
/// hot-removed device (ibverbs has no event type for it).
pub fn cm_async_event(raw: u32) -> Option<AsyncEvent> {
    (raw == 11).then_some(AsyncEvent::DeviceRemoved)
}

/// A GUID as ibverbs hands it out (`__be64`: the bytes in wire order, read as a host integer).
pub fn guid_from_be64(raw: u64) -> Guid {
    Guid(u64::from_be(raw))
}

/// Parse a GUID in either `ibv_devices` form (`505400fffe123456`) or `ibv_devinfo` form
/// (`5054:00ff:fe12:3456`).
pub fn parse_guid(s: &str) -> Option<Guid> {
    let hex: String = s.chars().filter(|c| *c != ':').collect();
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(&hex, 16).ok().map(Guid)
}

/// The PCI address of RDMA device `ibdev`, read from sysfs under `sysfs` (normally `/sys`).
///
/// A PCI HCA has `class/infiniband/<dev>/device` pointing into the PCI tree. A software device
/// (rxe, siw) has none; its netdev (`parent`, or the first GID's ndev) is followed instead,
/// which finds the NIC it is bound to (for a virtio NIC, the PCI function above `virtioN`).
/// Returns `None` for devices with no PCI ancestor (loopback, a veth).
pub fn pci_from_sysfs(sysfs: &Path, ibdev: &str) -> Option<PciAddr> {
    let ib = sysfs.join("class/infiniband").join(ibdev);
    if let Some(p) = pci_ancestor(&ib.join("device")) {
        return Some(p);
    }
    let ndev = netdev_of(&ib)?;
    pci_ancestor(&sysfs.join("class/net").join(ndev).join("device"))
}

/// The netdev an RDMA device is bound to, from sysfs (`parent`, else port 1's GID 0 ndev).
pub fn netdev_of(ib: &Path) -> Option<String> {
    let read = |p: PathBuf| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    read(ib.join("parent")).or_else(|| read(ib.join("ports/1/gid_attrs/ndevs/0")))
}

fn pci_ancestor(link: &Path) -> Option<PciAddr> {
    let real = std::fs::canonicalize(link).ok()?;
    real.ancestors()
        .filter_map(|p| p.file_name()?.to_str()?.parse::<PciAddr>().ok())
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_bits_match_ibverbs() {
        assert_eq!(access_bits(Access::empty()), 0);
        assert_eq!(access_bits(Access::LOCAL_WRITE), 1);
        assert_eq!(
            access_bits(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ),
            7
        );
        assert_eq!(access_bits(Access::all()), 15);
    }

    #[test]
    fn wc_status_and_opcode_decode() {
        assert_eq!(wc_status(0), WcStatus::Success);
        assert_eq!(wc_status(5), WcStatus::WrFlushErr);
        assert_eq!(wc_status(12), WcStatus::RetryExcErr);
        assert_eq!(wc_status(13), WcStatus::RnrRetryExcErr);
        // EEC / MW / general errors have no soft-HCA name.
        assert_eq!(wc_status(3), WcStatus::FatalErr);
        assert_eq!(wc_status(21), WcStatus::FatalErr);
        assert_eq!(wc_status(u32::MAX), WcStatus::FatalErr);
        assert_eq!(wc_opcode(0), Some(WcOpcode::Send));
        assert_eq!(wc_opcode(2), Some(WcOpcode::RdmaRead));
        assert_eq!(wc_opcode(128), Some(WcOpcode::Recv));
        assert_eq!(wc_opcode(3), None);
    }

    #[test]
    fn async_events_decode() {
        assert_eq!(
            async_event(8, 0, 0),
            HwEvent::Known(AsyncEvent::DeviceFatal)
        );
        assert_eq!(async_event(10, 0, 0), HwEvent::Known(AsyncEvent::PortError));
        assert_eq!(async_event(9, 0, 0), HwEvent::Known(AsyncEvent::PortActive));
        assert_eq!(
            async_event(1, 0x11, 0),
            HwEvent::Known(AsyncEvent::QpFatal(Qpn::new(0x11)))
        );
        assert_eq!(
            async_event(0, 0, 7),
            HwEvent::Known(AsyncEvent::CqError(CqId(7)))
        );
        assert_eq!(async_event(18, 0, 0), HwEvent::Other("GID_CHANGE"));
        assert_eq!(async_event(999, 0, 0), HwEvent::Other("UNKNOWN"));
        assert!(event_has_qp(1) && event_has_qp(16) && !event_has_qp(8));
        assert!(event_has_cq(0) && !event_has_cq(1));
        assert_eq!(cm_async_event(11), Some(AsyncEvent::DeviceRemoved));
        assert_eq!(cm_async_event(10), None);
        assert_eq!(cm_event_name(8), "REJECTED");
    }

    #[test]
    fn guid_forms() {
        // rxe on 52:54:00:12:34:56: ibv_devices prints 505400fffe123456.
        let g = Guid::from_mac([0x52, 0x54, 0, 0x12, 0x34, 0x56]);
        assert_eq!(parse_guid("505400fffe123456"), Some(g));
        assert_eq!(parse_guid("5054:00ff:fe12:3456"), Some(g));
        assert_eq!(parse_guid("5054:00ff"), None);
        assert_eq!(parse_guid("zz5400fffe123456"), None);
        // ibverbs returns the GUID big-endian in memory.
        let raw = u64::from_ne_bytes(g.to_bytes());
        assert_eq!(guid_from_be64(raw), g);
    }

    fn fake_sysfs() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "nvmf-hw-sysfs-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn pci_of_a_pci_hca_and_of_rxe_on_virtio() {
        use std::os::unix::fs::symlink;
        let root = fake_sysfs();
        let mk = |p: &str| std::fs::create_dir_all(root.join(p)).unwrap();
        // mlx5_0 -> /sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.1
        mk("devices/pci0000:00/0000:00:01.0/0000:3b:00.1/infiniband/mlx5_0");
        mk("class/infiniband/mlx5_0");
        symlink(
            root.join("devices/pci0000:00/0000:00:01.0/0000:3b:00.1"),
            root.join("class/infiniband/mlx5_0/device"),
        )
        .unwrap();
        assert_eq!(
            pci_from_sysfs(&root, "mlx5_0"),
            Some(PciAddr::new(0, 0x3b, 0, 1))
        );
        // rxe0 bound to eth0, a virtio NIC at 0000:00:02.0.
        mk("devices/pci0000:00/0000:00:02.0/virtio0/net/eth0");
        mk("class/infiniband/rxe0/ports/1/gid_attrs/ndevs");
        std::fs::write(root.join("class/infiniband/rxe0/parent"), "eth0\n").unwrap();
        mk("class/net/eth0");
        symlink(
            root.join("devices/pci0000:00/0000:00:02.0/virtio0"),
            root.join("class/net/eth0/device"),
        )
        .unwrap();
        assert_eq!(
            pci_from_sysfs(&root, "rxe0"),
            Some(PciAddr::new(0, 0, 2, 0))
        );
        // Without `parent`, the first GID's ndev names the netdev.
        std::fs::remove_file(root.join("class/infiniband/rxe0/parent")).unwrap();
        std::fs::write(
            root.join("class/infiniband/rxe0/ports/1/gid_attrs/ndevs/0"),
            "eth0\n",
        )
        .unwrap();
        assert_eq!(
            pci_from_sysfs(&root, "rxe0"),
            Some(PciAddr::new(0, 0, 2, 0))
        );
        // A device on a netdev without a PCI parent (veth, lo) has no PCI address.
        mk("class/infiniband/rxe1");
        std::fs::write(root.join("class/infiniband/rxe1/parent"), "veth0").unwrap();
        mk("devices/virtual/net/veth0");
        mk("class/net/veth0");
        assert_eq!(pci_from_sysfs(&root, "rxe1"), None);
        assert_eq!(pci_from_sysfs(&root, "absent"), None);
        let _ = std::fs::remove_dir_all(&root);
    }
}

//! Which RDMA device the host runs on, as every front end spells it (`--device`, fio's
//! `device=`): the built-in soft-HCA (`soft`, the default) or a kernel RDMA device (rxe, an
//! RNIC) through the hw backend, named as `rdma link` shows it (`rxe0`), by node GUID
//! (`guid:<GUID>`) or by PCI address (`pci:<dddd:bb:dd.f>`).
//!
//! The same host (recovery included) runs on either: this module only picks the device
//! source of [`crate::verbs`].

use std::fmt;
use std::str::FromStr;

use crate::nvme::discovery::DiscoveryLogEntry;
use crate::transport::{ConnectOptions, Controller, HostError};

/// `--device`: the soft-HCA or a kernel RDMA device.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum DeviceChoice {
    /// The built-in soft RoCEv2 HCA over a UDP socket.
    #[default]
    Soft,
    /// A kernel RDMA device: a name, `guid:<GUID>` or `pci:<address>`.
    Kernel(String),
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<DeviceChoice, String> {
        match s {
            "" | "soft" => Ok(DeviceChoice::Soft),
            "any" => Err(
                "--device any is not a device: name one (rxe0), or guid:<GUID> or pci:<address>"
                    .into(),
            ),
            s if s.starts_with("guid:") || s.starts_with("pci:") || s.starts_with("name:") => {
                Ok(DeviceChoice::Kernel(s.to_string()))
            }
            s if !s.is_empty()
                && s.len() <= 64
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')) =>
            {
                Ok(DeviceChoice::Kernel(s.to_string()))
            }
            s => Err(format!(
                "{s:?} is not a device: soft, a kernel RDMA device name (rxe0), guid:<GUID> or \
                 pci:<address>"
            )),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Soft => f.write_str("soft"),
            DeviceChoice::Kernel(s) => f.write_str(s),
        }
    }
}

#[cfg(not(feature = "hw"))]
fn no_hw(sel: &str) -> HostError {
    HostError::Invalid(format!(
        "--device {sel}: this build has no kernel RDMA backend; rebuild with `--features hw`, \
         or leave --device out to use the soft-HCA"
    ))
}

/// Connect through the kernel RDMA device `sel`; the controller comes back through the same
/// device (by `o.policy.identity`) after it is removed and re-added.
pub async fn connect_kernel(sel: &str, o: ConnectOptions) -> Result<Controller, HostError> {
    #[cfg(feature = "hw")]
    {
        use crate::hw::backend::HwSource;
        HwSource::check(sel).map_err(|e| HostError::Connect(e.to_string()))?;
        Controller::connect_managed(HwSource::new(), sel, o).await
    }
    #[cfg(not(feature = "hw"))]
    {
        let _ = o;
        Err(no_hw(sel))
    }
}

/// Read the discovery log through the kernel RDMA device `sel`.
pub async fn discover_kernel(
    sel: &str,
    o: ConnectOptions,
) -> Result<Vec<DiscoveryLogEntry>, HostError> {
    #[cfg(feature = "hw")]
    {
        use crate::hw::backend::HwSource;
        use crate::verbs::DeviceSource;
        HwSource::check(sel).map_err(|e| HostError::Connect(e.to_string()))?;
        let src = HwSource::new();
        let opened = src
            .open(sel)
            .ok_or_else(|| HostError::Connect(format!("cannot open RDMA device {sel}")))?;
        let cm = src.cm(&opened.dev);
        crate::transport::discover(opened.dev, cm, o).await
    }
    #[cfg(not(feature = "hw"))]
    {
        let _ = o;
        Err(no_hw(sel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_soft_names_guids_and_pci() {
        assert_eq!("soft".parse(), Ok(DeviceChoice::Soft));
        assert_eq!("".parse(), Ok(DeviceChoice::Soft));
        assert_eq!("rxe0".parse(), Ok(DeviceChoice::Kernel("rxe0".into())));
        assert_eq!("mlx5_0".parse(), Ok(DeviceChoice::Kernel("mlx5_0".into())));
        assert_eq!(
            "guid:0250:56ff:fe01:0203".parse(),
            Ok(DeviceChoice::Kernel("guid:0250:56ff:fe01:0203".into()))
        );
        assert!("any".parse::<DeviceChoice>().is_err());
        assert!("rxe0; rm -rf /".parse::<DeviceChoice>().is_err());
        assert!("../x".parse::<DeviceChoice>().is_err());
    }
}

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
use crate::verbs::DeviceFaults;

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
        use crate::hw::source::HwSource;
        HwSource::check(sel).map_err(|e| HostError::Connect(e.to_string()))?;
        Controller::connect_managed(HwSource::new(), sel, o).await
    }
    #[cfg(not(feature = "hw"))]
    {
        let _ = o;
        Err(no_hw(sel))
    }
}

/// [`connect_kernel`] for chaos tools and tests: the device source is wrapped in a
/// [`FaultInjector`](crate::verbs::FaultInjector), and the handle that resets the device
/// under the controller comes back beside it.
pub async fn connect_kernel_with_faults(
    sel: &str,
    o: ConnectOptions,
) -> Result<(Controller, DeviceFaults), HostError> {
    #[cfg(feature = "hw")]
    {
        use crate::hw::source::HwSource;
        use crate::verbs::FaultInjector;
        HwSource::check(sel).map_err(|e| HostError::Connect(e.to_string()))?;
        let src = FaultInjector::new(HwSource::new());
        let c = Controller::connect_managed(src.clone(), sel, o).await?;
        Ok((c, src.device(sel)))
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
        use crate::hw::source::HwSource;
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

/// The built-in target on a kernel RDMA device (`target --device`).
pub struct KernelTarget {
    #[cfg(feature = "hw")]
    target: crate::nvmet::Target<crate::hw::context::HwContext>,
    #[cfg(feature = "hw")]
    source: crate::hw::source::HwSource,
    #[cfg(feature = "hw")]
    name: String,
}

/// Start the built-in target on the kernel RDMA device `sel`, listening through rdma_cm on
/// `cfg.advertise` (an address of the device's network interface) at `cfg.port`. The error
/// is one line saying what to do.
pub fn start_target_kernel(
    sel: &str,
    cfg: crate::nvmet::TargetConfig,
) -> Result<KernelTarget, String> {
    #[cfg(feature = "hw")]
    {
        use crate::hw::source::HwSource;
        use crate::nvmet::{serve_cm, Target};
        use crate::verbs::DeviceSource;
        let at = cfg.advertise.map(|a| a.ip());
        if at.is_none_or(|ip| ip.is_loopback() || ip.is_unspecified()) {
            return Err(format!(
                "--device {sel}: give --listen an IP address of {sel}'s network interface \
                 (rdma_cm listens there)"
            ));
        }
        HwSource::check(sel).map_err(|e| format!("--device {sel}: {e}"))?;
        let source = HwSource::new();
        let opened = source
            .open(sel)
            .ok_or_else(|| format!("--device {sel}: cannot open the RDMA device"))?;
        let cm = source.cm(&opened.dev);
        let target = Target::start(opened.dev, cfg)
            .map_err(|e| format!("--device {sel}: cannot set up the target: {e}"))?;
        serve_cm(target.clone(), cm).map_err(|e| format!("--device {sel}: {e}"))?;
        Ok(KernelTarget {
            target,
            source,
            name: sel.to_string(),
        })
    }
    #[cfg(not(feature = "hw"))]
    {
        let _ = cfg;
        Err(no_hw(sel).to_string())
    }
}

impl KernelTarget {
    pub fn stats(&self) -> crate::nvmet::TargetStats {
        #[cfg(feature = "hw")]
        {
            self.target.stats()
        }
        #[cfg(not(feature = "hw"))]
        {
            crate::nvmet::TargetStats::default()
        }
    }

    /// Wait until the device dies (fatal error or removal); says so in one line. The target
    /// does not come back with the device: its queues and controllers died with it, and
    /// hosts reconnect to whatever is started next.
    pub async fn died(&self) -> String {
        #[cfg(feature = "hw")]
        {
            use crate::verbs::{DeviceContext, DeviceSource, Lifecycle};
            let changed = self.source.changed();
            loop {
                let n = changed.notified();
                tokio::pin!(n);
                n.as_mut().enable();
                match self.target.device().lifecycle() {
                    Lifecycle::Live => n.await,
                    l => {
                        return format!(
                            "RDMA device {} is gone ({l:?}): the target stops; start it again \
                             once the device is back",
                            self.name
                        )
                    }
                }
            }
        }
        #[cfg(not(feature = "hw"))]
        {
            std::future::pending::<String>().await
        }
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

//! `nvmf-rdma hw ...`: diagnostics of kernel RDMA devices. The NVMe-oF commands themselves
//! take `--device` (see [`crate::cli::device`]).

use std::time::Duration;

use super::device::{list_devices, HwDevice, Selector};
use super::events::AsyncEvents;
use super::HwError;

#[derive(clap::Args, Debug)]
pub struct HwArgs {
    #[command(subcommand)]
    pub cmd: HwCmd,
}

#[derive(clap::Subcommand, Debug)]
pub enum HwCmd {
    /// List RDMA devices: name, node GUID, PCI address, netdev.
    List,
    /// Print a device's async events (DEVICE_FATAL, PORT_ERR, PORT_ACTIVE, GID_CHANGE, ...).
    Events {
        /// any, guid:<GUID>, pci:<dddd:bb:dd.f>, or a device name.
        #[arg(long, default_value = "any")]
        device: Selector,
        /// Stop after this many seconds.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
}

pub async fn run(a: HwArgs) -> Result<(), HwError> {
    match a.cmd {
        HwCmd::List => {
            let devs = list_devices()?;
            if devs.is_empty() {
                println!("no RDMA devices");
            }
            for d in devs {
                println!("{d}");
            }
            Ok(())
        }
        HwCmd::Events { device, seconds } => {
            let dev = HwDevice::open(&device)?;
            let ev = AsyncEvents::new(&dev)?;
            println!("watching {} for {seconds} s", dev.info());
            let until = tokio::time::Instant::now() + Duration::from_secs_f64(seconds.max(0.0));
            while let Ok(e) = tokio::time::timeout_at(until, ev.next()).await {
                println!("event: {:?}", e?);
            }
            Ok(())
        }
    }
}

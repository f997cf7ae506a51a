//! What a chaos run is asked to do, checked before it starts: the `chaos` command's flags,
//! resolved.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::cli::device::DeviceChoice;
use crate::reconnect::Policy;

/// Where the built-in target and the host's soft-HCA listen.
pub const CHAOS_IP: [u8; 4] = [127, 0, 0, 1];
/// The most samples a run keeps (a day at one a second fits).
const MAX_SAMPLES: f64 = 100_000.0;

/// A fault chaos can inflict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum FaultKind {
    Reset,
    Replug,
    ReplugOther,
    TargetRestart,
    UserReset,
}

impl FaultKind {
    pub const ALL: [FaultKind; 5] = [
        FaultKind::Reset,
        FaultKind::Replug,
        FaultKind::ReplugOther,
        FaultKind::TargetRestart,
        FaultKind::UserReset,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Reset => "reset",
            FaultKind::Replug => "replug",
            FaultKind::ReplugOther => "replug-other",
            FaultKind::TargetRestart => "target-restart",
            FaultKind::UserReset => "user-reset",
        }
    }
}

/// The faults chaos can inflict on a kernel RDMA device: a reset of our context of it (every
/// verbs object dropped as on DEVICE_FATAL, the device opened anew after the down time) and
/// the controller reset a user asks for. Unplugging one is `rdma link delete` (rxe) or a
/// PCI remove, done from outside.
pub const KERNEL_FAULTS: [FaultKind; 2] = [FaultKind::Reset, FaultKind::UserReset];

/// What to run: the `chaos` command's flags, resolved.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// RAM namespace size; with `traddr`, how much of that target's namespace 1 is used.
    pub size: usize,
    /// Another target instead of the built-in one, its service port and subsystem.
    pub traddr: Option<SocketAddr>,
    pub trsvcid: u16,
    pub nqn: Option<String>,
    /// The host's soft-HCA address towards `traddr`.
    pub host_traddr: Option<SocketAddr>,
    pub device: DeviceChoice,
    pub workers: u64,
    pub seconds: f64,
    /// Time between faults.
    pub every: Duration,
    /// Faults to pick from; empty: the default for the target and device.
    pub faults: Vec<FaultKind>,
    pub seed: u64,
    /// Longest time a reset or unplugged HCA stays away.
    pub down_max: Duration,
    pub nr_io_queues: usize,
    pub queue_size: usize,
    /// Largest I/O a worker issues, bytes.
    pub max_io: usize,
    pub policy: Policy,
    pub io_timeout: Duration,
    /// Sampling interval; `None`: [`ChaosConfig::sample_interval`]'s default.
    pub interval: Option<Duration>,
}

/// A seed from the clock, for a run not given one (it is printed, so the run can be
/// replayed).
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

impl ChaosConfig {
    /// `interval`, else a quarter of `every` within 100ms..=1s (a stall between two faults
    /// shows in the rate), longer only if the run would take more than [`MAX_SAMPLES`].
    pub fn sample_interval(&self) -> Duration {
        self.interval.unwrap_or_else(|| {
            (self.every / 4)
                .clamp(Duration::from_millis(100), Duration::from_secs(1))
                .max(Duration::from_secs_f64(self.seconds / MAX_SAMPLES))
        })
    }

    /// The faults to inflict: those given, else the default for the target and device
    /// (target-restart only where chaos runs the target; a kernel device cannot be
    /// unplugged from here).
    pub fn chosen_faults(&self) -> Vec<FaultKind> {
        let a = self;
        if !a.faults.is_empty() {
            a.faults.clone()
        } else if matches!(a.device, DeviceChoice::Kernel(_)) {
            KERNEL_FAULTS.to_vec()
        } else if a.traddr.is_some() {
            vec![FaultKind::Reset, FaultKind::Replug]
        } else {
            vec![
                FaultKind::Reset,
                FaultKind::Replug,
                FaultKind::TargetRestart,
            ]
        }
    }

    pub fn check(&self) -> Result<()> {
        let a = self;
        let faults = a.chosen_faults();
        if !(a.seconds > 0.0 && a.seconds <= 86_400.0) {
            bail!("--seconds must be more than 0 and at most 86400");
        }
        if a.every < Duration::from_millis(10) {
            bail!("--every must be at least 10ms");
        }
        let interval = a.sample_interval();
        if interval < Duration::from_millis(100) {
            bail!("--interval must be at least 100ms");
        }
        if a.seconds / interval.as_secs_f64() > MAX_SAMPLES {
            bail!(
                "--interval too short for --seconds: at most {MAX_SAMPLES} samples \
                 (--interval {}s or longer)",
                (a.seconds / MAX_SAMPLES).ceil()
            );
        }
        if a.down_max > Duration::from_secs(600) {
            bail!("--down-max must be at most 600s");
        }
        if a.traddr.is_some() && a.nqn.is_none() {
            bail!(
                "-a needs -n NQN: the subsystem to test on that target (`discover -a ADDR` lists them)"
            );
        }
        if a.traddr.is_some() && faults.contains(&FaultKind::TargetRestart) {
            bail!("--faults target-restart needs the built-in target (no --traddr)");
        }
        // (clap makes --device need --traddr: the built-in target of chaos is on the soft-HCA.)
        if let DeviceChoice::Kernel(d) = &a.device {
            if let Some(k) = faults.iter().find(|k| !KERNEL_FAULTS.contains(k)) {
                bail!(
                    "--faults {}: on kernel RDMA device {d} chaos can inflict reset and user-reset; \
                     unplug it from outside (rxe: `rdma link delete {d}`, then `rdma link add`)",
                    k.name()
                );
            }
        }
        if !(16..=1024).contains(&a.queue_size) {
            bail!("--queue-size must be between 16 and 1024");
        }
        if a.nr_io_queues == 0 || a.nr_io_queues > 64 {
            bail!("--nr-io-queues must be between 1 and 64");
        }
        if a.size > 16 << 30 {
            bail!("--size at most 16G (the namespace and the workers' models are in RAM)");
        }
        if (a.size / 512) < a.workers as usize * 8 {
            bail!("--size too small: each worker needs at least 8 blocks of 512 B");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use FaultKind::*;

    fn config() -> ChaosConfig {
        ChaosConfig {
            size: 256 << 20,
            traddr: None,
            trsvcid: 4420,
            nqn: None,
            host_traddr: None,
            device: DeviceChoice::Soft,
            workers: 8,
            seconds: 20.0,
            every: Duration::from_secs(2),
            faults: Vec::new(),
            seed: 1,
            down_max: Duration::from_millis(200),
            nr_io_queues: 2,
            queue_size: 128,
            max_io: 64 << 10,
            policy: Policy::default(),
            io_timeout: Duration::from_secs(30),
            interval: None,
        }
    }

    /// The default faults follow the target and the device; what a run cannot do is refused
    /// before it starts, naming the flag.
    #[test]
    fn a_run_is_checked_before_it_starts() {
        let c = config();
        assert_eq!(c.chosen_faults(), [Reset, Replug, TargetRestart]);
        assert!(c.check().is_ok());
        assert_eq!(c.sample_interval(), Duration::from_millis(500));
        let ext = ChaosConfig {
            traddr: Some("192.168.100.2:4791".parse().unwrap()),
            nqn: Some("nqn.x".into()),
            ..config()
        };
        assert_eq!(ext.chosen_faults(), [Reset, Replug]);
        assert!(ext.check().is_ok());
        let kernel = ChaosConfig {
            device: DeviceChoice::Kernel("rxe0".into()),
            ..ext.clone()
        };
        assert_eq!(kernel.chosen_faults(), KERNEL_FAULTS);
        assert!(kernel.check().is_ok());
        for (bad, want) in [
            (
                ChaosConfig {
                    faults: vec![TargetRestart],
                    ..ext.clone()
                },
                "needs the built-in target",
            ),
            (
                ChaosConfig {
                    nqn: None,
                    ..ext.clone()
                },
                "-a needs -n NQN",
            ),
            (
                ChaosConfig {
                    faults: vec![Reset, Replug],
                    ..kernel.clone()
                },
                "rdma link delete rxe0",
            ),
            (
                ChaosConfig {
                    every: Duration::from_millis(1),
                    ..config()
                },
                "--every",
            ),
            (
                ChaosConfig {
                    size: 4096,
                    ..config()
                },
                "--size too small",
            ),
            (
                ChaosConfig {
                    seconds: 86_400.0,
                    interval: Some(Duration::from_millis(100)),
                    ..config()
                },
                "--interval too short",
            ),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}

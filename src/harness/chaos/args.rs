//! The `chaos` command's flags and the run they ask for ([`ChaosArgs::config`]).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cli::args::{ExternalTarget, Format, PolicyArgs};
use crate::cli::support::parse_duration;
use crate::cli::units::parse_size;
use crate::harness::chaos::config::{ChaosConfig, FaultKind};

/// `nvmf-rdma chaos`'s flags.
#[derive(Args, Debug, Clone)]
pub struct ChaosArgs {
    /// RAM namespace size; the workers share it out. With --traddr: how much of the
    /// target's namespace 1 the workers use (from LBA 0; its data is overwritten).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub size: usize,
    #[command(flatten)]
    pub ext: ExternalTarget,
    /// Verifying workers, each on its own range of blocks.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub workers: u64,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// Time between faults (500ms, 2s, ...); a fault waits until the controller has been
    /// live again for at least half of it.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub every: Duration,
    /// Faults to inflict, picked at random: reset (HCA fatal error), replug (hot-remove and
    /// the same card back), replug-other (another card in the slot, then ours again),
    /// target-restart, user-reset (controller reset) [default: reset,replug,target-restart
    /// on the built-in target; reset,replug with --traddr; reset,user-reset with --device].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub faults: Vec<FaultKind>,
    /// Seed of the fault order and down times (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Longest time a reset or unplugged HCA stays away (each fault picks 0..=this).
    #[arg(long = "down-max", default_value = "200ms", value_parser = parse_duration)]
    pub down_max: Duration,
    /// I/O queues.
    #[arg(short = 'i', long = "nr-io-queues", default_value_t = 2)]
    pub nr_io_queues: usize,
    /// Entries per I/O queue (16..=1024).
    #[arg(short = 'Q', long = "queue-size", default_value_t = 128)]
    pub queue_size: usize,
    /// Largest I/O a worker issues (each picks 1 block..=this).
    #[arg(long = "max-io", default_value = "64K", value_parser = parse_size)]
    pub max_io: usize,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Sample the I/O rate and latency this often (at least 100ms) for the JSON summary's
    /// "series" and --plot [default: a quarter of --every, 100ms..=1s]. Given, each sample
    /// is also printed to stderr as it is taken.
    #[arg(long, value_parser = parse_duration)]
    pub interval: Option<Duration>,
    /// Draw the run into this SVG file: I/O rate and latency over time, each fault a marker
    /// labelled with its kind, the time until the controller was live again shaded.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    // With -o json, stdout holds the summary alone; progress goes to stderr.
    #[command(flatten)]
    pub format: Format,
}

impl ChaosArgs {
    /// The run these flags ask for; `seed` when none is given. Chaos has its own policy
    /// defaults: reconnect at once, give up after a minute.
    pub fn config(&self, seed: u64) -> ChaosConfig {
        let r = self
            .policy
            .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
        let mut c = ChaosConfig {
            size: self.size,
            traddr: self.ext.traddr,
            trsvcid: self.ext.trsvcid,
            nqn: self.ext.nqn.clone(),
            host_traddr: self.ext.host_traddr,
            device: self.ext.device.clone(),
            workers: self.workers,
            seconds: self.seconds,
            every: self.every,
            faults: self.faults.clone(),
            seed: self.seed.unwrap_or(seed),
            down_max: self.down_max,
            nr_io_queues: self.nr_io_queues,
            queue_size: self.queue_size,
            max_io: self.max_io,
            policy: r.policy,
            io_timeout: r.io_timeout,
            interval: self.interval,
        };
        c.faults = c.chosen_faults();
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::ListFormat;
    use crate::cli::support::Tmo;
    use crate::harness::chaos::config::KERNEL_FAULTS;
    use clap::Parser;

    #[derive(Parser)]
    struct Chaos {
        #[command(flatten)]
        args: ChaosArgs,
    }

    fn chaos_args(extra: &[&str]) -> Result<ChaosArgs, clap::Error> {
        let argv = std::iter::once("chaos").chain(extra.iter().copied());
        Ok(Chaos::try_parse_from(argv)?.args)
    }

    #[test]
    fn chaos_flags_and_defaults() {
        let a = chaos_args(&[]).unwrap();
        assert_eq!(
            (
                a.size,
                a.workers,
                a.seconds,
                a.every,
                a.down_max,
                a.seed,
                a.format.output
            ),
            (
                256 << 20,
                8,
                20.0,
                Duration::from_secs(2),
                Duration::from_millis(200),
                None,
                ListFormat::Normal
            )
        );
        // Chaos's policy defaults: reconnect at once, give up after a minute.
        let c = a.config(1);
        assert_eq!(c.policy.reconnect_delay, Duration::ZERO);
        assert_eq!(c.policy.ctrl_loss_tmo, Some(Duration::from_secs(60)));
        let a = chaos_args(&[
            "--faults",
            "replug-other,user-reset",
            "--every",
            "500ms",
            "--seed",
            "9",
            "-l",
            "-1",
            "-o",
            "json",
        ])
        .unwrap();
        assert_eq!(a.faults, [FaultKind::ReplugOther, FaultKind::UserReset]);
        assert_eq!((a.every, a.seed), (Duration::from_millis(500), Some(9)));
        assert_eq!(a.format.output, ListFormat::Json);
        assert_eq!(a.policy.ctrl_loss_tmo, Some(Tmo(None)));
        for bad in [
            &["--faults", "meteor"][..],
            &["--every", "soon"][..],
            &["--workers", "0"][..],
            &["-o", "xml"][..],
            // No built-in target on a kernel device: --device needs --traddr.
            &["--device", "rxe0", "--faults", "reset"][..],
        ] {
            assert!(chaos_args(bad).is_err(), "{bad:?}");
        }
    }

    /// The faults each place takes by default, and the run's checks (ChaosConfig::check) on
    /// what the flags ask for.
    #[test]
    fn chaos_faults_follow_the_target_and_the_device() {
        let ext = ["-a", "192.168.100.2", "-n", "nqn.x"];
        let rxe = ["--device", "rxe0", "-a", "192.168.100.2", "-n", "nqn.x"];
        let with = |a: &[&'static str], b: &[&'static str]| [a, b].concat();
        use FaultKind::*;
        for (args, faults) in [
            (vec![], vec![Reset, Replug, TargetRestart]),
            (ext.to_vec(), vec![Reset, Replug]),
            (rxe.to_vec(), KERNEL_FAULTS.to_vec()),
        ] {
            let c = chaos_args(&args).unwrap().config(1);
            assert_eq!(c.faults, faults, "{args:?}");
            assert!(c.check().is_ok(), "{args:?}");
        }
        for (args, want) in [
            (
                with(&ext, &["--faults", "target-restart"]),
                "needs the built-in target",
            ),
            (
                with(&rxe, &["--faults", "reset,replug"]),
                "rdma link delete rxe0",
            ),
            (vec!["--every", "1ms"], ""),
            (vec!["--size", "4K", "--workers", "8"], ""),
        ] {
            let e = chaos_args(&args).unwrap().config(1).check();
            assert!(e.is_err_and(|e| e.to_string().contains(want)), "{args:?}");
        }
        let ok = with(&rxe, &["--faults", "reset,user-reset"]);
        assert!(chaos_args(&ok).unwrap().config(1).check().is_ok());
    }
}

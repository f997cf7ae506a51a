//! The binary's own argument types: `daemon`'s flags and where `read`, `write` and `verify`
//! do their I/O.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
pub(crate) use nvmf_rdma::cli::args::*;
use nvmf_rdma::cli::support::parse_pos_secs;
pub(crate) use nvmf_rdma::cli::units::parse_size;

/// `daemon`.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct DaemonArgs {
    /// Start in the background and return once it serves its socket (and `--connect-all`
    /// is done); the log goes to RUN_DIR/daemon.log.
    #[arg(long)]
    pub(crate) background: bool,
    /// At start, connect what the config file lists (CONFIG_DIR/discovery.conf).
    #[arg(long)]
    pub(crate) connect_all: bool,
    /// Stop the running daemon (refused while an export is in use, unless --force) and wait
    /// until it is gone.
    #[arg(long, conflicts_with_all = ["background", "connect_all"])]
    pub(crate) stop: bool,
    /// With --stop: stop even if exports are in use (their users get I/O errors).
    #[arg(long, requires = "stop")]
    pub(crate) force: bool,
    /// Where the config file is [default: $NVMF_RDMA_CONFIG_DIR, else /etc/nvmf-rdma].
    #[arg(long, value_name = "DIR")]
    pub(crate) config_dir: Option<PathBuf>,
    /// Seconds a control-socket client has to send each request line [default: 30].
    #[arg(long, value_name = "SECS", value_parser = parse_pos_secs, hide = true)]
    pub(crate) client_timeout: Option<u64>,
}

/// Where `read`, `write` and `verify` do their I/O: on a controller the daemon holds (`-d`,
/// the name `connect` printed, as nvme-cli names a device), or on one of their own made
/// with the fabrics flags (`-a`, `-n`, ...) and dropped at the end.
#[derive(Debug, Clone)]
pub(crate) struct IoAt {
    /// The daemon's controller (`-d nvmf0`).
    pub(crate) controller: Option<String>,
    /// The fabrics flags, when no `-d` is given.
    pub(crate) sub: Option<Subsys>,
    /// `--nsid` (with `-d` too).
    pub(crate) nsid: u32,
}

const CONTROLLER_ARG: &str = "controller";

impl clap::FromArgMatches for IoAt {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let controller = m.get_one::<String>(CONTROLLER_ARG).cloned();
        let nsid = m.get_one::<u32>("nsid").copied().unwrap_or(1);
        // Without -d, -a and -n are required (clap checked it): the flags make a Subsys.
        let sub = if controller.is_none() {
            Some(Subsys::from_arg_matches(m)?)
        } else {
            None
        };
        Ok(IoAt {
            controller,
            sub,
            nsid,
        })
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl clap::Args for IoAt {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let cmd = Subsys::augment_args(cmd)
            .mut_arg("traddr", |a| a.required(false).requires("nqn"))
            .mut_arg("nqn", |a| a.required(false).requires("traddr"));
        cmd.arg(
            clap::Arg::new(CONTROLLER_ARG)
                .short('d')
                .long(CONTROLLER_ARG)
                .value_name("NAME")
                .help(
                    "A controller the daemon holds, by the name `connect` printed (nvmf0); \
                     without it, -a and -n connect a controller of this command's own",
                )
                .conflicts_with_all(["traddr", "nqn"])
                .required_unless_present_all(["traddr", "nqn"]),
        )
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

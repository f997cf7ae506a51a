//! nvmf-rdma command line, following nvme-cli where it has a name for a thing.

mod args;
mod chaos;
mod client;
mod connect;
mod daemon;
mod demo;
mod io;
mod manpage;
mod sdnotify;
mod signals;
mod target;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::{args::*, chaos::*, client::*, connect::*, daemon::*, demo::*, io::*, target::*};
use anyhow::Context;
use anyhow::{bail, Result};
use clap::{CommandFactory, Parser, Subcommand};
use nvmf_rdma::cli::metrics_http;
use nvmf_rdma::cli::support::{error_line, lock_all_memory, parse_duration};
use nvmf_rdma::cli::target::{TargetAnaSet, TargetArgs, TargetNsAdd};
use nvmf_rdma::harness::bench::{run_bench, BenchArgs};
use nvmf_rdma::harness::chaos::args::ChaosArgs;
use nvmf_rdma::harness::hca_perf;

#[derive(Parser)]
#[command(
    name = "nvmf-rdma",
    version,
    about = "User-space NVMe-over-RDMA initiator with its own soft RoCEv2 HCA"
)]
struct Cli {
    /// Serve Prometheus metrics (controller state, reconnects, recoveries, recovery time,
    /// device counters) over HTTP at IP:PORT, e.g. 127.0.0.1:9464; for connect, chaos, demo
    /// and target.
    #[arg(long, global = true, value_name = "IP:PORT")]
    metrics_addr: Option<SocketAddr>,
    /// Lock all of the process's memory, now and future (mlockall), so the I/O and recovery
    /// paths never wait on a page fault. Needs RLIMIT_MEMLOCK (ulimit -l) large enough, or
    /// CAP_IPC_LOCK.
    #[arg(long, global = true)]
    mlock: bool,
    /// After packets move, keep polling the soft-HCA's socket this long before sleeping
    /// (0 turns it off). Waking a sleeping thread is most of a queue-depth-1 round trip on a
    /// virtual machine; polling costs a core while I/O flows and nothing once it stops.
    #[arg(long, global = true, default_value = "50us", value_parser = parse_duration, value_name = "TIME")]
    busy_poll: Duration,
    /// Stop busy polling for a while whenever the polling thread is preempted, so it does
    /// not hold a core the application (or the target) needs: less CPU per I/O on
    /// oversubscribed cores, fewer IOPS when the cores are free (see docs/performance.md).
    #[arg(long, global = true)]
    busy_poll_gate: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

impl Cli {
    /// Start what the global options ask for, before any device or controller exists.
    fn setup(&self) -> Result<()> {
        nvmf_rdma::driver::set_default_busy_poll(self.busy_poll);
        nvmf_rdma::driver::set_busy_poll_gate(self.busy_poll_gate);
        if self.mlock {
            match lock_all_memory().map_err(anyhow::Error::msg)? {
                None => tracing::debug!("memory locked"),
                Some(limit) => eprintln!(
                    "--mlock: memory locked up to RLIMIT_MEMLOCK ({}); allocations past it \
                     will fail (ulimit -l unlimited lifts it)",
                    hca_perf::human(limit.min(usize::MAX as u64) as usize)
                ),
            }
        }
        if let Some(addr) = self.metrics_addr {
            if matches!(&self.cmd, Cmd::Connect { mode, .. } if !mode.foreground) {
                bail!(
                    "--metrics-addr serves this process's controllers: give it to \
                     `nvmf-rdma daemon` (or use connect --foreground)"
                );
            }
            if !matches!(
                self.cmd,
                Cmd::Connect { .. }
                    | Cmd::Chaos(_)
                    | Cmd::Demo { .. }
                    | Cmd::Target(_)
                    | Cmd::Daemon(_)
            ) {
                bail!("--metrics-addr is for connect, daemon, chaos, demo and target");
            }
            metrics_http::install(addr)?;
            eprintln!("metrics: http://{addr}/metrics");
        }
        Ok(())
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the built-in target in-process, connect to it, write and verify a pattern, and
    /// print IOPS and latency.
    Demo {
        /// Bytes to write and verify, e.g. 64M.
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        size: usize,
        /// Seconds of 4 KiB random reads at QD32 after the verify.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
    },
    /// Soft-HCA only: RDMA WRITE a pattern between two devices, READ it back, verify.
    HcaDemo {
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        size: usize,
        #[arg(long, default_value = "128K", value_parser = parse_size)]
        chunk: usize,
    },
    /// Benchmark tables over loopback: NVMe-oF (default) or the raw soft-HCA (--hca). With
    /// --traddr: 4 KiB random reads at QD1 and QD32 and 128 KiB sequential reads at QD16 on
    /// namespace 1 of that target.
    Bench(BenchArgs),
    /// Run the built-in NVMe-oF target until interrupted.
    Target(TargetArgs),
    /// Add a namespace to a running `target --control SOCKET` (its hosts get a Namespace
    /// Attribute Changed event; the daemon rescans and exports it).
    #[command(subcommand)]
    TargetNs(TargetNsCmd),
    /// ANA groups of a running `target --control SOCKET`: set one's state through a port
    /// (its hosts get an ANA change event), or show every port's.
    #[command(subcommand)]
    TargetAna(TargetAnaCmd),
    /// Hardware verbs backend (built with `--features hw`): kernel RDMA devices through
    /// libibverbs/librdmacm instead of the soft-HCA.
    #[cfg(feature = "hw")]
    Hw(nvmf_rdma::hw::cli::HwArgs),
    /// Ask a discovery controller which subsystems it offers.
    Discover {
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        format: Format,
    },
    /// Run the daemon that owns controllers, their recovery and their exports (foreground,
    /// for systemd with sd_notify; or --background). The other commands talk to it over
    /// RUN_DIR/daemon.sock (docs/control-protocol.md).
    Daemon(DaemonArgs),
    /// Connect to a subsystem through the daemon (started in the background if none runs);
    /// returns once the controller is live and its exports are ready, and prints its name.
    /// With --foreground: hold it in this process instead, until a stop signal or
    /// `disconnect`.
    Connect {
        #[command(flatten)]
        sub: Subsys,
        #[command(flatten)]
        export: ExportArgs,
        #[command(flatten)]
        mode: ConnectMode,
    },
    /// Connect every subsystem a discovery controller lists (-a), or, without -a, what the
    /// daemon's config file lists (CONFIG_DIR/discovery.conf).
    ConnectAll(ConnectAllArgs),
    /// List the controllers (the daemon's and those held by `connect --foreground`).
    List(Format),
    /// List subsystems and the controllers (paths) to each.
    ListSubsys(Format),
    /// Disconnect controllers by NQN or name. Refused while an export is in use (a loop
    /// device on the FUSE file, an open file, NBD clients), naming what holds it.
    Disconnect {
        /// By subsystem NQN.
        #[arg(short = 'n', long = "nqn")]
        nqn: Option<String>,
        /// By controller name (from `list`).
        #[arg(short = 'd', long = "device")]
        device: Option<String>,
        /// Disconnect even if an export is in use (its users get I/O errors).
        #[arg(long)]
        force: bool,
    },
    /// Disconnect every controller; refused while any export is in use.
    DisconnectAll {
        /// Disconnect even if exports are in use.
        #[arg(long)]
        force: bool,
    },
    /// Write the man pages (nvmf-rdma.1 and one per subcommand) into DIR.
    Man {
        #[arg(long, value_name = "DIR", default_value = ".")]
        dir: PathBuf,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Read blocks: the raw bytes on stdout, into a file (--output), or a hex dump (--hex).
    /// `-d nvmf0` reads through the daemon's controller; -a/-n connect one for this command.
    Read {
        #[command(flatten)]
        at: IoAt,
        #[arg(long, default_value_t = 0)]
        lba: u64,
        #[arg(long, value_parser = parse_size)]
        size: usize,
        /// Where the data goes: a file, or `-` for stdout (the default).
        #[arg(long)]
        output: Option<PathBuf>,
        /// A hex dump on stdout instead of the raw bytes.
        #[arg(long)]
        hex: bool,
    },
    /// Write a file, or a repeated byte, at a block address (`-d nvmf0`: through the
    /// daemon's controller).
    Write {
        #[command(flatten)]
        at: IoAt,
        #[arg(long, default_value_t = 0)]
        lba: u64,
        #[arg(long, value_parser = parse_size)]
        size: Option<usize>,
        #[arg(long)]
        input: Option<PathBuf>,
        /// Byte to fill with when no --input is given.
        #[arg(long, default_value_t = 0)]
        pattern: u8,
    },
    /// Write random data over a range, read it back and compare, with progress (`-d nvmf0`:
    /// the daemon does it on its controller).
    Verify {
        #[command(flatten)]
        at: IoAt,
        #[arg(long, default_value_t = 0)]
        lba: u64,
        #[arg(long, value_parser = parse_size)]
        size: usize,
        #[arg(long, default_value = "128K", value_parser = parse_size)]
        chunk: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Chaos on loopback, no setup: a built-in RAM target and a host whose HCA is reset,
    /// unplugged and re-plugged (or replaced by another card), the target restarted, the
    /// controller reset, while workers write and verify. Prints what survived. With
    /// --traddr, against another target: only host-side faults are made (not
    /// target-restart); faults on the target side are yours to make. With -o json, stdout
    /// holds the summary alone; progress goes to stderr.
    Chaos(ChaosArgs),
    /// Print the RC QP state transition table (or a Graphviz graph with --dot).
    QpStates {
        #[arg(long)]
        dot: bool,
    },
}

#[derive(Subcommand)]
enum TargetAnaCmd {
    /// Set an ANA group's state through a port.
    Set(TargetAnaSet),
    /// Each port, its address and its ANA groups' states.
    Status {
        /// The target's control socket (its --control).
        #[arg(long, value_name = "SOCKET")]
        control: PathBuf,
    },
}

#[derive(Subcommand)]
enum TargetNsCmd {
    /// Add a RAM or file namespace.
    Add(TargetNsAdd),
}

/// Errors end the process with one line: what failed and why, outermost first, each cause
/// once, never Debug text or a backtrace.
fn main() -> std::process::ExitCode {
    quiet_on_closed_stdout();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if reader_went_away(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvmf-rdma: {}", error_line(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

/// A reader that stops reading (`| head -1`) ends the command quietly, as it ends `cat`: the
/// output nobody reads is not an error. `print!` panics when stdout is a closed pipe; this
/// hook turns exactly that panic into exit 0 and leaves every other panic as it was.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("os error 32") {
            std::process::exit(0);
        }
        default(info)
    }));
}

/// An error whose cause is a write to a closed pipe (`writeln!` to stdout under `| head`).
fn reader_went_away(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    // RUST_LOG decides when set; otherwise the target logs its hosts (connect, disconnect,
    // keep-alive expiry), the soft-HCA driver its warnings (a device facing RoCEv2 peers
    // without the raw socket for ICRC checks) and everything else only errors.
    let filter = match std::env::var_os("RUST_LOG") {
        None if matches!(cli.cmd, Cmd::Target(_)) => {
            tracing_subscriber::EnvFilter::new("error,nvmf_rdma::driver=warn,nvmf_rdma::nvmet=info")
        }
        None => tracing_subscriber::EnvFilter::new("error,nvmf_rdma::driver=warn"),
        Some(_) => tracing_subscriber::EnvFilter::from_default_env(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    cli.setup()?;
    // What a daemon started from here inherits of the global options.
    let mut global = vec![format!("--busy-poll={}us", cli.busy_poll.as_micros())];
    if cli.mlock {
        global.push("--mlock".into());
    }
    if cli.busy_poll_gate {
        global.push("--busy-poll-gate".into());
    }
    match cli.cmd {
        Cmd::Demo { size, seconds } => demo(size, seconds),
        Cmd::HcaDemo { size, chunk } => hca_demo(size, chunk),
        Cmd::Bench(a) => run_bench(a),
        Cmd::QpStates { dot } => {
            if dot {
                print!("{}", nvmf_rdma::hca::qp::state::dot());
            } else {
                print!("{}", nvmf_rdma::hca::qp::state::describe());
            }
            Ok(())
        }
        Cmd::Daemon(a) => run_daemon(a, global),
        Cmd::Man { dir } => write_man_pages(&dir),
        Cmd::Completions { shell } => {
            use std::io::Write;
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "nvmf-rdma", &mut out);
            let mut so = std::io::stdout().lock();
            // A closed pipe (`| head`) is the reader's choice, not an error to report.
            match so.write_all(&out).and_then(|_| so.flush()) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                r => r.context("write to stdout"),
            }
        }
        cmd => {
            let workers = match &cmd {
                Cmd::Target(t) => usize::from(t.threads),
                _ => 2,
            };
            let mut rt = if workers == 1 {
                tokio::runtime::Builder::new_current_thread()
            } else {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(workers);
                b
            };
            rt.enable_all().build()?.block_on(run_async(cmd, global))
        }
    }
}

async fn run_async(cmd: Cmd, global: Vec<String>) -> Result<()> {
    match cmd {
        Cmd::Target(t) => run_target(t).await,
        Cmd::TargetNs(TargetNsCmd::Add(a)) => run_target_ns_add(a).await,
        Cmd::TargetAna(TargetAnaCmd::Set(a)) => run_target_ana_set(a).await,
        Cmd::TargetAna(TargetAnaCmd::Status { control }) => run_target_ana_status(&control).await,
        #[cfg(feature = "hw")]
        Cmd::Hw(a) => Ok(nvmf_rdma::hw::cli::run(a).await?),
        Cmd::Discover { fabric, format } => run_discover(fabric, format.output).await,
        Cmd::Connect { sub, export, mode } => {
            if mode.foreground {
                run_connect(sub, export).await
            } else {
                run_connect_daemon(sub, export, mode, global).await
            }
        }
        Cmd::ConnectAll(a) => {
            let output = a.format.output;
            run_connect_all(a.into_subsys(), output, global).await
        }
        Cmd::ListSubsys(f) => run_list_subsys(f.output).await,
        Cmd::DisconnectAll { force } => run_disconnect_all(force).await,
        Cmd::Chaos(a) => run_chaos(a).await,
        Cmd::List(f) => run_list(f.output).await,
        Cmd::Disconnect { nqn, device, force } => run_disconnect(nqn, device, force).await,
        Cmd::Read {
            at,
            lba,
            size,
            output,
            hex,
        } => run_read(at, lba, size, output, hex).await,
        Cmd::Write {
            at,
            lba,
            size,
            input,
            pattern,
        } => run_write(at, lba, size, input, pattern).await,
        Cmd::Verify {
            at,
            lba,
            size,
            chunk,
            seed,
        } => run_verify(at, lba, size, chunk, seed).await,
        _ => unreachable!("handled synchronously"),
    }
}

/// `man`: nvmf-rdma.1 and nvmf-rdma-SUBCOMMAND.1 for each subcommand.
fn write_man_pages(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let cmd = Cli::command();
    let mut n = 0;
    let mut write = |name: String, c: clap::Command| -> Result<()> {
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(c).render(&mut out)?;
        let command = name.strip_prefix("nvmf-rdma-").unwrap_or(&name);
        out.extend_from_slice(manpage::extra_sections(command).as_bytes());
        std::fs::write(&path, out).with_context(|| format!("write {}", path.display()))?;
        n += 1;
        Ok(())
    };
    write("nvmf-rdma".into(), cmd.clone())?;
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let name = format!("nvmf-rdma-{}", sub.get_name());
        // A one-shot command: the few leaked names live as long as the process anyway.
        let leaked: &'static str = Box::leak(name.clone().into_boxed_str());
        write(name, sub.clone().name(leaked))?;
    }
    println!("wrote {n} man pages to {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests;

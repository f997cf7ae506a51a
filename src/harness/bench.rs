//! The `bench` command: the built-in NVMe-oF table, the raw soft-HCA table (in this process
//! or against a responder process), or fio's jobs against another target, shown as rows
//! while each job runs and a table (or JSON lines) at the end.

use std::time::Duration;

use anyhow::{bail, Result};

use crate::cli::args::{ExternalTarget, Fabric, ListFormat, PolicyArgs, Queues, Subsys};
use crate::cli::support::parse_duration;
use crate::cli::units::parse_size;
use crate::harness::hca_peer;
use crate::harness::hca_perf;
use crate::harness::nvmf_perf::{self, JobResult, Tick, DEMO_NQN};

/// `nvmf-rdma bench`'s flags.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Seconds per row.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// The raw soft-HCA table instead of NVMe-oF: RDMA WRITE, RDMA READ and SEND between two
    /// soft-HCA devices of this process, at the sizes and depths the NVMe-oF table's data
    /// takes.
    #[arg(long)]
    hca: bool,
    /// With --hca: the requester's side of the messages moves through this much memory
    /// (an RDMA READ's data lands there, a WRITE's leaves from there), e.g. 1G, the size
    /// of bench's RAM namespace; by default it is depth x message size, which stays in
    /// the CPU's caches.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    region: Option<usize>,
    /// With --hca: the responder in a process of its own (this program, started for each
    /// row), so that every packet crosses a UDP socket on 127.0.0.1, as between a host and
    /// a target of their own: RDMA WRITE and READ at 128 KiB and 4 KiB, each with UDP
    /// GSO/GRO on and off, with packets per second and per CPU-second of each side.
    #[arg(long)]
    peer_process: bool,
    /// The responder of --peer-process: reads the requester's line on stdin, answers on
    /// stdout, serves until stdin closes.
    #[arg(long, hide = true)]
    serve_peer: bool,
    /// I/O queues for the NVMe-oF table.
    #[arg(long, default_value_t = 1)]
    queues: usize,
    /// Run only this row of the NVMe-oF table (repeatable): randread-4k-qd1,
    /// randread-4k-qd32, randwrite-4k-qd1, randwrite-4k-qd32, read-128k-qd8, write-128k-qd8.
    #[arg(long = "job", value_name = "NAME")]
    pub jobs: Vec<String>,
    #[command(flatten)]
    ext: ExternalTarget,
    /// A row per interval while each job runs (then the summary table).
    #[arg(long, default_value = "1s", value_parser = parse_duration, value_name = "TIME")]
    interval: Duration,
    /// normal, or json: one object per line, `"type":"interval"` while a job runs and
    /// `"type":"result"` per job at the end; with --hca, `"type":"hca"` per row.
    #[arg(
        short = 'o',
        long = "output-format",
        value_enum,
        default_value = "normal"
    )]
    output: ListFormat,
}

/// How `bench` shows its rows: a line per interval while a job runs, then the table (or one
/// JSON object per line for both).
struct Rows {
    interval: Duration,
    output: ListFormat,
}

impl Rows {
    /// One interval of a running job, at once (stdout is flushed: a pipe sees it now).
    fn tick(&self, t: &Tick) {
        use std::io::Write;
        let line = if self.output == ListFormat::Json {
            serde_json::json!({
                "type": "interval", "job": t.job.name(), "t_s": secs(t.at),
                "iops": t.iops().round(), "mbps": (t.mbps() * 10.0).round() / 10.0,
                "errors": t.errors,
            })
            .to_string()
        } else {
            format!(
                "{:<18} {:>6.1} s {:>10.0} IOPS {:>9.1} MB/s{}",
                t.job.name(),
                t.at.as_secs_f64(),
                t.iops(),
                t.mbps(),
                if t.errors > 0 {
                    format!(" {} errors", t.errors)
                } else {
                    String::new()
                }
            )
        };
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}").and_then(|_| out.flush());
    }

    /// The summary: today's table, or a `result` object per job; `path`: how the packets
    /// went (`loopback`, `udp`, or `remote` for --traddr).
    fn summary(&self, rows: &[JobResult], path: &str) {
        if self.output != ListFormat::Json {
            nvmf_perf::print_results(rows);
            return;
        }
        for r in rows {
            println!(
                "{}",
                serde_json::json!({
                    "type": "result", "job": r.job.name(), "rw": r.job.pattern.name(),
                    "bs": r.job.bs, "qd": r.job.iodepth, "seconds": secs(r.elapsed),
                    "ios": r.ios, "iops": r.iops().round(), "mbps": (r.mbps() * 10.0).round() / 10.0,
                    "p50_us": secs(r.p50) * 1e6, "p99_us": secs(r.p99) * 1e6, "errors": r.errors,
                    "copies_per_io": (r.copies_per_io * 100.0).round() / 100.0,
                    "target_copies_per_io": r.target_copies_per_io, "path": path,
                })
            );
        }
    }
}

/// One row of the raw soft-HCA table as a `"type":"hca"` object (`bench --hca -o json`).
fn hca_json(r: &hca_perf::Report) -> serde_json::Value {
    serde_json::json!({
        "type": "hca", "op": r.workload.op.name(), "bytes": r.workload.msg_size,
        "depth": r.workload.depth, "seconds": secs(r.elapsed), "messages": r.messages,
        "gbps": (r.gbytes_per_sec() * 1e4).round() / 1e4, "msgs_per_s": r.msgs_per_sec().round(),
        "retransmits": r.retransmits, "region": r.workload.region,
    })
}

/// `bench --hca --peer-process`: each row against a responder in a child process; the
/// requester's side of the messages moves through `region` bytes (0: depth x size).
fn peer_table(duration: Duration, region: usize, show: &Rows) -> Result<()> {
    let exe = std::env::current_exe()?;
    let busy_poll = crate::driver::default_busy_poll();
    if show.output != ListFormat::Json {
        println!(
            "responder in another process: every packet through UDP sockets on 127.0.0.1; \
             CPU s: each process's user + system time for the row (set-up included)"
        );
        if region > 0 {
            println!(
                "requester's side of the messages through {} of memory",
                hca_perf::human(region)
            );
        }
        println!(
            "{:<11} {:>9} {:>6} {:>8} {:>8} {:>10} {:>12} {:>8} {:>8} {:>13} {:>13}",
            "op",
            "msg size",
            "depth",
            "GSO/GRO",
            "GB/s",
            "msgs/s",
            "packets/s",
            "req CPU",
            "rsp CPU",
            "req pkts/CPU",
            "rsp pkts/CPU"
        );
    }
    for (w, offload) in hca_peer::peer_workloads(duration, region) {
        let mut responder = std::process::Command::new(&exe);
        responder
            .arg(format!("--busy-poll={}us", busy_poll.as_micros()))
            .args(["bench", "--serve-peer"]);
        let row = hca_peer::run_peer_row(&mut responder, w, offload)?;
        let (r, req_cpu, rsp_cpu) = (&row.report, row.requester_cpu, row.responder_cpu);
        let per_cpu = |cpu: f64| r.packets as f64 / cpu.max(1e-9);
        if show.output == ListFormat::Json {
            let mut v = hca_json(r);
            v["path"] = "udp-two-process".into();
            v["offload"] = offload.into();
            v["packets"] = r.packets.into();
            v["packets_per_s"] = r.packets_per_sec().round().into();
            v["requester_cpu_s"] = ((req_cpu * 1e4).round() / 1e4).into();
            v["responder_cpu_s"] = ((rsp_cpu * 1e4).round() / 1e4).into();
            println!("{v}");
        } else {
            println!(
                    "{:<11} {:>9} {:>6} {:>8} {:>8.3} {:>10.0} {:>12.0} {:>8.2} {:>8.2} {:>13.0} {:>13.0}",
                    w.op.name(),
                    hca_perf::human(w.msg_size),
                    w.depth,
                    if offload { "on" } else { "off" },
                    r.gbytes_per_sec(),
                    r.msgs_per_sec(),
                    r.packets_per_sec(),
                    req_cpu,
                    rsp_cpu,
                    per_cpu(req_cpu),
                    per_cpu(rsp_cpu),
                );
        }
    }
    Ok(())
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e6
}

/// `bench --traddr`: the fio jobs of `tests/vm/run.sh bench` through our host.
fn remote_bench(sub: &Subsys, runtime: Duration, show: &Rows) -> Result<()> {
    let mut f = |t: &Tick| show.tick(t);
    let rows = nvmf_perf::remote_bench(sub, runtime, Some((show.interval, &mut f)))?;
    show.summary(&rows, "remote");
    let errors: u64 = rows.iter().map(|r| r.errors).sum();
    if errors > 0 {
        bail!("{errors} I/O errors");
    }
    Ok(())
}

/// Most memory `--region` may name (each end of the pair takes that much).
const MAX_REGION: usize = 4 << 30;

/// `bench`: the built-in table, the raw soft-HCA table, or fio's jobs against --traddr.
pub fn run_bench(args: BenchArgs) -> Result<()> {
    let BenchArgs {
        seconds,
        hca,
        region,
        peer_process,
        serve_peer,
        queues,
        jobs,
        ext,
        interval,
        output,
    } = args;
    let show = Rows { interval, output };
    let ExternalTarget {
        traddr,
        trsvcid,
        nqn,
        host_traddr,
        device,
    } = ext;
    if serve_peer {
        return hca_perf::serve_peer(std::io::stdin().lock(), std::io::stdout().lock());
    }
    if peer_process && !hca {
        bail!("--peer-process is a mode of the raw soft-HCA table: add --hca");
    }
    if !(0.05..=600.0).contains(&seconds) {
        bail!("--seconds must be between 0.05 and 600");
    }
    if !(0.01..=3600.0).contains(&show.interval.as_secs_f64()) {
        bail!("--interval must be between 10ms and 1h");
    }
    match region {
        Some(_) if !hca => bail!("--region is for the raw soft-HCA table: add --hca"),
        Some(r) if r == 0 || r > MAX_REGION => {
            bail!("--region must be between 1 byte and 4G, not {r} bytes")
        }
        _ => {}
    }
    if !jobs.is_empty() && (hca || traddr.is_some()) {
        bail!("--job picks rows of the built-in NVMe-oF table; not with --hca or --traddr");
    }
    if let Some(traddr) = traddr {
        let sub = Subsys {
            fabric: Fabric {
                transport: "rdma".into(),
                traddr,
                trsvcid,
                hostnqn: None,
                hostid: None,
                host_traddr,
                device,
            },
            nqn: nqn.unwrap_or_else(|| DEMO_NQN.into()),
            queues: Queues {
                nr_io_queues: queues.clamp(1, 64),
                queue_size: 128,
            },
            policy: PolicyArgs::default(),
            safe_retry: Default::default(),
            cqt_default: crate::reconnect::hold::DEFAULT_CQT.as_millis() as u64,
            nsid: 1,
            iopolicy: None,
        };
        return remote_bench(&sub, Duration::from_secs_f64(seconds), &show);
    }
    if peer_process {
        return peer_table(Duration::from_secs_f64(seconds), region.unwrap_or(0), &show);
    }
    in_process(
        hca,
        region,
        &jobs,
        queues,
        Duration::from_secs_f64(seconds),
        &show,
    )
}

/// The rows with host and target (or both soft-HCA ends) in this process.
fn in_process(
    hca: bool,
    region: Option<usize>,
    jobs: &[String],
    queues: usize,
    runtime: Duration,
    show: &Rows,
) -> Result<()> {
    // Both ends are in this process: say which way their packets go.
    let path = if crate::driver::local::enabled() {
        "loopback"
    } else {
        "udp"
    };
    if show.output != ListFormat::Json {
        println!(
            "{}",
            if path == "loopback" {
                "host and target in this process: packets take the in-memory loopback path (NVMF_RDMA_LOOPBACK=udp for the UDP socket)"
            } else {
                "host and target in this process: packets go through UDP sockets on 127.0.0.1 (NVMF_RDMA_LOOPBACK=udp)"
            }
        );
    }
    let json_path = |mut v: serde_json::Value| {
        v["path"] = path.into();
        v
    };
    if hca {
        let rows = hca_perf::standard_table(runtime, region.unwrap_or(0))?;
        if show.output == ListFormat::Json {
            for r in &rows {
                println!("{}", json_path(hca_json(r)));
            }
        } else {
            hca_perf::print_table(&rows);
        }
    } else {
        let jobs = nvmf_perf::select_jobs(runtime, jobs)?;
        let mut f = |t: &Tick| show.tick(t);
        let rows =
            nvmf_perf::bench_ticking(jobs, queues.clamp(1, 64), Some((show.interval, &mut f)))?;
        show.summary(&rows, path);
    }
    Ok(())
}

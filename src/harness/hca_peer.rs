//! The soft-HCA table's two-process rows: each row against a responder in a child process
//! (every packet through UDP sockets), with each process's CPU time.

use std::time::Duration;

use crate::harness::hca_perf::{Op, Report, Workload};
use crate::verbs::Mtu;

/// One row of the two-process table: the requester's report, whether GSO/GRO was on, and
/// each process's user + system CPU seconds for the row (set-up included).
pub struct PeerRow {
    pub report: Report,
    pub offload: bool,
    pub requester_cpu: f64,
    pub responder_cpu: f64,
}

/// The rows of the two-process table: large and small WRITEs and READs, each with GSO/GRO
/// on and off, the requester's side through `region` bytes ([`Workload::region`]).
pub fn peer_workloads(duration: Duration, region: usize) -> Vec<(Workload, bool)> {
    let mut v = Vec::new();
    for (op, msg_size, depth) in [
        (Op::Write, 128 << 10, 16),
        (Op::Read, 128 << 10, 16),
        (Op::Write, 4096, 64),
        (Op::Read, 4096, 16),
    ] {
        for offload in [true, false] {
            let w = Workload {
                op,
                msg_size,
                depth,
                duration,
                mtu: Mtu::Mtu4096,
                region,
            };
            v.push((w, offload));
        }
    }
    v
}

/// One row against a responder in a child process: `responder` is a command that runs
/// [`serve_peer`] on its stdin and stdout.
pub fn run_peer_row(
    responder: &mut std::process::Command,
    w: Workload,
    offload: bool,
) -> anyhow::Result<PeerRow> {
    use anyhow::{bail, Context};
    use std::process::Stdio;
    let mut child = responder
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| {
            let exe = std::path::Path::new(responder.get_program());
            format!("cannot start the responder {}", exe.display())
        })?;
    let (Some(to_peer), Some(from_peer)) = (child.stdin.take(), child.stdout.take()) else {
        bail!("the responder process has no stdin/stdout pipes");
    };
    let self0 = cpu_seconds(libc::RUSAGE_SELF);
    let children0 = cpu_seconds(libc::RUSAGE_CHILDREN);
    let r = super::hca_perf::run_with_peer(w, offload, std::io::BufReader::new(from_peer), to_peer);
    let status = child.wait()?;
    let requester_cpu = cpu_seconds(libc::RUSAGE_SELF) - self0;
    let responder_cpu = cpu_seconds(libc::RUSAGE_CHILDREN) - children0;
    let report = r.context("the two-process run failed")?;
    if !status.success() {
        bail!("the responder process failed ({status}); its errors are above");
    }
    Ok(PeerRow {
        report,
        offload,
        requester_cpu,
        responder_cpu,
    })
}

/// User + system CPU seconds of this process or of its waited-for children.
fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(who, &mut u) } != 0 {
        return 0.0;
    }
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(u.ru_utime) + s(u.ru_stime)
}

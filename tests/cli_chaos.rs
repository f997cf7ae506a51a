//! `nvmf-rdma chaos` end to end, as a user runs it: a short run on loopback must inflict
//! faults, recover from them, verify its data and exit 0, with a JSON summary that says so.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/proc.rs"]
mod proc;
use proc::Proc;

/// The number after `"key":` in flat-enough JSON.
fn num(j: &str, key: &str) -> Option<u64> {
    let k = format!("\"{key}\":");
    let rest = &j[j.find(&k)? + k.len()..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

#[test]
fn a_short_chaos_run_recovers_and_passes() {
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_nvmf-rdma"))
        .args([
            "chaos",
            "--seconds",
            "3",
            "--every",
            "500ms",
            "--size",
            "64M",
            "--workers",
            "4",
            "--seed",
            "7",
            "-o",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nvmf-rdma");
    // Bound the run: a hung recovery must fail the test, not wedge it.
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("chaos did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(status.success(), "exit {status}\n{stdout}\n{stderr}");
    let j = stdout.trim();
    assert!(j.starts_with('{') && j.ends_with('}'), "not JSON: {j}");
    assert!(j.contains("\"pass\":true"), "{j}");
    assert!(
        num(j, "recoveries").unwrap_or(0) > 0,
        "no recovery: {j}\n{stderr}"
    );
    assert!(num(j, "total").unwrap_or(0) > 0, "no fault: {j}");
    assert_eq!(num(j, "mismatches"), Some(0), "{j}");
    assert_eq!(num(j, "hangs"), Some(0), "{j}");
    assert!(num(j, "verified_bytes").unwrap_or(0) > 0, "{j}");
}

/// A target that dies for good: the controller gives up at ctrl_loss_tmo, and the run ends
/// then, with the give-up in its summary, not --seconds later. Before the fix the workers
/// spun on the dead controller for the whole run, keeping one list entry per failed I/O
/// (millions in the guest test), and this run took 600 s.
#[test]
fn a_controller_that_gives_up_ends_the_run() {
    let dir = std::env::temp_dir().join(format!("nvmf-cli-chaos-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let nqn = "nqn.2026-11.io.nvmf-rdma:cli-chaos";
    let (mut target, addr) = proc::start_target(nqn, "16M", &dir, &[]);
    let mut cmd = Command::new(proc::BIN);
    cmd.args([
        "chaos",
        "-a",
        &addr,
        "-n",
        nqn,
        "--size",
        "16M",
        "--workers",
        "2",
    ])
    .args([
        "-i",
        "1",
        "--seconds",
        "600",
        "--every",
        "3600s",
        "--faults",
        "user-reset",
    ])
    .args([
        "-c",
        "1",
        "-l",
        "3",
        "-k",
        "1",
        "--io-timeout",
        "1",
        "-o",
        "json",
    ]);
    let mut chaos = Proc::spawn(cmd);
    chaos.expect("connected; verifying I/O", Duration::from_secs(30));
    let t0 = Instant::now();
    target.kill();
    // ctrl_loss_tmo 3 s after the loss is noticed (keep-alive / I/O timeout 1 s): well
    // under a minute, where the run asked for ten.
    let st = chaos.exits(Duration::from_secs(120));
    let gone = t0.elapsed();
    let out = chaos.rest();
    assert!(
        !st.success(),
        "a run whose controller gave up must fail: {out}"
    );
    assert!(
        gone < Duration::from_secs(60),
        "ended {gone:?} after the loss: {out}"
    );
    assert!(out.contains("ctrl_loss_tmo expired"), "{out}");
    assert_eq!(num(&out, "mismatches"), Some(0), "{out}");
    assert_eq!(num(&out, "hangs"), Some(0), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

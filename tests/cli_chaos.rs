//! `nvmf-rdma chaos` end to end, as a user runs it: a short run on loopback must inflict
//! faults, recover from them, verify its data and exit 0, with a JSON summary that says so.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

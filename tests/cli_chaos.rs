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

/// A short chaos run on loopback with `extra` arguments: its exit status, stdout, stderr.
fn short_run(extra: &[&str]) -> (std::process::ExitStatus, String, String) {
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
        .args(extra)
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
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (status, stdout, stderr)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("nvmf-cli-chaos-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_short_chaos_run_recovers_and_passes() {
    let (status, stdout, stderr) = short_run(&[]);
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
    let dir = temp_dir("gives-up");
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

/// `--plot` draws one marker per fault of the run (the picture's marker colour, which
/// nothing else in it has), labelled with its kind, and `-o json` carries the I/O series
/// the plot is drawn from: one sample per `--interval`, each adding up with the totals.
#[test]
fn a_chaos_run_plots_each_fault_and_reports_its_io_series() {
    let dir = temp_dir("plot");
    let svg = dir.join("run.svg");
    let (status, stdout, stderr) =
        short_run(&["--interval", "250ms", "--plot", svg.to_str().unwrap()]);
    assert!(status.success(), "exit {status}\n{stdout}\n{stderr}");
    let j: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON summary");

    let series = j["series"].as_array().expect("a series array");
    // One per 250 ms of the run (its 3 s and the I/Os still in flight then, held through a
    // recovery perhaps), fewer when the sampler is kept off a busy machine's CPU: such a
    // sample covers the time that passed.
    let elapsed = j["elapsed_s"].as_f64().unwrap();
    let expect = elapsed / 0.25;
    assert!(
        elapsed >= 3.0
            && series.len() as f64 >= expect / 2.0
            && series.len() as f64 <= expect + 1.0,
        "{} samples in {elapsed} s: {series:?}",
        series.len()
    );
    let f = |s: &serde_json::Value, k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{k}: {s}"));
    let mut prev = 0.0;
    let last = f(series.last().unwrap(), "t_s");
    assert!(
        (last - elapsed).abs() < 0.1,
        "the series ends at {last}, the run at {elapsed}"
    );
    let mut ios = 0;
    for s in series {
        let (t, len, n) = (f(s, "t_s"), f(s, "len_s"), s["ios"].as_u64().unwrap());
        assert!(
            t > prev && (len - (t - prev)).abs() < 0.002,
            "{s} after {prev}"
        );
        // Half an interval at least: a sliver of time would not read as a rate.
        assert!(len >= 0.12, "{s}");
        // len_s is to the millisecond.
        assert!(
            (f(s, "iops") * len - n as f64).abs() <= n as f64 * 0.01 + 1.0,
            "{s}"
        );
        if n > 0 {
            assert!(f(s, "mb_s") > 0.0, "{s}");
            assert!(f(s, "lat_mean_ms") > 0.0, "{s}");
            assert!(f(s, "lat_max_ms") >= f(s, "lat_mean_ms"), "{s}");
        } else {
            assert!(s["lat_mean_ms"].is_null(), "{s}");
        }
        prev = t;
        ios += n;
    }
    assert_eq!(
        ios,
        j["ios"].as_u64().unwrap(),
        "the series adds up to the run's I/Os"
    );
    assert!(
        series.iter().any(|s| f(s, "iops") > 0.0),
        "no I/O in any sample: {series:?}"
    );
    // Given --interval, each sample is printed as it is taken.
    assert!(stderr.contains(" IO/s "), "{stderr}");

    let faults = j["fault_log"].as_array().expect("a fault log");
    assert!(!faults.is_empty(), "no fault: {j}");
    let picture = std::fs::read_to_string(&svg).expect("the plot was written");
    assert!(picture.trim_start().starts_with("<svg"), "{picture}");
    let markers = picture
        .split('<')
        .filter(|e| e.starts_with("polyline") && e.contains(r##"stroke="#B22222""##))
        .count();
    assert_eq!(markers, faults.len(), "one marker per fault: {faults:?}");
    let texts: Vec<&str> = picture
        .split("<text")
        .skip(1)
        .filter_map(|t| Some(t[t.find('>')? + 1..t.find("</text>")?].trim()))
        .collect();
    for fault in faults {
        let kind = fault["kind"].as_str().unwrap();
        assert!(
            texts.iter().any(|t| t.starts_with(&format!("{kind} "))),
            "no label for {kind}: {texts:?}"
        );
    }
    // The headline per fault: one time, not two.
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("live again"))
        .collect();
    assert_eq!(lines.len(), faults.len(), "{stderr}");
    assert!(lines.iter().all(|l| !l.contains("controller")), "{stderr}");
    // Nothing left beside it: the file came by a rename.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["run.svg"], "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `--plot` path that cannot take the picture, and a series that would not be bounded,
/// are refused before the run, in one line.
#[test]
fn a_plot_or_series_that_cannot_be_had_is_refused_at_once() {
    let dir = temp_dir("plot-dir");
    let (d, missing) = (dir.to_str().unwrap(), dir.join("missing/run.svg"));
    for (args, says) in [
        (vec!["--seconds", "3", "--plot", d], "not a regular file"),
        (
            vec!["--seconds", "3", "--plot", missing.to_str().unwrap()],
            "create it first",
        ),
        (
            vec!["--seconds", "3", "--interval", "50ms"],
            "at least 100ms",
        ),
        (
            vec!["--seconds", "86400", "--interval", "100ms"],
            "at most 100000 samples",
        ),
    ] {
        let t0 = Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_nvmf-rdma"))
            .arg("chaos")
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(t0.elapsed() < Duration::from_secs(2), "ran before refusing");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    assert!(dir.is_dir());
    let _ = std::fs::remove_dir_all(&dir);
}

//! `nvmf-rdma bench` streams a row per interval while each job runs (never silent for
//! seconds), then the summary; `-o json` makes every line one JSON object.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/proc.rs"]
mod proc;
use proc::BIN;

#[test]
fn bench_streams_a_row_per_interval_then_the_summary() {
    let mut p = Command::new(BIN)
        .args([
            "bench",
            "--seconds",
            "2",
            "--interval",
            "250ms",
            "--job",
            "randread-4k-qd1",
            "-o",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(p.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    // The first row arrives while the job still runs (it has 1.75 s to go): streamed, not
    // printed at the end.
    assert!(
        p.try_wait().unwrap().is_none(),
        "bench ended before its first row came"
    );
    let first: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["type"], "interval", "{first}");
    assert_eq!(first["job"], "randread-4k-qd1");
    assert!(first["iops"].as_f64().unwrap() > 0.0, "{first}");
    let rest: Vec<serde_json::Value> = lines
        .map(|l| serde_json::from_str(&l.unwrap()).expect("every line is JSON"))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let st = loop {
        if let Some(s) = p.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "bench still running");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(st.success());
    let intervals = 1 + rest.iter().filter(|v| v["type"] == "interval").count();
    assert_eq!(intervals, 8, "2 s in 250 ms intervals: {rest:?}");
    let last = rest.last().unwrap();
    assert_eq!(last["type"], "result", "{last}");
    assert_eq!(
        (last["qd"].as_u64(), last["bs"].as_u64()),
        (Some(1), Some(4096))
    );
    assert_eq!(last["errors"], 0);
    // Host copies per I/O are counted: a number, never absent.
    assert!(last["copies_per_io"].as_f64().is_some(), "{last}");

    // Normal output: the rows, then today's table.
    let o = Command::new(BIN)
        .args([
            "bench",
            "--seconds",
            "0.5",
            "--interval",
            "200ms",
            "--job",
            "randread-4k-qd1",
        ])
        .output()
        .unwrap();
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("randread-4k-qd1"))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(
        rows[0].starts_with("randread-4k-qd1") && rows[0].contains("0.2 s"),
        "{out}"
    );
    assert!(out.contains("p50 us"), "{out}");

    // A bad interval: one line that says the range.
    let o = Command::new(BIN)
        .args(["bench", "--interval", "1ms"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    assert!(e.contains("--interval must be between"), "{e}");
}

/// The six rows of `bench --hca --seconds 0.1 -o json EXTRA...`, each a JSON object.
fn hca_rows(extra: &[&str]) -> Vec<serde_json::Value> {
    let o = Command::new(BIN)
        .args(["bench", "--hca", "--seconds", "0.1", "-o", "json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is JSON"))
        .collect();
    assert_eq!(rows.len(), 6, "{rows:?}");
    rows
}

/// `bench --hca -o json` gives a `"type":"hca"` object per row of the raw soft-HCA table, so
/// fio-plugin/bench.sh can put the raw 128 KiB RDMA rates beside NVMe-oF's without scraping
/// the table (it refused json before).
#[test]
fn bench_hca_rows_as_json() {
    let rows = hca_rows(&[]);
    assert!(rows.iter().all(|r| r["type"] == "hca"), "{rows:?}");
    for op in ["RDMA READ", "RDMA WRITE"] {
        let r = rows
            .iter()
            .find(|r| r["op"] == op && r["bytes"] == 128 << 10)
            .unwrap_or_else(|| panic!("no 128 KiB {op} row: {rows:?}"));
        let (gbps, msgs, secs) = (
            r["gbps"].as_f64().unwrap(),
            r["messages"].as_f64().unwrap(),
            r["seconds"].as_f64().unwrap(),
        );
        assert!(msgs > 0.0, "{r}");
        // The rate is the messages' bytes over the time, not a separate figure.
        let want = msgs * 131072.0 / secs / 1e9;
        assert!(
            (gbps - want).abs() <= want * 0.01 + 1e-4,
            "{r}: want {want}"
        );
    }
}

/// `bench --hca --region SIZE` runs the raw table over that much memory on the requester's
/// side (the size of a namespace, out of cache) and says so in each row; `--region` without
/// `--hca`, or beyond 4G, is a one-line refusal.
#[test]
fn bench_hca_region_is_reported_and_checked() {
    let rows = hca_rows(&["--region", "8M"]);
    for r in &rows {
        assert_eq!(r["region"], 8 << 20, "{r}");
        assert!(r["messages"].as_f64().unwrap() > 0.0, "{r}");
    }
    for (args, want) in [
        (&["bench", "--region", "1G"][..], "add --hca"),
        (
            &["bench", "--hca", "--region", "5G"][..],
            "between 1 byte and 4G",
        ),
    ] {
        let o = Command::new(BIN).args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(want) && e.lines().count() == 1, "{args:?}: {e}");
    }
}

/// `bench --hca --peer-process` runs each row against a responder in a child process, so
/// its packets cross UDP sockets (the in-process table's take the loopback path): RDMA WRITE
/// and READ at 128 KiB and 4 KiB, each with GSO/GRO on and off, with the packets and each
/// side's CPU; with --region, through that much memory on the requester's side. Without
/// --hca it is a one-line refusal.
#[test]
fn bench_hca_peer_process_rows() {
    let o = Command::new(BIN)
        .args([
            "bench",
            "--hca",
            "--peer-process",
            "--seconds",
            "0.1",
            "-o",
            "json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is JSON"))
        .collect();
    assert_eq!(rows.len(), 8, "{rows:?}");
    for op in ["RDMA WRITE", "RDMA READ"] {
        for bytes in [128 << 10, 4096] {
            for offload in [true, false] {
                let r = rows
                    .iter()
                    .find(|r| r["op"] == op && r["bytes"] == bytes && r["offload"] == offload)
                    .unwrap_or_else(|| panic!("no {op} {bytes} offload {offload}: {rows:?}"));
                assert_eq!(r["path"], "udp-two-process", "{r}");
                let (msgs, pkts) = (
                    r["messages"].as_u64().unwrap(),
                    r["packets"].as_u64().unwrap(),
                );
                // Every message's data packets at least, sent or received by the requester.
                assert!(
                    msgs > 0 && pkts >= msgs * (bytes as u64).div_ceil(4096),
                    "{r}"
                );
                assert!(r["responder_cpu_s"].as_f64().unwrap() > 0.0, "{r}");
            }
        }
    }
    // With --region the requester's side moves through that much memory, as a target's
    // namespace does: the ceiling of a target that reads and writes its namespace.
    let o = Command::new(BIN)
        .args([
            "bench",
            "--hca",
            "--peer-process",
            "--region",
            "8M",
            "--seconds",
            "0.05",
            "-o",
            "json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is JSON"))
        .collect();
    assert_eq!(rows.len(), 8, "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r["region"] == 8 << 20 && r["messages"].as_u64() > Some(0)),
        "{rows:?}"
    );
    let o = Command::new(BIN)
        .args(["bench", "--peer-process"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("add --hca") && e.lines().count() == 1, "{e}");
}

/// `bench` says which way its packets went: the in-memory loopback path between the two
/// contexts of its process, or UDP when `NVMF_RDMA_LOOPBACK=udp` says so; both move data.
#[test]
fn bench_names_the_path_its_packets_take() {
    for (env, path) in [(None, "loopback"), (Some("udp"), "udp")] {
        let mut cmd = Command::new(BIN);
        cmd.args([
            "bench",
            "--seconds",
            "0.2",
            "--job",
            "randwrite-4k-qd1",
            "-o",
            "json",
        ]);
        cmd.env_remove("NVMF_RDMA_LOOPBACK");
        if let Some(v) = env {
            cmd.env("NVMF_RDMA_LOOPBACK", v);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout);
        let r: serde_json::Value = out
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["type"] == "result")
            .unwrap_or_else(|| panic!("no result in {out}"));
        assert_eq!(r["path"], path, "{r}");
        assert!(r["ios"].as_u64().unwrap() > 0 && r["errors"] == 0, "{r}");
    }
}

/// `nvmf-rdma target --threads N` serves I/O on one thread (the default: the device and the
/// queues hand off without waking another thread) and on several; out of range is refused.
#[test]
fn the_target_serves_io_on_one_thread_or_several() {
    let dir = std::env::temp_dir().join(format!("nvmf-threads-{}", std::process::id()));
    let nqn = "nqn.2026-11.io.nvmf-rdma:threads";
    for threads in ["1", "3"] {
        let (_t, addr) = proc::start_target(nqn, "16M", &dir, &["--threads", threads]);
        let o = Command::new(BIN)
            .args([
                "bench",
                "-a",
                &addr,
                "-n",
                nqn,
                "--seconds",
                "0.3",
                "-o",
                "json",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let results: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).expect("every line is JSON"))
            .filter(|v: &serde_json::Value| v["type"] == "result")
            .collect();
        assert_eq!(results.len(), 3, "--threads {threads}: {results:?}");
        for r in &results {
            assert_eq!(r["errors"], 0, "--threads {threads}: {r}");
            assert!(
                r["iops"].as_f64().unwrap() > 0.0,
                "--threads {threads}: {r}"
            );
        }
    }
    for bad in ["0", "65", "two"] {
        let o = Command::new(BIN)
            .args(["target", "--threads", bad])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "--threads {bad}");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("--threads"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

//! `nvmf-rdma target-ns add` against a running `target --control SOCKET`: a RAM namespace
//! is held to the memory the target can have and is taken without stalling the hosts'
//! I/O; a subsystem takes as many namespaces as a host can list and refuses more, in one
//! line each.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

#[path = "common/proc.rs"]
mod proc;
use proc::{one_line_error, BIN};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:target-ns";

/// A test's own directory, removed at the end.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("nvmf-target-ns-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `nvmf-rdma target-ns add` to the end (bounded).
fn add(ctl: &Path, nsid: u32, ram: &str) -> Output {
    add_with(ctl, nsid, ram, &[])
}

/// [`add`] with more flags.
fn add_with(ctl: &Path, nsid: u32, ram: &str, extra: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(["target-ns", "add", "--control"])
        .arg(ctl)
        .args(["-n", NQN, "--nsid", &nsid.to_string(), "--ram", ram])
        .args(extra)
        .env("RUST_BACKTRACE", "1");
    proc::run(c)
}

/// The target's address space is held to 3 GiB (RLIMIT_AS): more than that is not
/// available to it, however much the machine has. While another host does I/O (`bench`'s
/// table, a row every 250 ms), a 256 MiB namespace is added (its pages taken off the threads that
/// serve queues), then one of 4 GiB is refused in one line; the target lives on, and
/// the host's I/O never stops for a whole row and never fails.
#[test]
fn a_namespace_past_available_memory_is_refused_while_another_hosts_io_goes_on() {
    let dir = Dir::new("mem");
    let ctl = dir.0.join("target.ctl");
    let mut cmd = proc::target_cmd(
        NQN,
        "64M",
        &dir.0.join("run"),
        &["--control", ctl.to_str().unwrap()],
    );
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 3 << 30,
                rlim_max: 3 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let (mut t, addr) = proc::start_target_cmd(cmd);
    let mut bench = Command::new(BIN)
        .args(["bench", "-a", &addr, "-n", NQN, "--seconds", "1"])
        .args(["--interval", "250ms", "-o", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _reap = Reap(&mut bench);
    let mut rows = BufReader::new(_reap.0.stdout.take().unwrap()).lines();
    let first: serde_json::Value = serde_json::from_str(&rows.next().unwrap().unwrap()).unwrap();
    assert_eq!(first["type"], "interval", "{first}");

    let o = add(&ctl, 2, "256M");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = add(&ctl, 3, "4G");
    assert!(!o.status.success());
    let e = one_line_error(&o);
    assert!(
        e.contains("more than the") && e.contains("available now") && e.contains("--file"),
        "{e}"
    );
    assert!(t.child.try_wait().unwrap().is_none(), "the target ended");

    let rows: Vec<serde_json::Value> = rows
        .map(|l| serde_json::from_str(&l.unwrap()).expect("every line is JSON"))
        .collect();
    let stalled: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|r| r["type"] == "interval" && r["iops"].as_f64() == Some(0.0))
        .collect();
    assert!(stalled.is_empty(), "I/O stopped: {stalled:?}");
    let results: Vec<&serde_json::Value> = rows.iter().filter(|r| r["type"] == "result").collect();
    assert!(!results.is_empty(), "{rows:?}");
    for r in results {
        assert_eq!(r["errors"], 0, "{r}");
    }
    // The refused namespace is not there; the added one is, and the target still adds.
    t.expect("namespace 2 added", Duration::from_secs(5));
    let o = add(&ctl, 3, "1M");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(t.child.try_wait().unwrap().is_none(), "the target ended");
}

/// Ends a child process whatever the test does.
struct Reap<'a>(&'a mut std::process::Child);

impl Drop for Reap<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// 1024 namespaces in a subsystem (what one Identify Active Namespace ID list holds), then
/// the next is refused in one line saying why and what to do.
#[test]
fn a_subsystem_takes_as_many_namespaces_as_a_host_can_list() {
    let dir = Dir::new("count");
    let ctl = dir.0.join("target.ctl");
    let (t, _addr) = proc::start_target(
        NQN,
        "1M",
        &dir.0.join("run"),
        &["--control", ctl.to_str().unwrap()],
    );
    // Namespaces 2..=1024 over one connection, a request line each.
    let s = UnixStream::connect(&ctl).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    for nsid in 2..=1024u32 {
        let req = serde_json::json!({"op": "add-namespace", "nqn": NQN, "nsid": nsid, "ram": 4096});
        writeln!(w, "{req}").unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(v["ok"], true, "namespace {nsid}: {v}");
    }
    let o = add(&ctl, 1025, "4K");
    assert!(!o.status.success());
    let e = one_line_error(&o);
    assert!(
        e.contains("has 1024 namespaces") && e.contains("another subsystem"),
        "{e}"
    );
    t.expect("namespace 1024 added", Duration::from_secs(5));
}

/// `nvmf-rdma target-ana` to the end (bounded).
fn ana(ctl: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(["target-ana"])
        .args(args)
        .arg("--control")
        .arg(ctl)
        .env("RUST_BACKTRACE", "1");
    proc::run(c)
}

/// A target with two --listen addresses has two ports; `target-ana status` lists them with
/// their ANA groups, `target-ana set` changes a group's state through one port only, a
/// namespace added in a group of its own brings that group to every port, and a port, group
/// or state that is not there is refused in one line.
#[test]
fn two_listen_addresses_are_two_ports_whose_ana_state_is_set_at_run_time() {
    let dir = Dir::new("ana");
    let ctl = dir.0.join("target.ctl");
    let cmd = proc::target_cmd(
        NQN,
        "1M",
        &dir.0.join("run"),
        &[
            "--listen",
            "127.0.0.1:0",
            "--control",
            ctl.to_str().unwrap(),
        ],
    );
    let t = proc::Proc::spawn(cmd);
    let line = t.expect("listening on", Duration::from_secs(30));
    let addrs: Vec<&str> = line
        .split(" on ")
        .nth(1)
        .and_then(|s| s.split(" (").next())
        .map(|s| s.split(", ").collect())
        .unwrap_or_default();
    assert_eq!(addrs.len(), 2, "{line}");
    let status = |want: [&str; 2]| {
        let o = ana(&ctl, &["status"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            vec![
                format!("port 1 {}: {}", addrs[0], want[0]),
                format!("port 2 {}: {}", addrs[1], want[1]),
            ],
        );
    };
    status(["group 1 optimized", "group 1 optimized"]);
    let o = ana(&ctl, &["set", "--port", "2", "inaccessible"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    status(["group 1 optimized", "group 1 inaccessible"]);
    // A namespace in a group of its own: the group appears on every port.
    let o = add_with(&ctl, 2, "1M", &["--ana-group", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = ana(
        &ctl,
        &["set", "--port", "1", "--group", "2", "non-optimized"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    status([
        "group 1 optimized, group 2 non-optimized",
        "group 1 inaccessible, group 2 optimized",
    ]);
    let e = one_line_error(&add_with(&ctl, 3, "1M", &["--ana-group", "129"]));
    assert!(e.contains("ANA group 129 does not exist"), "{e}");
    let o = ana(&ctl, &["set", "--port", "3", "optimized"]);
    assert!(!o.status.success());
    let e = one_line_error(&o);
    assert!(e.contains("no port 3") && e.contains("1, 2"), "{e}");
    let o = ana(&ctl, &["set", "--port", "1", "fast"]);
    let e = one_line_error(&o);
    assert!(e.contains("unknown ANA state"), "{e}");
}

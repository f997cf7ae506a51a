//! A child `nvmf-rdma` process whose output lines are collected, for the tests that run the
//! binary as a user does (`#[path = "common/proc.rs"] mod proc;`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_nvmf-rdma");

pub struct Proc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    /// Start `cmd` with its stdout and stderr read line by line.
    pub fn spawn(mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start nvmf-rdma");
        let (tx, lines) = mpsc::channel();
        for out in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
        }
        Proc { child, lines }
    }

    /// The first output line containing `what`, within `limit`.
    pub fn expect(&self, what: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(what) => return l,
                Ok(l) => seen.push(l),
                Err(_) => break,
            }
        }
        panic!(
            "no line with {what:?} within {limit:?}; saw:\n{}",
            seen.join("\n")
        );
    }

    /// The exit status, within `limit` (killed and a panic past it).
    pub fn exits(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("still running {limit:?} later");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The output lines not read yet.
    pub fn rest(&self) -> String {
        self.lines.try_iter().collect::<Vec<_>>().join("\n")
    }

    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's PID.
        unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A built-in target with a `ram` RAM namespace under `nqn` on a free loopback port, its
/// run directory `run_dir`, more `target` flags `extra`; and the address it listens on.
pub fn start_target(nqn: &str, ram: &str, run_dir: &Path, extra: &[&str]) -> (Proc, String) {
    start_target_cmd(target_cmd(nqn, ram, run_dir, extra))
}

/// The command [`start_target`] runs, for a test that sets more on it.
pub fn target_cmd(nqn: &str, ram: &str, run_dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["target", "--listen", "127.0.0.1:0", "--ram", ram, "-n", nqn])
        .args(extra)
        .env("NVMF_RDMA_RUN_DIR", run_dir);
    cmd
}

/// Start a [`target_cmd`]; returns once it listens, with its address.
pub fn start_target_cmd(cmd: Command) -> (Proc, String) {
    let t = Proc::spawn(cmd);
    let line = t.expect("listening on", Duration::from_secs(30));
    let addr = line
        .split_whitespace()
        .skip_while(|w| *w != "on")
        .nth(1)
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    (t, addr)
}

/// The error a command printed: one line, no backtrace or cause chain.
pub fn one_line_error(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).trim().to_string();
    assert_eq!(e.lines().count(), 1, "not one line: {e}");
    assert!(!e.contains("backtrace") && !e.contains("Caused by"), "{e}");
    e
}

/// Run `cmd` to its end, its output collected (60 s at most).
pub fn run(mut cmd: Command) -> Output {
    let mut p = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while p.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "{cmd:?} still running after 60 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    p.wait_with_output().unwrap()
}

//! Every subcommand whose reader goes away (`nvmf-rdma ... | head -1`) ends quietly: exit 0,
//! or its own one-line error, never a panic.

#[path = "common/proc.rs"]
mod proc;

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:pipe";

/// A pipe whose read end is already closed: every write to the other end fails with EPIPE.
fn closed_pipe() -> Stdio {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills two fresh descriptors that nothing else owns.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: each descriptor is owned once; dropping the read end closes it.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    Stdio::from(write)
}

/// Run `args` with stdout a closed pipe; the exit code and stderr.
fn run_closed(args: &[&str], run_dir: &std::path::Path) -> (Option<i32>, String) {
    let mut child = Command::new(proc::BIN)
        .args(args)
        .env("NVMF_RDMA_RUN_DIR", run_dir)
        .stdin(Stdio::null())
        .stdout(closed_pipe())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start nvmf-rdma");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{args:?} still running a minute later");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_subcommand_ends_quietly_when_its_reader_goes_away() {
    let dir = tempdir();
    let (_target, addr) = proc::start_target(NQN, "16M", &dir, &[]);
    let io = ["-a", addr.as_str(), "-n", NQN];
    let with_io = |cmd: &[&'static str]| -> Vec<String> {
        cmd.iter()
            .map(|s| s.to_string())
            .chain(io.iter().map(|s| s.to_string()))
            .collect()
    };
    let mut cases: Vec<Vec<String>> = vec![
        with_io(&["read", "--hex", "--size", "64K"]),
        with_io(&["read", "--size", "64K"]),
        with_io(&["verify", "--size", "1M"]),
        with_io(&["write", "--size", "4K", "--pattern", "7"]),
        vec!["discover".into(), "-a".into(), addr.clone()],
        vec!["list".into()],
        vec!["list-subsys".into()],
        vec!["qp-states".into()],
        vec!["qp-states".into(), "--dot".into()],
        vec!["completions".into(), "bash".into()],
        vec![
            "demo".into(),
            "--size".into(),
            "8M".into(),
            "--seconds".into(),
            "1".into(),
        ],
        vec!["bench".into(), "--seconds".into(), "1".into()],
        vec!["--help".into()],
    ];
    // Every subcommand's help, so a new subcommand is covered without editing this list.
    let help = Command::new(proc::BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let subcommands: Vec<String> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(subcommands.len() > 10, "no subcommands in --help: {help}");
    cases.extend(subcommands.iter().map(|c| vec![c.clone(), "--help".into()]));
    for case in &cases {
        let args: Vec<&str> = case.iter().map(String::as_str).collect();
        let (code, err) = run_closed(&args, &dir);
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        match code {
            Some(0) => {}
            Some(_) => assert_eq!(
                err.trim_end().lines().count(),
                1,
                "{args:?} failed without one line: {err}"
            ),
            None => panic!("{args:?} ended by a signal: {err}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("nvmf-rdma-pipe-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

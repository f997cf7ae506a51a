//! The error lines a user can cause with bad flags or a wrong address: plain text, each cause
//! said once, never Debug formatting (`Foo(…)`, `Foo { … }`), never a panic.

#[path = "common/proc.rs"]
mod proc;

use std::process::{Command, Stdio};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:errors";

/// What is wrong with one stderr line, if anything.
fn fault(line: &str) -> Option<String> {
    let words: Vec<&str> = line.split(|c: char| c.is_whitespace()).collect();
    for w in &words {
        // `RejectReason(8 ...)`, `Some(..)`, `Os { code: 13, .. }`: a capitalised word glued to
        // a parenthesis or followed by a brace.
        let debugish = w
            .split_once('(')
            .is_some_and(|(head, _)| head.len() > 2 && head.starts_with(char::is_uppercase));
        if debugish && !w.starts_with("(") {
            return Some(format!("Debug formatting in {w:?}"));
        }
    }
    if line.contains(" { ") && line.contains(": ") && line.contains(" }") {
        return Some("a Debug struct".into());
    }
    // A cause said twice: the same segment between ": " separators.
    let segs: Vec<&str> = line.split(": ").map(str::trim).collect();
    for (i, s) in segs.iter().enumerate() {
        if s.len() >= 8 && segs[i + 1..].contains(s) {
            return Some(format!("{s:?} twice"));
        }
    }
    None
}

fn stderr_of(args: &[&str], run_dir: &std::path::Path) -> (Option<i32>, String) {
    let out = Command::new(proc::BIN)
        .args(args)
        .env("NVMF_RDMA_RUN_DIR", run_dir)
        .stdin(Stdio::null())
        .output()
        .expect("run nvmf-rdma");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_checker_catches_what_it_is_for() {
    assert!(fault("rejected by 1.2.3.4:4791: RejectReason(8 (invalid service ID))").is_some());
    assert!(fault(
        "fuse mount at /m: Permission denied (os error 13): Permission denied (os error 13)"
    )
    .is_some());
    assert!(fault("open: Os { code: 2, kind: NotFound }").is_some());
    assert!(fault("nvmf-rdma: fuse mount at /m: Permission denied (os error 13)").is_none());
    assert!(fault("the size 4X: unknown size unit 'X' (B, K, M)").is_none());
}

#[test]
fn error_lines_a_user_can_cause_say_each_cause_once_in_plain_text() {
    let dir = std::env::temp_dir().join(format!("nvmf-rdma-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (_target, addr) = proc::start_target(NQN, "16M", &dir, &[]);
    let ip = addr.split(':').next().unwrap().to_string();
    let missing = dir.join("no-such-dir/x.sock");
    let missing = missing.to_str().unwrap();
    let cases: Vec<Vec<&str>> = vec![
        // A port nobody listens on: the REJ, with a hint.
        vec!["discover", "-a", &addr, "-s", "4421"],
        // chaos against another target without the subsystem.
        vec!["chaos", "-a", &addr],
        // Bad sizes, durations, numbers.
        vec!["read", "-a", &addr, "-n", NQN, "--size", "4X"],
        vec!["read", "-a", &addr, "-n", NQN, "--size", "0.3K"],
        vec!["chaos", "--every", "soon"],
        vec!["chaos", "--every", "1ms"],
        vec!["connect", "-a", &addr, "-n", NQN, "--queue-size", "5"],
        vec!["connect", "-a", &addr, "-n", "not an nqn"],
        vec!["discover", "-t", "tcp", "-a", &ip],
        vec!["discover", "-a", "not-an-address"],
        // A subsystem the target does not have.
        vec![
            "read",
            "-a",
            &addr,
            "-n",
            "nqn.2026-11.io.nvmf-rdma:nope",
            "--size",
            "4K",
        ],
        // I/O past the end of the namespace.
        vec![
            "read",
            "-a",
            &addr,
            "-n",
            NQN,
            "--lba",
            "999999999",
            "--size",
            "4K",
        ],
        // No daemon runs in this run directory.
        vec!["list"],
        vec!["disconnect", "-d", "nvmf9"],
        vec!["read", "-d", "nvmf9", "--size", "4K"],
        // A target control socket that is not there.
        vec![
            "target-ns",
            "add",
            "--control",
            missing,
            "--nsid",
            "2",
            "--ram",
            "1M",
        ],
        // Target flags.
        vec!["target", "--listen", "127.0.0.1:0", "--ram", "0"],
        vec!["target", "--listen", "127.0.0.1:0", "--file", missing],
    ];
    let mut bad = Vec::new();
    for args in &cases {
        let (code, err) = stderr_of(args, &dir);
        if err.contains("panicked") {
            bad.push(format!("{args:?} panicked: {err}"));
            continue;
        }
        if code == Some(0) && err.trim().is_empty() {
            // Nothing to check (list with no daemon prints to stdout).
            continue;
        }
        for line in err.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(why) = fault(line) {
                bad.push(format!("{args:?}: {why}: {line}"));
            }
        }
    }
    // The ones that tell the user what to do.
    for (args, hint) in [
        (
            vec!["discover", "-a", addr.as_str(), "-s", "4421"],
            "check -s",
        ),
        (vec!["chaos", "-a", addr.as_str()], "-a needs -n NQN"),
        (
            vec![
                "read",
                "-a",
                addr.as_str(),
                "-n",
                "nqn.2026-11.io.nvmf-rdma:nope",
                "--size",
                "4K",
            ],
            "check the subsystem NQN (-n)",
        ),
        (
            vec!["read", "-a", addr.as_str(), "-n", NQN, "--size", "4X"],
            "K, M, G, T",
        ),
    ] {
        let (code, err) = stderr_of(&args, &dir);
        assert_ne!(code, Some(0), "{args:?}");
        if !err.contains(hint) {
            bad.push(format!("{args:?}: no {hint:?} in: {err}"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(bad.is_empty(), "error lines to fix:\n{}", bad.join("\n"));
}

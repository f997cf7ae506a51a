//! Unit tests of the command line.

use super::*;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use nvmf_rdma::cli::support::Tmo;
use nvmf_rdma::harness::chaos::config::KERNEL_FAULTS;

#[test]
fn busy_poll_default_is_the_tools_default_and_flags_parse() {
    let c = Cli::try_parse_from(["nvmf-rdma", "list"]).unwrap();
    assert_eq!(c.busy_poll, nvmf_rdma::driver::TOOL_BUSY_POLL);
    let c = Cli::try_parse_from(["nvmf-rdma", "list", "--busy-poll", "0"]).unwrap();
    assert_eq!(c.busy_poll, Duration::ZERO);
    assert!(Cli::try_parse_from(["nvmf-rdma", "list", "--busy-poll", "fast"]).is_err());
    // The preemption gate is opt-in: it trades IOPS for CPU.
    assert!(!c.busy_poll_gate);
    let c = Cli::try_parse_from(["nvmf-rdma", "list", "--busy-poll-gate"]).unwrap();
    assert!(c.busy_poll_gate);
    let c = Cli::try_parse_from(["nvmf-rdma", "bench", "--job", "randread-4k-qd1"]).unwrap();
    match c.cmd {
        Cmd::Bench(a) => assert_eq!(a.jobs, ["randread-4k-qd1"]),
        _ => panic!("not bench"),
    }
}

fn chaos_args(extra: &[&str]) -> Result<ChaosArgs, clap::Error> {
    let mut v = vec!["nvmf-rdma", "chaos"];
    v.extend_from_slice(extra);
    match Cli::try_parse_from(v)?.cmd {
        Cmd::Chaos(a) => Ok(a),
        _ => panic!("not chaos"),
    }
}

#[test]
fn chaos_flags_and_defaults() {
    let a = chaos_args(&[]).unwrap();
    assert_eq!(
        (a.size, a.workers, a.seconds, a.every, a.down_max, a.seed, a.output),
        (
            256 << 20,
            8,
            20.0,
            Duration::from_secs(2),
            Duration::from_millis(200),
            None,
            OutputFormat::Normal
        )
    );
    // Chaos's policy defaults: reconnect at once, give up after a minute.
    let c = a.config(1);
    assert_eq!(c.policy.reconnect_delay, Duration::ZERO);
    assert_eq!(c.policy.ctrl_loss_tmo, Some(Duration::from_secs(60)));
    let a = chaos_args(&[
        "--faults",
        "replug-other,user-reset",
        "--every",
        "500ms",
        "--seed",
        "9",
        "-l",
        "-1",
        "-o",
        "json",
    ])
    .unwrap();
    assert_eq!(a.faults, [FaultKind::ReplugOther, FaultKind::UserReset]);
    assert_eq!((a.every, a.seed), (Duration::from_millis(500), Some(9)));
    assert_eq!(a.output, OutputFormat::Json);
    assert_eq!(a.policy.ctrl_loss_tmo, Some(Tmo(None)));
    for bad in [
        &["--faults", "meteor"][..],
        &["--every", "soon"][..],
        &["--workers", "0"][..],
        &["-o", "xml"][..],
        // No built-in target on a kernel device: --device needs --traddr.
        &["--device", "rxe0", "--faults", "reset"][..],
    ] {
        assert!(chaos_args(bad).is_err(), "{bad:?}");
    }
}

/// The faults each place takes by default, and the run's checks (ChaosConfig::check) on
/// what the flags ask for.
#[test]
fn chaos_faults_follow_the_target_and_the_device() {
    let ext = ["-a", "192.168.100.2", "-n", "nqn.x"];
    let rxe = ["--device", "rxe0", "-a", "192.168.100.2", "-n", "nqn.x"];
    let with = |a: &[&'static str], b: &[&'static str]| [a, b].concat();
    use FaultKind::*;
    for (args, faults) in [
        (vec![], vec![Reset, Replug, TargetRestart]),
        (ext.to_vec(), vec![Reset, Replug]),
        (rxe.to_vec(), KERNEL_FAULTS.to_vec()),
    ] {
        let c = chaos_args(&args).unwrap().config(1);
        assert_eq!(c.faults, faults, "{args:?}");
        assert!(c.check().is_ok(), "{args:?}");
    }
    for (args, want) in [
        (
            with(&ext, &["--faults", "target-restart"]),
            "needs the built-in target",
        ),
        (
            with(&rxe, &["--faults", "reset,replug"]),
            "rdma link delete rxe0",
        ),
        (vec!["--every", "1ms"], ""),
        (vec!["--size", "4K", "--workers", "8"], ""),
    ] {
        let e = chaos_args(&args).unwrap().config(1).check();
        assert!(e.is_err_and(|e| e.to_string().contains(want)), "{args:?}");
    }
    let ok = with(&rxe, &["--faults", "reset,user-reset"]);
    assert!(chaos_args(&ok).unwrap().config(1).check().is_ok());
}

#[test]
fn man_pages_and_completions_cover_the_daemon_commands() {
    use clap::CommandFactory;
    let dir = std::env::temp_dir().join(format!("nvmf-man-{}", std::process::id()));
    write_man_pages(&dir).unwrap();
    let page = std::fs::read_to_string(dir.join("nvmf-rdma-daemon.1")).unwrap();
    assert!(page.contains("connect\\-all"), "{page}");
    assert!(dir.join("nvmf-rdma.1").exists() && dir.join("nvmf-rdma-list-subsys.1").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    clap_complete::generate(
        clap_complete::Shell::Bash,
        &mut Cli::command(),
        "nvmf-rdma",
        &mut out,
    );
    let s = String::from_utf8(out).unwrap();
    for w in [
        "daemon",
        "connect-all",
        "disconnect-all",
        "list-subsys",
        "--duplicate-connect",
    ] {
        assert!(s.contains(w), "completions lack {w}");
    }
}

/// --metrics-addr serves this process's controllers: the commands that have none refuse it.
#[test]
fn metrics_addr_is_refused_where_the_process_holds_no_controller() {
    let with = |cmd: &[&str]| {
        let argv = [&["nvmf-rdma"][..], cmd, &["--metrics-addr", "127.0.0.1:1"]].concat();
        Cli::try_parse_from(argv)
            .unwrap()
            .setup()
            .unwrap_err()
            .to_string()
    };
    assert!(with(&["list"]).contains("for connect, daemon"));
    let e = with(&["connect", "-a", "127.0.0.1", "-n", "nqn.a:b"]);
    assert!(
        e.contains("nvmf-rdma daemon") && e.contains("--foreground"),
        "{e}"
    );
}

#[test]
fn every_man_page_has_examples_exit_status_environment_and_files() {
    use clap::CommandFactory;
    let cmd = Cli::command();
    let names = std::iter::once("nvmf-rdma".to_string()).chain(
        cmd.get_subcommands()
            .map(|s| s.get_name().to_string())
            .filter(|n| n != "help"),
    );
    for name in names {
        let extra = crate::manpage::extra_sections(&name);
        for section in [
            ".SH EXAMPLES",
            ".SH \"EXIT STATUS\"",
            ".SH ENVIRONMENT",
            ".SH FILES",
        ] {
            assert!(extra.contains(section), "{name}: no {section}");
        }
        let examples = crate::manpage::examples(&name);
        assert!(!examples.is_empty(), "{name} has no example");
        // Each example is a command line this binary parses.
        for (_, line) in examples {
            let Some(rest) = line.strip_prefix("nvmf-rdma ") else {
                continue;
            };
            let words: Vec<&str> = rest.split_whitespace().take_while(|w| *w != "|").collect();
            let argv = std::iter::once("nvmf-rdma").chain(words.iter().copied());
            if let Err(e) = Cli::try_parse_from(argv) {
                panic!("{name}: example `{line}` does not parse: {e}");
            }
        }
    }
}

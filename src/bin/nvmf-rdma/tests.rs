//! Unit tests of the command line.

use super::*;
use std::time::Duration;

use clap::Parser;

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

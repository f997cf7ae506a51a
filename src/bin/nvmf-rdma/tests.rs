//! Unit tests of the command line.

use super::*;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use nvmf_rdma::cli::host::*;
use nvmf_rdma::cli::metrics_http;
use nvmf_rdma::cli::support::Tmo;
use nvmf_rdma::export::ExportAddr;
use nvmf_rdma::harness::chaos::config::KERNEL_FAULTS;
use nvmf_rdma::harness::nvmf_perf::{self, LocalTarget, DEMO_NQN};
use nvmf_rdma::reconnect::{IdentityMatch, Policy};
use nvmf_rdma::transport::ConnectOptions;

#[test]
fn system_host_ids_as_nvme_cli_keeps_them() {
    let dir = std::env::temp_dir().join(format!("nvmf-hostids-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fresh = || ConnectOptions::new("127.0.0.1:4791".parse().unwrap(), "nqn.x:y");
    // Nothing there: our defaults stand.
    let mut o = fresh();
    apply_system_host_ids(&mut o, &dir);
    assert_eq!(o.hostnqn, fresh().hostnqn);
    // A host ID alone names the NQN too.
    std::fs::write(dir.join("hostid"), "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n").unwrap();
    let mut o = fresh();
    apply_system_host_ids(&mut o, &dir);
    assert_eq!(o.hostid[..4], [0x0f, 0x1e, 0x2d, 0x3c]);
    assert_eq!(
        o.hostnqn,
        "nqn.2014-08.org.nvmexpress:uuid:0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    );
    // The host NQN file wins for the NQN; a bad one is ignored.
    std::fs::write(dir.join("hostnqn"), "nqn.2014-08.org.nvmexpress:uuid:sys\n").unwrap();
    let mut o = fresh();
    apply_system_host_ids(&mut o, &dir);
    assert_eq!(o.hostnqn, "nqn.2014-08.org.nvmexpress:uuid:sys");
    std::fs::write(dir.join("hostnqn"), "not an nqn").unwrap();
    std::fs::write(dir.join("hostid"), "zz").unwrap();
    let mut o = fresh();
    apply_system_host_ids(&mut o, &dir);
    assert_eq!(
        (o.hostnqn.clone(), o.hostid),
        (fresh().hostnqn, fresh().hostid)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

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
fn cli_parses_nvme_cli_style_flags() {
    let c = Cli::try_parse_from([
        "nvmf-rdma",
        "connect",
        "-t",
        "rdma",
        "-a",
        "127.0.0.1",
        "-s",
        "4420",
        "-n",
        "nqn.a:b",
        "-i",
        "2",
        "-Q",
        "64",
        "-k",
        "5",
        "-c",
        "1",
        "-l",
        "-1",
        "--fast_io_fail_tmo",
        "3",
    ])
    .unwrap();
    let Cmd::Connect { sub: s, .. } = c.cmd else {
        panic!("not connect")
    };
    assert_eq!(s.fabric.traddr, "127.0.0.1:4791".parse().unwrap());
    assert_eq!((s.nr_io_queues, s.queue_size), (2, 64));
    let o = options(&s).unwrap();
    assert_eq!(o.policy.ctrl_loss_tmo, None, "-1 = forever");
    assert_eq!(o.policy.fast_io_fail_tmo, Some(Duration::from_secs(3)));
    assert_eq!(o.policy.reconnect_delay, Duration::from_secs(1));
    assert_eq!(o.policy.keep_alive_tmo, Duration::from_secs(5));
    assert_eq!(o.keep_alive_tmo, Duration::from_secs(5));
    let bad = Cli::try_parse_from(["nvmf-rdma", "connect", "-a", "nowhere", "-n", "x"]);
    assert!(bad.is_err());
    let c = Cli::try_parse_from([
        "nvmf-rdma",
        "connect",
        "-t",
        "tcp",
        "-a",
        "127.0.0.1",
        "-n",
        "nqn.a:b",
    ])
    .unwrap();
    let Cmd::Connect { sub: s, .. } = c.cmd else {
        panic!()
    };
    assert!(options(&s).unwrap_err().to_string().contains("only rdma"));
}

fn connect_args(extra: &[&str]) -> Result<Subsys, clap::Error> {
    let mut v = vec!["nvmf-rdma", "connect", "-a", "127.0.0.1", "-n", "nqn.a:b"];
    v.extend_from_slice(extra);
    match Cli::try_parse_from(v)?.cmd {
        Cmd::Connect { sub, .. } => Ok(sub),
        _ => panic!("not connect"),
    }
}

#[test]
fn connect_policy_flags_fill_the_policy() {
    // Linux's defaults when nothing is given.
    let o = options(&connect_args(&[]).unwrap()).unwrap();
    assert_eq!(o.policy, Policy::default());
    assert_eq!(o.io_timeout, Duration::from_secs(30));
    let s = connect_args(&[
        "-c",
        "0",
        "-l",
        "60",
        "--fast-io-fail-tmo",
        "-1",
        "--replug-window",
        "5",
        "--identity",
        "pci",
        "--io-timeout",
        "7",
        "-k",
        "0",
    ])
    .unwrap();
    let o = options(&s).unwrap();
    assert_eq!(
        o.policy,
        Policy {
            ctrl_loss_tmo: Some(Duration::from_secs(60)),
            reconnect_delay: Duration::ZERO,
            fast_io_fail_tmo: None,
            keep_alive_tmo: Duration::ZERO,
            replug_window: Duration::from_secs(5),
            identity: IdentityMatch::Pci,
        }
    );
    assert_eq!(o.io_timeout, Duration::from_secs(7));
    // Chaos defaults apply only where no flag was given.
    let r = connect_args(&["-l", "-1"])
        .unwrap()
        .policy
        .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
    assert_eq!(r.policy.ctrl_loss_tmo, None);
    assert_eq!(r.policy.reconnect_delay, Duration::ZERO);
}

#[test]
fn bad_policy_values_are_clap_errors() {
    for (args, want) in [
        (&["-l", "-2"][..], "forever"),
        (&["-l", "ten"][..], "whole number"),
        (&["--fast_io_fail_tmo", "-5"][..], "forever"),
        (&["-c", "-1"][..], ">= 0"),
        (&["-k", "-1"][..], ">= 0"),
        (&["--identity", "serial"][..], "possible values"),
        (&["--io-timeout", "0"][..], ">= 1"),
        (&["--replug-window", "x"][..], "whole number"),
    ] {
        let e = connect_args(args).expect_err(&format!("{args:?} accepted"));
        let msg = e.to_string();
        assert!(
            msg.contains(want) && msg.contains("invalid value"),
            "{args:?}: {msg}"
        );
    }
}

/// GET `addr` over plain HTTP/1.1; the body.
fn scrape(addr: SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

/// The only test here that installs the (process-global) recorder.
#[test]
fn metrics_addr_serves_the_controller_metrics() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let cli =
        Cli::try_parse_from(["nvmf-rdma", "demo", "--metrics-addr", &addr.to_string()]).unwrap();
    cli.setup().unwrap();
    // A second install is refused: the port is taken (and a recorder is in place).
    assert!(metrics_http::install(addr).is_err());
    let t = LocalTarget::start(16 << 20, 9).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = rt.block_on(async {
        let c = nvmf_perf::connect_host(t.addr, DEMO_NQN, 1, 32)
            .await
            .unwrap();
        c.write(1, 0, &[1u8; 4096]).await.unwrap();
        let body = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        c.disconnect().await;
        body
    });
    let live = format!("nvmf_ctrl_state{{subnqn=\"{DEMO_NQN}\"}} 1");
    assert!(body.contains(&live), "{body}");
    assert!(body.contains("# HELP nvmf_ctrl_recoveries_total"), "{body}");
    assert!(
        body.contains("nvmf_ctrl_reconnect_attempts_total"),
        "{body}"
    );
    assert!(body.contains("softhca_tx_packets_total"), "{body}");
    // Junk at the target's port is dropped and counted by reason.
    let junk = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..3 {
        junk.send_to(b"not a RoCEv2 packet", t.addr).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let malformed = loop {
        let body = scrape(addr);
        let n: u64 = body
            .lines()
            .filter(|l| {
                l.starts_with("softhca_rx_dropped_by_reason_total")
                    && l.contains("reason=\"malformed\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        if n >= 3 || Instant::now() > deadline {
            break n;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(malformed >= 3, "malformed drops counted: {malformed}");
    // Other commands refuse the flag.
    let cli = Cli::try_parse_from(["nvmf-rdma", "list", "--metrics-addr", "127.0.0.1:1"]);
    assert!(cli.unwrap().setup().is_err());
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
        (a.size, a.workers, a.seconds, a.every, a.down_max, a.seed),
        (
            256 << 20,
            8,
            20.0,
            Duration::from_secs(2),
            Duration::from_millis(200),
            None
        )
    );
    assert_eq!(
        a.config(1).faults,
        [
            FaultKind::Reset,
            FaultKind::Replug,
            FaultKind::TargetRestart
        ]
    );
    // Against another target, the default is the host-side faults.
    let ext = chaos_args(&["-a", "192.168.100.2", "-n", "nqn.x"]).unwrap();
    assert_eq!(ext.config(1).faults, [FaultKind::Reset, FaultKind::Replug]);
    assert!(ext.config(1).check().is_ok());
    let e = chaos_args(&[
        "-a",
        "10.0.0.1",
        "-n",
        "nqn.x",
        "--faults",
        "target-restart",
    ])
    .unwrap()
    .config(1)
    .check();
    assert!(e
        .unwrap_err()
        .to_string()
        .contains("needs the built-in target"));
    assert_eq!(a.output, OutputFormat::Normal);
    // Chaos defaults: reconnect at once, give up after a minute.
    let r = a
        .policy
        .resolve(Duration::ZERO, Some(Duration::from_secs(60)));
    assert_eq!(r.policy.reconnect_delay, Duration::ZERO);
    assert_eq!(r.policy.ctrl_loss_tmo, Some(Duration::from_secs(60)));
    assert!(a.config(1).check().is_ok());
    let a = chaos_args(&[
        "--faults",
        "replug-other,user-reset",
        "--every",
        "500ms",
        "--seed",
        "9",
        "-l",
        "-1",
        "--identity",
        "any",
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
    ] {
        assert!(chaos_args(bad).is_err(), "{bad:?}");
    }
    let a = chaos_args(&["--every", "1ms"]).unwrap();
    assert!(a.config(1).check().is_err());
    let a = chaos_args(&["--size", "4K", "--workers", "8"]).unwrap();
    assert!(a.config(1).check().is_err());
}

#[test]
fn chaos_on_a_kernel_device_takes_the_faults_it_can_inflict() {
    let err = |extra: &[&str]| {
        chaos_args(extra)
            .unwrap()
            .config(1)
            .check()
            .err()
            .map(|e| e.to_string())
    };
    let ok = [
        "--device",
        "rxe0",
        "-a",
        "192.168.100.2",
        "-n",
        "nqn.x",
        "--faults",
        "reset,user-reset",
    ];
    assert_eq!(err(&ok), None);
    let dflt = chaos_args(&["--device", "rxe0", "-a", "192.168.100.2", "-n", "nqn.x"]).unwrap();
    assert_eq!(dflt.config(1).faults, KERNEL_FAULTS);
    // No built-in target on a kernel device: --device needs --traddr.
    assert!(chaos_args(&["--device", "rxe0", "--faults", "reset"]).is_err());
    // The run's checks (ChaosConfig::check) see the flags: unplugging is done from outside.
    let mut replug = ok;
    replug[7] = "reset,replug";
    assert!(err(&replug).unwrap().contains("rdma link delete rxe0"));
}

#[test]
fn connect_exports_parse() {
    let c = Cli::try_parse_from([
        "nvmf-rdma",
        "connect",
        "-a",
        "127.0.0.1",
        "-n",
        "nqn.a:b",
        "--nbd",
        "unix:/run/n.sock",
        "--fuse",
        "/mnt/x",
    ])
    .unwrap();
    let Cmd::Connect { export: x, .. } = c.cmd else {
        panic!()
    };
    assert_eq!(x.nbd, Some(ExportAddr::Unix("/run/n.sock".into())));
    assert_eq!(x.fuse, Some(PathBuf::from("/mnt/x")));
    let tcp = [
        "nvmf-rdma",
        "connect",
        "-a",
        "127.0.0.1",
        "-n",
        "x",
        "--nbd",
        "127.0.0.1:10809",
    ];
    assert!(Cli::try_parse_from(tcp).is_ok());
    let bad = [
        "nvmf-rdma",
        "connect",
        "-a",
        "127.0.0.1",
        "-n",
        "x",
        "--nbd",
        "10809",
    ];
    assert!(Cli::try_parse_from(bad).is_err());
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

#[test]
fn metrics_addr_on_a_daemon_connect_is_refused_with_a_hint() {
    let cli = Cli::try_parse_from([
        "nvmf-rdma",
        "connect",
        "-a",
        "127.0.0.1",
        "-n",
        "nqn.a:b",
        "--metrics-addr",
        "127.0.0.1:1",
    ])
    .unwrap();
    let e = cli.setup().unwrap_err().to_string();
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

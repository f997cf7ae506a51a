//! `nvmf-rdma connect` as a process, against a target process that is killed:
//! `disconnect` ends a `connect` whose controller retries forever, a controller that gives
//! up ends `connect` with an error exit, and SIGTERM / SIGHUP stop it cleanly, at any time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:cli-connect";
#[path = "common/proc.rs"]
mod proc;
use proc::{Proc, BIN};

impl Proc {
    fn start(args: &[&str], run_dir: &Path) -> Proc {
        Self::start_umask(args, run_dir, None)
    }

    /// Started through `sh` with `umask` set first, when given.
    fn start_umask(args: &[&str], run_dir: &Path, umask: Option<&str>) -> Proc {
        let mut cmd = match umask {
            None => Command::new(BIN),
            Some(m) => {
                let mut c = Command::new("sh");
                c.args(["-c", &format!("umask {m}; exec \"$0\" \"$@\""), BIN]);
                c
            }
        };
        cmd.args(args).env("NVMF_RDMA_RUN_DIR", run_dir);
        Self::spawn(cmd)
    }
}

struct Rig {
    target: Proc,
    addr: String,
    dir: PathBuf,
}

impl Rig {
    fn new(tag: &str) -> Rig {
        let dir = std::env::temp_dir().join(format!("nvmf-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (target, addr) = proc::start_target(NQN, "16M", &dir, &[]);
        Rig { target, addr, dir }
    }

    fn connect(&self, policy: &[&str]) -> Proc {
        let mut args = vec![
            "connect",
            "--foreground",
            "-a",
            &self.addr,
            "-n",
            NQN,
            "-i",
            "1",
            "-Q",
            "32",
            "--io-timeout",
            "1",
        ];
        args.extend_from_slice(policy);
        let c = Proc::start(&args, &self.dir);
        c.expect("connected to", Duration::from_secs(20));
        c
    }

    fn kill_target(&mut self) {
        self.target.kill();
    }

    fn sockets(&self) -> usize {
        std::fs::read_dir(&self.dir)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().extension().is_some_and(|x| x == "sock"))
                    .count()
            })
            .unwrap_or(0)
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `disconnect` ends a `connect` whose controller is recovering against a dead target: it
/// does not say "disconnected 1 controller(s)" while `connect` keeps running.
#[test]
fn disconnect_ends_connect_while_it_retries_forever() {
    let mut rig = Rig::new("forever");
    let mut c = rig.connect(&["-l", "-1", "-c", "0"]);
    rig.kill_target();
    c.expect("recovering", Duration::from_secs(20));
    c.expect("reconnecting", Duration::from_secs(20));
    let out = Command::new(BIN)
        .args(["disconnect", "-n", NQN])
        .env("NVMF_RDMA_RUN_DIR", &rig.dir)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("disconnected 1 controller(s)"), "{said}");
    // `disconnect` returns once `connect` is done: it is gone, or going, now.
    let st = c.exits(Duration::from_secs(2));
    assert!(st.success(), "exit {st}: {}", c.rest());
    assert_eq!(rig.sockets(), 0, "control socket left behind");
}

/// A controller that gives up (ctrl_loss_tmo) ends `connect` with an error exit, as Linux
/// deletes the controller; before the fix `connect` stayed running until killed.
#[test]
fn a_dead_controller_ends_connect_with_an_error() {
    let mut rig = Rig::new("dead");
    let mut c = rig.connect(&["-l", "1", "-c", "0"]);
    rig.kill_target();
    let st = c.exits(Duration::from_secs(20));
    assert!(!st.success(), "exit {st}: {}", c.rest());
    let rest = c.rest();
    assert!(
        rest.contains("controller is dead (ctrl_loss_tmo expired)"),
        "{rest}"
    );
    assert_eq!(rig.sockets(), 0, "control socket left behind");
}

/// SIGTERM and SIGHUP stop `connect` cleanly (exit 0, socket gone), also while its
/// controller is recovering; before, they killed it outright and left the socket.
#[test]
fn sigterm_and_sighup_stop_connect_cleanly_at_any_time() {
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGHUP, "SIGHUP")] {
        let rig = Rig::new(name);
        let mut c = rig.connect(&["-l", "-1", "-c", "0"]);
        c.signal(sig);
        c.expect(&format!("{name}: disconnecting"), Duration::from_secs(10));
        let st = c.exits(Duration::from_secs(5));
        assert!(st.success(), "{name}: exit {st}: {}", c.rest());
        assert_eq!(rig.sockets(), 0, "{name}: control socket left behind");
    }
    let mut rig = Rig::new("sigint-recovering");
    let mut c = rig.connect(&["-l", "-1", "-c", "0"]);
    rig.kill_target();
    c.expect("reconnecting", Duration::from_secs(20));
    c.signal(libc::SIGINT);
    let st = c.exits(Duration::from_secs(5));
    assert!(
        st.success(),
        "SIGINT while recovering: exit {st}: {}",
        c.rest()
    );
}

/// Security review #14: under umask 000 the run directory is 0700 and the control socket
/// 0600, and another user cannot disconnect the controller (before: both 0777, and user
/// `nobody` disconnected a root-owned controller).
#[test]
fn the_control_socket_is_private_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let rig = Rig::new("umask");
    let dir = rig.dir.join("run");
    let args = [
        "connect",
        "--foreground",
        "-a",
        &rig.addr,
        "-n",
        NQN,
        "-i",
        "1",
        "-Q",
        "32",
        "-l",
        "5",
    ];
    let mut c = Proc::start_umask(&args, &dir, Some("000"));
    c.expect("connected to", Duration::from_secs(20));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "run dir");
    let sock = dir.join("nvmf0.sock");
    assert_eq!(mode(&sock), 0o600, "control socket");
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let setpriv = Command::new("setpriv").arg("--version").output().is_ok();
    if root && setpriv {
        // The parent must be passable for the other user to reach the run dir at all.
        std::fs::set_permissions(&rig.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
            .args(["disconnect", "-n", NQN])
            .env("NVMF_RDMA_RUN_DIR", &dir)
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "another user disconnected our controller"
        );
        assert!(c.child.try_wait().unwrap().is_none(), "connect ended");
    } else {
        eprintln!("SKIPPED (part): the other-user check needs root and setpriv");
    }
    c.signal(libc::SIGTERM);
    assert!(c.exits(Duration::from_secs(5)).success());
}

/// Security review #12: an NBD export whose process runs out of file descriptors keeps its
/// listener. `connect --nbd` runs with RLIMIT_NOFILE 48; 80 clients connect, so accept()
/// fails with EMFILE for those beyond; once they leave, a new client is served. Before, the
/// first EMFILE ended the listener for good (new clients were refused) while `connect` ran on.
#[test]
fn the_nbd_listener_outlives_running_out_of_file_descriptors() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::os::unix::process::CommandExt;
    let rig = Rig::new("emfile");
    let sock = rig.dir.join("nbd.sock");
    let nbd = format!("unix:{}", sock.display());
    let mut cmd = Command::new(BIN);
    cmd.args([
        "connect",
        "--foreground",
        "-a",
        &rig.addr,
        "-n",
        NQN,
        "-i",
        "1",
        "-Q",
        "16",
        "--nbd",
        &nbd,
    ])
    .env("NVMF_RDMA_RUN_DIR", &rig.dir);
    // SAFETY: setrlimit is async-signal-safe; it only lowers this child's own limit.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 48,
                rlim_max: 48,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut c = Proc::spawn(cmd);
    c.expect("nbd: serving", Duration::from_secs(20));
    let greeted = |s: &mut UnixStream, wait: Duration| {
        s.set_read_timeout(Some(wait)).unwrap();
        let mut g = [0u8; 8];
        s.read_exact(&mut g).is_ok() && &g == b"NBDMAGIC"
    };
    let mut clients: Vec<UnixStream> = Vec::new();
    for _ in 0..80 {
        match UnixStream::connect(&sock) {
            Ok(s) => clients.push(s),
            Err(_) => break,
        }
    }
    // Accepted clients are greeted at once; the rest wait in the backlog.
    let mut served = 0;
    for s in clients.iter_mut() {
        served += usize::from(greeted(s, Duration::from_millis(300)));
    }
    assert!(
        served < clients.len(),
        "all {} clients were accepted: the descriptor limit was not reached",
        clients.len()
    );
    let n = clients.len();
    drop(clients);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ok =
            UnixStream::connect(&sock).is_ok_and(|mut s| greeted(&mut s, Duration::from_secs(2)));
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the NBD listener is gone after EMFILE ({served} of {n} clients had been served); connect said:\n{}",
            c.rest()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(c.child.try_wait().unwrap().is_none(), "connect ended");
    c.signal(libc::SIGTERM);
    assert!(c.exits(Duration::from_secs(10)).success(), "{}", c.rest());
}

/// `list` shows a foreground `connect` as it shows a daemon's controller: `traddr` is the
/// address alone, as nvme-cli shows it. Before one builder served both, a foreground
/// connect's traddr read "127.0.0.1:PORT" (the soft-HCA's UDP port).
#[test]
fn list_shows_a_foreground_connects_address_without_its_port() {
    let rig = Rig::new("list");
    let _c = rig.connect(&[]);
    let out = Command::new(BIN)
        .args(["list", "-o", "json"])
        .env("NVMF_RDMA_RUN_DIR", &rig.dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    let (ip, _udp_port) = rig.addr.rsplit_once(':').unwrap();
    assert_eq!(v["controllers"][0]["traddr"], ip, "{v}");
}

//! The daemon's registry in process, no child process: a built-in target on loopback, a
//! [`Daemon`] called as the socket server calls it, and its log captured. Connect, the in-use
//! refusal, a namespace the target adds showing up (the AEN rescan), a controller that gave
//! up being reaped, and SIGHUP's reload of the config file.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvmf_rdma::daemon::proto::{
    ConnectParams, ErrorCode, ExportInfo, LineStatus, ProtoError, Reply, Request,
};
use nvmf_rdma::daemon::{Daemon, DaemonConfig, Reporter};
use nvmf_rdma::driver::SoftHca;
use nvmf_rdma::nvmet::{Namespace, Target};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:daemon-registry";
const MIB: u64 = 1 << 20;

/// The daemon's log, kept for the test to read.
#[derive(Default)]
struct Lines(Mutex<Vec<String>>);

impl Reporter for Lines {
    fn say(&self, line: &str) {
        self.0.lock().unwrap().push(line.to_string());
    }
}

impl Lines {
    fn has(&self, what: &[&str]) -> bool {
        self.0
            .lock()
            .unwrap()
            .iter()
            .any(|l| what.iter().all(|w| l.contains(w)))
    }
}

use crate::export_common::TempDir as Dir;

/// The built-in target serving one 8 MiB RAM namespace on loopback.
async fn target(i: u8) -> (Target<SoftHca>, SoftHca) {
    port(i, Arc::new(Namespace::ram(1, 8 * MIB, 9))).await
}

fn daemon(dir: &Path) -> (Daemon, Arc<Lines>) {
    let lines = Arc::new(Lines::default());
    let d = Daemon::new(DaemonConfig {
        run_dir: dir.join("run"),
        config_dir: dir.join("etc"),
        client_timeout: Duration::from_secs(30),
        report: lines.clone(),
    });
    std::fs::create_dir_all(dir.join("etc")).unwrap();
    (d, lines)
}

fn params(addr: SocketAddr) -> ConnectParams {
    ConnectParams {
        traddr: addr.to_string(),
        nqn: NQN.into(),
        nr_io_queues: Some(1),
        queue_size: Some(32),
        ..ConnectParams::default()
    }
}

async fn connect(d: &Daemon, p: ConnectParams) -> Result<String, ProtoError> {
    let r = crate::rig::within(
        20,
        "connect",
        d.handle(Request::Connect {
            params: Box::new(p),
        }),
    )
    .await?;
    match r {
        Reply::Connect(c) => Ok(c.device),
        r => panic!("connect answered {r:?}"),
    }
}

async fn list(d: &Daemon) -> Vec<nvmf_rdma::daemon::proto::ControllerInfo> {
    match d.handle(Request::List {}).await.unwrap() {
        Reply::List(l) => l.controllers,
        r => panic!("list answered {r:?}"),
    }
}

/// Poll `list` until `f` holds, for at most `secs`.
async fn list_until(
    d: &Daemon,
    secs: u64,
    what: &str,
    f: impl Fn(&[nvmf_rdma::daemon::proto::ControllerInfo]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let l = list(d).await;
        if f(&l) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {l:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_lists_a_live_controller_and_refuses_a_duplicate() {
    let dir = Dir::new("connect");
    let (_t, hca) = target(1).await;
    let (d, lines) = daemon(&dir.0);
    let name = connect(&d, params(hca.addr())).await.unwrap();
    assert_eq!(name, "nvmf0");
    let l = list(&d).await;
    assert_eq!(l.len(), 1);
    assert_eq!(
        (l[0].state.as_str(), l[0].subnqn.as_str(), l[0].trsvcid),
        ("live", NQN, 4420)
    );
    assert_eq!(l[0].capacity(), 8 * MIB);
    assert!(lines.has(&["nvmf0: connected"]));
    let e = connect(&d, params(hca.addr())).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Duplicate, "{e}");
    let mut again = params(hca.addr());
    again.duplicate_connect = true;
    assert_eq!(connect(&d, again).await.unwrap(), "nvmf1");
    d.shutdown(false).await.unwrap();
    assert!(list(&d).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_is_refused_while_an_nbd_client_holds_the_export() {
    let dir = Dir::new("inuse");
    let (_t, hca) = target(2).await;
    let (d, _lines) = daemon(&dir.0);
    let sock = dir.0.join("nbd.sock");
    let mut p = params(hca.addr());
    p.nbd = Some(format!("unix:{}", sock.display()));
    let name = connect(&d, p).await.unwrap();
    let client = tokio::net::UnixStream::connect(&sock).await.unwrap();
    list_until(&d, 10, "the NBD client counted", |l| {
        matches!(l[0].exports[..], [ExportInfo::Nbd { clients: 1, .. }])
    })
    .await;
    let disconnect = |force| Request::Disconnect {
        device: Some(name.clone()),
        nqn: None,
        force,
    };
    let e = d.handle(disconnect(false)).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InUse, "{e}");
    assert!(
        e.message.contains("nvmf0 is in use") && e.message.contains("NBD client"),
        "{e}"
    );
    // The client is named: this process, by its pid.
    let me = format!("(pid {})", std::process::id());
    assert!(e.message.contains(&me), "{e}");
    assert_eq!(
        list(&d).await.len(),
        1,
        "a refused disconnect takes nothing away"
    );
    drop(client);
    list_until(&d, 10, "the NBD client gone", |l| {
        matches!(l[0].exports[..], [ExportInfo::Nbd { clients: 0, .. }])
    })
    .await;
    match d.handle(disconnect(false)).await.unwrap() {
        Reply::Disconnect(r) => assert_eq!(r.disconnected, ["nvmf0"]),
        r => panic!("{r:?}"),
    }
    assert!(!sock.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_the_target_adds_shows_up_in_list() {
    let dir = Dir::new("aen");
    let (t, hca) = target(3).await;
    let (d, lines) = daemon(&dir.0);
    connect(&d, params(hca.addr())).await.unwrap();
    t.add_namespace(NQN, Namespace::ram(2, 4 * MIB, 12))
        .unwrap();
    list_until(&d, 10, "namespace 2 listed", |l| {
        l[0].namespaces
            .iter()
            .any(|n| n.nsid == 2 && n.block_size == 4096)
    })
    .await;
    assert!(lines.has(&["nvmf0: namespaces changed", "2 ("]));
    d.shutdown(false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_that_gave_up_is_reaped() {
    let dir = Dir::new("reap");
    let (_t, hca) = target(4).await;
    let (d, lines) = daemon(&dir.0);
    let mut p = params(hca.addr());
    p.ctrl_loss_tmo = Some(1);
    p.reconnect_delay = Some(0);
    p.keep_alive_tmo = Some(1);
    connect(&d, p).await.unwrap();
    // The target's device dies: nothing answers on its address any more.
    hca.fatal();
    hca.stopped().await;
    list_until(&d, 30, "the dead controller removed", |l| l.is_empty()).await;
    assert!(lines.has(&["nvmf0: dead; removed"]));
    // Its name is free again.
    let (_t2, hca2) = target(5).await;
    assert_eq!(connect(&d, params(hca2.addr())).await.unwrap(), "nvmf0");
    d.shutdown(false).await.unwrap();
}

/// A file of `n` bytes of a pattern, for the descriptor tests.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + i / 4096) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_data_goes_through_a_passed_descriptor_both_ways() {
    use std::os::fd::OwnedFd;
    let dir = Dir::new("fd");
    let (_t, hca) = target(6).await;
    let (d, _lines) = daemon(&dir.0);
    let name = connect(&d, params(hca.addr())).await.unwrap();
    // More than one piece, and a last piece shorter than the others.
    let data = pattern(6 << 20);
    let input = dir.0.join("in.bin");
    std::fs::write(&input, &data).unwrap();
    let mut heard = Vec::new();
    let req = Request::WriteFromFd {
        device: name.clone(),
        nsid: 1,
        lba: 16,
        size: data.len() as u64,
        progress: true,
    };
    let f = OwnedFd::from(std::fs::File::open(&input).unwrap());
    let r = d
        .handle_fd(req, Some(f), &mut |done, total| heard.push((done, total)))
        .await
        .unwrap();
    assert!(
        matches!(r, Reply::Copied(ref c) if c.copied == data.len() as u64),
        "{r:?}"
    );
    assert_eq!(heard.last(), Some(&(data.len() as u64, data.len() as u64)));
    // Back through a socket pair, as a pipe to a reader would take it.
    let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &mine, &mut got).unwrap();
        got
    });
    let req = Request::ReadToFd {
        device: name.clone(),
        nsid: 1,
        lba: 16,
        size: data.len() as u64,
        progress: false,
    };
    d.handle_fd(req, Some(OwnedFd::from(theirs)), &mut |_, _| {})
        .await
        .unwrap();
    assert!(reader.join().unwrap() == data, "the bytes read back differ");
    // Without a descriptor, or past the namespace's end: refused with what to do.
    let req = |lba| Request::ReadToFd {
        device: name.clone(),
        nsid: 1,
        lba,
        size: 4096,
        progress: false,
    };
    let e = d.handle(req(0)).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
    assert!(e.message.contains("descriptor"), "{e}");
    let out = OwnedFd::from(std::fs::File::create(dir.0.join("out.bin")).unwrap());
    let e = d
        .handle_fd(req(16383), Some(out), &mut |_, _| {})
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest, "{e}");
    // An input shorter than the size asked for fails, naming it.
    let req = Request::WriteFromFd {
        device: name,
        nsid: 1,
        lba: 0,
        size: 2 * data.len() as u64,
        progress: false,
    };
    let f = OwnedFd::from(std::fs::File::open(&input).unwrap());
    let e = d.handle_fd(req, Some(f), &mut |_, _| {}).await.unwrap_err();
    assert!(e.message.contains("short"), "{e}");
    d.shutdown(false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_connects_new_lines_and_reports_the_ones_gone() {
    let dir = Dir::new("reload");
    let (_ta, a) = target(7).await;
    let (_tb, b) = target(8).await;
    let (d, lines) = daemon(&dir.0);
    let conf = dir.0.join("etc").join("discovery.conf");
    let line = |addr: SocketAddr| format!("-a {addr} -n {NQN} -i 1 -Q 32\n");
    std::fs::write(&conf, line(a.addr())).unwrap();
    match d
        .handle(Request::ConnectAll { params: None })
        .await
        .unwrap()
    {
        Reply::ConnectAll(r) => assert_eq!(r.results[0].status, LineStatus::Connected, "{r:?}"),
        r => panic!("{r:?}"),
    }
    std::fs::write(&conf, line(b.addr())).unwrap();
    d.reload().await;
    let l = list(&d).await;
    assert_eq!(
        l.len(),
        2,
        "the new line connected, the old one's controller kept: {l:?}"
    );
    assert!(l
        .iter()
        .any(|c| c.address.as_deref() == Some(&b.addr().to_string())));
    assert!(
        lines.has(&[
            "reload:",
            &a.addr().to_string(),
            "no longer configured",
            "would remove nvmf0"
        ]),
        "{:?}",
        lines.0.lock().unwrap()
    );
    assert!(lines.has(&["reload:", "\"status\":\"connected\"", "nvmf1"]));
    // Read again unchanged: nothing to do.
    d.reload().await;
    assert!(lines.has(&["reload: no new line"]));
    assert_eq!(list(&d).await.len(), 2);
    d.shutdown(false).await.unwrap();
}

/// The subsystem served with `ns` on a soft-HCA of its own: one port of it (two targets
/// with the same namespace are two ports of one subsystem).
async fn port(i: u8, ns: Arc<Namespace>) -> (Target<SoftHca>, SoftHca) {
    crate::rig::serve(crate::rig::device(31, "tgt", i), NQN, vec![ns]).await
}

/// A connect to a second port of a connected subsystem adds a path (as `nvme connect`):
/// `list` shows both controllers as paths of one subsystem with the policy given, each
/// with its ANA state and I/O count. Disconnecting the path that holds the NBD export keeps
/// the export: it goes on through the other path, with the data written through the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_port_adds_a_path_and_the_export_outlives_the_first_path() {
    let dir = Dir::new("multipath");
    let ns = Arc::new(Namespace::ram(1, 8 * MIB, 9));
    let (_ta, a) = port(10, ns.clone()).await;
    let (_tb, b) = port(11, ns).await;
    let (d, lines) = daemon(&dir.0);
    let sock = dir.0.join("nbd.sock");
    let mut p = params(a.addr());
    p.nbd = Some(format!("unix:{}", sock.display()));
    p.iopolicy = Some("round-robin".into());
    assert_eq!(connect(&d, p).await.unwrap(), "nvmf0");
    assert_eq!(connect(&d, params(b.addr())).await.unwrap(), "nvmf1");

    let s = sock.clone();
    tokio::task::spawn_blocking(move || {
        let mut c = crate::export_nbd::Client::connect(&s, false);
        for i in 0..16u64 {
            c.write(i * 4096, &[i as u8; 4096], 0);
        }
    })
    .await
    .unwrap();
    let l = list(&d).await;
    assert_eq!(l.len(), 2);
    for c in &l {
        assert_eq!(c.iopolicy.as_deref(), Some("round-robin"), "{c:?}");
        let path = c.path.as_ref().expect("a path");
        assert_eq!(path.ana_state, [(1, "optimized".to_string())]);
        // Round-robin: both paths carried the writes.
        assert!(path.ios > 0, "{c:?}");
    }

    match d
        .handle(Request::Disconnect {
            device: Some("nvmf0".into()),
            nqn: None,
            force: false,
        })
        .await
        .unwrap()
    {
        Reply::Disconnect(r) => assert_eq!(r.disconnected, ["nvmf0"]),
        r => panic!("{r:?}"),
    }
    assert!(lines.has(&["nvmf0: its exports go on through nvmf1"]));
    let l = list(&d).await;
    assert_eq!(l.len(), 1);
    assert!(
        matches!(l[0].exports[..], [ExportInfo::Nbd { .. }]),
        "{l:?}"
    );
    let s = sock.clone();
    tokio::task::spawn_blocking(move || {
        let mut c = crate::export_nbd::Client::connect(&s, false);
        for i in 0..16u64 {
            assert_eq!(c.read(i * 4096, 4096), vec![i as u8; 4096]);
        }
    })
    .await
    .unwrap();
    list_until(&d, 10, "the NBD client gone", |l| {
        matches!(l[0].exports[..], [ExportInfo::Nbd { clients: 0, .. }])
    })
    .await;
    d.shutdown(false).await.unwrap();
    assert!(!sock.exists());
}

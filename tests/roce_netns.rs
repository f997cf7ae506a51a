//! ICRCs of RoCEv2 peers checked against the real IPv4 header, end to end with
//! the release binary: a soft target and a soft host in two network namespaces joined by a
//! veth pair on private addresses, so each treats the other as a RoCEv2 device
//! (`roce_peer`: not loopback) and reads its datagrams off a raw socket.
//!
//! - A `verify` counts ICRCs verified, none mismatched, none unchecked.
//! - nftables in the host's namespace overwrites one payload byte of every 50th full-sized
//!   datagram to UDP port 4791: the host drops each as an ICRC error, the target resends
//!   (go-back-N) and every byte reads back intact. The same corruption with the check off
//!   (`NVMF_RDMA_ICRC=skip`) reaches the data: the kernel's UDP checksum does not stop it
//!   (the datagram crossed the veth with its checksum left to offload), the ICRC does.
//! - Without CAP_NET_RAW the host falls back to unchecked ICRCs and says how many.
//! - CM REQs with valid ICRCs from invented source addresses (a peer that forges its
//!   source never sees the REP, so never sends the RTU) do not keep a real host out.
//!
//! Needs root (netns, raw sockets) and `nft` for the corruption; skips with a message
//! where there is no root or no netns (CI runs as root and installs nftables).

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nvmf-rdma");
const NQN: &str = "nqn.2024-01.io.nvmf-rdma:icrc";
const TARGET_IP: &str = "10.231.7.1";
const HOST_IP: &str = "10.231.7.2";

/// Two namespaces and a veth pair between them, with a target running in the first.
/// Dropping it stops the target and deletes both namespaces (and so the veth).
struct Pair {
    target_ns: String,
    host_ns: String,
    target: Option<Child>,
    /// The target's stdout and stderr.
    log: std::path::PathBuf,
}

fn ip(args: &[&str]) -> std::io::Result<Output> {
    Command::new("ip").args(args).output()
}

fn ok(o: std::io::Result<Output>, what: &str) {
    let o = o.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

impl Pair {
    /// `None` (after saying why) where this machine cannot run the test.
    fn new() -> Option<Pair> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: needs root (network namespaces, raw sockets)");
            return None;
        }
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "{}{}",
            std::process::id() % 100_000,
            N.fetch_add(1, Ordering::Relaxed)
        );
        let (t, h) = (format!("icrc-t{tag}"), format!("icrc-h{tag}"));
        match ip(&["netns", "add", &t]) {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                eprintln!(
                    "SKIP: no network namespaces here: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                return None;
            }
            Err(e) => {
                eprintln!("SKIP: cannot run ip: {e}");
                return None;
            }
        }
        let mut p = Pair {
            target_ns: t.clone(),
            host_ns: h.clone(),
            target: None,
            log: std::path::PathBuf::new(),
        };
        ok(ip(&["netns", "add", &h]), "ip netns add");
        let (vt, vh) = (format!("ict{tag}"), format!("ich{tag}"));
        ok(
            ip(&[
                "link", "add", &vt, "netns", &t, "type", "veth", "peer", "name", &vh, "netns", &h,
            ]),
            "ip link add veth",
        );
        for (ns, dev, addr) in [(&t, &vt, TARGET_IP), (&h, &vh, HOST_IP)] {
            ok(
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]),
                "ip addr add",
            );
            ok(ip(&["-n", ns, "link", "set", dev, "up"]), "ip link set up");
            ok(
                ip(&["-n", ns, "link", "set", "lo", "up"]),
                "ip link set lo up",
            );
        }
        let log = std::env::temp_dir().join(format!("icrc-target-{tag}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &t, BIN, "target", "--listen", TARGET_IP])
            .args(["--ram", "64M", "-n", NQN])
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start the target");
        p.target = Some(child);
        p.log = log.clone();
        let t0 = Instant::now();
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("listening")
        {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the target did not start: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(p)
    }

    /// Run a command in the host's namespace, `env` added to its environment.
    fn in_host(&self, env: &[(&str, &str)], cmd: &[&str]) -> Output {
        let mut c = Command::new("timeout");
        c.args(["120", "ip", "netns", "exec", &self.host_ns])
            .args(cmd);
        for (k, v) in env {
            c.env(k, v);
        }
        c.stdin(Stdio::null())
            .output()
            .expect("run in the host netns")
    }

    /// `nvmf-rdma verify` of `size` from the host's namespace: (succeeded, stdout+stderr).
    fn verify(&self, env: &[(&str, &str)], prefix: &[&str], size: &str) -> (bool, String) {
        let mut cmd: Vec<&str> = prefix.to_vec();
        cmd.extend([BIN, "verify", "-a", TARGET_IP, "-n", NQN, "--size", size]);
        let o = self.in_host(env, &cmd);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status.success(), text)
    }
}

impl Pair {
    /// Stop the target as Ctrl-C does and return what it said.
    fn stop_target(&mut self) -> String {
        if let Some(mut c) = self.target.take() {
            // SAFETY: kill(2) on our child's pid (`ip netns exec` execs the target).
            unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
            let _ = c.wait();
        }
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        if let Some(mut c) = self.target.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = ip(&["netns", "del", &self.host_ns]);
        let _ = ip(&["netns", "del", &self.target_ns]);
    }
}

/// (verified, mismatched, unchecked) from verify's `icrc:` line.
fn icrc_counts(out: &str) -> (u64, u64, u64) {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("icrc: "))
        .unwrap_or_else(|| panic!("no icrc line in:\n{out}"));
    let n: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .map(|w| w.parse().unwrap())
        .collect();
    assert_eq!(n.len(), 3, "{line}");
    (n[0], n[1], n[2])
}

#[test]
fn a_roce_peers_icrcs_are_verified_against_the_real_ip_header() {
    let Some(p) = Pair::new() else { return };
    let (ok, out) = p.verify(&[], &[], "4M");
    assert!(ok && out.contains("every byte read back matches"), "{out}");
    let (verified, mismatched, unchecked) = icrc_counts(&out);
    eprintln!("icrc: {verified} verified, {mismatched} mismatched, {unchecked} unchecked");
    assert!(verified > 1000, "{out}");
    assert_eq!((mismatched, unchecked), (0, 0), "{out}");

    // Without CAP_NET_RAW: unchecked, and said so; the data still arrives.
    let (ok, out) = p.verify(&[], &["setpriv", "--bounding-set=-net_raw"], "1M");
    assert!(ok, "{out}");
    let (verified, mismatched, unchecked) = icrc_counts(&out);
    assert_eq!((verified, mismatched), (0, 0), "{out}");
    assert!(unchecked > 0, "{out}");
    assert!(out.contains("no raw socket (CAP_NET_RAW)"), "{out}");

    // ... unless the raw socket is asked for: then no device.
    let (ok, out) = p.verify(
        &[("NVMF_RDMA_ICRC", "raw")],
        &["setpriv", "--bounding-set=-net_raw"],
        "1M",
    );
    assert!(!ok && out.contains("raw socket for ICRC checks"), "{out}");
}

#[test]
fn a_byte_corrupted_in_flight_is_dropped_as_an_icrc_error_and_resent() {
    let Some(p) = Pair::new() else { return };
    if Command::new("nft").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("CI").is_none(),
            "nft (nftables) is missing: .ci/run installs it"
        );
        eprintln!("SKIP: needs nft (apt-get install nftables)");
        return;
    }
    // In the host's namespace, before the raw socket sees it: every 50th datagram to 4791
    // of more than 1000 bytes (a full 1024-byte payload: the target's RDMA WRITEs of read
    // data) gets byte 500 of its UDP payload overwritten. The UDP checksum is not updated.
    let nft = |rule: &str| {
        let o = p.in_host(&[], &["nft", rule]);
        assert!(
            o.status.success(),
            "nft {rule}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    nft("add table ip icrc");
    nft("add chain ip icrc in { type filter hook input priority 0; }");
    nft(
        "add rule ip icrc in udp dport 4791 udp length > 1000 numgen inc mod 50 == 0 \
         @th,4064,8 set 0x5a counter",
    );
    let mangled = || {
        let o = p.in_host(&[], &["nft", "list", "chain", "ip", "icrc", "in"]);
        let s = String::from_utf8_lossy(&o.stdout).to_string();
        let at = s.find("counter packets ").expect("nft counter") + "counter packets ".len();
        s[at..].split(' ').next().unwrap().parse::<u64>().unwrap()
    };

    let (ok, out) = p.verify(&[], &[], "8M");
    assert!(ok && out.contains("every byte read back matches"), "{out}");
    let (verified, mismatched, unchecked) = icrc_counts(&out);
    let hit = mangled();
    eprintln!("nft mangled {hit}; icrc: {verified} verified, {mismatched} mismatched");
    assert!(hit > 20, "nft mangled {hit} datagrams");
    assert!(verified > 1000, "{out}");
    assert_eq!(unchecked, 0, "{out}");
    // A datagram whose byte was already 0x5a is not corrupted; every other one is caught.
    assert!(mismatched > 0 && mismatched <= hit, "{hit} mangled: {out}");

    // The control: the same corruption with the check off reaches the data.
    let (ok, out) = p.verify(&[("NVMF_RDMA_ICRC", "skip")], &[], "8M");
    assert!(
        !ok && out.contains("MISMATCH"),
        "corruption not seen with ICRCs skipped: {out}"
    );
}

/// CM REQs for I/O queues of the target's NVMe-oF port, `n` from each of `srcs`
/// (addresses no interface has), sent from the host's namespace through a raw IP socket as a
/// peer that forges its source address would, each with a valid ICRC over the IPv4 header
/// it goes out with.
fn forge_reqs(host_ns: &str, srcs: &[std::net::Ipv4Addr], n: u32) {
    use nvmf_rdma::cm::{CmConfig, CmEndpoint, ConnectParams, NvmeCmRequest};
    use nvmf_rdma::hca::device::ROCE_V2_PORT;
    use nvmf_rdma::hca::wire::{emit_packet, BthRepr, DethRepr, IcrcContext, Opcode};
    use nvmf_rdma::hca::wire::{PacketHeaders, GSI_QKEY};
    use nvmf_rdma::verbs::{Guid, Psn, Qpn};
    use rand::SeedableRng;
    use std::net::{Ipv4Addr, SocketAddr};
    use std::os::fd::AsRawFd;

    const IP_ID: u16 = 0x1234;
    let ns = std::fs::File::open(format!("/var/run/netns/{host_ns}")).expect("netns file");
    let srcs = srcs.to_vec();
    std::thread::spawn(move || {
        // SAFETY: a valid namespace fd; only this thread moves.
        assert_eq!(
            unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
            0
        );
        // SAFETY: plain socket call.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        let dst: Ipv4Addr = TARGET_IP.parse().unwrap();
        let to = SocketAddr::from((dst, ROCE_V2_PORT));
        let private = NvmeCmRequest {
            qid: 1,
            hrqsize: 32,
            hsqsize: 31,
            cntlid: 0,
        }
        .emit();
        for (k, src) in srcs.iter().enumerate() {
            let from = SocketAddr::from((*src, ROCE_V2_PORT));
            let rng = rand::rngs::StdRng::seed_from_u64(k as u64);
            let mut cm = CmEndpoint::new(CmConfig::new(from.ip(), Guid(0x100 + k as u64)), rng);
            for i in 0..n {
                let params = ConnectParams::new(Qpn::new(0x100 + i), 4420);
                cm.connect(nvmf_rdma::verbs::Instant(0), to, &params, &private)
                    .unwrap();
            }
            let mut psn = 0;
            while let Some((_, mad)) = cm.poll_transmit() {
                let ctx = IcrcContext {
                    src: from,
                    dst: to,
                    ip_id: IP_ID,
                    dont_fragment: true,
                };
                let mut h =
                    PacketHeaders::new(BthRepr::new(Opcode::UD_SEND_ONLY, Qpn::GSI, Psn::new(psn)));
                psn += 1;
                h.deth = Some(DethRepr {
                    qkey: GSI_QKEY,
                    src_qp: Qpn::GSI,
                });
                let mut roce = Vec::new();
                emit_packet(&h, &mad, &ctx, &mut roce);
                let udp_len = 8 + roce.len() as u16;
                let mut pkt = vec![0x45, 0];
                pkt.extend_from_slice(&(20 + udp_len).to_be_bytes());
                pkt.extend_from_slice(&IP_ID.to_be_bytes());
                pkt.extend_from_slice(&[0x40, 0, 64, 17, 0, 0]);
                pkt.extend_from_slice(&src.octets());
                pkt.extend_from_slice(&dst.octets());
                pkt.extend_from_slice(&ROCE_V2_PORT.to_be_bytes());
                pkt.extend_from_slice(&ROCE_V2_PORT.to_be_bytes());
                pkt.extend_from_slice(&udp_len.to_be_bytes());
                pkt.extend_from_slice(&[0, 0]);
                pkt.extend_from_slice(&roce);
                // SAFETY: a zeroed sockaddr_in with family and address set.
                let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_addr.s_addr = u32::from(dst).to_be();
                // SAFETY: pkt and sin outlive the call.
                let r = unsafe {
                    libc::sendto(
                        fd,
                        pkt.as_ptr().cast(),
                        pkt.len(),
                        0,
                        (&sin as *const libc::sockaddr_in).cast(),
                        std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                    )
                };
                assert!(r > 0, "sendto: {}", std::io::Error::last_os_error());
            }
        }
        // SAFETY: our fd.
        unsafe { libc::close(fd) };
    })
    .join()
    .expect("forger thread");
}

#[test]
fn forged_reqs_from_invented_addresses_do_not_lock_a_real_host_out() {
    let Some(mut p) = Pair::new() else { return };
    // Five invented addresses on the veth's network, 256 REQs each: more than the
    // target's 1024 queues, as fast as a raw socket sends them.
    let srcs: Vec<std::net::Ipv4Addr> = (0..5).map(|i| [10, 231, 7, 100 + i].into()).collect();
    forge_reqs(&p.host_ns, &srcs, 256);
    for _ in 0..3 {
        let (ok, out) = p.verify(&[], &[], "1M");
        assert!(ok && out.contains("every byte read back matches"), "{out}");
    }
    // Every forged REQ reached the target (ICRC and all) and was answered or refused.
    let log = p.stop_target();
    let count = |what: &str| -> u64 {
        let at = log
            .find(what)
            .unwrap_or_else(|| panic!("no '{what}' in:\n{log}"));
        let n = log[..at].trim_end().rsplit(' ').next().unwrap();
        n.parse()
            .unwrap_or_else(|_| panic!("'{n}' before '{what}' in:\n{log}"))
    };
    let (connected, refused) = (count("queues connected"), count("refused"));
    assert!(
        connected + refused >= 5 * 256,
        "{connected} accepted, {refused} refused:\n{log}"
    );
}

//! ICRCs of RoCEv2 peers checked against the real IPv4 header (issue 15), end to end with
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

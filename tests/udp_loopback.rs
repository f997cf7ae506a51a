//! The same SEND / RDMA WRITE / RDMA READ checks as the simulator tests, through the tokio
//! driver over real UDP sockets on 127.0.0.1, with and without segmentation offload, and
//! over the loopback path two contexts of one process take to each other.

use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::driver::{Fabric, SoftHca};
use nvmf_rdma::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use nvmf_rdma::hca::rc::{connect_end, create_end, RcEnd, RcOptions};
use nvmf_rdma::hca::*;
use nvmf_rdma::verbs::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn cfg(i: u8) -> DeviceConfig {
    DeviceConfig {
        identity: DeviceIdentity::from_mac(
            &format!("lo{i}"),
            [2, 0, 0, 0, 0, i],
            PciAddr::new(0, 1, i, 0),
        ),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: i as u64,
    }
}

/// How two contexts of this process reach each other.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Path {
    /// UDP, one datagram per packet.
    Udp,
    /// UDP with GSO/GRO.
    UdpOffload,
    /// In memory (`driver::local`).
    Loopback,
    /// UDP with GSO/GRO, from a context on the loopback path (its port, not its device,
    /// computes the ICRC of what it sends over UDP) to one that is not.
    FromLoopbackToUdp,
}

impl Path {
    /// The fabric of context `a` (the requester of `all_ops`) or of the other.
    fn fabric(self, a: bool) -> Fabric {
        Fabric::Udp {
            offload: self != Path::Udp,
            loopback: self == Path::Loopback || (self == Path::FromLoopbackToUdp && a),
        }
    }
}

async fn pair(path: Path, mtu: Mtu) -> (SoftHca, SoftHca, RcEnd, RcEnd) {
    let a = SoftHca::start_on(cfg(1), &path.fabric(true)).await.unwrap();
    let b = SoftHca::start_on(cfg(2), &path.fabric(false))
        .await
        .unwrap();
    connect(&a, &b, mtu)
}

fn connect(a: &SoftHca, b: &SoftHca, mtu: Mtu) -> (SoftHca, SoftHca, RcEnd, RcEnd) {
    let (a, b) = (a.clone(), b.clone());
    let o = RcOptions {
        mtu,
        buf_len: 8 << 20,
        timeout: 14,
        ..RcOptions::default()
    };
    let ea = a.with(|d, _| create_end(d, &o, Psn::new(100))).unwrap();
    let eb = b
        .with(|d, _| create_end(d, &o, Psn::new(0xFF_FFF0)))
        .unwrap();
    a.with(|d, _| connect_end(d, &ea, b.addr(), eb.qpn, eb.psn, &o))
        .unwrap();
    b.with(|d, _| connect_end(d, &eb, a.addr(), ea.qpn, ea.psn, &o))
        .unwrap();
    (a, b, ea, eb)
}

async fn one_wc(h: &SoftHca, cq: CqId) -> WorkCompletion {
    let mut v = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), h.wait_cq(cq, 1, &mut v))
        .await
        .expect("completion within 20 s");
    v[0]
}

/// Post one signaled `op` over `sgl` on `e`'s QP and wait for its completion.
async fn post_one(h: &SoftHca, e: &RcEnd, op: SendOp, sgl: Sgl, wr_id: u64) -> WorkCompletion {
    let wr = SendWr::signaled(wr_id, op, sgl);
    h.with(|d, now| d.post_send(now, e.qpn, wr)).unwrap();
    one_wc(h, e.cq).await
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    SmallRng::seed_from_u64(seed).fill(&mut v[..]);
    v
}

fn snapshot(mem: &HostMem, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mem.read(0, &mut v);
    v
}

const SIZES: [usize; 8] = [1, 255, 1024, 4097, 65_536, 300_001, 1 << 20, 8 << 20];

async fn all_ops(path: Path, mtu: Mtu) {
    let (a, b, ea, eb) = pair(path, mtu).await;
    for (i, &len) in SIZES.iter().enumerate() {
        let sgl = Sgl::one(ea.mr.addr, len as u32, ea.mr.lkey);
        // SEND
        let data = pattern(len, i as u64);
        let got = send_one((&a, &ea), (&b, &eb), &data).await;
        assert!(got == (WcStatus::Success, data), "SEND {len} B");
        // WRITE
        let data = pattern(len, 100 + i as u64);
        ea.mem.write(0, &data);
        let op = SendOp::Write {
            remote_addr: eb.mr.addr,
            rkey: eb.mr.rkey,
        };
        assert_eq!(
            post_one(&a, &ea, op, sgl, 2).await.status,
            WcStatus::Success
        );
        assert!(snapshot(&eb.mem, len) == data, "WRITE {len} B");
        // READ
        let data = pattern(len, 200 + i as u64);
        eb.mem.write(0, &data);
        let op = SendOp::Read {
            remote_addr: eb.mr.addr,
            rkey: eb.mr.rkey,
        };
        let w = post_one(&a, &ea, op, sgl, 3).await;
        assert_eq!((w.status, w.byte_len as usize), (WcStatus::Success, len));
        assert!(snapshot(&ea.mem, len) == data, "READ {len} B");
    }
    for h in [&a, &b] {
        let s = h.with(|d, _| d.stats().clone());
        assert_eq!(s.rx_icrc_errors + s.rx_malformed, 0, "{s:?}");
        // Every packet came the way asked for: off the socket from 127.0.0.1 (not checked:
        // the kernel's loopback is memory to memory), or handed over in memory (not
        // checked: it never left the process).
        if path == Path::Loopback {
            assert_eq!(
                (s.rx_loopback, s.rx_icrc_verified),
                (s.rx_packets, 0),
                "{s:?}"
            );
        } else {
            assert_eq!(
                (s.rx_icrc_unchecked, s.rx_icrc_verified, s.rx_loopback),
                (s.rx_packets, 0, 0),
                "{s:?}"
            );
        }
        assert!(s.rx_bytes > 8 << 20, "{s:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_write_read_over_udp_with_offload() {
    all_ops(Path::UdpOffload, Mtu::Mtu4096).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_write_read_over_udp_without_offload() {
    all_ops(Path::Udp, Mtu::Mtu1024).await;
}

/// Every ICRC the context on the loopback path sends over UDP is checked by the other and
/// must be right: a zero or wrong one is dropped, and the ops time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_write_read_from_the_loopback_path_to_a_context_off_it() {
    all_ops(Path::FromLoopbackToUdp, Mtu::Mtu4096).await;
}

/// Packets that never leave the process carry 16 KiB each, whatever the path MTU says (a
/// quarter of the packets, each with its per-packet work, for large transfers), and only
/// there: towards a context off the loopback path the MTU holds. Measured as the mean size
/// of what a side received during a 1 MiB WRITE and a 1 MiB READ, which a retransmit or a
/// stray ACK cannot move across the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loopback_path_carries_16_kib_per_packet() {
    const LEN: usize = 1 << 20;
    for (path, in_memory) in [(Path::Loopback, true), (Path::FromLoopbackToUdp, false)] {
        let (a, b, ea, eb) = pair(path, Mtu::Mtu4096).await;
        let rx = |h: &SoftHca| h.with(|d, _| (d.stats().rx_packets, d.stats().rx_bytes));
        let mean = |(p0, b0): (u64, u64), (p1, b1): (u64, u64)| (b1 - b0) / (p1 - p0).max(1);
        let check = |what: &str, mean: u64| {
            if in_memory {
                assert!(mean > 8192, "{path:?}: {what}: {mean} B per packet");
            } else {
                assert!(
                    (4096..=4096 + 64).contains(&mean),
                    "{path:?}: {what}: {mean} B"
                );
            }
        };
        let sgl = Sgl::one(ea.mr.addr, LEN as u32, ea.mr.lkey);
        let data = pattern(LEN, 7);
        ea.mem.write(0, &data);
        let before = rx(&b);
        let (remote_addr, rkey) = (eb.mr.addr, eb.mr.rkey);
        let op = SendOp::Write { remote_addr, rkey };
        assert_eq!(
            post_one(&a, &ea, op, sgl, 1).await.status,
            WcStatus::Success
        );
        assert!(snapshot(&eb.mem, LEN) == data, "{path:?}: WRITE");
        check("WRITE", mean(before, rx(&b)));
        let data = pattern(LEN, 8);
        eb.mem.write(0, &data);
        let before = rx(&a);
        let op = SendOp::Read { remote_addr, rkey };
        assert_eq!(
            post_one(&a, &ea, op, sgl, 2).await.status,
            WcStatus::Success
        );
        assert!(snapshot(&ea.mem, LEN) == data, "{path:?}: READ");
        check("READ", mean(before, rx(&a)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_write_read_over_the_loopback_path() {
    all_ops(Path::Loopback, Mtu::Mtu4096).await;
    all_ops(Path::Loopback, Mtu::Mtu1024).await;
}

/// SEND `len` bytes from `from` to `to` over their connected ends; returns what arrived.
async fn send_one(
    from: (&SoftHca, &RcEnd),
    to: (&SoftHca, &RcEnd),
    data: &[u8],
) -> (WcStatus, Vec<u8>) {
    let len = data.len();
    let ((a, ea), (b, eb)) = (from, to);
    ea.mem.write(0, data);
    b.with(|d, _| {
        d.post_recv(
            eb.qpn,
            RecvWr {
                wr_id: 7,
                sgl: Sgl::one(eb.mr.addr, len as u32, eb.mr.lkey),
            },
        )
    })
    .unwrap();
    a.with(|d, now| {
        d.post_send(
            now,
            ea.qpn,
            SendWr::signaled(
                8,
                SendOp::Send,
                Sgl::one(ea.mr.addr, len as u32, ea.mr.lkey),
            ),
        )
    })
    .unwrap();
    assert_eq!(one_wc(a, ea.cq).await.status, WcStatus::Success);
    let w = one_wc(b, eb.cq).await;
    assert_eq!(w.byte_len as usize, len);
    (w.status, snapshot(&eb.mem, len))
}

/// A context reset on the loopback path: its address comes back with a new context, and a
/// peer that had been handing packets to the old one reaches the new one (it looks its
/// destination up again once a context came or went), in memory, not over UDP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loopback_path_follows_a_context_back_on_its_address() {
    let (a, b, ea, eb) = pair(Path::Loopback, Mtu::Mtu4096).await;
    let data = pattern(100_000, 1);
    assert_eq!(
        send_one((&b, &eb), (&a, &ea), &data).await,
        (WcStatus::Success, data.clone())
    );
    let addr = a.addr();
    a.fatal();
    tokio::time::timeout(Duration::from_secs(10), a.stopped())
        .await
        .expect("the driver did not stop after fatal");
    let mut c = cfg(3);
    c.addr = addr;
    let a2 = SoftHca::start_on(c, &Path::Loopback.fabric(true))
        .await
        .unwrap();
    let (_, _, ea2, eb2) = connect(&a2, &b, Mtu::Mtu4096);
    let data = pattern(100_000, 2);
    assert_eq!(
        send_one((&b, &eb2), (&a2, &ea2), &data).await,
        (WcStatus::Success, data)
    );
    let s = a2.with(|d, _| d.stats().clone());
    assert!(s.rx_loopback >= 7 && s.rx_icrc_verified == 0, "{s:?}");
}

/// A fatal reset through the driver: outstanding work flushes, the waiter wakes, the port is
/// released and a new context can bind the same address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fatal_flushes_and_frees_the_port() {
    let (a, _b, ea, eb) = pair(Path::UdpOffload, Mtu::Mtu1024).await;
    a.with(|d, _| {
        for i in 0..8 {
            d.post_recv(
                ea.qpn,
                RecvWr {
                    wr_id: 100 + i,
                    sgl: Sgl::one(ea.mr.addr, 64, ea.mr.lkey),
                },
            )
            .unwrap();
        }
    });
    let waiter = {
        let a = a.clone();
        tokio::spawn(async move {
            let mut v = Vec::new();
            while v.len() < 8 {
                if a.wait_cq(ea.cq, 64, &mut v).await == 0 {
                    break;
                }
            }
            v
        })
    };
    let _ = eb;
    a.fatal();
    let wcs = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(wcs.len(), 8);
    assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlushErr));
    assert!(matches!(
        a.with(|d, now| d.post_send(now, ea.qpn, SendWr::signaled(1, SendOp::Send, Sgl::empty()))),
        Err(VerbsError::DeviceGone)
    ));
    // The driver lets go of the socket; the same address can be bound again. Wait for the
    // driver task to end rather than retry a bind a fixed number of times: under load the
    // task may not have run yet.
    let addr = a.addr();
    tokio::time::timeout(Duration::from_secs(10), a.stopped())
        .await
        .expect("the driver did not stop after fatal");
    let mut c = cfg(9);
    c.addr = addr;
    if let Err(e) = SoftHca::start(c).await {
        panic!("address {addr} not released after fatal: {e}");
    }
}

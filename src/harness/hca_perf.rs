//! Loopback workloads shared by the demo, the `bench` subcommand and `cargo bench`: two
//! soft-HCAs on 127.0.0.1, each driven by its own single-threaded runtime on its own OS
//! thread (one core per side), moving real bytes through real UDP sockets.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant as StdInstant};

use crate::driver::SoftHca;
use crate::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use crate::hca::rc::{connect_end, create_end, RcEnd, RcOptions};
use crate::verbs::{Mtu, RecvWr, SendOp, SendWr, Sgl, WcStatus, WorkCompletion};
use crate::verbs::{PciAddr, Psn};

/// Which operation a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Write,
    Read,
    Send,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Write => "RDMA WRITE",
            Op::Read => "RDMA READ",
            Op::Send => "SEND",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub op: Op,
    pub msg_size: usize,
    /// Work requests kept in flight.
    pub depth: usize,
    pub duration: Duration,
    pub mtu: Mtu,
    /// Bytes the requester's side of the messages moves through, one message after the
    /// other (an RDMA READ lands there, an RDMA WRITE or SEND leaves from there); 0 for
    /// `depth` messages' worth, which stays in the CPU's caches. A RAM namespace's data is
    /// not in cache: `bench --hca --region 1G` is the raw rate over memory of its size.
    pub region: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct Report {
    pub workload: Workload,
    pub messages: u64,
    pub bytes: u64,
    pub elapsed: Duration,
    pub retransmits: u64,
}

impl Report {
    pub fn gbytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64() / 1e9
    }
    pub fn msgs_per_sec(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }
}

fn config(name: &str, i: u8) -> DeviceConfig {
    DeviceConfig {
        identity: DeviceIdentity::from_mac(
            name,
            [0x52, 0x54, 0, 0, 0x10, i],
            PciAddr::new(0, 0x10, i, 0),
        ),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: 0x1234_5678 + i as u64,
    }
}

/// Start a soft-HCA on a dedicated thread with its own current-thread runtime. The runtime
/// lives until `stop` is dropped.
fn start_on_thread(
    cfg: DeviceConfig,
) -> std::io::Result<(
    SoftHca,
    tokio::runtime::Handle,
    std::thread::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
)> {
    let (tx, rx) = mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let join = std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        rt.block_on(async move {
            match SoftHca::start(cfg).await {
                Ok(h) => {
                    let _ = tx.send(Ok((h, tokio::runtime::Handle::current())));
                    let _ = stop_rx.await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        });
    });
    let (h, rt) = rx
        .recv()
        .map_err(|_| std::io::Error::other("driver thread died"))??;
    Ok((h, rt, join, stop_tx))
}

/// A connected pair of soft-HCAs on loopback, each on its own thread.
pub struct LoopbackPair {
    pub a: SoftHca,
    pub b: SoftHca,
    pub ea: RcEnd,
    pub eb: RcEnd,
    rt_a: tokio::runtime::Handle,
    threads: Vec<(
        std::thread::JoinHandle<()>,
        tokio::sync::oneshot::Sender<()>,
    )>,
}

impl LoopbackPair {
    pub fn new(opts: &RcOptions) -> anyhow::Result<LoopbackPair> {
        let (a, rt_a, ja, sa) = start_on_thread(config("srxe0", 0))?;
        let (b, _rt_b, jb, sb) = start_on_thread(config("srxe1", 1))?;
        let ea = a.with(|d, _| create_end(d, opts, Psn::new(0x10_0000)))?;
        let eb = b.with(|d, _| create_end(d, opts, Psn::new(0x20_0000)))?;
        a.with(|d, _| connect_end(d, &ea, b.addr(), eb.qpn, eb.psn, opts))?;
        b.with(|d, _| connect_end(d, &eb, a.addr(), ea.qpn, ea.psn, opts))?;
        Ok(LoopbackPair {
            a,
            b,
            ea,
            eb,
            rt_a,
            threads: vec![(ja, sa), (jb, sb)],
        })
    }

    /// Run an async closure on side A's runtime thread and wait for its result.
    pub fn on_a<F, R>(&self, f: F) -> R
    where
        F: std::future::Future<Output = R> + Send + 'static,
        R: Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        self.rt_a.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv().expect("side A runtime alive")
    }
}

impl Drop for LoopbackPair {
    fn drop(&mut self) {
        self.a.fatal();
        self.b.fatal();
        for (j, s) in self.threads.drain(..) {
            let _ = s.send(());
            let _ = j.join();
        }
    }
}

/// Run one workload from A towards B and report throughput.
pub fn run(w: Workload) -> anyhow::Result<Report> {
    let opts = RcOptions {
        mtu: w.mtu,
        buf_len: region_len(&w),
        timeout: 14,
        caps: crate::verbs::QpCaps {
            max_send_wr: 1024,
            max_recv_wr: 1024,
        },
        cqe: 4096,
        max_unacked: 256,
        ..RcOptions::default()
    };
    let p = LoopbackPair::new(&opts)?;
    let (a, b, ea, eb) = (p.a.clone(), p.b.clone(), p.ea.clone(), p.eb.clone());
    let report = p.on_a(async move { drive_load(w, a, b, ea, eb).await });
    report
}

/// The requester's buffer: `region` rounded down to whole messages, and at least `depth`
/// messages.
fn region_len(w: &Workload) -> usize {
    let slots = w.depth.max(1);
    let whole = w.region / w.msg_size.max(1) * w.msg_size;
    whole.max(w.msg_size * slots)
}

async fn drive_load(
    w: Workload,
    a: SoftHca,
    b: SoftHca,
    ea: RcEnd,
    eb: RcEnd,
) -> anyhow::Result<Report> {
    let size = w.msg_size;
    let slots = w.depth.max(1);
    let region = region_len(&w);
    // Where the next message's local side goes: sequentially through the region.
    let mut next = 0usize;
    let mut wr = |i: usize| -> SendWr {
        let local = next;
        next = (next + size) % region;
        let sgl = Sgl::one(ea.mr.addr + local as u64, size as u32, ea.mr.lkey);
        let remote_addr = eb.mr.addr + (i * size) as u64;
        let op = match w.op {
            Op::Write => SendOp::Write {
                remote_addr,
                rkey: eb.mr.rkey,
            },
            Op::Read => SendOp::Read {
                remote_addr,
                rkey: eb.mr.rkey,
            },
            Op::Send => SendOp::Send,
        };
        SendWr::signaled(i as u64, op, sgl)
    };
    let post_recv = |i: usize| {
        let r = RecvWr {
            wr_id: i as u64,
            sgl: Sgl::one(eb.mr.addr + (i * size) as u64, size as u32, eb.mr.lkey),
        };
        b.with(|d, _| d.post_recv(eb.qpn, r))
    };
    if w.op == Op::Send {
        for i in 0..slots.max(512) {
            post_recv(i % slots)?;
        }
    }
    let start = StdInstant::now();
    a.with(|d, now| -> anyhow::Result<()> {
        for i in 0..slots {
            d.post_send(now, ea.qpn, wr(i))?;
        }
        Ok(())
    })?;
    let mut done = 0u64;
    let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(256);
    let mut recv_wcs: Vec<WorkCompletion> = Vec::with_capacity(256);
    let mut posting = true;
    let mut in_flight = slots;
    while in_flight > 0 {
        wcs.clear();
        if a.wait_cq(ea.cq, 256, &mut wcs).await == 0 {
            anyhow::bail!("device died during the run");
        }
        if start.elapsed() >= w.duration {
            posting = false;
        }
        if w.op == Op::Send {
            recv_wcs.clear();
            b.with(|d, _| d.poll_cq(eb.cq, usize::MAX, &mut recv_wcs));
            for r in &recv_wcs {
                post_recv(r.wr_id as usize)?;
            }
        }
        a.with(|d, now| -> anyhow::Result<()> {
            for wc in &wcs {
                if wc.status != WcStatus::Success {
                    anyhow::bail!("work request {} failed: {}", wc.wr_id, wc.status.as_str());
                }
                done += 1;
                in_flight -= 1;
                if posting {
                    d.post_send(now, ea.qpn, wr(wc.wr_id as usize))?;
                    in_flight += 1;
                }
            }
            Ok(())
        })?;
    }
    let elapsed = start.elapsed();
    let retransmits = a.with(|d, _| d.stats().retransmits);
    Ok(Report {
        workload: w,
        messages: done,
        bytes: done * size as u64,
        elapsed,
        retransmits,
    })
}

/// The benchmark table docs/performance.md records.
/// `region`: see [`Workload::region`].
pub fn standard_table(duration: Duration, region: usize) -> anyhow::Result<Vec<Report>> {
    let mut out = Vec::new();
    for (op, size, depth) in [
        (Op::Write, 4096, 64),
        (Op::Write, 128 << 10, 16),
        (Op::Read, 4096, 16),
        (Op::Read, 128 << 10, 16),
        (Op::Send, 64, 128),
        (Op::Send, 4096, 64),
    ] {
        out.push(run(Workload {
            op,
            msg_size: size,
            depth,
            duration,
            mtu: Mtu::Mtu4096,
            region,
        })?);
    }
    Ok(out)
}

pub fn print_table(rows: &[Report]) {
    println!(
        "{:<11} {:>9} {:>6} {:>10} {:>12} {:>8}",
        "op", "msg size", "depth", "GB/s", "msgs/s", "retrans"
    );
    for r in rows {
        println!(
            "{:<11} {:>9} {:>6} {:>10.3} {:>12.0} {:>8}",
            r.workload.op.name(),
            human(r.workload.msg_size),
            r.workload.depth,
            r.gbytes_per_sec(),
            r.msgs_per_sec(),
            r.retransmits
        );
    }
}

pub fn human(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1024 && n % 1024 == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

/// What the demo measured.
#[derive(Debug, Clone, Copy)]
pub struct DemoReport {
    pub bytes: usize,
    pub write: Duration,
    pub read: Duration,
    pub verified: bool,
    pub retransmits: u64,
}

/// The demo: fill `total` bytes with a pattern on A, RDMA WRITE them to B in `chunk`-sized
/// messages, RDMA READ them back from B into a second buffer on A, and compare.
pub fn demo(total: usize, chunk: usize) -> anyhow::Result<DemoReport> {
    anyhow::ensure!(
        chunk > 0 && total % chunk == 0,
        "size must be a multiple of the chunk size"
    );
    let opts = RcOptions {
        mtu: Mtu::Mtu4096,
        buf_len: total * 2,
        timeout: 14,
        caps: crate::verbs::QpCaps {
            max_send_wr: 1024,
            max_recv_wr: 16,
        },
        max_unacked: 256,
        ..RcOptions::default()
    };
    let p = LoopbackPair::new(&opts)?;
    let mut pattern = vec![0u8; total];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for b in pattern.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
    }
    p.ea.mem.write(0, &pattern);
    let (a, ea, eb) = (p.a.clone(), p.ea.clone(), p.eb.clone());
    let (write, read) = p.on_a(async move {
        let t0 = StdInstant::now();
        transfer_all(&a, &ea, &eb, total, chunk, false).await?;
        let t1 = StdInstant::now();
        transfer_all(&a, &ea, &eb, total, chunk, true).await?;
        Ok::<_, anyhow::Error>((t1 - t0, t1.elapsed()))
    })?;
    let mut back = vec![0u8; total];
    p.ea.mem.read(total, &mut back);
    let mut on_b = vec![0u8; total];
    p.eb.mem.read(0, &mut on_b);
    let retransmits =
        p.a.with(|d, _| d.stats().retransmits) + p.b.with(|d, _| d.stats().retransmits);
    Ok(DemoReport {
        bytes: total,
        write,
        read,
        verified: back == pattern && on_b == pattern,
        retransmits,
    })
}

/// WRITE A[0..total] to B[0..total], or READ B[0..total] into A[total..2*total], keeping up
/// to 32 messages in flight.
async fn transfer_all(
    a: &SoftHca,
    ea: &RcEnd,
    eb: &RcEnd,
    total: usize,
    chunk: usize,
    read: bool,
) -> anyhow::Result<()> {
    let n = total / chunk;
    let mut next = 0usize;
    let mut done = 0usize;
    let mut wcs = Vec::new();
    let post = |i: usize, d: &mut crate::hca::Device, now| {
        let off = (i * chunk) as u64;
        let remote_addr = eb.mr.addr + off;
        let (op, local) = if read {
            (
                SendOp::Read {
                    remote_addr,
                    rkey: eb.mr.rkey,
                },
                ea.mr.addr + total as u64 + off,
            )
        } else {
            (
                SendOp::Write {
                    remote_addr,
                    rkey: eb.mr.rkey,
                },
                ea.mr.addr + off,
            )
        };
        let sgl = Sgl::one(local, chunk as u32, ea.mr.lkey);
        d.post_send(now, ea.qpn, SendWr::signaled(i as u64, op, sgl))
    };
    while done < n {
        a.with(|d, now| -> anyhow::Result<()> {
            while next < n && next - done < 32 {
                post(next, d, now)?;
                next += 1;
            }
            Ok(())
        })?;
        wcs.clear();
        if a.wait_cq(ea.cq, 64, &mut wcs).await == 0 {
            anyhow::bail!("device died during the transfer");
        }
        for wc in &wcs {
            anyhow::ensure!(
                wc.status == WcStatus::Success,
                "chunk {} failed: {}",
                wc.wr_id,
                wc.status.as_str()
            );
            done += 1;
        }
    }
    Ok(())
}

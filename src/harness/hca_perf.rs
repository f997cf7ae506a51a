//! Loopback workloads shared by the demo, the `bench` subcommand and `cargo bench`: two
//! soft-HCAs on 127.0.0.1, each driven by its own single-threaded runtime on its own OS
//! thread (one core per side). In one process their packets take the in-memory loopback
//! path; [`run_with_peer`] and [`serve_peer`] put the responder in another process, so that
//! every packet crosses a UDP socket, as between a host and a target of their own.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant as StdInstant};

use crate::driver::SoftHca;
use crate::hca::device::{DeviceConfig, DeviceIdentity, IcrcCheck};
use crate::hca::rc::{connect_end, create_end, RcEnd, RcOptions};
use crate::verbs::{MemKey, PciAddr, Psn, Qpn};
use crate::verbs::{Mtu, RecvWr, SendOp, SendWr, Sgl, WcStatus, WorkCompletion};

mod demo;

pub use demo::{demo, DemoReport};

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
    /// Packets the requester's device sent and received during the run.
    pub packets: u64,
}

impl Report {
    pub fn gbytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64() / 1e9
    }
    pub fn msgs_per_sec(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }
    pub fn packets_per_sec(&self) -> f64 {
        self.packets as f64 / self.elapsed.as_secs_f64()
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

/// Start a soft-HCA on a dedicated thread with its own current-thread runtime, with or
/// without UDP segmentation offload (and with it, the in-memory loopback path to the other
/// contexts of this process). The runtime lives until `stop` is dropped.
fn start_on_thread(
    cfg: DeviceConfig,
    offload: bool,
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
            match SoftHca::start_with(cfg, offload).await {
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
        let (a, rt_a, ja, sa) = start_on_thread(config("srxe0", 0), true)?;
        let (b, _rt_b, jb, sb) = start_on_thread(config("srxe1", 1), true)?;
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

/// The QP options of a run; `buf_len`: the side's buffer.
fn run_options(w: &Workload, buf_len: usize) -> RcOptions {
    RcOptions {
        mtu: w.mtu,
        buf_len,
        timeout: 14,
        caps: crate::verbs::QpCaps {
            max_send_wr: 1024,
            max_recv_wr: 1024,
        },
        cqe: 4096,
        max_unacked: 256,
        ..RcOptions::default()
    }
}

/// Run one workload from A towards B and report throughput.
pub fn run(w: Workload) -> anyhow::Result<Report> {
    let p = LoopbackPair::new(&run_options(&w, region_len(&w)))?;
    let (a, b, ea, eb) = (p.a.clone(), p.b.clone(), p.ea.clone(), p.eb.clone());
    let remote = Remote {
        va: eb.mr.addr,
        rkey: eb.mr.rkey,
    };
    let report = p.on_a(async move { drive_load(w, a, ea, remote, Some((b, eb))).await });
    report
}

/// The responder's buffer, as the requester addresses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Remote {
    va: u64,
    rkey: MemKey,
}

/// The requester's line to a responder in another process: the run's shape and where its
/// QP is. One line of text, `offer SIZE DEPTH MTU OFFLOAD ADDR QPN PSN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Offer {
    msg_size: usize,
    depth: usize,
    mtu: Mtu,
    offload: bool,
    addr: SocketAddr,
    qpn: Qpn,
    psn: Psn,
}

/// The responder's answer: where its QP and buffer are.
/// `answer ADDR QPN PSN VA RKEY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Answer {
    addr: SocketAddr,
    qpn: Qpn,
    psn: Psn,
    remote: Remote,
}

/// Most message size times depth a responder sets aside for a peer's run.
const MAX_PEER_BUF: usize = 1 << 30;

impl Offer {
    fn line(&self) -> String {
        format!(
            "offer {} {} {} {} {} {} {}",
            self.msg_size,
            self.depth,
            self.mtu.bytes(),
            u8::from(self.offload),
            self.addr,
            self.qpn.get(),
            self.psn.get()
        )
    }

    fn parse(line: &str) -> anyhow::Result<Offer> {
        let f = fields(line, "offer", 7)?;
        let msg_size: usize = num(f[0], "message size")?;
        let depth: usize = num(f[1], "depth")?;
        anyhow::ensure!(
            msg_size > 0
                && depth > 0
                && msg_size <= u32::MAX as usize
                && msg_size.saturating_mul(depth) <= MAX_PEER_BUF,
            "the requester asked for {depth} messages of {msg_size} bytes: at most 1 GiB in all"
        );
        let mtu = Mtu::from_bytes(num(f[2], "MTU")?)
            .ok_or_else(|| anyhow::anyhow!("the requester's MTU {} is not an IB MTU", f[2]))?;
        Ok(Offer {
            msg_size,
            depth,
            mtu,
            offload: f[3] == "1",
            addr: f[4].parse()?,
            qpn: Qpn::new(num(f[5], "QPN")?),
            psn: Psn::new(num(f[6], "PSN")?),
        })
    }
}

impl Answer {
    fn line(&self) -> String {
        format!(
            "answer {} {} {} {} {}",
            self.addr,
            self.qpn.get(),
            self.psn.get(),
            self.remote.va,
            self.remote.rkey.0
        )
    }

    fn parse(line: &str) -> anyhow::Result<Answer> {
        let f = fields(line, "answer", 5)?;
        Ok(Answer {
            addr: f[0].parse()?,
            qpn: Qpn::new(num(f[1], "QPN")?),
            psn: Psn::new(num(f[2], "PSN")?),
            remote: Remote {
                va: num(f[3], "buffer address")?,
                rkey: MemKey(num(f[4], "rkey")?),
            },
        })
    }
}

/// The `n` fields after `word` on a line of the two-process exchange.
fn fields<'a>(line: &'a str, word: &str, n: usize) -> anyhow::Result<Vec<&'a str>> {
    let f: Vec<&str> = line.split_whitespace().skip(1).take(n + 1).collect();
    anyhow::ensure!(
        line.split_whitespace().next() == Some(word) && f.len() == n,
        "the peer process sent {line:?}, not an {word} line of {n} fields: are both sides the same build?"
    );
    Ok(f)
}

fn num<T: std::str::FromStr>(s: &str, what: &str) -> anyhow::Result<T> {
    s.parse()
        .map_err(|_| anyhow::anyhow!("the peer process sent {s:?} as its {what}"))
}

fn read_line(input: &mut impl BufRead, what: &str) -> anyhow::Result<String> {
    let mut line = String::new();
    // A line longer than this is not ours: stop reading rather than grow.
    let n = std::io::Read::take(&mut *input, 512).read_line(&mut line)?;
    anyhow::ensure!(
        n > 0,
        "the peer process closed its side before its {what} line"
    );
    Ok(line)
}

/// Run one RDMA WRITE or READ workload (the requester's side through `w.region`, the
/// responder's depth x message size) against a responder in another process reached through `peer_in`
/// and `peer_out` (its stdout and stdin, [`serve_peer`] at the other end). `offload`: UDP
/// GSO and GRO on both sides. Every packet crosses a UDP socket on 127.0.0.1.
pub fn run_with_peer(
    w: Workload,
    offload: bool,
    mut peer_in: impl BufRead,
    mut peer_out: impl Write,
) -> anyhow::Result<Report> {
    anyhow::ensure!(
        w.op != Op::Send,
        "a responder in another process serves RDMA WRITE and READ, not SEND"
    );
    let opts = run_options(&w, region_len(&w));
    let (a, rt, join, stop) = start_on_thread(config("srxe0", 0), offload)?;
    let _stop = StopOnDrop(Some((a.clone(), join, stop)));
    let ea = a.with(|d, _| create_end(d, &opts, Psn::new(0x10_0000)))?;
    let offer = Offer {
        msg_size: w.msg_size,
        depth: w.depth.max(1),
        mtu: w.mtu,
        offload,
        addr: a.addr(),
        qpn: ea.qpn,
        psn: ea.psn,
    };
    writeln!(peer_out, "{}", offer.line())?;
    peer_out.flush()?;
    let ans = Answer::parse(&read_line(&mut peer_in, "answer")?)?;
    a.with(|d, _| connect_end(d, &ea, ans.addr, ans.qpn, ans.psn, &opts))?;
    let (tx, rx) = mpsc::channel();
    let a2 = a.clone();
    rt.spawn(async move {
        let _ = tx.send(drive_load(w, a2, ea, ans.remote, None).await);
    });
    let report = rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the requester's runtime stopped"))?;
    // The responder ends when its input does.
    drop(peer_out);
    report
}

/// Ends a driver thread started by [`start_on_thread`] on every way out.
struct StopOnDrop(
    Option<(
        SoftHca,
        std::thread::JoinHandle<()>,
        tokio::sync::oneshot::Sender<()>,
    )>,
);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some((h, join, stop)) = self.0.take() {
            h.fatal();
            let _ = stop.send(());
            let _ = join.join();
        }
    }
}

/// The responder of [`run_with_peer`], in a process of its own: read the requester's offer
/// from `input`, start a soft-HCA on 127.0.0.1 with an RC QP and a buffer of depth x
/// message size, answer on `out`, and serve RDMA WRITE and READ until `input` ends.
pub fn serve_peer(mut input: impl BufRead, mut out: impl Write) -> anyhow::Result<()> {
    let offer = Offer::parse(&read_line(&mut input, "offer")?)?;
    let w = Workload {
        op: Op::Write,
        msg_size: offer.msg_size,
        depth: offer.depth,
        duration: Duration::ZERO,
        mtu: offer.mtu,
        region: 0,
    };
    let opts = run_options(&w, offer.msg_size * offer.depth);
    let (b, _rt, join, stop) = start_on_thread(config("srxe1", 1), offer.offload)?;
    let _stop = StopOnDrop(Some((b.clone(), join, stop)));
    let eb = b.with(|d, _| create_end(d, &opts, Psn::new(0x20_0000)))?;
    b.with(|d, _| connect_end(d, &eb, offer.addr, offer.qpn, offer.psn, &opts))?;
    let ans = Answer {
        addr: b.addr(),
        qpn: eb.qpn,
        psn: eb.psn,
        remote: Remote {
            va: eb.mr.addr,
            rkey: eb.mr.rkey,
        },
    };
    writeln!(out, "{}", ans.line())?;
    out.flush()?;
    // Serve until the requester closes its end.
    std::io::copy(&mut input, &mut std::io::sink())?;
    Ok(())
}

/// The requester's buffer: `region` rounded down to whole messages, and at least `depth`
/// messages.
fn region_len(w: &Workload) -> usize {
    let slots = w.depth.max(1);
    let whole = w.region / w.msg_size.max(1) * w.msg_size;
    whole.max(w.msg_size * slots)
}

/// Keep `w.depth` messages in flight from A for `w.duration`. `recv`: the responder's
/// device and end, for SEND (receives are posted there); the same process only.
async fn drive_load(
    w: Workload,
    a: SoftHca,
    ea: RcEnd,
    remote: Remote,
    recv: Option<(SoftHca, RcEnd)>,
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
        let remote_addr = remote.va + (i * size) as u64;
        let op = match w.op {
            Op::Write => SendOp::Write {
                remote_addr,
                rkey: remote.rkey,
            },
            Op::Read => SendOp::Read {
                remote_addr,
                rkey: remote.rkey,
            },
            Op::Send => SendOp::Send,
        };
        SendWr::signaled(i as u64, op, sgl)
    };
    let post_recv = |i: usize| -> anyhow::Result<()> {
        let Some((b, eb)) = &recv else {
            anyhow::bail!("SEND needs the responder's receive queue in this process");
        };
        let r = RecvWr {
            wr_id: i as u64,
            sgl: Sgl::one(eb.mr.addr + (i * size) as u64, size as u32, eb.mr.lkey),
        };
        Ok(b.with(|d, _| d.post_recv(eb.qpn, r))?)
    };
    if w.op == Op::Send {
        for i in 0..slots.max(512) {
            post_recv(i % slots)?;
        }
    }
    let packets_at = |a: &SoftHca| a.with(|d, _| d.stats().tx_packets + d.stats().rx_packets);
    let packets0 = packets_at(&a);
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
        if let (Op::Send, Some((b, eb))) = (w.op, &recv) {
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
        packets: packets_at(&a) - packets0,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An os pipe as (reader, writer).
    fn pipe() -> (std::fs::File, std::fs::File) {
        let mut fds = [0; 2];
        // SAFETY: pipe fills two new descriptors that the Files then own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        use std::os::fd::FromRawFd;
        unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        }
    }

    /// The requester and the responder of a two-process run find each other through the
    /// two lines they exchange, and the run moves data both ways (the responder here is a
    /// thread: what crosses is only those lines and the packets).
    #[test]
    fn a_run_against_a_peer_moves_data_both_ways() {
        for op in [Op::Write, Op::Read] {
            let (req_in, rsp_out) = pipe();
            let (rsp_in, req_out) = pipe();
            let peer =
                std::thread::spawn(move || serve_peer(std::io::BufReader::new(rsp_in), rsp_out));
            let w = Workload {
                op,
                msg_size: 128 << 10,
                depth: 4,
                duration: Duration::from_millis(200),
                mtu: Mtu::Mtu4096,
                region: 0,
            };
            let r = run_with_peer(w, false, std::io::BufReader::new(req_in), req_out).unwrap();
            peer.join().unwrap().unwrap();
            assert!(
                r.messages > 0 && r.bytes == r.messages * (128 << 10),
                "{r:?}"
            );
            // 32 data packets per message, and at least an ACK or a request the other way.
            assert!(r.packets > r.messages * 32, "{r:?}");
        }
    }

    #[test]
    fn a_peer_line_that_is_not_ours_is_an_error_not_a_panic() {
        let ok = Offer {
            msg_size: 4096,
            depth: 16,
            mtu: Mtu::Mtu4096,
            offload: true,
            addr: "127.0.0.1:4791".parse().unwrap(),
            qpn: Qpn::new(17),
            psn: Psn::new(5),
        };
        assert_eq!(Offer::parse(&ok.line()).unwrap(), ok);
        for bad in [
            "",
            "offer",
            "answer 127.0.0.1:1 1 1 1 1",
            "offer 4096 16 4096 1 127.0.0.1:1 17 5 extra",
            "offer 1073741824 2 4096 1 127.0.0.1:1 17 5",
            "offer 0 16 4096 1 127.0.0.1:1 17 5",
            "offer 4096 16 4000 1 127.0.0.1:1 17 5",
            "offer 4096 16 4096 1 nowhere 17 5",
            "offer 4096 16 4096 1 127.0.0.1:1 -1 5",
        ] {
            assert!(Offer::parse(bad).is_err(), "{bad:?} parsed");
        }
        let a = Answer {
            addr: "127.0.0.1:9".parse().unwrap(),
            qpn: Qpn::new(3),
            psn: Psn::new(4),
            remote: Remote {
                va: 1 << 40,
                rkey: MemKey(0xdead_beef),
            },
        };
        assert_eq!(Answer::parse(&a.line()).unwrap(), a);
        assert!(Answer::parse("answer 127.0.0.1:9 3 4 x 1").is_err());
    }
}

//! The demo: a pattern written from one soft-HCA to the other and read back, checked.

use std::time::{Duration, Instant as StdInstant};

use super::*;

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

//! `demo` and `hca-demo`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::io::*;
use anyhow::{bail, Context, Result};
use nvmf_rdma::harness::hca_perf;
use nvmf_rdma::harness::nvmf_perf::{self, Job, LocalTarget, Pattern, DEMO_NQN};

pub(crate) fn demo(size: usize, seconds: f64) -> Result<()> {
    if size > 1 << 30 {
        bail!("--size at most 1G");
    }
    let ns_bytes = (size as u64).max(256 << 20);
    println!(
        "nvmf-rdma demo: built-in target ({} RAM namespace) and host, each on its own soft RoCEv2 HCA on 127.0.0.1 ({})",
        hca_perf::human(ns_bytes as usize),
        if nvmf_rdma::driver::local::enabled() {
            "one process: packets take the in-memory loopback path; NVMF_RDMA_LOOPBACK=udp for UDP"
        } else {
            "packets over UDP"
        }
    );
    let t = LocalTarget::start(ns_bytes, 9)?;
    let addr = t.addr;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let c = Arc::new(
            nvmf_perf::connect_host(addr, DEMO_NQN, 1, 128)
                .await
                .context("connect")?,
        );
        let ns = c.namespaces()[0];
        println!(
            "connected: {} cntlid {} model '{}', namespace 1: {} blocks of {} B",
            DEMO_NQN,
            c.cntlid,
            c.ident.mn.text().trim(),
            ns.blocks,
            ns.block_size
        );
        let t0 = Instant::now();
        let n = size - size % 4096;
        verify(&c, 1, 0, n, 128 << 10, 42, &mut show_progress).await?;
        eprintln!();
        println!("verified {n} bytes: every byte read back matches");
        println!(
            "write+read-back of {} took {:.3} s",
            hca_perf::human(size),
            t0.elapsed().as_secs_f64()
        );
        let job = Job {
            pattern: Pattern::RandRead,
            bs: 4096,
            iodepth: 32,
            runtime: Duration::from_secs_f64(seconds),
        };
        let r = nvmf_perf::run_job(c.clone(), job).await;
        nvmf_perf::print_results(std::slice::from_ref(&r));
        if r.errors > 0 {
            bail!("{} I/O errors", r.errors);
        }
        match Arc::try_unwrap(c) {
            Ok(c) => c.disconnect().await,
            Err(_) => tracing::warn!("controller still shared; not disconnecting cleanly"),
        }
        anyhow::Ok(())
    })?;
    tracing::debug!("stopping the target");
    drop(t);
    tracing::debug!("done");
    Ok(())
}

pub(crate) fn hca_demo(size: usize, chunk: usize) -> Result<()> {
    if chunk > 1 << 30 || size > 8 << 30 {
        bail!("--size at most 8G and --chunk at most 1G");
    }
    println!(
        "soft-HCA demo: two RoCEv2 devices on 127.0.0.1, RC QP, {} in {} messages",
        hca_perf::human(size),
        hca_perf::human(chunk)
    );
    let r = hca_perf::demo(size, chunk).context("demo failed")?;
    let gbs = |d: Duration| r.bytes as f64 / d.as_secs_f64() / 1e9;
    println!(
        "RDMA WRITE {:>10}  {:8.3} s  {:6.3} GB/s",
        hca_perf::human(r.bytes),
        r.write.as_secs_f64(),
        gbs(r.write)
    );
    println!(
        "RDMA READ  {:>10}  {:8.3} s  {:6.3} GB/s",
        hca_perf::human(r.bytes),
        r.read.as_secs_f64(),
        gbs(r.read)
    );
    println!("retransmits: {}", r.retransmits);
    if !r.verified {
        bail!("data read back does not match what was written");
    }
    println!("verified: every byte read back matches the pattern written");
    Ok(())
}

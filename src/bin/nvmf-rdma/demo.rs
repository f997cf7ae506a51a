//! `demo` and `hca-demo`.

use std::time::Duration;

use crate::io::*;
use anyhow::{bail, Context, Result};
use nvmf_rdma::harness::hca_perf;
use nvmf_rdma::harness::nvmf_perf::{self, DemoStep, DEMO_NQN};

pub(crate) fn demo(size: usize, seconds: f64) -> Result<()> {
    if size > 1 << 30 {
        bail!("--size at most 1G");
    }
    let mut step = |s: DemoStep<'_>| {
        match s {
        DemoStep::Starting { ns_bytes } => println!(
            "nvmf-rdma demo: built-in target ({} RAM namespace) and host, each on its own soft RoCEv2 HCA on 127.0.0.1 ({})",
            hca_perf::human(ns_bytes as usize),
            if nvmf_rdma::driver::local::enabled() {
                "one process: packets take the in-memory loopback path; NVMF_RDMA_LOOPBACK=udp for UDP"
            } else {
                "packets over UDP"
            }
        ),
        DemoStep::Connected(c) => {
            let ns = c.namespaces()[0];
            println!(
                "connected: {} cntlid {} model '{}', namespace 1: {} blocks of {} B",
                DEMO_NQN,
                c.cntlid,
                c.ident.mn.text().trim(),
                ns.blocks,
                ns.block_size
            );
        }
        DemoStep::Verified { bytes, took } => {
            eprintln!();
            println!("verified {bytes} bytes: every byte read back matches");
            println!(
                "write+read-back of {} took {:.3} s",
                hca_perf::human(size),
                took.as_secs_f64()
            );
        }
    }
    };
    let r = nvmf_perf::demo(size, seconds, &mut show_progress, &mut step)?;
    nvmf_perf::print_results(std::slice::from_ref(&r));
    if r.errors > 0 {
        bail!("{} I/O errors", r.errors);
    }
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

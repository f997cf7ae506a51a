//! `connect --foreground`: hold a controller and its exports in this process
//! ([`nvmf_rdma::daemon::foreground`]) until a stop signal or `disconnect`; and `discover`.

use std::sync::Arc;

use crate::{args::*, signals::*};
use anyhow::{bail, Result};
use nvmf_rdma::cli::host::*;
use nvmf_rdma::cli::support::run_dir;
use nvmf_rdma::daemon::foreground::Foreground;
use nvmf_rdma::daemon::Stdout;
use nvmf_rdma::harness::hca_perf;

pub(crate) async fn run_connect(s: Subsys, x: ExportArgs) -> Result<()> {
    let mut signals = StopSignals::new()?.forward(|sig| sig);
    let c = tokio::select! {
        c = connect(&s) => Arc::new(c?),
        Some(sig) = signals.recv() => bail!("{sig} while connecting to {}: nothing was connected", s.nqn),
    };
    let held = Foreground::start(c, &s, &x, &run_dir()).await?;
    for l in held.exports().describe() {
        println!("{l}");
    }
    let c = held.controller();
    println!(
        "{}: connected to {} at {} (cntlid {})",
        held.name(),
        s.nqn,
        s.fabric.traddr,
        c.cntlid
    );
    for ns in c.namespaces() {
        println!(
            "  namespace {}: {} blocks of {} B ({})",
            ns.nsid,
            ns.blocks,
            ns.block_size,
            hca_perf::human(ns.bytes() as usize)
        );
    }
    held.run(&mut signals, Arc::new(Stdout)).await
}

/// `discover`: the discovery log of a discovery controller, nvme-cli style.
pub(crate) async fn run_discover(f: Fabric, output: ListFormat) -> Result<()> {
    let entries = discover_at(&f).await?;
    if output == ListFormat::Json {
        // nvme-cli's field names and words.
        let records: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "trtype": "rdma",
                    "adrfam": if e.adrfam == 2 { "ipv6" } else { "ipv4" },
                    "subtype": match e.subtype {
                        1 => "discovery subsystem referral",
                        3 => "current discovery subsystem",
                        _ => "nvme subsystem",
                    },
                    "portid": e.portid,
                    "trsvcid": e.trsvcid.text().trim(),
                    "subnqn": e.subnqn.text().trim(),
                    "traddr": e.traddr.text().trim(),
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "records": records }));
        return Ok(());
    }
    println!("Discovery Log Number of Records {}", entries.len());
    for (i, e) in entries.iter().enumerate() {
        println!("=====Discovery Log Entry {i}======");
        println!("trtype:  rdma");
        println!("adrfam:  {}", if e.adrfam == 2 { "ipv6" } else { "ipv4" });
        println!("portid:  {}", e.portid);
        println!("trsvcid: {}", e.trsvcid.text().trim());
        println!("subnqn:  {}", e.subnqn.text());
        println!("traddr:  {}", e.traddr.text().trim());
    }
    Ok(())
}

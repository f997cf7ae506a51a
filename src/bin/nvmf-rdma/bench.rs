//! `bench`.

use std::sync::Arc;
use std::time::Duration;

use crate::{args::*, host::*};
use anyhow::{bail, Result};
use nvmf_rdma::harness::hca_perf;
use nvmf_rdma::harness::nvmf_perf::{self, Job, Pattern, DEMO_NQN};

/// `bench --traddr`: the fio jobs of `tests/vm/run.sh bench` through our host.
pub(crate) fn remote_bench(sub: &Subsys, runtime: Duration) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let c = Arc::new(connect(sub).await?);
        let mut rows = Vec::new();
        for (pattern, bs, iodepth) in [
            (Pattern::RandRead, 4096, 1),
            (Pattern::RandRead, 4096, 32),
            (Pattern::SeqRead, 128 << 10, 16),
        ] {
            let job = Job {
                pattern,
                bs,
                iodepth,
                runtime,
            };
            rows.push(nvmf_perf::run_job(c.clone(), job).await);
        }
        nvmf_perf::print_results(&rows);
        let errors: u64 = rows.iter().map(|r| r.errors).sum();
        if let Ok(c) = Arc::try_unwrap(c) {
            c.disconnect().await;
        }
        if errors > 0 {
            bail!("{errors} I/O errors");
        }
        Ok(())
    })
}

/// `bench`: the built-in table, the raw soft-HCA table, or fio's jobs against --traddr.
pub(crate) fn run_bench(
    seconds: f64,
    hca: bool,
    queues: usize,
    jobs: Vec<String>,
    ext: ExternalTarget,
) -> Result<()> {
    let ExternalTarget {
        traddr,
        trsvcid,
        nqn,
        host_traddr,
        device,
    } = ext;
    if !(0.05..=600.0).contains(&seconds) {
        bail!("--seconds must be between 0.05 and 600");
    }
    if !jobs.is_empty() && (hca || traddr.is_some()) {
        bail!("--job picks rows of the built-in NVMe-oF table; not with --hca or --traddr");
    }
    if let Some(traddr) = traddr {
        let sub = Subsys {
            fabric: Fabric {
                transport: "rdma".into(),
                traddr,
                trsvcid,
                hostnqn: None,
                hostid: None,
                host_traddr,
                device,
            },
            nqn: nqn.unwrap_or_else(|| DEMO_NQN.into()),
            nr_io_queues: queues.clamp(1, 64),
            queue_size: 128,
            policy: PolicyArgs::default(),
            nsid: 1,
        };
        return remote_bench(&sub, Duration::from_secs_f64(seconds));
    }
    if hca {
        hca_perf::print_table(&hca_perf::standard_table(Duration::from_secs_f64(seconds))?);
    } else {
        let jobs = nvmf_perf::select_jobs(Duration::from_secs_f64(seconds), &jobs)?;
        nvmf_perf::print_results(&nvmf_perf::bench(jobs, queues.clamp(1, 64))?);
    }
    Ok(())
}

//! `cargo bench --bench nvmf`: NVMe-oF over the soft-HCA on loopback, host and target on
//! their own threads; 4 KiB random read/write at QD1/QD32 and 128 KiB sequential.
fn main() -> anyhow::Result<()> {
    let secs: f64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let rows = nvmf_rdma::harness::nvmf_perf::bench(
        nvmf_rdma::harness::nvmf_perf::standard_jobs(std::time::Duration::from_secs_f64(secs)),
        1,
    )?;
    nvmf_rdma::harness::nvmf_perf::print_results(&rows);
    Ok(())
}

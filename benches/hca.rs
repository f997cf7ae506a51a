//! `cargo bench --bench hca`: soft-HCA throughput over loopback UDP, one core per side.
fn main() -> anyhow::Result<()> {
    let secs: f64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let rows =
        nvmf_rdma::harness::hca_perf::standard_table(std::time::Duration::from_secs_f64(secs), 0)?;
    nvmf_rdma::harness::hca_perf::print_table(&rows);
    Ok(())
}

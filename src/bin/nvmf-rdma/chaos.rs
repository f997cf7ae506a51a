//! `chaos`: faults on loopback while workers write and verify; the run itself is
//! [`nvmf_rdma::harness::chaos::run`].

use std::sync::Arc;

use anyhow::{bail, Result};
use nvmf_rdma::cli::args::ListFormat;
use nvmf_rdma::harness::chaos::args::ChaosArgs;
use nvmf_rdma::harness::chaos::config::clock_seed;
use nvmf_rdma::harness::chaos::run::{self, Progress};
use nvmf_rdma::harness::chaos::{plot, report};

pub(crate) async fn run_chaos(a: ChaosArgs) -> Result<()> {
    let cfg = a.config(clock_seed());
    cfg.check()?;
    if let Some(p) = &a.plot {
        plot::check_plot_path(p)?;
    }
    let json = a.format.output == ListFormat::Json;
    // With -o json stdout holds the summary alone; progress goes to stderr.
    let say = move |s: &str| {
        if json {
            eprintln!("{s}");
        } else {
            println!("{s}");
        }
    };
    say(&report::header(&cfg));
    let (seconds, samples) = (cfg.seconds, a.interval.is_some());
    let progress = Arc::new(move |p: Progress<'_>| match p {
        Progress::Connected => say(&format!("connected; verifying I/O for {seconds} s")),
        Progress::Fault(f) => eprintln!("{}", f.describe()),
        Progress::Sample(s) if samples => eprintln!("{}", s.describe()),
        Progress::Sample(_) => {}
    });
    let s = run::run(&cfg, progress).await?;
    if json {
        println!("{}", s.to_json(&cfg));
    } else {
        print!("{}", s.text(&cfg));
    }
    if let Some(path) = &a.plot {
        let title = format!(
            "nvmf-rdma chaos, seed {}: {} faults, {}",
            s.seed,
            s.faults.len(),
            if s.problems.is_empty() {
                "PASS"
            } else {
                "FAIL"
            }
        );
        plot::write_atomic(
            path,
            plot::svg(&title, &s.faults, &s.series, s.elapsed)?.as_bytes(),
        )?;
        eprintln!("plot: {}", path.display());
    }
    if !s.problems.is_empty() {
        bail!("chaos: {}", s.problems.join("; "));
    }
    Ok(())
}

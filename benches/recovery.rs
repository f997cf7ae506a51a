//! Recovery time: from the fatal event (host HCA reset) to the first resubmitted I/O
//! completing, over 100 resets on loopback with reconnect_delay 0. QD1 4 KiB reads run
//! throughout; each sample is the time from the reset call to the next read completion.
//!
//! `cargo bench --bench recovery` (RESETS=n to change the count).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::harness::chaos::{connect_host, host_options, pct, TargetRig, HOST_DEV};
use nvmf_rdma::reconnect::Policy;

fn main() {
    let resets: usize = std::env::var("RESETS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let t = TargetRig::start([127, 0, 0, 1], 64 << 20).await.unwrap();
        let mgr = DeviceManager::new(true);
        let p = Policy {
            reconnect_delay: Duration::ZERO,
            ..Policy::default()
        };
        let c = Arc::new(
            connect_host(&mgr, [127, 0, 0, 1], host_options(t.addr, 1, 32, p))
                .await
                .unwrap(),
        );
        let done = Arc::new(AtomicU64::new(0));
        let epoch = Instant::now();
        let reader = {
            let (c, done) = (c.clone(), done.clone());
            tokio::spawn(async move {
                loop {
                    c.read(1, 0, 4096).await.unwrap();
                    done.store(epoch.elapsed().as_nanos() as u64, Ordering::SeqCst);
                }
            })
        };
        let mut samples = Vec::with_capacity(resets);
        for k in 1..=resets as u64 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let t0 = epoch.elapsed().as_nanos() as u64;
            mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
            // A read that finished before the reset took hold is not the resubmitted one:
            // count the first completion after this reset's recovery.
            while c.status().machine.recoveries < k {
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
            let live = epoch.elapsed().as_nanos() as u64;
            while done.load(Ordering::SeqCst) <= live.max(t0) {
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
            samples.push(done.load(Ordering::SeqCst) - t0);
        }
        reader.abort();
        samples.sort_unstable();
        let ms = |ns: u64| ns as f64 / 1e6;
        println!("recovery: fatal reset -> first resubmitted I/O completes ({resets} resets, reconnect_delay 0, loopback)");
        println!(
            "  p50 {:.2} ms   p99 {:.2} ms   max {:.2} ms   recoveries {}",
            ms(pct(&samples, 0.50)),
            ms(pct(&samples, 0.99)),
            ms(*samples.last().unwrap_or(&0)),
            c.status().machine.recoveries
        );
    });
}

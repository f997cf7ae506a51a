//! Recovery time: from the fatal event (host HCA reset) to the first resubmitted I/O
//! completing, over 100 resets on loopback with reconnect_delay 0. QD1 4 KiB reads run
//! throughout; each sample is the time from the reset call to the next I/O completion.
//! For the slowest recoveries and the median one it prints where the time went, from the
//! controller's [`RecoveryTrace`] (all times on the controller's clock).
//!
//! `cargo bench --bench recovery` (RESETS=n to change the count; RECOVERY_IO=write for
//! writes instead of reads, RECOVERY_BS=bytes for another size: a write larger than the
//! target's in-capsule size is fetched by the target's RDMA READ, so the write held across
//! the reset has a dead copy on the target while it is resubmitted).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::{DeviceManager, SoftHca};
use nvmf_rdma::harness::chaos::{connect_host, host_options, pct, TargetRig, HOST_DEV};
use nvmf_rdma::reconnect::Policy;
use nvmf_rdma::transport::RecoveryTrace;

/// One recovery, in ns on the controller's clock.
struct Sample {
    /// The reset was called.
    t0: u64,
    /// The reset returned: the new context is live.
    device_back: u64,
    /// The first read completed after the controller was LIVE again.
    done: u64,
    trace: RecoveryTrace,
    /// Transport counters of this recovery: the new host context's, the target's change.
    host: Counters,
    target: Counters,
    /// How long this process's threads waited for a CPU (ns, summed over threads) from the
    /// reset until the bench saw the completion, at `seen`.
    run_queue: u64,
    seen: u64,
}

/// Time this process's threads have spent runnable but not running, in ns, summed over its
/// threads (`/proc/self/task/*/schedstat`, second field; 0 where the kernel keeps none). On a
/// shared machine this is what a recovery that waits on no timer waits on.
fn run_queue_wait() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// The soft-HCA counters that say a packet was lost or refused on the way.
#[derive(Clone, Copy, Default)]
struct Counters {
    timeouts: u64,
    retransmits: u64,
    rnr_naks: u64,
    dropped: u64,
}

impl Counters {
    fn of(h: &SoftHca) -> Counters {
        h.with_quiet(|d, _| {
            let s = d.stats();
            Counters {
                timeouts: s.timeouts,
                retransmits: s.retransmits,
                rnr_naks: s.rnr_naks_rx,
                dropped: s.rx_dropped + s.rx_unknown_qp + s.rx_ghost,
            }
        })
    }

    fn since(self, before: Counters) -> Counters {
        Counters {
            timeouts: self.timeouts - before.timeouts,
            retransmits: self.retransmits - before.retransmits,
            rnr_naks: self.rnr_naks - before.rnr_naks,
            dropped: self.dropped - before.dropped,
        }
    }
}

impl std::fmt::Display for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "timeouts {} retransmits {} rnr {} dropped {}",
            self.timeouts, self.retransmits, self.rnr_naks, self.dropped
        )
    }
}

impl Sample {
    fn total(&self) -> u64 {
        self.done - self.t0
    }

    /// Phase durations in ms, in order; a phase the trace lacks shows as NaN.
    fn phases(&self) -> [f64; 7] {
        let t = &self.trace;
        let marks = [
            Some(self.t0),
            t.torn_down.map(|i| i.0),
            t.attempt_start.map(|i| i.0),
            t.device_open.map(|i| i.0),
            t.admin_cm.map(|i| i.0),
            t.admin_ready.map(|i| i.0),
            t.live.map(|i| i.0),
            Some(self.done),
        ];
        let mut out = [f64::NAN; 7];
        for (i, o) in out.iter_mut().enumerate() {
            if let (Some(a), Some(b)) = (marks[i], marks[i + 1]) {
                *o = b.saturating_sub(a) as f64 / 1e6;
            }
        }
        out
    }
}

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
        let writes = std::env::var("RECOVERY_IO").is_ok_and(|v| v == "write");
        let bs: usize = std::env::var("RECOVERY_BS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(4096);
        let done = Arc::new(AtomicU64::new(0));
        let reader = {
            let (c, done) = (c.clone(), done.clone());
            tokio::spawn(async move {
                let data = vec![0x5Au8; bs];
                loop {
                    if writes {
                        c.write(1, 0, &data).await.unwrap();
                    } else {
                        c.read(1, 0, bs).await.unwrap();
                    }
                    done.store(c.now().0, Ordering::SeqCst);
                }
            })
        };
        let mut samples = Vec::with_capacity(resets);
        for k in 1..=resets as u64 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let t0 = c.now().0;
            let target_before = Counters::of(t.hca());
            let waited_before = run_queue_wait();
            let host = mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
            let device_back = c.now().0;
            let st = c
                .wait_status(Duration::from_secs(30), |s| s.machine.recoveries >= k)
                .await
                .unwrap();
            let trace = st.last_trace.unwrap_or_default();
            // A read that finished before the controller was LIVE again is not the
            // resubmitted one: count the first completion after it.
            let live = trace.live.map_or(t0, |i| i.0).max(t0);
            while done.load(Ordering::SeqCst) <= live {
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
            samples.push(Sample {
                t0,
                device_back,
                done: done.load(Ordering::SeqCst),
                trace,
                host: Counters::of(&host),
                target: Counters::of(t.hca()).since(target_before),
                run_queue: run_queue_wait().saturating_sub(waited_before),
                seen: c.now().0,
            });
        }
        reader.abort();
        let lossy = samples
            .iter()
            .filter(|s| s.host.timeouts + s.target.timeouts + s.host.rnr_naks + s.target.rnr_naks > 0)
            .count();
        samples.sort_unstable_by_key(Sample::total);
        let totals: Vec<u64> = samples.iter().map(Sample::total).collect();
        let ms = |ns: u64| ns as f64 / 1e6;
        println!(
            "recovery: fatal reset -> first resubmitted I/O completes ({resets} resets, QD1 {} B {}, reconnect_delay 0, loopback)",
            bs,
            if writes { "writes" } else { "reads" }
        );
        println!(
            "  p50 {:.2} ms   p99 {:.2} ms (nearest rank)   max {:.2} ms   recoveries {}",
            ms(pct(&totals, 0.50)),
            ms(pct(&totals, 0.99)),
            ms(*totals.last().unwrap_or(&0)),
            c.status().machine.recoveries
        );
        println!("  recoveries with a transport timeout or RNR NAK on either side: {lossy}");
        println!("  phases (ms): teardown = reset -> resources dropped; wait = -> start of the attempt that connected (device back, failed attempts, retry gaps); open = device opened; CM = admin CM connection; admin = Fabrics Connect + CC.EN/CSTS.RDY; I/O queues = -> LIVE; first I/O = -> first resubmitted I/O done");
        println!(
            "  {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
            "", "total", "teardown", "wait", "open", "CM", "admin", "I/O q", "first I/O", "attempts"
        );
        let mid = samples.len() / 2;
        let picks = (samples.len().saturating_sub(5)..samples.len())
            .rev()
            .map(|i| (format!("#{}", samples.len() - i), i))
            .chain((!samples.is_empty()).then(|| ("median".to_string(), mid)));
        for (name, i) in picks {
            let s = &samples[i];
            let ph = s.phases();
            println!(
                "  {:>8} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8}   device back {:.2} ms after the reset; threads waited for a CPU {:.2} ms of {:.2}; host {}; target {}",
                name,
                ms(s.total()),
                ph[0],
                ph[1],
                ph[2],
                ph[3],
                ph[4],
                ph[5],
                ph[6],
                s.trace.attempts,
                ms(s.device_back.saturating_sub(s.t0)),
                ms(s.run_queue),
                ms(s.seen - s.t0),
                s.host,
                s.target,
            );
        }
    });
}

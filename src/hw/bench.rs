//! Data verification and a closed-loop benchmark over an [`HwController`]'s I/O queue.

use std::fmt;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::host::HwController;
use super::HwError;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fill `buf` (starting at LBA `slba`) with the pattern of `seed`: every block differs, so a
/// block read from the wrong LBA or a stale write is caught.
pub fn fill(buf: &mut [u8], seed: u64, slba: u64, block_size: u32) {
    for (bi, block) in buf.chunks_mut(block_size as usize).enumerate() {
        let lba = slba + bi as u64;
        let mut s = seed ^ lba.wrapping_mul(0xA076_1D64_78BD_642F);
        for w in block.chunks_mut(8) {
            s = splitmix(s);
            w.copy_from_slice(&s.to_le_bytes()[..w.len()]);
        }
    }
}

/// Check `buf` against the pattern [`fill`] wrote.
pub fn check(buf: &[u8], seed: u64, slba: u64, block_size: u32) -> Result<(), HwError> {
    let mut want = vec![0u8; buf.len()];
    fill(&mut want, seed, slba, block_size);
    match buf.iter().zip(&want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(HwError::Mismatch {
            offset: i as u64,
            lba: slba + i as u64 / u64::from(block_size),
            expected: want[i],
            got: buf[i],
        }),
    }
}

/// One workload.
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub write: bool,
    pub random: bool,
    pub bytes: u32,
    pub qd: u16,
    /// First LBA and number of blocks of the region used.
    pub start_lba: u64,
    pub range_blocks: u64,
    /// Stop issuing after this long ...
    pub duration: Option<Duration>,
    /// ... or after this many I/Os (whichever first).
    pub count: Option<u64>,
    /// Fill writes with / check reads against the pattern of this seed.
    pub verify_seed: Option<u64>,
    pub rng_seed: u64,
}

/// What a workload measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub name: String,
    pub ios: u64,
    pub bytes: u64,
    pub secs: f64,
    pub avg_us: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub verified: bool,
}

impl Report {
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.secs.max(1e-9)
    }
    pub fn mib_s(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-9) / (1024.0 * 1024.0)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} IOs in {:.2}s = {:.0} IOPS, {:.1} MiB/s, lat avg {:.0} us p50 {} us p99 {} us max {} us{}",
            self.name,
            self.ios,
            self.secs,
            self.iops(),
            self.mib_s(),
            self.avg_us,
            self.p50_us,
            self.p99_us,
            self.max_us,
            if self.verified { ", data verified" } else { "" }
        )
    }
}

/// Percentile of sorted `v` (nearest rank).
pub fn percentile(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Run `w` to completion on `c`'s I/O queue.
pub async fn run(c: &mut HwController, w: &Workload) -> Result<Report, HwError> {
    let blocks = c.blocks_for(w.bytes)?;
    let bs = c.block_size;
    let positions = w.range_blocks / u64::from(blocks);
    if positions == 0 || w.start_lba + w.range_blocks > c.blocks {
        return Err(HwError::Invalid(format!(
            "{}: region {}+{} blocks does not fit {}-block I/Os in a {}-block namespace",
            w.name, w.start_lba, w.range_blocks, blocks, c.blocks
        )));
    }
    let qd = usize::from(w.qd.clamp(1, c.io.depth()));
    let mut rng = SmallRng::seed_from_u64(w.rng_seed);
    let mut inflight: Vec<Option<(u64, Instant)>> = vec![None; usize::from(c.io.depth())];
    let mut n_inflight = 0usize;
    let mut issued = 0u64;
    let mut seq = 0u64;
    let mut lats: Vec<u64> = Vec::with_capacity(1 << 16);
    let t0 = Instant::now();
    loop {
        let stop =
            w.duration.is_some_and(|d| t0.elapsed() >= d) || w.count.is_some_and(|n| issued >= n);
        while !stop && n_inflight < qd && w.count.is_none_or(|n| issued < n) {
            let Some(cid) = c.io.free_slot() else { break };
            let pos = if w.random {
                rng.random_range(0..positions)
            } else {
                let p = seq % positions;
                seq += 1;
                p
            };
            let slba = w.start_lba + pos * u64::from(blocks);
            if w.write {
                if let Some(seed) = w.verify_seed {
                    fill(c.io.data_mut(cid, w.bytes as usize), seed, slba, bs);
                }
                c.submit_write(cid, slba, w.bytes)?;
            } else {
                c.submit_read(cid, slba, w.bytes)?;
            }
            inflight[usize::from(cid)] = Some((slba, Instant::now()));
            n_inflight += 1;
            issued += 1;
        }
        if n_inflight == 0 {
            break;
        }
        c.io.wait().await?;
        while let Some(d) = c.io.take() {
            let (slba, t) = inflight
                .get_mut(usize::from(d.cid))
                .and_then(Option::take)
                .ok_or(HwError::StrayCompletion(d.cid))?;
            n_inflight -= 1;
            lats.push(t.elapsed().as_micros() as u64);
            let status = d.cqe.nvme_status();
            if !status.is_success() {
                return Err(HwError::Nvme {
                    what: if w.write { "Write" } else { "Read" },
                    status,
                });
            }
            if !w.write {
                if let Some(seed) = w.verify_seed {
                    check(c.io.data(d.cid, w.bytes as usize), seed, slba, bs)?;
                }
            }
        }
        c.tick()?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let avg = lats.iter().sum::<u64>() as f64 / lats.len().max(1) as f64;
    lats.sort_unstable();
    Ok(Report {
        name: w.name.clone(),
        ios: lats.len() as u64,
        bytes: lats.len() as u64 * u64::from(w.bytes),
        secs,
        avg_us: avg,
        p50_us: percentile(&lats, 50.0),
        p99_us: percentile(&lats, 99.0),
        max_us: lats.last().copied().unwrap_or(0),
        verified: w.verify_seed.is_some(),
    })
}

/// Write a pattern over the first `bytes` of the namespace in 128 KiB commands, read it back
/// sequentially and with random 4 KiB reads, checking every byte.
pub async fn verify(c: &mut HwController, bytes: u64, seed: u64) -> Result<Vec<Report>, HwError> {
    let big = (128 * 1024).min(c.io.max_io()) / c.block_size * c.block_size;
    let range_blocks = (bytes / u64::from(c.block_size)).min(c.blocks);
    let range_blocks = range_blocks / u64::from(big / c.block_size) * u64::from(big / c.block_size);
    let count = range_blocks / u64::from(big / c.block_size);
    let base = Workload {
        name: String::new(),
        write: true,
        random: false,
        bytes: big,
        qd: 8,
        start_lba: 0,
        range_blocks,
        duration: None,
        count: Some(count),
        verify_seed: Some(seed),
        rng_seed: seed,
    };
    let mut out = Vec::new();
    out.push(
        run(
            c,
            &Workload {
                name: format!("verify: write {} KiB seq", big / 1024),
                ..base.clone()
            },
        )
        .await?,
    );
    out.push(
        run(
            c,
            &Workload {
                name: format!("verify: read {} KiB seq", big / 1024),
                write: false,
                ..base.clone()
            },
        )
        .await?,
    );
    let small = 4096u32.max(c.block_size);
    out.push(
        run(
            c,
            &Workload {
                name: format!("verify: read {} KiB random", small / 1024),
                write: false,
                random: true,
                bytes: small,
                qd: 32,
                count: Some(count * 4),
                ..base
            },
        )
        .await?,
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_round_trips_and_catches_misplaced_blocks() {
        let mut b = vec![0u8; 8192];
        fill(&mut b, 7, 100, 4096);
        check(&b, 7, 100, 4096).unwrap();
        // the same bytes read back as if from LBA 101: every block differs
        assert!(check(&b, 7, 101, 4096).is_err());
        // another seed (a stale earlier run) is caught
        assert!(check(&b, 8, 100, 4096).is_err());
        // one flipped byte is reported with its LBA and offset
        b[4096 + 17] ^= 0x40;
        match check(&b, 7, 100, 4096) {
            Err(HwError::Mismatch { offset, lba, .. }) => {
                assert_eq!(offset, 4096 + 17);
                assert_eq!(lba, 101);
            }
            other => panic!("{other:?}"),
        }
        // 512-byte blocks and a tail shorter than a word
        let mut s = vec![0u8; 1030];
        fill(&mut s, 1, 0, 512);
        check(&s, 1, 0, 512).unwrap();
        assert_ne!(&s[..512], &s[512..1024]);
    }

    #[test]
    fn percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&v, 100.0), 100);
        assert_eq!(percentile(&[], 99.0), 0);
        assert_eq!(percentile(&[5], 1.0), 5);
    }

    #[test]
    fn report_rates() {
        let r = Report {
            name: "x".into(),
            ios: 1000,
            bytes: 1000 * 4096,
            secs: 2.0,
            avg_us: 1.0,
            p50_us: 1,
            p99_us: 2,
            max_us: 3,
            verified: false,
        };
        assert_eq!(r.iops(), 500.0);
        assert!((r.mib_s() - 1.953125).abs() < 1e-9);
        assert!(r.to_string().contains("500 IOPS"));
    }
}

//! `cargo bench --bench copy`: how fast this machine copies a 16 KiB packet payload
//! (the loopback path's packet size) with `memcpy` (`copy_from_slice`) and with the data
//! path's `copy_bytes`, with the destination this many bytes ahead of the source within a
//! 4 KiB page: 0, the distances a payload has behind its headers when both buffers start
//! on pages (BTH 12 bytes, BTH + RETH 28), 44, and 200. "memory" copies from 256 MiB read
//! once in order (out of cache, as a RAM namespace's data), "cache" from 1 MiB read over
//! and over. Each of a row's four figures is taken three times, in turn with the others,
//! and the median is printed: compare within a row, not across machines (src/hca/copy.rs
//! says what was seen on the machines of this project's kind).

use std::time::Instant;

use nvmf_rdma::hca::copy::copy_bytes;

const PKT: usize = 16 << 10;
const COLD: usize = 256 << 20;
const WARM: usize = 1 << 20;

/// GB/s of `copy` over `bytes` of source, packet by packet, into `dst` at `off`.
fn rate(src: &[u8], dst: &mut [u8], off: usize, passes: usize, copy: fn(&mut [u8], &[u8])) -> f64 {
    let t = Instant::now();
    let mut moved = 0usize;
    for _ in 0..passes {
        for (i, p) in src.chunks_exact(PKT).enumerate() {
            let at = off + (i % 64) * PKT;
            copy(&mut dst[at..at + PKT], p);
            moved += PKT;
        }
    }
    std::hint::black_box(&dst);
    moved as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let cold: Vec<u8> = (0..COLD).map(|i| (i * 31 + 7) as u8).collect();
    let warm = &cold[..WARM];
    let mut dst = vec![0u8; 64 * PKT + 8192];
    let memcpy: fn(&mut [u8], &[u8]) = |d, s| d.copy_from_slice(s);
    println!("16 KiB copies, GB/s (median of 3): memcpy vs copy_bytes");
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>12}",
        "ahead by", "memory memcpy", "copy_bytes", "cache memcpy", "copy_bytes"
    );
    // The distance is the one between the two ends, whatever the allocator's alignment.
    let (src_page, dst_page) = (cold.as_ptr() as usize % 4096, dst.as_ptr() as usize % 4096);
    for ahead in [0usize, 12, 28, 44, 200] {
        let at = (ahead + src_page + 4096 - dst_page) % 4096;
        let mut row = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..3 {
            row[0].push(rate(&cold, &mut dst, at, 1, memcpy));
            row[1].push(rate(&cold, &mut dst, at, 1, copy_bytes));
            row[2].push(rate(warm, &mut dst, at, 200, memcpy));
            row[3].push(rate(warm, &mut dst, at, 200, copy_bytes));
        }
        let [a, b, c, d] = row.map(median);
        println!("{ahead:>10} {a:>12.1} {b:>12.1} {c:>12.1} {d:>12.1}");
    }
}

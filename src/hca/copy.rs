//! Payload copies: a packet's payload gathered from a memory region, scattered into one, or
//! moved between packet buffers. One place decides how bytes are copied, whatever the caller.
//!
//! glibc's `memcpy` moves runs of a few KiB and more with `rep movsb`. On the AMD EPYC
//! (Zen 4) machines of this project's kind that instruction crawls when the destination is
//! a little ahead of the source within a 4 KiB page ("4K aliasing": each store looks to the
//! CPU as if a later load might depend on it). Measured with a C loop of 16 KiB copies:
//! with `(dst - src) mod 4096` from 1 to 15 it ran at 3.4 GB/s, from 16 to 31 at 9 GB/s
//! from memory (30 from cache), against 21-23 GB/s (37-55 from cache) at other distances.
//! A RAM namespace and I/O buffers start on pages, and a packet's payload sits behind 12 or
//! 28 bytes of headers, so gathers into packets, the scatters out of them and the copies
//! between packet buffers land in that window often enough to show: the own loop's 128 KiB
//! reads ran 1.18x as fast once they stayed out of it (6 alternated rounds; 1.27x while the
//! machine ran in its fast mode; docs/performance.md). A plain vector loop
//! (32-byte unaligned AVX2 loads and stores) ran at 20-21 GB/s from memory and 57-70 from
//! cache at every distance, so runs of [`VECTOR_MIN`] bytes or more in the window take it;
//! every other copy stays with `memcpy`. `cargo bench --bench copy` shows both on the
//! machine at hand.

/// Shorter copies stay with `memcpy`: below a couple of KiB glibc copies with vector moves,
/// not `rep movsb`.
pub const VECTOR_MIN: usize = 2048;

/// Writes at least this long go past the cache into memory marked with
/// [`crate::hca::HostMem::stream_writes`]: a packet's payload or an in-capsule block, not a
/// queue entry.
pub const STREAM_MIN: usize = 1024;

/// Whether a copy of `len` bytes from `src` to `dst` takes the vector loop.
fn in_alias_window(dst: *const u8, src: *const u8, len: usize) -> bool {
    let ahead = (dst as usize).wrapping_sub(src as usize) % 4096;
    len >= VECTOR_MIN && (1..64).contains(&ahead)
}

/// `dst.copy_from_slice(src)`, without `rep movsb` where the destination is just ahead of
/// the source within a page (module doc). Panics if the lengths differ, as `copy_from_slice`
/// does.
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_bytes: lengths differ");
    // SAFETY: two slices of the same length; a `&mut` and a `&` cannot overlap.
    unsafe { copy_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// `out.extend_from_slice(src)`, copied as [`copy_bytes`] copies.
pub fn extend_bytes(out: &mut Vec<u8>, src: &[u8]) {
    out.reserve(src.len());
    let start = out.len();
    // SAFETY: `reserve` made room for `src.len()` more bytes after `start` (the pointer is
    // taken after it, so it does not move again); `src` is borrowed shared while `out` is
    // borrowed mutably, so they do not overlap. Every byte up to the new length is written
    // before `set_len`.
    unsafe {
        copy_raw(out.as_mut_ptr().add(start), src.as_ptr(), src.len());
        out.set_len(start + src.len());
    }
}

/// The one choice both copies make: the vector loop in the window, `memcpy` elsewhere.
///
/// # Safety
/// `src` is valid for `len` bytes of reads, `dst` for `len` bytes of writes, and the two
/// ranges do not overlap.
unsafe fn copy_raw(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller's contract is both callees'.
    unsafe {
        if in_alias_window(dst, src, len) {
            vector_copy(dst, src, len)
        } else {
            std::ptr::copy_nonoverlapping(src, dst, len)
        }
    }
}

/// Copies `len` bytes with unaligned 32-byte vector loads and stores where the CPU has
/// AVX2 (every x86_64 of this project's kinds), else with `memcpy` as before.
///
/// # Safety
/// `src` is valid for `len` bytes of reads, `dst` for `len` bytes of writes, and the two
/// ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn vector_copy(dst: *mut u8, src: *const u8, len: usize) {
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the caller's contract is passed on.
        unsafe { vector_copy_avx2(dst, src, len) }
    } else {
        // SAFETY: the caller's contract is `copy_nonoverlapping`'s.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn vector_copy(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller's contract is `copy_nonoverlapping`'s.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// [`vector_copy`] with 4 x 32-byte moves per step.
///
/// # Safety
/// As [`vector_copy`], and the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vector_copy_avx2(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let steps = len / 128;
    // SAFETY: every load reads and every store writes 32 bytes inside the first
    // `steps * 128 <= len` bytes of the ranges, which the caller vouches for; unaligned
    // loads and stores take any address.
    unsafe {
        for k in 0..steps {
            let s = src.add(k * 128).cast::<__m256i>();
            let d = dst.add(k * 128).cast::<__m256i>();
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_storeu_si256(d, a);
            _mm256_storeu_si256(d.add(1), b);
            _mm256_storeu_si256(d.add(2), c);
            _mm256_storeu_si256(d.add(3), e);
        }
        let done = steps * 128;
        // The tail, under 128 bytes: memcpy moves it with vector moves.
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
    }
}

/// `dst.copy_from_slice(src)` with non-temporal stores for the 16-byte-aligned middle, then a
/// store fence, so the bytes are in memory order before the caller's lock is released.
#[cfg(target_arch = "x86_64")]
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    let head = ((dst.as_ptr() as usize).wrapping_neg() & 15).min(dst.len());
    let body = (dst.len() - head) & !15;
    dst[..head].copy_from_slice(&src[..head]);
    // SAFETY: SSE2 is part of x86_64. `dst[head..head + body]` starts 16-byte aligned and
    // both ranges hold `body` bytes (a multiple of 16) inside their slices; the loads are
    // unaligned loads.
    unsafe {
        let d = dst.as_mut_ptr().add(head).cast::<__m128i>();
        let s = src.as_ptr().add(head).cast::<__m128i>();
        for k in 0..body / 16 {
            _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
        }
        _mm_sfence();
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

#[cfg(not(target_arch = "x86_64"))]
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest};
    use rand::{Rng, SeedableRng};

    /// `len` random bytes from `seed`, behind `at` bytes of padding.
    fn source(seed: u64, at: usize, len: usize) -> Vec<u8> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        (0..at + len).map(|_| rng.random()).collect()
    }

    proptest! {
        /// Streaming stores copy exactly `src` into exactly `dst`, whatever the alignment of
        /// either and the length (head, aligned middle and tail each empty or not).
        #[test]
        fn copy_streaming_copies_exactly_the_range(
            dst_at in 0usize..48, src_at in 0usize..48, len in 0usize..700, seed: u64,
        ) {
            let src = source(seed, src_at, len);
            let mut dst = vec![0xEEu8; dst_at + len + 32];
            copy_streaming(&mut dst[dst_at..dst_at + len], &src[src_at..]);
            prop_assert!(dst[..dst_at].iter().all(|&b| b == 0xEE));
            prop_assert_eq!(&dst[dst_at..dst_at + len], &src[src_at..]);
            prop_assert!(dst[dst_at + len..].iter().all(|&b| b == 0xEE));
        }

        /// Every way of copying writes exactly `src` into exactly `dst`: any offsets, lengths
        /// on both sides of VECTOR_MIN and of a loop step.
        #[test]
        fn copies_take_exactly_the_range_at_any_offsets(
            dst_at in 0usize..130, src_at in 0usize..130, len in 0usize..(VECTOR_MIN * 3),
            seed: u64,
        ) {
            let src = source(seed, src_at, len);
            let check = |dst: &[u8]| {
                dst[..dst_at].iter().all(|&b| b == 0xEE)
                    && dst[dst_at..dst_at + len] == src[src_at..]
                    && dst[dst_at + len..].iter().all(|&b| b == 0xEE)
            };
            let mut dst = vec![0xEEu8; dst_at + len + 32];
            copy_bytes(&mut dst[dst_at..dst_at + len], &src[src_at..]);
            prop_assert!(check(&dst));
            // The loop itself, whatever the window says of these two allocations.
            let mut dst = vec![0xEEu8; dst_at + len + 32];
            // SAFETY: two distinct vectors, each with `len` bytes at the offsets given.
            unsafe { vector_copy(dst.as_mut_ptr().add(dst_at), src.as_ptr().add(src_at), len) };
            prop_assert!(check(&dst));
            let mut out = vec![0xEEu8; dst_at];
            extend_bytes(&mut out, &src[src_at..]);
            prop_assert_eq!(out.len(), dst_at + len);
            out.resize(dst_at + len + 32, 0xEE);
            prop_assert!(check(&out));
        }
    }

    /// The rule itself: the loop only for long runs whose destination is 1-63 bytes ahead
    /// of the source within a page.
    #[test]
    fn only_long_runs_just_ahead_within_a_page_take_the_loop() {
        let base = 0x10_0000 as *const u8;
        let at = |n: usize| base.wrapping_add(n);
        assert!(in_alias_window(at(12), base, VECTOR_MIN));
        assert!(in_alias_window(at(4096 * 5 + 28), base, 16 << 10));
        assert!(in_alias_window(at(4096 + 63), at(4096 * 7), 16 << 10));
        assert!(!in_alias_window(at(12), base, VECTOR_MIN - 1));
        assert!(!in_alias_window(base, base, 16 << 10));
        assert!(!in_alias_window(at(4096 * 3), base, 16 << 10));
        assert!(!in_alias_window(at(64), base, 16 << 10));
        // Behind the source is not the window.
        assert!(!in_alias_window(base, at(12), 16 << 10));
    }
}

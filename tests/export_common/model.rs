//! A model of what an export must hold after concurrent requests: each byte is the value of the
//! last acknowledged request that covered it, or, where requests covering it overlapped in
//! time, of one of them. Request times are ticks of one counter shared by every client: taken
//! before a request is sent and after its reply is read, so the model only ever counts more
//! requests as overlapping than really did (it can miss a clobber, never invent one).
//!
//! Request bytes come from [`byte_of`] (never zero), so a byte names the request that wrote
//! it; Write Zeroes writes zeroes; a trim leaves old-or-zero.

use std::sync::atomic::{AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Write,
    Zeroes,
    Trim,
}

/// One request of a client, with the ticks around it.
#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub id: u32,
    pub kind: Kind,
    pub offset: u64,
    pub len: u64,
    /// Tick taken before the request was sent.
    pub sent: u64,
    /// Tick taken after its successful reply was read.
    pub acked: u64,
}

impl Op {
    /// Request `id`, sent at `sent`, not acknowledged yet.
    pub fn sent(id: u32, kind: Kind, offset: u64, len: u64, sent: u64) -> Op {
        Op {
            id,
            kind,
            offset,
            len,
            sent,
            acked: u64::MAX,
        }
    }
}

/// The clock every client of one run shares.
#[derive(Default)]
pub struct Ticks(AtomicU64);

impl Ticks {
    pub fn tick(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// The byte request `id` writes at device offset `at`: never zero.
pub fn byte_of(id: u32, at: u64) -> u8 {
    let x = (id as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ at.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    ((x >> 56) as u8) | 1
}

/// The payload of write `id` at `offset`.
pub fn payload(id: u32, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len).map(|a| byte_of(id, a)).collect()
}

/// What a run's clients send: within `len` bytes at `base`, blocks of `bs`.
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    pub base: u64,
    pub len: u64,
    pub bs: u64,
    /// Also Write Zeroes and trims (else only writes, aligned and not).
    pub zeroes_and_trims: bool,
}

impl Mix {
    /// One client's requests (kind, offset, length) from `seed`: whole-block writes,
    /// writes that start or end inside a block, and, if asked, zeroes and trims of both
    /// shapes, all over the same few blocks.
    pub fn requests(&self, seed: u64, n: usize) -> Vec<(Kind, u64, u64)> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let blocks = self.len / self.bs;
        (0..n)
            .map(|_| {
                let pick = rng.random_range(0..10u32);
                let kind = match pick {
                    8 if self.zeroes_and_trims => Kind::Zeroes,
                    9 if self.zeroes_and_trims => Kind::Trim,
                    _ => Kind::Write,
                };
                let aligned = pick % 2 == 0;
                if aligned {
                    let b = rng.random_range(0..blocks);
                    let n = rng.random_range(1..=(blocks - b).min(3));
                    (kind, self.base + b * self.bs, n * self.bs)
                } else {
                    let off = rng.random_range(0..self.len - 1);
                    let len = rng.random_range(1..=(self.len - off).min(2 * self.bs + 7));
                    (kind, self.base + off, len)
                }
            })
            .collect()
    }
}

/// A byte that holds none of the values the model allows.
#[derive(Debug)]
pub struct Bad {
    pub at: u64,
    pub got: u8,
    /// Ids of the requests whose value it may hold (none: the initial contents).
    pub allowed: Vec<u32>,
    /// The request whose byte it holds, if any covering one does.
    pub holds: Option<u32>,
}

/// Check `got` (the device's bytes at `base`) against `ops` (every request of the run, all
/// acknowledged) and `initial` (the bytes before the run).
pub fn check(ops: &[Op], base: u64, got: &[u8], initial: &[u8]) -> Vec<Bad> {
    let mut bad = Vec::new();
    // Requests by the 4 KiB page they touch, so each byte scans only its neighbours.
    const PAGE: u64 = 4096;
    let pages = (got.len() as u64).div_ceil(PAGE) as usize;
    let mut by_page: Vec<Vec<&Op>> = vec![Vec::new(); pages];
    for op in ops {
        let lo = op.offset.saturating_sub(base);
        let hi = (op.offset + op.len)
            .saturating_sub(base)
            .min(got.len() as u64);
        if op.len == 0 || hi <= lo {
            continue;
        }
        for p in (lo / PAGE)..hi.div_ceil(PAGE) {
            by_page[p as usize].push(op);
        }
    }
    let mut cover = Vec::new();
    for (i, &g) in got.iter().enumerate() {
        let at = base + i as u64;
        cover.clear();
        cover.extend(
            by_page[i / PAGE as usize]
                .iter()
                .filter(|o| o.offset <= at && at < o.offset + o.len)
                .copied(),
        );
        let mut allowed = Vec::new();
        if !allows(&cover, at, g, initial[i], &mut allowed) {
            let holds = cover
                .iter()
                .find(|o| o.kind == Kind::Write && byte_of(o.id, at) == g)
                .map(|o| o.id);
            bad.push(Bad {
                at,
                got: g,
                allowed,
                holds,
            });
        }
    }
    bad
}

/// May a byte covered by `cover` hold `g`? `allowed` gets the candidates' ids.
fn allows(cover: &[&Op], at: u64, g: u8, initial: u8, allowed: &mut Vec<u32>) -> bool {
    if cover.is_empty() {
        return g == initial;
    }
    // A request is superseded when another covering one was sent after it was acknowledged.
    let last_sent = cover.iter().map(|o| o.sent).max().unwrap_or(0);
    let mut trimmed = false;
    let mut ok = false;
    for o in cover.iter().filter(|o| o.acked > last_sent) {
        allowed.push(o.id);
        ok |= match o.kind {
            Kind::Write => byte_of(o.id, at) == g,
            Kind::Zeroes => g == 0,
            Kind::Trim => {
                trimmed = true;
                g == 0
            }
        };
    }
    if !ok && trimmed {
        // Old-or-zero: whatever the byte could hold were the trims not there.
        let rest: Vec<&Op> = cover
            .iter()
            .filter(|o| o.kind != Kind::Trim)
            .copied()
            .collect();
        return allows(&rest, at, g, initial, allowed);
    }
    ok
}

/// Panic with a summary when `bad` is not empty: how many bytes and blocks, and the first few.
pub fn assert_clean(what: &str, seed: u64, bad: &[Bad], bs: u64, checked_blocks: u64) {
    if bad.is_empty() {
        return;
    }
    let mut blocks: Vec<u64> = bad.iter().map(|b| b.at / bs).collect();
    blocks.dedup();
    let first: Vec<String> = bad
        .iter()
        .take(5)
        .map(|b| {
            format!(
                "byte {} holds {:#04x} (from request {:?}), allowed requests {:?}",
                b.at, b.got, b.holds, b.allowed
            )
        })
        .collect();
    panic!(
        "{what} (seed {seed:#x}; replay with NVMF_MODEL_SEED={seed}): {} bytes in {} of {checked_blocks} \
         blocks hold a value no acknowledged request left there:\n{}",
        bad.len(),
        blocks.len(),
        first.join("\n")
    );
}

/// The seed of a run: NVMF_MODEL_SEED if set, else `default`; printed so a failure replays.
pub fn seed(default: u64) -> u64 {
    let s = std::env::var("NVMF_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    println!("model seed {s} (NVMF_MODEL_SEED)");
    s
}

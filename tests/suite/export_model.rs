//! The exports against a model of acknowledged requests (`export_common::model`): several
//! clients send aligned and unaligned writes (and Write Zeroes and trims) to the same few
//! blocks at once, through NBD and through FUSE; afterwards every byte must hold what the
//! last acknowledged request covering it left, or one of the requests that raced for it.
//! The requests come from a printed seed (NVMF_MODEL_SEED replays one); the interleaving is
//! the machine's.

use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::export_common::model::{self, Kind, Mix, Op, Ticks};
use crate::export_common::*;
use crate::export_nbd::{serve, Client, Served};
use nvmf_rdma::export::mount_fuse;
use nvmf_rdma::export::nbd::Command;

/// Clients of a round, requests per client, requests one NBD client has in flight at once.
const CLIENTS: usize = 4;
const PER_CLIENT: usize = 64;
const BATCH: usize = 16;
/// Blocks the clients of a round fight over.
const BLOCKS: u64 = 16;

/// One round through NBD: `CLIENTS` connections, each pipelining `BATCH` requests at a time.
fn nbd_round(sv: &Served, mix: Mix, seed: u64) -> (Vec<Op>, Vec<u8>, Vec<u8>) {
    let initial = model::payload(0, mix.base, mix.len);
    let mut c = Client::connect(&sv.sock, false);
    c.write(mix.base, &initial, 0);
    let ticks = Arc::new(Ticks::default());
    let workers: Vec<_> = (0..CLIENTS)
        .map(|k| {
            let (sock, ticks) = (sv.sock.clone(), ticks.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&sock, k % 2 == 1);
                let reqs = mix.requests(seed.wrapping_add(k as u64 * 7919), PER_CLIENT);
                let mut ops = Vec::with_capacity(reqs.len());
                for (b, batch) in reqs.chunks(BATCH).enumerate() {
                    let mut cookies = Vec::with_capacity(batch.len());
                    for (i, &(kind, offset, len)) in batch.iter().enumerate() {
                        let id = 1 + (k * PER_CLIENT + b * BATCH + i) as u32;
                        let sent = ticks.tick();
                        let cookie = match kind {
                            Kind::Write => {
                                let data = model::payload(id, offset, len);
                                c.send(Command::Write, 0, offset, len as u32, &data)
                            }
                            Kind::Zeroes => {
                                c.send(Command::WriteZeroes, 0, offset, len as u32, &[])
                            }
                            Kind::Trim => c.send(Command::Trim, 0, offset, len as u32, &[]),
                        };
                        cookies.push(cookie);
                        ops.push(Op::sent(id, kind, offset, len, sent));
                    }
                    let first = ops.len() - batch.len();
                    for _ in 0..batch.len() {
                        let (cookie, e, _) = c.reply(|_| 0);
                        let acked = ticks.tick();
                        let i = cookies
                            .iter()
                            .position(|&x| x == cookie)
                            .expect("known cookie");
                        assert_eq!(e, 0, "request {:?} failed", ops[first + i]);
                        ops[first + i].acked = acked;
                    }
                }
                ops
            })
        })
        .collect();
    let mut ops = Vec::new();
    for w in workers {
        ops.extend(w.join().expect("client thread"));
    }
    let got = c.read(mix.base, mix.len as u32);
    (ops, initial, got)
}

fn nbd_rounds(lbads: u8, zeroes_and_trims: bool, rounds: u64, default_seed: u64, what: &str) {
    let sv = serve(lbads);
    let bs = 1u64 << lbads;
    let seed = model::seed(default_seed);
    let mut checked = 0;
    for r in 0..rounds {
        let mix = Mix {
            base: r * BLOCKS * bs + 4 * bs,
            len: BLOCKS * bs,
            bs,
            zeroes_and_trims,
        };
        let round_seed = seed.wrapping_add(r);
        let (ops, initial, got) = nbd_round(&sv, mix, round_seed);
        let bad = model::check(&ops, mix.base, &got, &initial);
        checked += BLOCKS;
        model::assert_clean(
            &format!("{what}, {bs}-byte blocks, round {r}"),
            round_seed,
            &bad,
            bs,
            BLOCKS,
        );
    }
    println!("{what}, {bs}-byte blocks: {checked} blocks over {rounds} rounds, 0 clobbered");
}

/// Whole-block and partial-block writes to the same blocks from pipelining NBD clients: no
/// acknowledged write is undone by a read-modify-write that read the block before it.
#[test]
fn nbd_aligned_and_unaligned_writes_to_the_same_blocks_keep_every_acknowledged_write() {
    for lbads in [12u8, 9] {
        nbd_rounds(lbads, false, 12, 0x5EED_0001, "NBD writes");
    }
}

/// Writes of both shapes, Write Zeroes of both shapes and trims from several NBD clients at
/// once: each byte ends as the model allows.
#[test]
fn nbd_requests_of_every_kind_match_the_model_of_acknowledged_requests() {
    for lbads in [9u8, 12] {
        nbd_rounds(lbads, true, 12, 0x5EED_0002, "NBD writes, zeroes and trims");
    }
}

/// Zero `len` bytes of the file at `offset` (Write Zeroes underneath).
fn zero_range(f: &std::fs::File, offset: u64, len: u64, punch: bool) {
    let mode = libc::FALLOC_FL_KEEP_SIZE
        | if punch {
            libc::FALLOC_FL_PUNCH_HOLE
        } else {
            libc::FALLOC_FL_ZERO_RANGE
        };
    // SAFETY: a valid open descriptor; fallocate touches no memory of ours.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, len as i64) };
    assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
}

fn fuse_round(file: &Path, mix: Mix, seed: u64) -> (Vec<Op>, Vec<u8>, Vec<u8>) {
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(file)
            .expect("open the FUSE file")
    };
    let f = open();
    let initial = model::payload(0, mix.base, mix.len);
    f.write_all_at(&initial, mix.base).unwrap();
    let ticks = Arc::new(Ticks::default());
    let workers: Vec<_> = (0..CLIENTS * 2)
        .map(|k| {
            let (f, ticks) = (open(), ticks.clone());
            std::thread::spawn(move || {
                let reqs = mix.requests(seed.wrapping_add(k as u64 * 7919), PER_CLIENT);
                let mut ops = Vec::with_capacity(reqs.len());
                for (i, &(kind, offset, len)) in reqs.iter().enumerate() {
                    let id = 1 + (k * PER_CLIENT + i) as u32;
                    let sent = ticks.tick();
                    // A punched hole reads back as zeroes on this export: Write Zeroes too.
                    let kind = match kind {
                        Kind::Write => {
                            f.write_all_at(&model::payload(id, offset, len), offset)
                                .unwrap();
                            Kind::Write
                        }
                        Kind::Zeroes | Kind::Trim => {
                            zero_range(&f, offset, len, kind == Kind::Trim);
                            Kind::Zeroes
                        }
                    };
                    let mut op = Op::sent(id, kind, offset, len, sent);
                    op.acked = ticks.tick();
                    ops.push(op);
                }
                ops
            })
        })
        .collect();
    let mut ops = Vec::new();
    for w in workers {
        ops.extend(w.join().expect("writer thread"));
    }
    let mut got = vec![0u8; mix.len as usize];
    f.read_exact_at(&mut got, mix.base).unwrap();
    (ops, initial, got)
}

/// pwrite of whole and partial blocks and fallocate zero ranges from several threads on the
/// FUSE file: every acknowledged write survives. Needs root and /dev/fuse (skipped without).
#[test]
fn fuse_aligned_and_unaligned_writes_to_the_same_blocks_keep_every_acknowledged_write() {
    let test = "fuse_aligned_and_unaligned_writes_to_the_same_blocks_keep_every_acknowledged_write";
    if !is_root() {
        return skip(test, "needs root (FUSE mount)");
    }
    if !Path::new("/dev/fuse").exists() {
        return skip(test, "/dev/fuse is absent");
    }
    let seed = model::seed(0x5EED_0003);
    for lbads in [12u8, 9] {
        let stack = Stack::start(16 << 20, lbads, 2);
        let tmp = TempDir::new("fuse-model");
        let mp = tmp.path().join("mnt");
        std::fs::create_dir_all(&mp).unwrap();
        let fuse = mount_fuse(stack.dev.clone(), stack.rt.handle().clone(), &mp, "ns1").unwrap();
        wait_for("the FUSE file", Duration::from_secs(10), || {
            fuse.file().exists()
        });
        let bs = 1u64 << lbads;
        let rounds = 16;
        for r in 0..rounds {
            let mix = Mix {
                base: r * BLOCKS * bs + 2 * bs,
                len: BLOCKS * bs,
                bs,
                zeroes_and_trims: r % 2 == 1,
            };
            let round_seed = seed.wrapping_add(r);
            let (ops, initial, got) = fuse_round(fuse.file(), mix, round_seed);
            let bad = model::check(&ops, mix.base, &got, &initial);
            model::assert_clean(
                &format!("FUSE, {bs}-byte blocks, round {r}"),
                round_seed,
                &bad,
                bs,
                BLOCKS,
            );
        }
        println!(
            "FUSE, {bs}-byte blocks: {} blocks over {rounds} rounds, 0 clobbered",
            rounds * BLOCKS
        );
        fuse.unmount().unwrap();
    }
}

//! Registered I/O buffers: a write leaves from the caller's registered memory and a
//! read lands in it, with no host copy, and the buffer survives a device reset (its memory is
//! ours and is registered again on the new device context).

use std::time::Duration;

use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::harness::chaos::{connect_host, host_options, TargetRig, HOST_DEV};
use nvmf_rdma::reconnect::{CtrlState, Policy};
use nvmf_rdma::transport::{Controller, HostError, IoBuffer};

const IP: [u8; 4] = [127, 0, 0, 1];
const CHUNK: usize = 16 << 10;

fn policy() -> Policy {
    crate::rig::reconnect_at_once(Some(Duration::from_secs(30)), Duration::from_secs(30))
}

async fn rig() -> (DeviceManager, TargetRig, Controller) {
    let t = TargetRig::start(IP, 16 << 20).await.unwrap();
    let mgr = DeviceManager::new(true);
    let c = connect_host(&mgr, IP, host_options(t.addr, 1, 32, policy()))
        .await
        .unwrap();
    (mgr, t, c)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed.wrapping_add((i >> 9) as u8))
        .collect()
}

fn chunk(b: &IoBuffer, k: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    b.read(k * b.chunk_len(), &mut v);
    v
}

/// Write chunk 0 at `lba` (a whole chunk, keyed) and 4 KiB of chunk 2 at `lba + 64` (in the
/// capsule at this depth), read both back into chunks 1 and 3: the data round-trips.
async fn round_trip(c: &Controller, b: &IoBuffer, lba: u64, seed: u8) {
    let big = pattern(seed, CHUNK);
    let small = pattern(seed ^ 0xA5, 4096);
    b.write(0, &big);
    b.write(2 * CHUNK, &small);
    c.write_from(b, 0, 1, lba, CHUNK).await.unwrap();
    c.write_from(b, 2, 1, lba + 64, 4096).await.unwrap();
    c.read_to(b, 1, 1, lba, CHUNK).await.unwrap();
    c.read_to(b, 3, 1, lba + 64, 4096).await.unwrap();
    assert!(
        chunk(b, 1, CHUNK) == big,
        "the keyed write or read lost data"
    );
    assert!(chunk(b, 3, 4096) == small, "the in-capsule write lost data");
    // The same bytes through the copying API: what the registered path wrote is on the target.
    assert!(c.read(1, lba, CHUNK).await.unwrap() == big);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_buffer_round_trips_data_with_no_host_copy() {
    let (_mgr, _t, c) = rig().await;
    let b = c.io_buffer(CHUNK, 4).unwrap();
    assert_eq!(b.as_mut_ptr() as usize % 4096, 0, "chunk 0 is page-aligned");
    let in_capsule_before: u64 = c.queue_stats().iter().map(|s| s.in_capsule).sum();
    let (copies, bytes) = c.io_copies();
    let b2 = c.io_buffer(CHUNK, 4).unwrap();
    round_trip(&c, &b2, 0, 1).await;
    // Four registered commands; the copying read after them is one command of two copies.
    let (n, nb) = c.io_copies();
    assert_eq!(
        (n - copies, nb - bytes),
        (2, 2 * CHUNK as u64),
        "registered-buffer I/O made host copies"
    );
    let in_capsule: u64 = c.queue_stats().iter().map(|s| s.in_capsule).sum();
    assert!(
        in_capsule > in_capsule_before,
        "the 4 KiB write went in the capsule"
    );
    drop(b2);

    // The copying API counts its copies: one per write, two per read.
    let (copies, _) = c.io_copies();
    c.write(1, 128, &pattern(9, 8192)).await.unwrap();
    let mut out = vec![0u8; 8192];
    c.read_into(1, 128, &mut out).await.unwrap();
    assert_eq!(c.io_copies().0 - copies, 3);

    // Misuse is refused with what to do, and nothing is sent.
    let too_long = c.write_from(&b, 0, 1, 0, CHUNK + 4096).await;
    assert!(
        matches!(too_long, Err(HostError::Invalid(_))),
        "{too_long:?}"
    );
    let no_chunk = c.read_to(&b, 4, 1, 0, 4096).await;
    assert!(
        matches!(no_chunk, Err(HostError::Invalid(_))),
        "{no_chunk:?}"
    );
    assert_eq!(
        b.chunk_at(b.as_mut_ptr().wrapping_add(CHUNK), 4096),
        Some(1)
    );
    assert_eq!(b.chunk_at(b.as_mut_ptr().wrapping_add(100), 4096), None);
    assert!(c.io_buffer(c.max_transfer() + 1, 1).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_buffer_works_after_device_resets_even_with_io_out() {
    let (mgr, t, c) = rig().await;
    let b = c.io_buffer(CHUNK, 4).unwrap();
    round_trip(&c, &b, 0, 1).await;

    // Reset with nothing out: the buffer is registered again on the new context.
    mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
    c.wait_status(Duration::from_secs(20), |s| {
        s.machine.recoveries >= 1 && s.state() == CtrlState::Live
    })
    .await
    .unwrap();
    // Bounded: a buffer left unregistered would have its commands fail and retry forever.
    tokio::time::timeout(Duration::from_secs(20), round_trip(&c, &b, 256, 2))
        .await
        .expect("registered-buffer I/O after the reset did not complete");

    // Reset with a registered write held by the target: it is sent again after recovery,
    // from the same buffer under the new context's keys.
    let data = pattern(3, CHUNK);
    b.write(0, &data);
    t.target.stall_io(true);
    let (copies, _) = c.io_copies();
    let w = c.write_from(&b, 0, 1, 512, CHUNK);
    let stalled = async {
        while t.target.stalled_io() < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
        c.wait_status(Duration::from_secs(20), |s| {
            s.machine.recoveries >= 2 && s.state() == CtrlState::Live
        })
        .await
        .unwrap();
        t.target.stall_io(false);
    };
    let (r, ()) = tokio::join!(w, stalled);
    r.unwrap();
    let requeued: u64 = c.queue_stats().iter().map(|s| s.requeued).sum();
    assert!(requeued >= 1, "the write was out during the reset");
    c.read_to(&b, 1, 1, 512, CHUNK).await.unwrap();
    assert!(chunk(&b, 1, CHUNK) == data);
    assert_eq!(c.io_copies().0, copies, "recovery made no copy either");
}

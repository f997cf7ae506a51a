//! NVMe-oF over the soft-HCA, end to end on loopback UDP: CM handshake, Fabrics Connect,
//! enable, Identify, I/O queues, and data written then read back.

use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::{CmService, SoftHca};
use nvmf_rdma::hca::device::DeviceConfig;
use nvmf_rdma::nvme::Nqn;
use nvmf_rdma::nvmet::{serve_cm, Namespace, Subsystem, Target, TargetConfig};
use nvmf_rdma::transport::{ConnectOptions, Controller, HostError};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const NQN: &str = "nqn.2026-11.io.nvmf-rdma:test";

fn cfg(name: &str, i: u8) -> DeviceConfig {
    crate::rig::device(1, name, i)
}

async fn target(bytes: u64) -> (Target<SoftHca>, SoftHca) {
    let hca = SoftHca::start(cfg("tgt0", 1)).await.unwrap();
    let ns = Arc::new(Namespace::ram(1, bytes, 9));
    let tc = TargetConfig {
        subsystems: vec![Subsystem::new(Nqn::new(NQN).unwrap(), vec![ns])],
        ..TargetConfig::default()
    };
    let t = Target::start(hca.clone(), tc).unwrap();
    serve_cm(t.clone(), CmService::for_device(&hca)).unwrap();
    (t, hca)
}

/// A host with `queues` I/O queues connected to `target`, `tune` applied to its options.
async fn host_with(
    target: &SoftHca,
    queues: usize,
    tune: impl FnOnce(&mut ConnectOptions),
) -> Result<Controller, HostError> {
    let hca = SoftHca::start(cfg("host0", 2)).await.unwrap();
    let cm = CmService::for_device(&hca);
    let mut o = ConnectOptions::new(target.addr(), NQN);
    o.nr_io_queues = queues;
    o.queue_size = 32;
    tune(&mut o);
    Controller::connect(hca, cm, o).await
}

/// A host with `queues` I/O queues, connected within 20 s or the test fails.
async fn connected(target: &SoftHca, queues: usize) -> Controller {
    connected_with(target, queues, |_| {}).await
}

/// [`connected`], with `tune` applied to the options first.
async fn connected_with(
    target: &SoftHca,
    queues: usize,
    tune: impl FnOnce(&mut ConnectOptions),
) -> Controller {
    tokio::time::timeout(Duration::from_secs(20), host_with(target, queues, tune))
        .await
        .expect("connect in time")
        .expect("connect")
}

/// Disconnect a controller the test shared between tasks, once they are done with it.
async fn disconnect(c: Arc<Controller>) {
    Arc::try_unwrap(c)
        .ok()
        .expect("last handle")
        .disconnect()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_identify_write_read_back() {
    let (t, thca) = target(64 << 20).await;
    let c = connected(&thca, 2).await;
    assert_eq!(c.io_queue_count(), 2);
    let ns = c.namespaces()[0];
    assert_eq!((ns.nsid, ns.block_size, ns.bytes()), (1, 512, 64 << 20));
    assert_eq!(c.ident.subnqn.text(), NQN);

    let mut rng = SmallRng::seed_from_u64(9);
    let mut written = Vec::new();
    for i in 0..40 {
        let blocks = match i % 4 {
            0 => 1,
            1 => rng.random_range(1..64),
            2 => 256,
            _ => 2048, // 1 MiB
        };
        let lba = rng.random_range(0..(ns.blocks - blocks as u64));
        let mut data = vec![0u8; blocks * 512];
        rng.fill(&mut data[..]);
        c.write(1, lba, &data).await.unwrap();
        let back = c.read(1, lba, data.len()).await.unwrap();
        assert!(
            back == data,
            "read back differs at lba {lba} len {}",
            data.len()
        );
        written.push((lba, data));
    }
    // Unaligned and out-of-range requests get clear errors and touch nothing.
    let e = c.read(1, 0, 1000).await.unwrap_err();
    assert!(e.to_string().contains("block size"), "{e}");
    let e = c.write(1, ns.blocks, &[0u8; 512]).await.unwrap_err();
    assert!(e.to_string().contains("beyond the namespace end"), "{e}");
    assert!(matches!(
        c.read(7, 0, 512).await,
        Err(HostError::Invalid(_))
    ));

    // Flush, write zeroes, deallocate.
    c.flush(1).await.unwrap();
    c.write_zeroes(1, 100, 8).await.unwrap();
    assert!(c.read(1, 100, 4096).await.unwrap().iter().all(|&b| b == 0));
    c.write(1, 200, &[0xAA; 4096]).await.unwrap();
    c.deallocate(1, &[(200, 8)]).await.unwrap();
    assert!(c.read(1, 200, 4096).await.unwrap().iter().all(|&b| b == 0));

    let queues_before = t.queue_count();
    assert_eq!(queues_before, 3);
    c.disconnect().await;
    for _ in 0..200 {
        if t.queue_count() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        t.queue_count(),
        0,
        "target dropped the queues after disconnect"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_into_matches_read_and_rejects_bad_lengths() {
    let (t, thca) = target(16 << 20).await;
    let c = connected(&thca, 1).await;
    let max = c.max_transfer();
    let mut rng = SmallRng::seed_from_u64(21);
    // One block, a few, exactly the transfer limit, and more than it (several commands).
    for bytes in [512, 4096, max, max * 2 + 1024] {
        let lba = rng.random_range(0..1000u64);
        let mut data = vec![0u8; bytes];
        rng.fill(&mut data[..]);
        c.write(1, lba, &data).await.unwrap();
        let mut buf = vec![0xEEu8; bytes];
        c.read_into(1, lba, &mut buf).await.unwrap();
        assert!(
            buf == data,
            "read_into differs from what was written ({bytes} bytes)"
        );
        assert!(
            c.read(1, lba, bytes).await.unwrap() == buf,
            "read and read_into disagree ({bytes} bytes)"
        );
    }
    // A length that is not a multiple of the block size, an empty buffer, and a range past
    // the end are clean errors, and the buffer is left alone.
    let blocks = c.namespaces()[0].blocks;
    for (lba, len) in [(0, 1000), (0, 0), (blocks - 1, 1024)] {
        let mut buf = vec![0xABu8; len];
        match c.read_into(1, lba, &mut buf).await {
            Err(HostError::Invalid(_)) => {}
            other => panic!("read_into of {len} bytes at {lba}: {other:?}"),
        }
        assert!(
            buf.iter().all(|&b| b == 0xAB),
            "a refused read_into wrote the buffer"
        );
    }
    // The queue still works after the refusals.
    let mut buf = vec![0u8; 512];
    c.read_into(1, 0, &mut buf).await.unwrap();
    c.disconnect().await;
    drop(t);
}

/// Writes borrow the caller's buffer: taken straight into a free slot, or queued (copied)
/// when every slot is busy. Far more concurrent writes than slots must all land, in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_concurrent_writes_than_slots_all_land() {
    let (t, thca) = target(16 << 20).await;
    let c = Arc::new(connected(&thca, 1).await);
    // The queue has 32 entries (one reserved): 200 writes of 4 KiB at once.
    let writes: Vec<_> = (0..200u64)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                let data = vec![(i % 251) as u8 + 1; 4096];
                c.write(1, i * 8, &data).await
            })
        })
        .collect();
    for w in writes {
        w.await.unwrap().unwrap();
    }
    for i in 0..200u64 {
        let mut buf = vec![0u8; 4096];
        c.read_into(1, i * 8, &mut buf).await.unwrap();
        assert!(
            buf.iter().all(|&b| b == (i % 251) as u8 + 1),
            "write {i} did not land whole"
        );
    }
    let io = &c.queue_stats()[1];
    assert_eq!(io.submitted, io.completed, "{io:?}");
    assert!(io.submitted >= 400, "{io:?}");
    disconnect(c).await;
    drop(t);
}

/// A 4 KiB write fits the target's in-capsule size. While the queue is shallow it goes in
/// the capsule; with more than `inline_depth` commands in flight it goes as a keyed SGL and
/// the target reads it. Both kinds land whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shallow_writes_go_in_the_capsule_deep_ones_as_keyed_sgls() {
    let depth = nvmf_rdma::transport::SOFT_INLINE_DEPTH;
    let in_capsule = deep_writes(Some(depth)).await;
    assert_eq!(in_capsule, 10 + depth as u64);
}

/// By default the host chooses by the path: this target is in the process, its packets
/// take the loopback path, and there every write that fits goes in its capsule, however
/// deep the queue (fails before the choice by path: 10 + SOFT_INLINE_DEPTH of them did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn towards_a_target_in_this_process_every_fitting_write_goes_in_the_capsule() {
    assert_eq!(deep_writes(None).await, 10 + DEEP);
}

/// Writes held at the target, so the queue only gets deeper.
const DEEP: u64 = 24;

/// Ten writes one at a time, then [`DEEP`] at once with `inline_depth`; every one read back
/// whole. How many went in their capsule.
async fn deep_writes(inline_depth: Option<usize>) -> u64 {
    let (t, thca) = target(16 << 20).await;
    let c = Arc::new(connected_with(&thca, 1, |o| o.inline_depth = inline_depth).await);
    let fill = |i: u64| vec![(i * 7 % 251) as u8 + 1; 4096];
    // The I/O queue's Fabrics Connect sent its data in the capsule too.
    let base = c.queue_stats()[1].in_capsule;
    let in_capsule = |c: &Controller| c.queue_stats()[1].in_capsule - base;
    for i in 0..10u64 {
        c.write(1, i * 8, &fill(i)).await.unwrap();
    }
    assert_eq!(
        in_capsule(&c),
        10,
        "one at a time, every write is in its capsule"
    );

    // The target holds the commands, so the queue only gets deeper.
    t.stall_io(true);
    let writes: Vec<_> = (10..10 + DEEP)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { c.write(1, i * 8, &fill(i)).await })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(10), async {
        while t.stalled_io() < DEEP as usize {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("all writes reach the target");
    t.stall_io(false);
    for w in writes {
        w.await.unwrap().unwrap();
    }
    let n = in_capsule(&c);
    for i in 0..10 + DEEP {
        let mut buf = vec![0u8; 4096];
        c.read_into(1, i * 8, &mut buf).await.unwrap();
        assert_eq!(buf, fill(i), "write {i} did not land whole");
    }
    disconnect(c).await;
    drop(t);
    n
}

/// At full queue depth the host sends its next command as soon as it has a response, ahead
/// of its (coalesced) ACK of that response, so the target's command slot is still waiting
/// for the ACK. The target holds such capsules until a slot frees: nothing is refused or
/// lost, and every byte reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_depth_commands_ahead_of_acks_are_held_not_dropped() {
    let (t, thca) = target(16 << 20).await;
    let c = Arc::new(connected(&thca, 1).await);
    let mut tasks = Vec::new();
    for w in 0..64u64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(w);
            for round in 0..40u64 {
                // Each worker owns its own 8 blocks.
                let lba = w * 8;
                let mut data = vec![0u8; 4096];
                rng.fill(&mut data[..]);
                c.write(1, lba, &data).await.unwrap();
                let back = c.read(1, lba, 4096).await.unwrap();
                assert!(back == data, "worker {w} round {round}: read back differs");
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("I/O finished in time")
            .unwrap();
    }
    let s = t.stats();
    assert_eq!(s.errors, 0, "{s:?}");
    assert!(
        s.held_capsules > 0,
        "the queue never ran full of slots waiting for ACKs: {s:?}"
    );
    disconnect(c).await;
}

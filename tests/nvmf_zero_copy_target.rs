//! Target-side zero copy for RAM namespaces (issue 17): reads are RDMA WRITEs straight from
//! the namespace and writes RDMA READs straight into it, with no staging copy, and still
//! every logical block is written and read whole (NVMe's one-block atomicity) when commands
//! overlap, although the soft-HCA moves a block in several packets.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::harness::chaos::{connect_host, host_options, TargetRig, HOST_DEV};
use nvmf_rdma::reconnect::Policy;
use nvmf_rdma::transport::Controller;
use nvmf_rdma::verbs::Mtu;

const IP: [u8; 4] = [127, 0, 0, 1];
/// 512-byte blocks (the rig's), so with a 256-byte MTU every block spans two packets.
const BLOCK: usize = 512;
/// Every command covers the same 64 blocks (keyed: larger than the in-capsule size).
const SPAN: usize = 64 * BLOCK;

/// Reconnect at once after the host's device comes back.
fn policy() -> Policy {
    Policy {
        reconnect_delay: Duration::ZERO,
        ..Policy::default()
    }
}

async fn rig(queues: usize) -> (DeviceManager, TargetRig, Controller) {
    let t = TargetRig::start(IP, 1 << 20).await.unwrap();
    let mgr = DeviceManager::new(true);
    let mut o = host_options(t.addr, queues, 32, policy());
    o.mtu = Mtu::Mtu256;
    let c = connect_host(&mgr, IP, o).await.unwrap();
    (mgr, t, c)
}

/// Do the namespace's ranges all come free? A read's is given back when the host's ACK of
/// its response reaches the target, just after the host has the response.
async fn ranges_drain(t: &TargetRig) -> bool {
    for _ in 0..200 {
        if t.ns.ranges_in_use() == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// The blocks of `data` that are not one byte value throughout.
fn torn(data: &[u8]) -> Vec<usize> {
    data.chunks(BLOCK)
        .enumerate()
        .filter(|(_, b)| b.iter().any(|x| *x != b[0]))
        .map(|(i, _)| i)
        .collect()
}

/// Two writers put distinct patterns (one byte value per command, the same for every block)
/// on the same 64 blocks over and over, on different queues, while two readers read them
/// back: every block any read returns is wholly one write's. Without the namespace's range
/// table the writes' RDMA READ responses land interleaved packet by packet and the reads'
/// RDMA WRITEs leave half old, half new blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_zero_copy_commands_never_tear_a_block() {
    let (_mgr, t, c) = rig(4).await;
    // The I/O queues' Fabrics Connects brought their data in the capsule (copied).
    let connected = t.target.stats();
    let c = Arc::new(c);
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2u8 {
        let (c, stop) = (c.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                // Odd bytes for writer 0, even (never 0) for writer 1.
                let v = ((n % 100) as u8) * 2 + 1 + w;
                c.write(1, 0, &vec![v; SPAN]).await.unwrap();
                n += 1;
            }
            n
        }));
    }
    let mut readers = Vec::new();
    for _ in 0..2 {
        let c = c.clone();
        readers.push(tokio::spawn(async move {
            let mut bad = Vec::new();
            for _ in 0..300 {
                let got = c.read(1, 0, SPAN).await.unwrap();
                bad.extend(torn(&got));
            }
            bad
        }));
    }
    let mut bad = Vec::new();
    for r in readers {
        bad.extend(r.await.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    let mut writes = 0;
    for w in writers {
        writes += w.await.unwrap();
    }
    let last = c.read(1, 0, SPAN).await.unwrap();
    bad.extend(torn(&last));
    assert!(writes > 50, "the writers hardly ran ({writes} writes)");
    assert!(
        bad.is_empty(),
        "torn blocks read: {} (first {:?})",
        bad.len(),
        &bad[..bad.len().min(8)]
    );
    assert!(
        ranges_drain(&t).await,
        "a finished command still holds its range"
    );
    let s = t.target.stats();
    assert_eq!(
        (
            s.io_copies - connected.io_copies,
            s.io_copied_bytes - connected.io_copied_bytes
        ),
        (0, 0),
        "keyed reads and writes of a RAM namespace are copied nowhere on the target"
    );
    assert!(s.bytes_written >= writes as u64 * SPAN as u64);
}

/// A queue that goes while its commands hold or wait for namespace ranges gives them back:
/// the host's device is reset in the middle of overlapping I/O, the host reconnects, and
/// every range is free again and the same blocks can be written and read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_of_a_queue_that_goes_are_released() {
    let (mgr, t, c) = rig(2).await;
    let c = Arc::new(c);
    let mut io = Vec::new();
    for w in 0..4u8 {
        let c = c.clone();
        io.push(tokio::spawn(async move {
            for n in 0..200u8 {
                let v = n.wrapping_mul(4).wrapping_add(w) | 1;
                // Errors are expected while the device is away.
                let _ = c.write(1, 0, &vec![v; SPAN]).await;
                let _ = c.read(1, 0, SPAN).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    mgr.reset(HOST_DEV, Duration::ZERO).await.unwrap();
    // A range left behind by a dead queue would hold every later overlapping command
    // for ever: bound the wait.
    let after = async {
        for h in io {
            h.await.unwrap();
        }
        // The new queues' traffic goes through while no old command is left.
        c.write(1, 0, &vec![7u8; SPAN]).await.unwrap();
        c.read(1, 0, SPAN).await.unwrap()
    };
    let back = tokio::time::timeout(Duration::from_secs(60), after)
        .await
        .expect("I/O after the reset is stuck behind a range of a queue that went");
    assert_eq!(back, vec![7u8; SPAN]);
    assert!(ranges_drain(&t).await, "a range outlived its queue");
    assert!(t.target.stats().queues_dropped > 0, "no queue went");
}

//! The host's data-path counters reach the metrics recorder (copies per I/O are shown in
//! the bench output and exported): completed I/O, payload copies and their bytes,
//! published at each controller event (keep-alives included), never counted per I/O.

use std::time::Duration;

use nvmf_rdma::driver::DeviceManager;
use nvmf_rdma::harness::chaos::{connect_host, host_options, TargetRig};
use nvmf_rdma::reconnect::Policy;

#[path = "common/counters.rs"]
mod counters;
use counters::Counters;

const IP: [u8; 4] = [127, 0, 0, 1];
const CHUNK: usize = 16 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_io_and_copy_counters_are_exported() {
    let rec = Counters::default();
    metrics::set_global_recorder(rec.clone()).expect("the only recorder of this binary");
    let t = TargetRig::start(IP, 16 << 20).await.unwrap();
    let mgr = DeviceManager::new(true);
    let policy = Policy {
        keep_alive_tmo: Duration::from_secs(1),
        ..Policy::default()
    };
    let c = connect_host(&mgr, IP, host_options(t.addr, 1, 32, policy))
        .await
        .unwrap();
    // Registered buffers: no copy. One copying read: two copies (slot, then the caller's).
    let b = c.io_buffer(CHUNK, 2).unwrap();
    b.write(0, &vec![0x5Au8; CHUNK]);
    c.write_from(&b, 0, 1, 0, CHUNK).await.unwrap();
    c.read_to(&b, 1, 1, 0, CHUNK).await.unwrap();
    let data = c.read(1, 0, CHUNK).await.unwrap();
    assert!(data.iter().all(|&x| x == 0x5A));
    let (copies, bytes) = c.io_copies();
    assert_eq!((copies, bytes), (2, 2 * CHUNK as u64));
    // Published at the next keep-alive (every half second here); 10 s is ample.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while rec.get("nvmf_ctrl_io_copies_total") != copies
        || rec.get("nvmf_ctrl_completed_io_total") < 3
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not published: copies {}, completed {}",
            rec.get("nvmf_ctrl_io_copies_total"),
            rec.get("nvmf_ctrl_completed_io_total")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rec.get("nvmf_ctrl_io_copied_bytes_total"), bytes);
    c.disconnect().await;
}

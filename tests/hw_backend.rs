//! The `hw` backend against a real RDMA device. Skips (passing, with a message) when the host
//! has no RDMA device; `tests/vm/run.sh hw` runs the full path in a qemu guest against rxe.
//!
//! With `NVMF_HW_TARGET=<ip>:<port>` and `NVMF_HW_NQN=<subsystem>` it also connects the
//! ordinary host (the one the soft-HCA runs, recovery included) through the first device
//! over the backend seam, writes and verifies 4 MiB with two I/O queues, and disconnects.
#![cfg(feature = "hw")]

use std::time::Duration;

use nvmf_rdma::hw::device::{list_devices, roce_v2_ipv4_gid, HwDevice, HwDeviceInfo, Selector};
use nvmf_rdma::hw::events::AsyncEvents;
use nvmf_rdma::hw::source::HwSource;
use nvmf_rdma::hw::HwError;
use nvmf_rdma::transport::{ConnectOptions, Controller};
use nvmf_rdma::verbs::FaultInjector;

#[path = "common/conformance.rs"]
mod conformance;
#[path = "common/counting_alloc.rs"]
mod counting_alloc;

#[global_allocator]
static A: counting_alloc::Counting = counting_alloc::Counting;

fn devices_or_skip(test: &str) -> Option<Vec<HwDeviceInfo>> {
    match list_devices() {
        Ok(d) if !d.is_empty() => Some(d),
        Ok(_) => {
            eprintln!("{test}: skipping: no RDMA device on this host");
            None
        }
        Err(HwError::NoVerbs(e)) => {
            eprintln!("{test}: skipping: no RDMA support on this host ({e})");
            None
        }
        Err(e) => panic!("{test}: listing devices failed: {e}"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn devices_open_and_have_identity() {
    let Some(devs) = devices_or_skip("devices_open_and_have_identity") else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        for info in devs {
            assert_ne!(info.guid.0, 0, "{info}: zero GUID");
            let dev = HwDevice::open(&Selector::Guid(info.guid)).unwrap();
            assert_eq!(dev.info(), &info);
            // the same device by name, and by PCI address when it has one
            let by_name = HwDevice::open(&Selector::Name(info.name.clone())).unwrap();
            assert_eq!(by_name.info().guid, info.guid);
            if let Some(p) = info.pci {
                assert_eq!(
                    HwDevice::open(&Selector::Pci(p)).unwrap().info().guid,
                    info.guid
                );
            }
            // verbs objects come up; an idle device has no async event pending
            let cq = dev.create_cq(16).unwrap();
            let _qp = dev.create_rc_qp(&cq, 8, 8).unwrap();
            let ev = AsyncEvents::new(&dev).unwrap();
            let _ = ev.try_next().unwrap();
        }
    });
}

/// The same checks `tests/verbs_conformance.rs` runs on the soft-HCA, through the same seam:
/// on each RoCE device, a QP connected through rdma_cm to another QP of the same device, at
/// the device's IPv4 address.
#[test]
fn hw_device_passes_the_verbs_conformance_checks() {
    let name = "hw_device_passes_the_verbs_conformance_checks";
    let Some(devs) = devices_or_skip(name) else {
        return;
    };
    let rt = runtime();
    let mut ran = 0;
    for info in devs {
        let Some((_, gid)) = roce_v2_ipv4_gid(std::path::Path::new("/sys"), &info.name) else {
            eprintln!(
                "{}: no RoCE v2 IPv4 GID, not a loopback candidate",
                info.name
            );
            continue;
        };
        let ip = std::net::Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15]);
        rt.block_on(async {
            let src = HwSource::new();
            // Any port nothing else on the guest listens on (nvmet has 4420).
            let at = std::net::SocketAddr::from((ip, 4791));
            conformance::conformance(&src, &info.name, &info.name, at, 18515)
                .await
                .unwrap_or_else(|e| panic!("{info}: {e}"));
        });
        ran += 1;
    }
    if ran == 0 {
        eprintln!("{name}: skipping: no RoCE v2 device with an IPv4 GID");
    }
}

#[test]
fn unknown_device_is_an_error() {
    if devices_or_skip("unknown_device_is_an_error").is_none() {
        return;
    }
    let err = HwDevice::open(&Selector::Name("no-such-device".into())).unwrap_err();
    assert!(matches!(err, HwError::NoSuchDevice(_)), "{err}");
}

#[test]
fn target_write_verify_when_configured() {
    let (Ok(addr), Ok(nqn)) = (
        std::env::var("NVMF_HW_TARGET"),
        std::env::var("NVMF_HW_NQN"),
    ) else {
        eprintln!(
            "target_write_verify_when_configured: skipping: NVMF_HW_TARGET/NVMF_HW_NQN not set"
        );
        return;
    };
    if devices_or_skip("target_write_verify_when_configured").is_none() {
        return;
    }
    let dev = devices_or_skip("target_write_verify_when_configured").unwrap()[0]
        .name
        .clone();
    let rt = runtime();
    rt.block_on(async {
        let mut o = ConnectOptions::new(addr.parse().expect("NVMF_HW_TARGET is ip:port"), &nqn);
        o.nr_io_queues = 2;
        o.connect_timeout = Duration::from_secs(20);
        let c = Controller::connect_managed(HwSource::new(), &dev, o)
            .await
            .unwrap();
        let ns = c.namespaces()[0];
        let bs = ns.block_size as usize;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for chunk in 0..32u64 {
            let data: Vec<u8> = (0..128 << 10)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let lba = chunk * (data.len() / bs) as u64;
            c.write(ns.nsid, lba, &data).await.unwrap();
            assert_eq!(
                c.read(ns.nsid, lba, data.len()).await.unwrap(),
                data,
                "chunk {chunk}"
            );
        }
        assert_eq!(c.status().machine.recoveries, 0);
        c.disconnect().await;
    });
}

/// The recovery path on a kernel device allocates nothing in the host's code, as on the
/// soft-HCA (`tests/recovery_alloc.rs`): from the fault (our context of the device dropped
/// as on DEVICE_FATAL, [`FaultInjector::reset`]) until the
/// controller is live again with the I/O that was in flight resubmitted. libibverbs,
/// librdmacm and their bindings are the platform's (`alloc_audit`), as the soft-HCA is.
#[test]
fn hw_recovery_allocates_nothing_in_the_host_when_configured() {
    use nvmf_rdma::harness::alloc_audit::Platform;
    use nvmf_rdma::reconnect::CtrlState;
    use std::sync::Arc;
    let name = "hw_recovery_allocates_nothing_in_the_host_when_configured";
    let (Ok(addr), Ok(nqn)) = (
        std::env::var("NVMF_HW_TARGET"),
        std::env::var("NVMF_HW_NQN"),
    ) else {
        eprintln!("{name}: skipping: NVMF_HW_TARGET/NVMF_HW_NQN not set");
        return;
    };
    let Some(devs) = devices_or_skip(name) else {
        return;
    };
    let dev = devs[0].name.clone();
    let rt = runtime();
    rt.block_on(async {
        let mut o = ConnectOptions::new(addr.parse().expect("NVMF_HW_TARGET is ip:port"), &nqn);
        o.nr_io_queues = 2;
        o.connect_timeout = Duration::from_secs(20);
        o.policy.reconnect_delay = Duration::ZERO;
        o.policy.ctrl_loss_tmo = Some(Duration::from_secs(60));
        let src = FaultInjector::new(HwSource::new());
        let c = Arc::new(
            Controller::connect_managed(src.clone(), &dev, o)
                .await
                .unwrap(),
        );
        let ns = c.namespaces()[0];
        // Warm up: every slot of both queues used once.
        for i in 0..64u64 {
            c.write(ns.nsid, 4096 + i * 8, &[i as u8; 4096])
                .await
                .unwrap();
        }
        // I/O in flight at the fault: 1.5 MiB of writes, which rxe under emulation takes
        // tens of milliseconds to carry (nvmet cannot be told to hold them, as our target
        // can in `tests/recovery_alloc.rs`; the count of held I/Os is printed).
        const N: usize = 24;
        let mut writes = Vec::new();
        for i in 0..N {
            let c = c.clone();
            let data = vec![i as u8 ^ 0x5A; 64 << 10];
            writes.push(tokio::spawn(async move {
                let lba = i as u64 * 256;
                c.write(ns.nsid, lba, &data).await.map(|_| (lba, data))
            }));
        }
        tokio::task::yield_now().await;
        counting_alloc::start();
        Platform::new(async {
            src.reset(&dev, Duration::ZERO).await.unwrap();
            c.wait_status(Duration::from_secs(30), |s| {
                s.machine.recoveries >= 1 && s.state() == CtrlState::Live
            })
            .await
            .unwrap();
        })
        .await;
        let n = counting_alloc::stop();
        println!(
            "{name}: allocations during recovery on {dev}: host {}, platform {}; I/Os held {}",
            n.host,
            n.platform,
            c.queue_stats().iter().map(|q| q.requeued).sum::<u64>()
        );
        assert_eq!(
            n.host,
            0,
            "the host allocated during recovery; first sites:\n{}",
            n.traces.join("\n-----\n")
        );
        for w in writes {
            let (lba, data) = w.await.unwrap().expect("the write completes");
            assert!(c.read(ns.nsid, lba, data.len()).await.unwrap() == data);
        }
        if let Ok(c) = Arc::try_unwrap(c) {
            c.disconnect().await;
        }
    });
}

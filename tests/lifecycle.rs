//! Device lifecycle: the zombie semantics of a context after `Device::fatal()` and
//! `Device::remove()` ("RDMA reset flows"), the peer's view of a dead device, the device
//! list across unplug / re-plug / reset, and the recovery shape later work builds on: a
//! fresh context with the same identity, the same host buffers re-registered, data moving.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use nvmf_rdma::hca::rc::{connect_end, RcEnd, RcOptions};
use nvmf_rdma::hca::sim::{sim_identity, Faults, Sim};
use nvmf_rdma::hca::*;
use nvmf_rdma::verbs::*;

const SEC: Duration = Duration::from_secs(1);
const SLOT: usize = 64 << 10;
/// A-side send WQEs (wr_id 0..N_A) and B-side ones (wr_id 500..500+N_B).
const N_A: u64 = 48;
const N_B: u64 = 24;
const B_BASE: u64 = 500;
/// Receive WQEs: A's are 1000.., B's 2000...
const A_RECV_BASE: u64 = 1000;
const B_RECV_BASE: u64 = 2000;

/// Transport retries while the workload runs: low, so the peer of a dead device gives up
/// after `RETRY_CNT + 1` ACK timeouts.
const RETRY_CNT: u8 = 2;

fn opts() -> RcOptions {
    RcOptions {
        buf_len: 8 << 20,
        retry_cnt: RETRY_CNT,
        ..RcOptions::default()
    }
}

/// Loss, duplication and reordering mild enough that `RETRY_CNT` retries never run out on
/// a live peer in these seeds (a NAK-sequence retry spends one too), so every error seen is
/// the dead device's doing.
const MILD: Faults = Faults {
    drop: 0.02,
    duplicate: 0.05,
    reorder: 0.05,
    reorder_window_ns: 20_000,
    corrupt: 0.005,
    latency_ns: 2_000,
    byte_ns: 0,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Recv,
}

/// Every WQE a side posted: wr_id → (kind, signaled).
type Posted = BTreeMap<u64, (Kind, bool)>;

/// A mixed workload in both directions, sized so that plenty is still outstanding when the
/// device dies a little way in.
fn load(p: &mut Pair) -> [Posted; 2] {
    let mut posted = [Posted::new(), Posted::new()];
    // Receives for the other side's SENDs (and WRITE with immediate).
    for i in 0..N_B {
        let wr = recv_wr(A_RECV_BASE + i, &p.a, (4 << 20) + i as usize * SLOT, SLOT);
        post_recv(&mut p.sim, 0, p.a.qpn, wr);
        posted[0].insert(A_RECV_BASE + i, (Kind::Recv, true));
    }
    for i in 0..N_A {
        let wr = recv_wr(B_RECV_BASE + i, &p.b, (4 << 20) + i as usize * SLOT, SLOT);
        post_recv(&mut p.sim, 1, p.b.qpn, wr);
        posted[1].insert(B_RECV_BASE + i, (Kind::Recv, true));
    }
    for (dev, n, base) in [(0usize, N_A, 0u64), (1, N_B, B_BASE)] {
        let (me, peer) = if dev == 0 {
            (p.a.clone(), p.b.clone())
        } else {
            (p.b.clone(), p.a.clone())
        };
        for i in 0..n {
            let off = i as usize * SLOT;
            let remote_addr = peer.mr.addr + ((2 << 20) + off) as u64;
            let rkey = peer.mr.rkey;
            let op = match i % 5 {
                0 => SendOp::Send,
                1 => SendOp::Write { remote_addr, rkey },
                2 => SendOp::Read { remote_addr, rkey },
                3 => SendOp::SendWithImm(i as u32),
                _ => SendOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm: i as u32,
                },
            };
            // Write-with-immediate consumes a receive on the peer; the peer posted one per
            // WQE, so the count works out for every op that needs one.
            let len = 1 + (i as usize * 7919) % SLOT;
            let mut wr = send_wr(base + i, op, &me, off, len);
            wr.signaled = i % 3 != 2;
            post_send(&mut p.sim, dev, me.qpn, wr);
            posted[dev].insert(base + i, (Kind::Send, wr.signaled));
        }
    }
    posted
}

/// Check that every posted WQE completed at most once and every receive exactly once, and
/// that the send queue retired as a FIFO: sends before the first failed one succeeded
/// (silently if unsignaled), and every send from the first failed one on, signaled or not,
/// has exactly one completion and all but the first are flushes. `first_error` is the status
/// the first failed send must carry.
fn check_exactly_once(who: &str, posted: &Posted, wcs: &[WorkCompletion], first_error: WcStatus) {
    let mut seen = BTreeMap::new();
    for w in wcs {
        assert!(
            seen.insert(w.wr_id, w.status).is_none(),
            "{who}: wr {} completed twice",
            w.wr_id
        );
        assert!(
            posted.contains_key(&w.wr_id),
            "{who}: unknown wr {}",
            w.wr_id
        );
    }
    let first_bad = posted
        .iter()
        .filter(|(_, (k, _))| *k == Kind::Send)
        .map(|(id, _)| *id)
        .find(|id| seen.get(id).is_some_and(|s| *s != WcStatus::Success))
        .unwrap_or_else(|| panic!("{who}: no send failed"));
    assert_eq!(seen[&first_bad], first_error, "{who}: wr {first_bad}");
    for (&id, &(kind, signaled)) in posted {
        let st = seen.get(&id).copied();
        match kind {
            Kind::Recv => assert!(
                matches!(st, Some(WcStatus::Success | WcStatus::WrFlushErr)),
                "{who}: receive {id}: {st:?}"
            ),
            Kind::Send if id < first_bad => assert_eq!(
                st,
                signaled.then_some(WcStatus::Success),
                "{who}: send {id} before the failure"
            ),
            Kind::Send if id > first_bad => assert_eq!(
                st,
                Some(WcStatus::WrFlushErr),
                "{who}: send {id} (signaled {signaled}) after the failure"
            ),
            Kind::Send => {}
        }
    }
    // Send completions come out in posting order.
    let sends: Vec<u64> = wcs
        .iter()
        .filter(|w| posted[&w.wr_id].0 == Kind::Send)
        .map(|w| w.wr_id)
        .collect();
    assert!(sends.windows(2).all(|w| w[0] < w[1]), "{who}: {sends:?}");
}

fn statuses(wcs: &[WorkCompletion]) -> BTreeMap<&'static str, usize> {
    let mut m = BTreeMap::new();
    for w in wcs {
        *m.entry(w.status.as_str()).or_insert(0) += 1;
    }
    m
}

/// A pair with the workload running, stopped once A has seen a few completions.
fn loaded_pair(seed: u64, faults: Faults) -> (Pair, [Posted; 2], Vec<WorkCompletion>) {
    let mut p = pair(seed, faults, opts());
    assert_eq!(events(&mut p.sim, 0), [AsyncEvent::PortActive]);
    let posted = load(&mut p);
    let mut before = Vec::new();
    let cq = p.a.cq;
    let ok = p.sim.run_until(10 * SEC, |s| {
        s.devices[0].poll_cq(cq, usize::MAX, &mut before);
        before.len() >= 6
    });
    assert!(ok, "seed {seed}: workload made no progress");
    (p, posted, before)
}

/// Everything the zombie contract says, checked on device 0 after `kill` ran on it.
fn zombie_contract(seed: u64, kill: fn(&mut Device), want_events: &[AsyncEvent]) {
    let (mut p, posted, mut a_wcs) = loaded_pair(seed, MILD);
    let flushed_before = p.sim.devices[0].stats().flushed;
    assert_eq!(
        flushed_before,
        0,
        "{:?} {:?} {:?}",
        ids(&a_wcs),
        p.sim.devices[0].stats(),
        p.sim.devices[1].stats()
    );
    kill(&mut p.sim.devices[0]);
    assert!(!p.sim.devices[0].is_live());

    // Pending WQEs are flushed in software at once: poll_cq works on the zombie.
    let after = drain(&mut p.sim, 0, p.a.cq);
    assert!(!after.is_empty());
    assert!(
        after.iter().all(|w| w.status == WcStatus::WrFlushErr),
        "seed {seed}: {:?}",
        statuses(&after)
    );
    // Signaled or not, sends and receives alike.
    let flushed: BTreeSet<u64> = after.iter().map(|w| w.wr_id).collect();
    assert!(flushed
        .iter()
        .any(|id| posted[0][id] == (Kind::Send, false)));
    assert!(flushed.iter().any(|id| posted[0][id] == (Kind::Send, true)));
    assert!(flushed.iter().any(|id| posted[0][id].0 == Kind::Recv));
    assert_eq!(p.sim.devices[0].stats().flushed, after.len() as u64);
    a_wcs.extend(after);
    check_exactly_once("zombie", &posted[0], &a_wcs, WcStatus::WrFlushErr);

    // Events: the port goes down, then the device.
    assert_eq!(events(&mut p.sim, 0), want_events);

    // Posts fail at once, and so does everything that would create or change state.
    let d = &mut p.sim.devices[0];
    let mem = HostMem::new(4096);
    let now = p.sim.now;
    assert_eq!(
        d.post_send(now, p.a.qpn, send_wr(9999, SendOp::Send, &p.a, 0, 1)),
        Err(VerbsError::DeviceGone)
    );
    assert_eq!(
        d.post_recv(p.a.qpn, recv_wr(9998, &p.a, 0, 1)),
        Err(VerbsError::DeviceGone)
    );
    assert_eq!(d.alloc_pd(), Err(VerbsError::DeviceGone));
    assert_eq!(
        d.reg_mr(p.a.pd, &mem, 0, 4096, Access::LOCAL_WRITE),
        Err(VerbsError::DeviceGone)
    );
    assert_eq!(d.create_cq(16), Err(VerbsError::DeviceGone));
    assert_eq!(
        d.create_qp(p.a.pd, p.a.cq, p.a.cq, QpCaps::default()),
        Err(VerbsError::DeviceGone)
    );
    let to_reset = QpAttr {
        state: QpState::Reset,
        ..QpAttr::default()
    };
    assert_eq!(
        d.modify_qp(p.a.qpn, &to_reset, AttrMask::STATE),
        Err(VerbsError::DeviceGone)
    );
    // Failed posts produce no completion; fatal twice changes nothing.
    kill(d);
    assert!(d.poll_event().is_none());
    assert!(drain(&mut p.sim, 0, p.a.cq).is_empty());

    // The zombie neither sends nor wants timers, and ignores what arrives.
    assert!(p.sim.devices[0].poll_timeout().is_none());
    let sent_before = p.sim.devices[0].stats().tx_packets;

    // The peer: its outstanding work fails by retry exhaustion, not a hang; the rest of its
    // queues flush behind it.
    let b_limit = 30 * SEC;
    let mut b_wcs = Vec::new();
    let cq = p.b.cq;
    let quiet = p.sim.run_until(b_limit, |s| {
        s.devices[1].poll_cq(cq, usize::MAX, &mut b_wcs);
        s.devices[1].query_qp(p.b.qpn).map(|a| a.state) == Ok(QpState::Err)
    });
    assert!(quiet, "seed {seed}: peer never gave up");
    assert!(
        run_quiet(&mut p.sim, b_limit),
        "seed {seed}: peer still busy"
    );
    b_wcs.extend(drain(&mut p.sim, 1, p.b.cq));
    check_exactly_once("peer", &posted[1], &b_wcs, WcStatus::RetryExcErr);
    // The ACK timer drove it: a dead device sends no NAKs. (Retries spent on sequence
    // NAKs since the last progress count too, so the expiries may be fewer than
    // RETRY_CNT + 1.)
    let sb = p.sim.devices[1].stats();
    assert!(sb.timeouts >= 1, "{sb:?}");
    assert_eq!(sb.naks_rx, 0);
    assert_eq!(p.sim.devices[0].stats().tx_packets, sent_before);
    assert!(drain(&mut p.sim, 0, p.a.cq).is_empty());

    // Release in the "wrong" order (PD before MR, CQ before QP): all succeed on a zombie.
    let d = &mut p.sim.devices[0];
    assert_eq!(d.object_counts(), (1, 1, 1, 1));
    assert_eq!(d.dealloc_pd(p.a.pd), Ok(()));
    assert_eq!(d.destroy_cq(p.a.cq), Ok(()));
    assert_eq!(d.dereg_mr(p.a.mr.lkey), Ok(()));
    assert_eq!(d.destroy_qp(p.a.qpn), Ok(()));
    assert_eq!(d.object_counts(), (0, 0, 0, 0));
    // Releasing twice is harmless too.
    assert_eq!(d.destroy_qp(p.a.qpn), Ok(()));
    assert_eq!(d.dealloc_pd(p.a.pd), Ok(()));
    let mut none = Vec::new();
    assert_eq!(d.poll_cq(p.a.cq, 10, &mut none), 0);
}

#[test]
fn fatal_makes_a_zombie() {
    for seed in [1, 2, 3] {
        zombie_contract(
            seed,
            Device::fatal,
            &[AsyncEvent::PortError, AsyncEvent::DeviceFatal],
        );
    }
}

#[test]
fn remove_makes_a_zombie_and_says_removed() {
    for seed in [4, 5, 6] {
        zombie_contract(
            seed,
            Device::remove,
            &[
                AsyncEvent::PortError,
                AsyncEvent::DeviceFatal,
                AsyncEvent::DeviceRemoved,
            ],
        );
    }
}

#[test]
fn remove_after_fatal_adds_only_removed() {
    let mut p = pair(7, Faults::NONE, opts());
    let _ = events(&mut p.sim, 0);
    p.sim.devices[0].fatal();
    assert_eq!(p.sim.devices[0].lifecycle(), Lifecycle::Fatal);
    p.sim.devices[0].remove();
    assert_eq!(p.sim.devices[0].lifecycle(), Lifecycle::Removed);
    p.sim.devices[0].fatal();
    p.sim.devices[0].remove();
    assert_eq!(
        events(&mut p.sim, 0),
        [
            AsyncEvent::PortError,
            AsyncEvent::DeviceFatal,
            AsyncEvent::DeviceRemoved
        ]
    );
}

#[test]
fn release_all_on_a_zombie_frees_everything() {
    let (mut p, _, _) = loaded_pair(8, Faults::NONE);
    let d = &mut p.sim.devices[0];
    // A second PD, MR and CQ the QP does not use.
    let pd = d.alloc_pd().unwrap();
    d.reg_mr(pd, &p.a.mem, 0, 4096, Access::LOCAL_WRITE)
        .unwrap();
    d.create_cq(8).unwrap();
    d.fatal();
    assert_eq!(d.object_counts(), (2, 2, 2, 1));
    d.release_all();
    assert_eq!(d.object_counts(), (0, 0, 0, 0));
}

#[test]
fn live_device_still_refuses_out_of_order_release() {
    // The zombie's leniency is not the live device's: there, busy objects stay.
    let mut p = pair(9, Faults::NONE, opts());
    let d = &mut p.sim.devices[0];
    assert_eq!(
        d.dealloc_pd(p.a.pd),
        Err(VerbsError::Busy("protection domain"))
    );
    assert_eq!(
        d.destroy_cq(p.a.cq),
        Err(VerbsError::Busy("completion queue"))
    );
    assert_eq!(d.object_counts(), (1, 1, 1, 1));
}

// ---- the device list ---------------------------------------------------------------------

fn identity_with(i: usize, mac_low: u8, pci_dev: u8) -> DeviceIdentity {
    DeviceIdentity::from_mac(
        &sim_identity(i).name,
        [0x52, 0x54, 0x00, 0x00, 0x01, mac_low],
        PciAddr::new(0, 0x5e, pci_dev, 0),
    )
}

#[test]
fn device_list_follows_unplug_replug_and_reset() {
    let mut sim = Sim::new(10, Faults::NONE, 2);
    let mut list = DeviceList::new();
    for d in &sim.devices {
        list.plug(d.identity().clone()).unwrap();
    }
    let name0 = sim_identity(0).name;
    let first = list.refresh();
    assert_eq!(first.len(), 2);
    assert!(first.iter().all(|d| d.generation == 1));
    assert_eq!(first[0].identity(), *sim.devices[0].identity());

    // Hot-remove: the context turns zombie and the device leaves the list.
    let e = list.epoch();
    sim.devices[0].remove();
    list.unplug(&name0).unwrap();
    assert!(list.changed_since(e));
    let now = list.refresh();
    assert_eq!(now.len(), 1);
    assert!(now.iter().all(|d| d.name != name0));
    assert!(list.find_by_guid(sim_identity(0).guid).is_none());
    assert!(list.find_by_pci(sim_identity(0).pci).is_none());

    // Re-plug with the same identity: back, one generation on.
    sim.replace_device(0, sim_identity(0));
    let back = list.plug(sim.devices[0].identity().clone()).unwrap();
    assert_eq!(back.generation, 2);
    assert_eq!(back.identity(), sim_identity(0));
    assert!(back.same_hardware(&sim_identity(0)));
    assert_eq!(list.find_by_guid(back.guid), Some(back.clone()));

    // Re-plug with a different GUID (same PCI slot): a new card, not ours.
    sim.devices[0].remove();
    list.unplug(&name0).unwrap();
    let new_guid = identity_with(0, 0x77, sim_identity(0).pci.device);
    let new_guid = DeviceIdentity {
        pci: sim_identity(0).pci,
        ..new_guid
    };
    sim.replace_device(0, new_guid.clone());
    let g = list.plug(new_guid.clone()).unwrap();
    assert_eq!(
        (g.generation, g.guid, g.pci),
        (3, new_guid.guid, sim_identity(0).pci)
    );
    assert!(!g.same_hardware(&sim_identity(0)));
    assert!(list.find_by_guid(sim_identity(0).guid).is_none());
    assert_eq!(list.find_by_pci(sim_identity(0).pci), Some(g.clone()));

    // Re-plug with the original GUID in a different PCI slot.
    sim.devices[0].remove();
    list.unplug(&name0).unwrap();
    let moved = DeviceIdentity {
        pci: PciAddr::new(0, 0x5e, 3, 0),
        ..sim_identity(0)
    };
    sim.replace_device(0, moved.clone());
    let m = list.plug(moved.clone()).unwrap();
    assert_eq!(
        (m.generation, m.guid, m.pci),
        (4, sim_identity(0).guid, moved.pci)
    );
    assert!(!m.same_hardware(&sim_identity(0)));
    assert_eq!(list.find_by_guid(sim_identity(0).guid), Some(m.clone()));
    assert!(list.find_by_pci(sim_identity(0).pci).is_none());

    // A fatal reset: same identity, next generation, still present.
    sim.devices[1].fatal();
    let r = list.reset(&sim_identity(1).name).unwrap();
    assert_eq!(r.identity(), sim_identity(1));
    assert_eq!(r.generation, 2);
    sim.replace_device(1, sim_identity(1));
    assert_eq!(*sim.devices[1].identity(), r.identity());
    let names: Vec<(String, u64)> = list
        .refresh()
        .into_iter()
        .map(|d| (d.name, d.generation))
        .collect();
    assert_eq!(names, [(name0, 4), (sim_identity(1).name, 2)]);
}

// ---- recovery shape ---------------------------------------------------------------------

/// Open the objects for `mem` (the SAME host buffer as before) on a fresh context: new PD,
/// new MR (new keys), new CQ and a QP in INIT.
fn reopen_end(dev: &mut Device, mem: &HostMem, o: &RcOptions, psn: Psn) -> RcEnd {
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(o.cqe).unwrap();
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let mr = dev.reg_mr(pd, mem, 0, mem.len(), all).unwrap();
    let qpn = dev.create_qp(pd, cq, cq, o.caps).unwrap();
    dev.modify_qp(
        qpn,
        &QpAttr {
            state: QpState::Init,
            access: all,
            ..QpAttr::default()
        },
        AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS,
    )
    .unwrap();
    RcEnd {
        pd,
        cq,
        qpn,
        mem: mem.clone(),
        mr,
        psn,
    }
}

/// Take an existing QP in any state back to INIT through RESET, keeping its PD, CQ and MR.
fn recycle_qp(dev: &mut Device, end: &RcEnd) {
    let reset = QpAttr {
        state: QpState::Reset,
        ..QpAttr::default()
    };
    dev.modify_qp(end.qpn, &reset, AttrMask::STATE).unwrap();
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    dev.modify_qp(
        end.qpn,
        &QpAttr {
            state: QpState::Init,
            access: all,
            ..QpAttr::default()
        },
        AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS,
    )
    .unwrap();
}

#[test]
fn after_fatal_a_fresh_context_with_the_same_identity_reconnects_and_moves_data() {
    let (mut p, _, _) = loaded_pair(11, MILD);
    let old_rkey = p.a.mr.rkey;
    p.sim.devices[0].fatal();
    // The recovery path: drop every resource on the zombie, whatever its state.
    p.sim.devices[0].release_all();
    assert_eq!(p.sim.devices[0].object_counts(), (0, 0, 0, 0));
    // The peer notices by itself (retry exhaustion), then its QP is recycled.
    let b_qpn = p.b.qpn;
    let gave_up = p.sim.run_until(30 * SEC, |s| {
        s.devices[1].query_qp(b_qpn).map(|a| a.state) == Ok(QpState::Err)
    });
    assert!(gave_up);
    run_quiet(&mut p.sim, 30 * SEC);
    let _ = drain(&mut p.sim, 1, p.b.cq);

    // The same device comes back (same identity) as a new context.
    p.sim.replace_device(0, sim_identity(0));
    p.sim.clear_link();
    assert_eq!(*p.sim.devices[0].identity(), sim_identity(0));
    assert_eq!(events(&mut p.sim, 0), [AsyncEvent::PortActive]);
    // The new connection runs on the full lossy link with the usual retry budget.
    p.sim.faults = Faults::LOSSY;
    let o = RcOptions {
        retry_cnt: 7,
        ..p.opts
    };
    let a = reopen_end(&mut p.sim.devices[0], &p.a.mem, &o, Psn::new(0x00ab_cdef));
    assert!(a.mem.same(&p.a.mem));
    assert_eq!(a.mr.addr, p.a.mr.addr, "same buffer, same address");
    let _ = old_rkey; // keys may or may not repeat; nothing relies on either
    let b = RcEnd {
        psn: Psn::new(0x0012_3456),
        ..p.b.clone()
    };
    recycle_qp(&mut p.sim.devices[1], &b);
    let (d0, d1) = p.sim.devices.split_at_mut(1);
    connect_end(&mut d0[0], &a, d1[0].addr(), b.qpn, b.psn, &o).unwrap();
    connect_end(&mut d1[0], &b, d0[0].addr(), a.qpn, a.psn, &o).unwrap();
    p.a = a;
    p.b = b;

    // Data moves again, both ways, all three operations, under the same lossy link.
    let w = fill(&p.a.mem, 0, 300_000, 21);
    let s = fill(&p.b.mem, 0, 100_000, 22);
    let r = fill(&p.b.mem, 1 << 20, 200_000, 23);
    post_recv(&mut p.sim, 0, p.a.qpn, recv_wr(1, &p.a, 2 << 20, 100_000));
    let wr = send_wr(
        2,
        SendOp::Write {
            remote_addr: p.b.mr.addr + (3 << 20),
            rkey: p.b.mr.rkey,
        },
        &p.a,
        0,
        300_000,
    );
    post_send(&mut p.sim, 0, p.a.qpn, wr);
    let rd = send_wr(
        3,
        SendOp::Read {
            remote_addr: p.b.mr.addr + (1 << 20),
            rkey: p.b.mr.rkey,
        },
        &p.a,
        4 << 20,
        200_000,
    );
    post_send(&mut p.sim, 0, p.a.qpn, rd);
    post_send(
        &mut p.sim,
        1,
        p.b.qpn,
        send_wr(4, SendOp::Send, &p.b, 0, 100_000),
    );
    let wa = wait_wcs(&mut p.sim, 0, p.a.cq, 3, 60 * SEC);
    let wb = wait_wcs(&mut p.sim, 1, p.b.cq, 1, 60 * SEC);
    let mut got = ids(&wa);
    got.sort_by_key(|w| w.0);
    let ok = WcStatus::Success;
    assert_eq!(got, [(1, ok), (2, ok), (3, ok)]);
    assert_eq!(ids(&wb), [(4, ok)]);
    assert!(read(&p.b.mem, 3 << 20, 300_000) == w);
    assert!(read(&p.a.mem, 4 << 20, 200_000) == r);
    assert!(read(&p.a.mem, 2 << 20, 100_000) == s);
}

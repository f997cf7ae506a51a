//! The RC QP state machine, exhaustively: every one of the 7×7 (from, to) pairs through
//! `Device::modify_qp` on a real QP driven into `from`, plus the table itself against Linux's
//! `qp_state_table` (drivers/infiniband/core/verbs.c, RC column) and a checked-in snapshot of
//! `state::describe()` / `state::dot()`.
//!
//! SQE cannot be reached by an RC QP: IBA 10.3.1.10 enters SQE only on a send error of an
//! unreliable (UD/UC) QP; an RC send error goes to ERR. No row of the table leads to SQE and
//! nothing in the QP code sets it, so the SQE row is checked on the table directly.
//!
//! Regenerate the snapshots with `UPDATE_SNAPSHOTS=1 cargo test --test qp_state` and review
//! the diff against the Linux table below before committing.

mod common;
#[path = "common/snapshot.rs"]
mod snapshot;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use nvmf_rdma::hca::qp::state::{self, ModifyError, Transition};
use nvmf_rdma::hca::rc::RcOptions;
use nvmf_rdma::hca::sim::{sim_addr, sim_identity, Faults};
use nvmf_rdma::hca::*;
use nvmf_rdma::verbs::*;
use snapshot::check_snapshot;

const ALL_STATES: [QpState; 7] = QpState::ALL;

struct Fixture {
    dev: Device,
    pd: PdId,
    cq: CqId,
}

fn fixture() -> Fixture {
    let mut dev = Device::new(DeviceConfig {
        identity: sim_identity(0),
        addr: sim_addr(0),
        icrc: IcrcCheck::Verify,
        peer_port: None,
        seed: 7,
    });
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(64).unwrap();
    Fixture { dev, pd, cq }
}

fn peer() -> SocketAddr {
    sim_addr(1)
}

/// Attribute values valid for every field, so any mask can be applied.
fn attr(state: QpState) -> QpAttr {
    QpAttr {
        state,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        dest: Some(peer()),
        dest_qpn: Qpn::new(99),
        rq_psn: Psn::new(100),
        sq_psn: Psn::new(200),
        timeout: 10,
        retry_cnt: 3,
        rnr_retry: 3,
        min_rnr_timer: 1,
        ..QpAttr::default()
    }
}

/// The required attributes for (from, to), as the caller of a real device would pass them.
fn required(from: QpState, to: QpState) -> AttrMask {
    state::transition(from, to)
        .expect("legal transition")
        .required
}

fn modify(f: &mut Fixture, qpn: Qpn, to: QpState, mask: AttrMask) -> Result<(), VerbsError> {
    f.dev.modify_qp(qpn, &attr(to), mask)
}

/// A fresh QP driven into `target` along the path a connection takes.
fn qp_in(f: &mut Fixture, target: QpState) -> Qpn {
    let qpn = f
        .dev
        .create_qp(f.pd, f.cq, f.cq, QpCaps::default())
        .unwrap();
    let path: &[QpState] = match target {
        QpState::Reset => &[],
        QpState::Init => &[QpState::Init],
        QpState::Rtr => &[QpState::Init, QpState::Rtr],
        QpState::Rts => &[QpState::Init, QpState::Rtr, QpState::Rts],
        QpState::Sqd => &[QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd],
        QpState::Err => &[QpState::Init, QpState::Rtr, QpState::Rts, QpState::Err],
        QpState::Sqe => panic!("an RC QP cannot reach SQE"),
    };
    let mut cur = QpState::Reset;
    for &next in path {
        modify(f, qpn, next, AttrMask::STATE | required(cur, next))
            .unwrap_or_else(|e| panic!("driving to {}: {e}", target.name()));
        cur = next;
    }
    assert_eq!(f.dev.query_qp(qpn).unwrap().state, target);
    qpn
}

fn state_of(f: &Fixture, qpn: Qpn) -> QpState {
    f.dev.query_qp(qpn).unwrap().state
}

fn bits(m: AttrMask) -> impl Iterator<Item = AttrMask> {
    m.iter()
}

#[test]
fn every_pair_through_modify_qp() {
    let mut f = fixture();
    let mut legal = 0;
    let mut illegal = 0;
    for from in ALL_STATES {
        if from == QpState::Sqe {
            continue; // see sqe_row_is_checked_on_the_table
        }
        for to in ALL_STATES {
            let pair = format!("{} -> {}", from.name(), to.name());
            match state::transition(from, to) {
                None => {
                    illegal += 1;
                    // Refused whatever the mask says, and the QP does not move.
                    for mask in [AttrMask::STATE, AttrMask::all()] {
                        let qpn = qp_in(&mut f, from);
                        assert_eq!(
                            modify(&mut f, qpn, to, mask),
                            Err(VerbsError::Modify(ModifyError::Illegal { from, to })),
                            "{pair} with {mask:?}"
                        );
                        assert_eq!(state_of(&f, qpn), from, "{pair}: refused modify moved it");
                    }
                }
                Some(Transition { required, optional }) => {
                    legal += 1;
                    // Exactly the required attributes: accepted.
                    let qpn = qp_in(&mut f, from);
                    modify(&mut f, qpn, to, AttrMask::STATE | required)
                        .unwrap_or_else(|e| panic!("{pair}: {e}"));
                    assert_eq!(state_of(&f, qpn), to, "{pair}");

                    // Required plus every optional one: accepted.
                    let qpn = qp_in(&mut f, from);
                    modify(&mut f, qpn, to, AttrMask::STATE | required | optional)
                        .unwrap_or_else(|e| panic!("{pair} with optional: {e}"));
                    assert_eq!(state_of(&f, qpn), to, "{pair}");

                    // Any one required attribute missing: refused, naming it.
                    for missing in bits(required) {
                        let qpn = qp_in(&mut f, from);
                        assert_eq!(
                            modify(&mut f, qpn, to, AttrMask::STATE | (required - missing)),
                            Err(VerbsError::Modify(ModifyError::Missing {
                                from,
                                to,
                                missing
                            })),
                            "{pair} without {missing:?}"
                        );
                        assert_eq!(state_of(&f, qpn), from, "{pair}");
                    }

                    // Any one attribute the transition does not take: refused, naming it.
                    let unexpected = AttrMask::all() - AttrMask::STATE - required - optional;
                    for extra in bits(unexpected) {
                        let qpn = qp_in(&mut f, from);
                        assert_eq!(
                            modify(&mut f, qpn, to, AttrMask::STATE | required | extra),
                            Err(VerbsError::Modify(ModifyError::Unexpected {
                                from,
                                to,
                                extra
                            })),
                            "{pair} with {extra:?}"
                        );
                        assert_eq!(state_of(&f, qpn), from, "{pair}");
                    }
                }
            }
        }
    }
    // 6 reachable rows: 20 legal pairs (the SQE row's 3 are checked on the table), 22 illegal.
    assert_eq!((legal, illegal), (20, 22));
}

#[test]
fn modify_without_state_is_a_self_transition() {
    let mut f = fixture();
    let qpn = qp_in(&mut f, QpState::Rts);
    // RTS→RTS allows MIN_RNR_TIMER.
    f.dev
        .modify_qp(
            qpn,
            &QpAttr {
                min_rnr_timer: 12,
                ..attr(QpState::Reset) // state is ignored without STATE in the mask
            },
            AttrMask::MIN_RNR_TIMER,
        )
        .unwrap();
    let a = f.dev.query_qp(qpn).unwrap();
    assert_eq!((a.state, a.min_rnr_timer), (QpState::Rts, 12));
    // RTS→RTS does not take TIMEOUT.
    assert_eq!(
        f.dev
            .modify_qp(qpn, &attr(QpState::Reset), AttrMask::TIMEOUT),
        Err(VerbsError::Modify(ModifyError::Unexpected {
            from: QpState::Rts,
            to: QpState::Rts,
            extra: AttrMask::TIMEOUT
        }))
    );
    // INIT→INIT without STATE, empty mask: a no-op that is allowed.
    let qpn = qp_in(&mut f, QpState::Init);
    f.dev
        .modify_qp(qpn, &attr(QpState::Err), AttrMask::empty())
        .unwrap();
    assert_eq!(state_of(&f, qpn), QpState::Init);
}

#[test]
fn modify_unknown_qp_and_bad_values_are_refused() {
    let mut f = fixture();
    assert_eq!(
        modify(&mut f, Qpn::new(12345), QpState::Init, AttrMask::STATE),
        Err(VerbsError::InvalidHandle("queue pair"))
    );
    let qpn = qp_in(&mut f, QpState::Init);
    let rtr = AttrMask::STATE | required(QpState::Init, QpState::Rtr);
    let no_dest = QpAttr {
        dest: None,
        ..attr(QpState::Rtr)
    };
    assert!(matches!(
        f.dev.modify_qp(qpn, &no_dest, rtr),
        Err(VerbsError::InvalidArgument(_))
    ));
    let bad_timer = QpAttr {
        min_rnr_timer: 32,
        ..attr(QpState::Rtr)
    };
    assert!(matches!(
        f.dev.modify_qp(qpn, &bad_timer, rtr),
        Err(VerbsError::InvalidArgument(_))
    ));
    assert_eq!(state_of(&f, qpn), QpState::Init);
}

/// RTS→SQD on a lossy link with long WRITEs in flight: the started messages finish —
/// retransmissions included, even when a rewind lands on a message's first packet — no new
/// one starts while drained, and SQD→RTS resumes the rest.
#[test]
fn sqd_drains_started_messages_under_loss_and_rts_resumes() {
    let (n, len) = (4u64, 400_000usize);
    let mut dropped = 0;
    for seed in 0..30 {
        let mut p = pair(
            seed,
            Faults::LOSSY,
            RcOptions {
                buf_len: 2 << 20,
                ..RcOptions::default()
            },
        );
        let mut data = Vec::new();
        for i in 0..n {
            let off = i as usize * 500_000;
            data.push(fill(&p.a.mem, off, len, seed * 10 + i));
            let op = SendOp::Write {
                remote_addr: p.b.mr.addr + off as u64,
                rkey: p.b.mr.rkey,
            };
            post_send(&mut p.sim, 0, p.a.qpn, send_wr(i, op, &p.a, off, len));
        }
        // The first window goes out (WQE 0 is started, not finished), then drain.
        for _ in 0..3 {
            p.sim.step();
        }
        let sqd = attr(QpState::Sqd);
        p.sim.devices[0]
            .modify_qp(p.a.qpn, &sqd, AttrMask::STATE)
            .unwrap();
        assert!(run_quiet(&mut p.sim, Duration::from_secs(60)));
        let drained = drain(&mut p.sim, 0, p.a.cq);
        assert!(
            !drained.is_empty() && drained.len() < n as usize,
            "seed {seed}: {:?}",
            ids(&drained)
        );
        assert!(
            drained.iter().all(|w| w.status == WcStatus::Success),
            "seed {seed}: SQD drain failed: {:?}",
            ids(&drained)
        );
        assert_eq!(qp_state(&p.sim, 0, p.a.qpn), QpState::Sqd);

        p.sim.devices[0]
            .modify_qp(p.a.qpn, &attr(QpState::Rts), AttrMask::STATE)
            .unwrap();
        let rest = wait_wcs(
            &mut p.sim,
            0,
            p.a.cq,
            n as usize - drained.len(),
            Duration::from_secs(60),
        );
        let all: Vec<_> = drained.iter().chain(&rest).copied().collect();
        assert_eq!(
            ids(&all),
            (0..n).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>(),
            "seed {seed}"
        );
        for (i, d) in data.iter().enumerate() {
            assert!(
                read(&p.b.mem, i * 500_000, len) == *d,
                "seed {seed}: WQE {i}"
            );
        }
        dropped += p.sim.link.dropped;
    }
    assert!(dropped > 0);
}

/// The SQE row cannot be driven on an RC QP; check it on the table, and check that no legal
/// transition leads into SQE from any state a real QP can be in.
#[test]
fn sqe_row_is_checked_on_the_table() {
    let none = AttrMask::empty();
    for to in ALL_STATES {
        let want = match to {
            QpState::Reset | QpState::Err | QpState::Rts => Some(Transition {
                required: none,
                optional: none,
            }),
            _ => None,
        };
        assert_eq!(
            state::transition(QpState::Sqe, to),
            want,
            "SQE -> {}",
            to.name()
        );
    }
    for from in ALL_STATES {
        if from != QpState::Sqe {
            assert_eq!(state::transition(from, QpState::Sqe), None);
        }
    }
    assert_eq!(
        state::check(QpState::Sqe, QpState::Rts, AttrMask::STATE),
        Ok(())
    );
    assert_eq!(
        state::check(
            QpState::Sqe,
            QpState::Rts,
            AttrMask::STATE | AttrMask::ACCESS_FLAGS
        ),
        Err(ModifyError::Unexpected {
            from: QpState::Sqe,
            to: QpState::Rts,
            extra: AttrMask::ACCESS_FLAGS
        })
    );
}

/// Linux `qp_state_table`, IB_QPT_RC column, transcribed independently of `state.rs`.
/// One deliberate difference: RESET→ERR is legal here (IBA 10.3.1.2 lets any state go to
/// ERR; Linux's core table omits it, so `ibv_modify_qp` on Linux refuses it).
fn linux_rc(from: QpState, to: QpState) -> Option<(AttrMask, AttrMask)> {
    use AttrMask as A;
    use QpState::*;
    let none = A::empty();
    Some(match (from, to) {
        (_, Reset) => (none, none),
        (Reset, Err) => (none, none), // IBA; not in Linux
        (Reset, _) if to != Init => return None,
        (_, Err) => (none, none),
        (Reset, Init) => (A::PKEY_INDEX | A::PORT | A::ACCESS_FLAGS, none),
        (Init, Init) => (none, A::PKEY_INDEX | A::PORT | A::ACCESS_FLAGS),
        (Init, Rtr) => (
            A::AV
                | A::PATH_MTU
                | A::DEST_QPN
                | A::RQ_PSN
                | A::MAX_DEST_RD_ATOMIC
                | A::MIN_RNR_TIMER,
            A::ALT_PATH | A::ACCESS_FLAGS | A::PKEY_INDEX,
        ),
        (Rtr, Rts) => (
            A::TIMEOUT | A::RETRY_CNT | A::RNR_RETRY | A::SQ_PSN | A::MAX_QP_RD_ATOMIC,
            A::CUR_STATE | A::ALT_PATH | A::ACCESS_FLAGS | A::MIN_RNR_TIMER | A::PATH_MIG_STATE,
        ),
        (Rts, Rts) => (
            none,
            A::CUR_STATE | A::ACCESS_FLAGS | A::ALT_PATH | A::PATH_MIG_STATE | A::MIN_RNR_TIMER,
        ),
        (Rts, Sqd) => (none, A::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Rts) => (
            none,
            A::CUR_STATE | A::ALT_PATH | A::ACCESS_FLAGS | A::MIN_RNR_TIMER | A::PATH_MIG_STATE,
        ),
        (Sqd, Sqd) => (
            none,
            A::PORT
                | A::AV
                | A::TIMEOUT
                | A::RETRY_CNT
                | A::RNR_RETRY
                | A::MAX_QP_RD_ATOMIC
                | A::MAX_DEST_RD_ATOMIC
                | A::ALT_PATH
                | A::ACCESS_FLAGS
                | A::PKEY_INDEX
                | A::MIN_RNR_TIMER
                | A::PATH_MIG_STATE,
        ),
        (Sqe, Rts) => (none, none),
        _ => return None,
    })
}

#[test]
fn table_matches_linux_rc_column() {
    for from in ALL_STATES {
        for to in ALL_STATES {
            let ours = state::transition(from, to).map(|t| (t.required, t.optional));
            assert_eq!(ours, linux_rc(from, to), "{} -> {}", from.name(), to.name());
        }
    }
}

#[test]
fn describe_matches_snapshot() {
    let text = state::describe();
    assert_eq!(text.lines().count(), 49);
    check_snapshot("qp_transitions.txt", &text);
}

#[test]
fn dot_matches_snapshot() {
    let dot = state::dot();
    assert!(dot.starts_with("digraph qp {\n") && dot.ends_with("}\n"));
    // One edge per legal pair: 20 from reachable states + 3 out of SQE.
    assert_eq!(dot.lines().filter(|l| l.contains("->")).count(), 23);
    check_snapshot("qp_transitions.dot", &dot);
}

//! The RC QP state machine (IBA 10.3.1, figure 124; Linux `qp_state_table` in
//! drivers/infiniband/core/verbs.c), written once as a table: for each legal (current, next)
//! pair, the attributes a modify must carry and the ones it may carry. Anything not in the
//! table is an illegal transition.

use bitflags::bitflags;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
}

impl QpState {
    pub const ALL: [QpState; 7] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Err,
    ];
    pub fn name(self) -> &'static str {
        match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Sqd => "SQD",
            QpState::Sqe => "SQE",
            QpState::Err => "ERR",
        }
    }
    /// Inbound requests are processed from RTR on (IBA 10.3.1.3).
    pub fn can_receive(self) -> bool {
        matches!(
            self,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }
    /// New send work is started only in RTS.
    pub fn can_send(self) -> bool {
        self == QpState::Rts
    }
}

bitflags! {
    /// Which fields of a modify are meant (ibv_qp_attr_mask).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AttrMask: u32 {
        const STATE = 1 << 0;
        const CUR_STATE = 1 << 1;
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        const ACCESS_FLAGS = 1 << 3;
        const PKEY_INDEX = 1 << 4;
        const PORT = 1 << 5;
        const QKEY = 1 << 6;
        const AV = 1 << 7;
        const PATH_MTU = 1 << 8;
        const TIMEOUT = 1 << 9;
        const RETRY_CNT = 1 << 10;
        const RNR_RETRY = 1 << 11;
        const RQ_PSN = 1 << 12;
        const MAX_QP_RD_ATOMIC = 1 << 13;
        const ALT_PATH = 1 << 14;
        const MIN_RNR_TIMER = 1 << 15;
        const SQ_PSN = 1 << 16;
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        const PATH_MIG_STATE = 1 << 18;
        const DEST_QPN = 1 << 20;
    }
}

/// The attributes a legal transition requires and allows (besides STATE itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub required: AttrMask,
    pub optional: AttrMask,
}

const fn t(required: AttrMask, optional: AttrMask) -> Option<Transition> {
    Some(Transition { required, optional })
}
const fn m(bits: u32) -> AttrMask {
    AttrMask::from_bits_truncate(bits)
}

use AttrMask as A;

const NONE: AttrMask = AttrMask::empty();
const RESET_TO_INIT: AttrMask = m(A::PKEY_INDEX.bits() | A::PORT.bits() | A::ACCESS_FLAGS.bits());
const INIT_OPT: AttrMask = RESET_TO_INIT;
const RTR_REQ: AttrMask = m(A::AV.bits()
    | A::PATH_MTU.bits()
    | A::DEST_QPN.bits()
    | A::RQ_PSN.bits()
    | A::MAX_DEST_RD_ATOMIC.bits()
    | A::MIN_RNR_TIMER.bits());
const RTR_OPT: AttrMask = m(A::ALT_PATH.bits() | A::ACCESS_FLAGS.bits() | A::PKEY_INDEX.bits());
const RTS_REQ: AttrMask = m(A::TIMEOUT.bits()
    | A::RETRY_CNT.bits()
    | A::RNR_RETRY.bits()
    | A::SQ_PSN.bits()
    | A::MAX_QP_RD_ATOMIC.bits());
const RTS_OPT: AttrMask = m(A::CUR_STATE.bits()
    | A::ALT_PATH.bits()
    | A::ACCESS_FLAGS.bits()
    | A::MIN_RNR_TIMER.bits()
    | A::PATH_MIG_STATE.bits());
/// SQD→SQD (Linux `qp_state_table`, RC column): PORT may change while drained, and unlike
/// the RTS-bound rows there is no CUR_STATE.
const SQD_OPT: AttrMask = m(A::PORT.bits()
    | A::AV.bits()
    | A::TIMEOUT.bits()
    | A::RETRY_CNT.bits()
    | A::RNR_RETRY.bits()
    | A::MAX_QP_RD_ATOMIC.bits()
    | A::MAX_DEST_RD_ATOMIC.bits()
    | A::ALT_PATH.bits()
    | A::ACCESS_FLAGS.bits()
    | A::PKEY_INDEX.bits()
    | A::MIN_RNR_TIMER.bits()
    | A::PATH_MIG_STATE.bits());
/// SQE→RTS: Linux lists optional attributes only for UD/UC (which can reach SQE); the RC
/// column is empty.
const SQE_OPT: AttrMask = NONE;

/// The table. Rows are the current state, columns the next, in `QpState::ALL` order.
/// Every state may go to RESET and ERR (IBA 10.3.1.2). RTS→SQD drains the send queue;
/// SQE is entered only by an unreliable QP's send error, and left for RTS.
static TABLE: [[Option<Transition>; 7]; 7] = [
    // from RESET
    [
        t(NONE, NONE),
        t(RESET_TO_INIT, NONE),
        None,
        None,
        None,
        None,
        t(NONE, NONE),
    ],
    // from INIT
    [
        t(NONE, NONE),
        t(NONE, INIT_OPT),
        t(RTR_REQ, RTR_OPT),
        None,
        None,
        None,
        t(NONE, NONE),
    ],
    // from RTR
    [
        t(NONE, NONE),
        None,
        None,
        t(RTS_REQ, RTS_OPT),
        None,
        None,
        t(NONE, NONE),
    ],
    // from RTS
    [
        t(NONE, NONE),
        None,
        None,
        t(NONE, RTS_OPT),
        t(NONE, A::EN_SQD_ASYNC_NOTIFY),
        None,
        t(NONE, NONE),
    ],
    // from SQD
    [
        t(NONE, NONE),
        None,
        None,
        t(NONE, RTS_OPT),
        t(NONE, SQD_OPT),
        None,
        t(NONE, NONE),
    ],
    // from SQE
    [
        t(NONE, NONE),
        None,
        None,
        t(NONE, SQE_OPT),
        None,
        None,
        t(NONE, NONE),
    ],
    // from ERR
    [t(NONE, NONE), None, None, None, None, None, t(NONE, NONE)],
];

fn idx(s: QpState) -> usize {
    s as usize
}

/// The transition from `cur` to `next`, if legal.
pub fn transition(cur: QpState, next: QpState) -> Option<Transition> {
    TABLE[idx(cur)][idx(next)]
}

/// Why a modify was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ModifyError {
    #[error("illegal QP transition {} -> {}", .from.name(), .to.name())]
    Illegal { from: QpState, to: QpState },
    #[error("QP transition {} -> {} needs attributes {missing:?}", .from.name(), .to.name())]
    Missing {
        from: QpState,
        to: QpState,
        missing: AttrMask,
    },
    #[error("QP transition {} -> {} does not take attributes {extra:?}", .from.name(), .to.name())]
    Unexpected {
        from: QpState,
        to: QpState,
        extra: AttrMask,
    },
}

/// Check a modify's mask against the table. Without STATE in the mask the QP stays where it
/// is and the mask is checked as a self-transition.
pub fn check(cur: QpState, next: QpState, mask: AttrMask) -> Result<(), ModifyError> {
    let tr = transition(cur, next).ok_or(ModifyError::Illegal {
        from: cur,
        to: next,
    })?;
    let given = mask - AttrMask::STATE;
    let missing = tr.required - given;
    if !missing.is_empty() {
        return Err(ModifyError::Missing {
            from: cur,
            to: next,
            missing,
        });
    }
    let extra = given - tr.required - tr.optional;
    if !extra.is_empty() {
        return Err(ModifyError::Unexpected {
            from: cur,
            to: next,
            extra,
        });
    }
    Ok(())
}

/// The whole table as text, one line per pair; a test pins it and `--dot` users can graph it.
pub fn describe() -> String {
    use std::fmt::Write;
    let mut s = String::new();
    for from in QpState::ALL {
        for to in QpState::ALL {
            match transition(from, to) {
                Some(tr) => {
                    let _ = writeln!(
                        s,
                        "{:5} -> {:5} legal   required={:?} optional={:?}",
                        from.name(),
                        to.name(),
                        tr.required,
                        tr.optional
                    );
                }
                None => {
                    let _ = writeln!(s, "{:5} -> {:5} illegal", from.name(), to.name());
                }
            }
        }
    }
    s
}

/// Graphviz rendering of the legal transitions.
pub fn dot() -> String {
    let mut s = String::from("digraph qp {\n");
    for from in QpState::ALL {
        for to in QpState::ALL {
            if transition(from, to).is_some() {
                s.push_str(&format!("  {} -> {};\n", from.name(), to.name()));
            }
        }
    }
    s.push_str("}\n");
    s
}

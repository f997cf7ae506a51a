//! The states of one CM connection and every transition between them, written once as data
//! (s2n-quic style). [`CmEndpoint`](super::CmEndpoint) looks each input up here before it acts;
//! an input with no row for the current state is counted and dropped. Each row names the IBA
//! or Linux behaviour it follows (drivers/infiniband/core/cm.c unless said otherwise; "cma"
//! is drivers/infiniband/core/cma.c), and where this CM departs from Linux, why.
//!
//! State names are those of Linux `enum ib_cm_state`. Linux's REP_RCVD (active) and DREQ_RCVD
//! (either side) are not states here: rdma_cm answers a REP with an RTU at once
//! (`cma_rep_recv` → `ib_send_cm_rtu`) and an rdma_cm consumer answers a DREQ with a DREP as
//! soon as it sees DISCONNECTED; this CM does both itself.

use std::fmt::Write as _;

/// Where a connection is in its life. `Idle` is "not in the table": a connection is created
/// out of it and forgotten into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConnState {
    Idle,
    /// Active: REQ sent, waiting for REP / REJ / MRA.
    ReqSent,
    /// Active: the peer MRAed our REQ; waiting longer.
    MraReqRcvd,
    /// Passive: REQ delivered to the owner as `ConnectRequest`; waiting for accept / reject.
    ReqRcvd,
    /// Passive: REP sent, waiting for RTU.
    RepSent,
    /// Passive: the peer MRAed our REP; waiting longer.
    MraRepRcvd,
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// Disconnected; lingering so stray messages for this connection get answered, not
    /// mistaken for a new one.
    TimeWait,
}

impl ConnState {
    pub const ALL: [ConnState; 9] = [
        ConnState::Idle,
        ConnState::ReqSent,
        ConnState::MraReqRcvd,
        ConnState::ReqRcvd,
        ConnState::RepSent,
        ConnState::MraRepRcvd,
        ConnState::Established,
        ConnState::DreqSent,
        ConnState::TimeWait,
    ];
}

/// What can happen to a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Input {
    // Commands from the owner.
    Connect,
    Accept,
    Reject,
    Disconnect,
    Abort,
    /// The owner's QP saw the first packet from the peer before the RTU
    /// (`IB_EVENT_COMM_EST`).
    CommEst,
    // MADs.
    RecvReq,
    /// A REQ whose (peer, CA GUID, comm ID) is already in the table.
    RecvDupReq,
    /// An MRA for our REQ.
    RecvMraReq,
    /// An MRA for our REP.
    RecvMraRep,
    RecvRep,
    /// A REP for a connection that already answered one with an RTU.
    RecvDupRep,
    RecvRtu,
    RecvRej,
    /// A REJ with reason 10, stale connection.
    RecvRejStale,
    RecvDreq,
    RecvDrep,
    // Timers.
    /// The response timer expired and retries are left.
    Retransmit,
    RetriesExhausted,
    TimewaitExpired,
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: ConnState,
    pub on: Input,
    pub to: ConnState,
    /// What it does and which IBA / Linux behaviour it follows.
    pub rule: &'static str,
}

const fn t(from: ConnState, on: Input, to: ConnState, rule: &'static str) -> Transition {
    Transition { from, on, to, rule }
}

use ConnState::*;
use Input::*;

/// Every legal transition.
pub const TRANSITIONS: &[Transition] = &[
    // --- active side --------------------------------------------------------------------------
    t(Idle, Connect, ReqSent,
      "send REQ; retry on 2 x packet lifetime + remote CM response timeout, max CM retries times (ib_send_cm_req; cma_connect_ib)"),
    t(ReqSent, RecvMraReq, MraReqRcvd,
      "wait service timeout + packet lifetime more before the next REQ retry (cm_mra_handler, ib_modify_mad)"),
    t(ReqSent, RecvRep, Established,
      "send RTU, report Established (cm_rep_handler; cma_rep_recv + ib_send_cm_rtu)"),
    t(MraReqRcvd, RecvRep, Established,
      "send RTU, report Established (cm_rep_handler; cma_rep_recv + ib_send_cm_rtu)"),
    t(ReqSent, RecvRej, Idle, "report Rejected, forget (cm_rej_handler → cm_reset_to_idle; cma REJECTED)"),
    t(MraReqRcvd, RecvRej, Idle, "report Rejected, forget (cm_rej_handler → cm_reset_to_idle)"),
    t(ReqSent, RecvRejStale, TimeWait, "report Rejected, linger (cm_rej_handler: STALE_CONN → cm_enter_timewait)"),
    t(MraReqRcvd, RecvRejStale, TimeWait, "report Rejected, linger (cm_rej_handler: STALE_CONN → cm_enter_timewait)"),
    t(ReqSent, Retransmit, ReqSent, "resend REQ (ib_mad retry)"),
    t(MraReqRcvd, Retransmit, MraReqRcvd, "resend REQ with the MRA-extended timeout (ib_mad retry)"),
    t(ReqSent, RetriesExhausted, Idle,
      "report Unreachable, forget (cm_process_send_error: IB_CM_REQ_ERROR; cma UNREACHABLE -ETIMEDOUT)"),
    t(MraReqRcvd, RetriesExhausted, Idle,
      "report Unreachable, forget (cm_process_send_error: IB_CM_REQ_ERROR)"),
    t(ReqSent, Abort, Idle, "send REJ timeout with our GUID as ARI, forget (cm_destroy_id: REQ_SENT)"),
    t(MraReqRcvd, Abort, Idle, "send REJ timeout with our GUID as ARI, forget (cm_destroy_id: MRA_REQ_RCVD)"),
    // --- passive side -------------------------------------------------------------------------
    t(Idle, RecvReq, ReqRcvd,
      "listener matched: report ConnectRequest (cm_req_handler; cma CONNECT_REQUEST)"),
    t(ReqRcvd, RecvDupReq, ReqRcvd, "drop: the owner has not answered yet (cm_dup_req_handler: REQ_RCVD)"),
    t(ReqRcvd, Accept, RepSent,
      "send REP; retry on the REQ's local CM response timeout, the REQ's max CM retries times (ib_send_cm_rep, cm_req_handler)"),
    t(ReqRcvd, Reject, Idle, "send REJ (local comm ID 0, message REQ), forget (ib_send_cm_rej, cm_format_rej: REQ_RCVD)"),
    t(ReqRcvd, RecvRej, Idle, "the active side gave up: report Rejected, forget (cm_rej_handler: REQ_RCVD)"),
    t(ReqRcvd, RecvRejStale, TimeWait, "the active side gave up: report Rejected, linger (cm_rej_handler: REQ_RCVD, STALE_CONN)"),
    t(ReqRcvd, Abort, Idle, "send REJ consumer-defined, forget (cm_destroy_id: REQ_RCVD)"),
    t(RepSent, RecvDupReq, RepSent,
      "resend REP at once (departs from cm_dup_req_handler, which drops it and waits for the REP retry)"),
    t(MraRepRcvd, RecvDupReq, MraRepRcvd, "resend REP at once (as RepSent)"),
    t(RepSent, RecvMraRep, MraRepRcvd, "wait service timeout + ACK timeout more (cm_mra_handler: REP_SENT)"),
    t(RepSent, RecvRtu, Established, "report Established (cm_rtu_handler; cma ESTABLISHED)"),
    t(MraRepRcvd, RecvRtu, Established, "report Established (cm_rtu_handler)"),
    t(RepSent, CommEst, Established, "report Established without RTU (cm_establish, ib_cm_notify COMM_EST)"),
    t(MraRepRcvd, CommEst, Established, "report Established without RTU (cm_establish)"),
    t(RepSent, Retransmit, RepSent, "resend REP (ib_mad retry)"),
    t(MraRepRcvd, Retransmit, MraRepRcvd, "resend REP with the MRA-extended timeout (ib_mad retry)"),
    t(RepSent, RetriesExhausted, Idle,
      "report Unreachable, forget (cm_process_send_error: IB_CM_REP_ERROR; cma UNREACHABLE)"),
    t(MraRepRcvd, RetriesExhausted, Idle, "report Unreachable, forget (IB_CM_REP_ERROR)"),
    t(RepSent, RecvRej, Idle, "report Rejected, forget (cm_rej_handler: REP_SENT → cm_reset_to_idle)"),
    t(MraRepRcvd, RecvRej, Idle, "report Rejected, forget (cm_rej_handler: MRA_REP_RCVD)"),
    t(RepSent, RecvRejStale, TimeWait, "report Rejected, linger (cm_rej_handler: STALE_CONN)"),
    t(MraRepRcvd, RecvRejStale, TimeWait, "report Rejected, linger (cm_rej_handler: STALE_CONN)"),
    t(RepSent, RecvDreq, TimeWait,
      "the RTU was lost and the peer is already leaving: send DREP, report Disconnected (cm_dreq_handler: REP_SENT)"),
    t(MraRepRcvd, RecvDreq, TimeWait, "send DREP, report Disconnected (cm_dreq_handler: MRA_REP_RCVD)"),
    t(RepSent, Abort, Idle, "send REJ consumer-defined, forget (cm_destroy_id: REP_SENT)"),
    t(MraRepRcvd, Abort, Idle, "send REJ consumer-defined, forget (cm_destroy_id: MRA_REP_RCVD)"),
    // --- established --------------------------------------------------------------------------
    t(Established, RecvDupRep, Established, "our RTU was lost: resend it (cm_dup_rep_handler: ESTABLISHED)"),
    t(Established, RecvDupReq, Established,
      "REJ stale connection for the REQ (departs from cm_dup_req_handler, which drops it in ESTABLISHED)"),
    t(Established, Disconnect, DreqSent, "send DREQ, retry like the handshake (ib_send_cm_dreq)"),
    t(Established, RecvDreq, TimeWait,
      "send DREP, report Disconnected (cm_dreq_handler → DREQ_RCVD; the rdma_cm consumer's ib_send_cm_drep → cm_enter_timewait)"),
    t(Established, RecvRej, TimeWait, "report Disconnected (cm_rej_handler: ESTABLISHED → cm_enter_timewait)"),
    t(Established, RecvRejStale, TimeWait, "report Disconnected (cm_rej_handler: ESTABLISHED)"),
    t(Established, Abort, Idle, "send DREQ once, forget (cm_destroy_id: ESTABLISHED → DREQ → destroy)"),
    // --- teardown -----------------------------------------------------------------------------
    t(DreqSent, RecvDrep, TimeWait, "report Disconnected (cm_drep_handler; cma DISCONNECTED)"),
    t(DreqSent, RecvDreq, TimeWait,
      "both sides disconnected at once: send DREP, report Disconnected (cm_dreq_handler: DREQ_SENT)"),
    t(DreqSent, Retransmit, DreqSent, "resend DREQ (ib_mad retry)"),
    t(DreqSent, RetriesExhausted, TimeWait,
      "report Disconnected anyway (cm_process_send_error: IB_CM_DREQ_ERROR → cm_enter_timewait; cma DISCONNECTED)"),
    t(DreqSent, RecvRej, TimeWait, "report Disconnected (cm_rej_handler: DREQ_SENT)"),
    t(DreqSent, RecvRejStale, TimeWait, "report Disconnected (cm_rej_handler: DREQ_SENT)"),
    t(DreqSent, Abort, Idle, "forget (cm_destroy_id: DREQ_SENT)"),
    t(TimeWait, RecvDreq, TimeWait, "our DREP was lost: send it again (cm_dreq_handler: TIMEWAIT)"),
    t(TimeWait, RecvDupReq, TimeWait, "REJ stale connection (cm_dup_req_handler: TIMEWAIT)"),
    t(TimeWait, TimewaitExpired, Idle, "report TimewaitExit, forget (cm_timewait_handler; cma TIMEWAIT_EXIT)"),
    t(TimeWait, Abort, Idle, "forget"),
];

/// The row for `on` in state `from`, if the input is legal there.
pub fn lookup(from: ConnState, on: Input) -> Option<&'static Transition> {
    TRANSITIONS.iter().find(|t| t.from == from && t.on == on)
}

/// The table as text, one row a line with its rule, for review and the checked-in snapshot.
pub fn describe() -> String {
    let mut s = String::new();
    for t in TRANSITIONS {
        let _ = writeln!(
            s,
            "{:<12} --{:<16}--> {:<12} {}",
            format!("{:?}", t.from),
            format!("{:?}", t.on),
            format!("{:?}", t.to),
            t.rule
        );
    }
    s
}

/// The table as a Graphviz digraph, for documentation.
pub fn dot() -> String {
    let mut s = String::from("digraph cm {\n  rankdir=LR;\n");
    for t in TRANSITIONS {
        let _ = writeln!(s, "  {:?} -> {:?} [label=\"{:?}\"];", t.from, t.to, t.on);
    }
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn one_row_per_state_and_input() {
        let mut seen = BTreeSet::new();
        for t in TRANSITIONS {
            assert!(
                seen.insert((t.from, t.on)),
                "duplicate row {:?} {:?}",
                t.from,
                t.on
            );
            assert!(!t.rule.is_empty());
        }
    }

    #[test]
    fn every_state_is_reachable_and_can_end() {
        for s in ConnState::ALL {
            if s != Idle {
                assert!(TRANSITIONS.iter().any(|t| t.to == s), "{s:?} unreachable");
                assert!(
                    TRANSITIONS
                        .iter()
                        .any(|t| t.from == s && t.on == Abort && t.to == Idle),
                    "{s:?} cannot be aborted"
                );
            }
        }
    }

    #[test]
    fn waiting_states_have_timers_and_quiet_states_do_not() {
        let timed = [ReqSent, MraReqRcvd, RepSent, MraRepRcvd, DreqSent];
        for s in ConnState::ALL {
            let has = lookup(s, Retransmit).is_some() && lookup(s, RetriesExhausted).is_some();
            assert_eq!(has, timed.contains(&s), "{s:?}");
        }
        assert!(lookup(TimeWait, TimewaitExpired).is_some());
    }

    #[test]
    fn one_line_per_row() {
        assert_eq!(describe().lines().count(), TRANSITIONS.len());
        let d = dot();
        assert!(d.starts_with("digraph cm {"));
        assert_eq!(d.lines().count(), TRANSITIONS.len() + 3);
    }
}

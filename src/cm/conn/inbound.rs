//! What the CM endpoint does with each MAD a peer sends: REQ (a new or duplicate connection
//! request), REP, RTU, MRA, REJ, DREQ and DREP. Each handler matches the MAD to a connection,
//! moves it along the table in [`crate::cm::state`] and queues what the row says to send or
//! report; a MAD it cannot match or the state does not expect is counted and dropped.

use super::*;

impl CmEndpoint {
    pub(super) fn on_req(&mut self, now: Instant, from: SocketAddr, tid: u64, r: &ReqRepr) {
        // A REQ we have seen: same peer, same CA GUID, same comm ID (cm.c cm_match_req →
        // cm_insert_remote_id / cm_dup_req_handler).
        let dup = peer_range(
            &self.by_remote,
            (from.ip(), r.local_ca_guid.0, r.local_comm_id),
        )
        .find(|k| self.conns.get(k).is_some_and(|c| c.passive));
        if let Some(key) = dup {
            self.on_dup_req(key, from, tid, r);
            return;
        }
        if self.refused_as_stale(now, from, tid, r) {
            return;
        }

        // Nobody listens: REJ invalid service ID, no state kept (cm_match_req → cm_issue_rej).
        if !self.listening.contains(&r.service_id) {
            self.stats.rej_invalid_service += 1;
            self.rej_req(from, tid, 0, r, RejectReason::INVALID_SERVICE_ID);
            return;
        }

        // rdma_cm refuses a REQ it cannot read, and a QP type other than its port space's
        // (RC for RDMA_PS_TCP): the listener callback fails and ib_cm destroys the new ID in
        // REQ_RCVD, which sends REJ consumer-defined without private data
        // (cma_ib_req_handler / cma_check_req_qp_type / cm_destroy_id).
        match split_req_private(&r.private_data) {
            Ok((cma, ulp)) if r.transport == TransportType::Rc => {
                self.new_passive(from, tid, r, cma, ulp)
            }
            _ => self.rej_req(from, tid, 0, r, RejectReason::CONSUMER_DEFINED),
        }
    }

    /// A REQ for a connection we already have from it: answer again or refuse as stale.
    fn on_dup_req(&mut self, key: u32, from: SocketAddr, tid: u64, r: &ReqRepr) {
        let Some(state) = self.conns.get(&key).map(|c| c.state) else {
            return;
        };
        if self.apply(key, Input::RecvDupReq).is_none() {
            return;
        }
        match state {
            ConnState::RepSent | ConnState::MraRepRcvd => {
                if let Some(m) = self.conns.get(&key).and_then(|c| c.pending) {
                    self.stats.rx_duplicates += 1;
                    self.send(from, m);
                }
            }
            ConnState::Established | ConnState::TimeWait => {
                self.stats.rx_duplicates += 1;
                self.stats.rej_stale += 1;
                self.rej_req(from, tid, key, r, RejectReason::STALE_CONN);
            }
            // ReqRcvd: the owner has not answered; drop.
            _ => self.stats.rx_duplicates += 1,
        }
    }

    /// Whether the REQ came from a QP still connected here, and was refused.
    fn refused_as_stale(&mut self, now: Instant, from: SocketAddr, tid: u64, r: &ReqRepr) -> bool {
        // A new comm ID from a QP that is still connected here: the peer lost its state
        // (reset, crash). Refuse as stale and disconnect the old connection
        // (cm_match_req: cm_insert_remote_qpn → REJ stale + ib_send_cm_dreq). Connections in
        // TimeWait do not count, as Linux drops them from the QPN table when they enter it;
        // otherwise a reconnect after a reset could reuse the QPN only after TimeWait. Nor do
        // connections already being torn down (DreqSent): we declared them stale once, so
        // the peer's next REQ is accepted instead of being refused until the DREQ times out.
        let stale = peer_range(
            &self.by_qpn,
            (from.ip(), r.local_ca_guid.0, r.local_qpn.get()),
        )
        .find_map(|k| {
            let c = self.conns.get(&k)?;
            (!matches!(c.state, ConnState::TimeWait | ConnState::DreqSent)).then_some((k, c.state))
        });
        if let Some((old, old_state)) = stale {
            self.stats.rej_stale += 1;
            self.rej_req(from, tid, 0, r, RejectReason::STALE_CONN);
            if old_state == ConnState::Established {
                self.start_dreq(now, old, &[]);
                // The owner learns now that the connection is dead (its peer lost it), so
                // it stops sending on a QP whose remote end has been reborn.
                self.events
                    .push_back(CmEvent::Disconnected { id: ConnId(old) });
            }
            return true;
        }
        false
    }

    /// Refuse `r` with `reason`, no data; `local` is our comm ID for it, 0 if none.
    fn rej_req(
        &mut self,
        from: SocketAddr,
        tid: u64,
        local: u32,
        r: &ReqRepr,
        reason: RejectReason,
    ) {
        let m = rej_mad(tid, local, r.local_comm_id, MsgRef::Req, reason, &[], &[]);
        self.send(from, m);
    }

    /// Record the passive connection `r` asks for and hand the request to the owner.
    fn new_passive(
        &mut self,
        from: SocketAddr,
        tid: u64,
        r: &ReqRepr,
        cma: CmaHdrRepr,
        ulp: &[u8],
    ) {
        let local_id = self.alloc_id();
        let recv_psn = Psn::new(self.rng.random());
        let conn = Conn {
            state: ConnState::Idle,
            passive: true,
            peer: from,
            remote_id: r.local_comm_id,
            remote_guid: r.local_ca_guid,
            tid,
            local_qpn: Qpn::new(0),
            remote_qpn: Some(r.local_qpn),
            // The REQ's PSN is what we send with; we pick what we receive with (REP).
            local_psn: r.starting_psn,
            remote_psn: recv_psn,
            // Linux cm_req_handler / cm_format_req_event swap these to our point of view.
            responder_resources: r.initiator_depth,
            initiator_depth: r.responder_resources,
            retry_count: r.retry_count,
            rnr_retry_count: r.rnr_retry_count,
            path_mtu: r.path_mtu,
            target_ack_delay: 0,
            // cm_req_handler: the path's packet lifetime is the REQ's local ACK timeout - 1,
            // and av.timeout = lifetime + 1.
            av_timeout: r.local_ack_timeout,
            try_timeout: iba_time(r.local_cm_response_timeout.min(MAX_PEER_TIMEOUT_EXP)),
            max_retries: r.max_cm_retries,
            pending: None,
            deadline: None,
            retries_left: 0,
            last_reply: None,
            indexed: IndexKeys::default(),
        };
        self.insert_conn(local_id, conn);
        self.apply(local_id, Input::RecvReq);
        self.events
            .push_back(CmEvent::ConnectRequest(ConnectRequest {
                id: ConnId(local_id),
                peer: from,
                service_id: r.service_id,
                remote_ca_guid: r.local_ca_guid,
                remote_qpn: r.local_qpn,
                remote_psn: recv_psn,
                local_psn: r.starting_psn,
                responder_resources: r.initiator_depth,
                initiator_depth: r.responder_resources,
                path_mtu: r.path_mtu,
                retry_count: r.retry_count,
                rnr_retry_count: r.rnr_retry_count,
                flow_control: r.flow_control,
                cma,
                nvme: NvmeCmRequest::parse(ulp),
                private_data: ulp.to_vec(),
            }));
    }

    pub(super) fn on_rep(&mut self, from: SocketAddr, r: &RepRepr) {
        // cm_rep_handler looks the ID up by the REP's remote comm ID alone: we do not know the
        // peer's yet.
        let Some(conn) = self.conns.get(&r.remote_comm_id) else {
            self.stats.rx_unmatched += 1;
            return;
        };
        if conn.peer.ip() != from.ip() {
            self.stats.rx_unmatched += 1;
            return;
        }
        let key = r.remote_comm_id;
        if conn.state == ConnState::Established {
            // cm_dup_rep_handler matches both IDs.
            if conn.remote_id != r.local_comm_id {
                self.stats.rx_unmatched += 1;
                return;
            }
            let rtu = conn.last_reply;
            if self.apply(key, Input::RecvDupRep).is_some() {
                if let Some(m) = rtu {
                    self.stats.rx_duplicates += 1;
                    self.send(from, m);
                }
            }
            return;
        }
        if lookup(conn.state, Input::RecvRep).is_none() {
            self.stats.rx_unexpected += 1;
            return;
        }
        let config = self.config;
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        conn.remote_id = r.local_comm_id;
        conn.remote_guid = r.local_ca_guid;
        conn.remote_qpn = Some(r.local_qpn);
        // The REP's PSN is what we send with (the peer's receive PSN).
        conn.local_psn = r.starting_psn;
        // cm_rep_handler: our initiator depth is the peer's responder resources and back.
        conn.initiator_depth = r.responder_resources;
        conn.responder_resources = r.initiator_depth;
        conn.rnr_retry_count = r.rnr_retry_count;
        conn.target_ack_delay = r.target_ack_delay;
        conn.av_timeout = ack_timeout(r.target_ack_delay, config.packet_lifetime);
        conn.pending = None;
        conn.deadline = None;
        let rtu = CmMad {
            transaction_id: conn.tid,
            message: CmMessage::Rtu(RtuRepr {
                local_comm_id: key,
                remote_comm_id: r.local_comm_id,
                private_data: [0; RtuRepr::PRIVATE_LEN],
            }),
        }
        .emit();
        conn.last_reply = Some(rtu);
        let peer = conn.peer;
        let ev = Established {
            id: ConnId(key),
            remote_id: ConnId(r.local_comm_id),
            peer,
            remote_ca_guid: r.local_ca_guid,
            remote_qpn: r.local_qpn,
            remote_psn: conn.remote_psn,
            local_psn: r.starting_psn,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            retry_count: conn.retry_count,
            rnr_retry_count: conn.rnr_retry_count,
            path_mtu: conn.path_mtu,
            target_ack_delay: r.target_ack_delay,
            ack_timeout: conn.av_timeout,
            accept: NvmeCmAccept::parse(&r.private_data).ok(),
            private_data: r.private_data.to_vec(),
        };
        self.sync(key);
        self.send(peer, rtu);
        self.apply(key, Input::RecvRep);
        self.events.push_back(CmEvent::Established(ev));
    }

    pub(super) fn on_rtu(&mut self, from: SocketAddr, r: &RtuRepr) {
        let Some(key) = self.matched(from, r.remote_comm_id, r.local_comm_id) else {
            return;
        };
        if self.apply_checked(key, Input::RecvRtu).is_none() {
            return;
        }
        // `apply_checked` already moved the state; report with the RTU's private data.
        self.report_passive_established(key, r.private_data.to_vec());
    }

    pub(super) fn on_mra(&mut self, now: Instant, from: SocketAddr, m: &MraRepr) {
        // cm_acquire_mraed_id: an MRA for our REQ carries only our comm ID.
        let key = match m.message_mraed {
            MsgRef::Req => match self.conns.get(&m.remote_comm_id) {
                Some(c) if c.peer.ip() == from.ip() => Some(m.remote_comm_id),
                _ => None,
            },
            _ => self.matched_quiet(from, m.remote_comm_id, m.local_comm_id),
        };
        let Some(key) = key else {
            self.stats.rx_unmatched += 1;
            return;
        };
        let input = match m.message_mraed {
            MsgRef::Req => Input::RecvMraReq,
            MsgRef::Rep => Input::RecvMraRep,
            // MRA for LAP: alternate paths are not supported on RoCE.
            MsgRef::Other => {
                self.stats.rx_unexpected += 1;
                return;
            }
        };
        if self.apply_checked(key, input).is_none() {
            return;
        }
        if let Some(conn) = self.conns.get_mut(&key) {
            // cm_mra_handler: service timeout + the path's ACK timeout, for this and later
            // tries (ib_modify_mad changes the send's timeout).
            conn.try_timeout = iba_time(m.service_timeout.min(MAX_MRA_TIMEOUT_EXP))
                + iba_time(conn.av_timeout.min(MAX_MRA_TIMEOUT_EXP));
            conn.deadline = Some(now + conn.try_timeout);
        }
        self.sync(key);
    }

    pub(super) fn on_rej(&mut self, now: Instant, from: SocketAddr, r: &RejRepr) {
        // cm_acquire_rejected_id: a timeout REJ names the sender by comm ID and CA GUID (in
        // the ARI), since it may not know ours; a REJ of our REQ carries only our comm ID;
        // anything else must match both.
        let key = if r.reason == RejectReason::TIMEOUT {
            let guid = r.ari().get(..8).map(|g| {
                let mut a = [0u8; 8];
                a.copy_from_slice(g);
                Guid(u64::from_be_bytes(a))
            });
            guid.and_then(|g| peer_range(&self.by_remote, (from.ip(), g.0, r.local_comm_id)).next())
        } else if r.message_rejected == MsgRef::Req {
            match self.conns.get(&r.remote_comm_id) {
                Some(c) if c.peer.ip() == from.ip() => Some(r.remote_comm_id),
                _ => None,
            }
        } else {
            self.matched_quiet(from, r.remote_comm_id, r.local_comm_id)
        };
        let Some(key) = key else {
            self.stats.rx_unmatched += 1;
            return;
        };
        let Some(from_state) = self.conns.get(&key).map(|c| c.state) else {
            return;
        };
        // A REJ of a REQ only means something while that REQ is outstanding: once a REP
        // established us, it is a delayed answer to a duplicate REQ.
        let connected = matches!(from_state, ConnState::Established | ConnState::DreqSent);
        if connected && r.message_rejected == MsgRef::Req {
            self.stats.rx_unexpected += 1;
            return;
        }
        let input = if r.reason == RejectReason::STALE_CONN {
            Input::RecvRejStale
        } else {
            Input::RecvRej
        };
        let Some(to) = self.apply_checked(key, input) else {
            return;
        };
        if let Some(c) = self.conns.get_mut(&key) {
            c.pending = None;
            c.deadline = None;
        }
        self.sync(key);
        let id = ConnId(key);
        if connected {
            self.events.push_back(CmEvent::Disconnected { id });
        } else {
            let nvme_status = (r.reason == RejectReason::CONSUMER_DEFINED)
                .then(|| NvmeCmReject::parse(&r.private_data).ok())
                .flatten()
                .map(|j| j.status)
                .filter(|s| s.as_u16() != 0);
            self.events.push_back(CmEvent::Rejected(Rejected {
                id,
                reason: r.reason,
                nvme_status,
                ari: r.ari().to_vec(),
                private_data: r.private_data.to_vec(),
            }));
        }
        if to == ConnState::TimeWait {
            self.enter_timewait(now, key);
        }
    }

    pub(super) fn on_dreq(&mut self, now: Instant, from: SocketAddr, tid: u64, d: &DreqRepr) {
        let drep = |local: u32, remote: u32| {
            CmMad {
                transaction_id: tid,
                message: CmMessage::Drep(DrepRepr {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    private_data: [0; DrepRepr::PRIVATE_LEN],
                }),
            }
            .emit()
        };
        let Some(key) = self.matched_quiet(from, d.remote_comm_id, d.local_comm_id) else {
            // cm_dreq_handler → cm_issue_drep: answer a DREQ for an unknown connection so
            // the peer can finish its teardown (our DREP was lost and TimeWait is over, or
            // we never had the connection).
            self.stats.rx_unmatched += 1;
            self.send(from, drep(d.remote_comm_id, d.local_comm_id));
            return;
        };
        let Some(conn) = self.conns.get(&key) else {
            return;
        };
        // cm_dreq_handler ignores a DREQ naming another QP than ours.
        if conn.local_qpn != d.remote_qpn {
            self.stats.rx_unexpected += 1;
            return;
        }
        let from_state = conn.state;
        let peer = conn.peer;
        if self.apply_checked(key, Input::RecvDreq).is_none() {
            return;
        }
        self.send(peer, drep(key, d.local_comm_id));
        if from_state == ConnState::TimeWait {
            self.stats.rx_duplicates += 1;
            return;
        }
        self.disconnected(now, key);
    }

    pub(super) fn on_drep(&mut self, now: Instant, from: SocketAddr, d: &DrepRepr) {
        let Some(key) = self.matched(from, d.remote_comm_id, d.local_comm_id) else {
            return;
        };
        if self.apply_checked(key, Input::RecvDrep).is_none() {
            return;
        }
        self.disconnected(now, key);
    }

    /// The peer ended the connection: nothing more to resend, TimeWait, and the owner told.
    fn disconnected(&mut self, now: Instant, key: u32) {
        if let Some(c) = self.conns.get_mut(&key) {
            c.pending = None;
        }
        self.enter_timewait(now, key);
        self.events
            .push_back(CmEvent::Disconnected { id: ConnId(key) });
    }
}

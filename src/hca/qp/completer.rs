//! Completer: consume ACKs, NAKs and RDMA READ responses, retire send WQEs in order and run
//! the retry machinery (IBA 9.7.5.1; rxe_comp.c).

use super::{Ctx, Qp};
use crate::hca::wire::{AethSyndrome, NakCode, OpClass, ParsedPacket};
use crate::verbs::Access;
use crate::verbs::Sgl;
use crate::verbs::{Instant, Psn};
use crate::verbs::{WcOpcode, WcStatus, WorkCompletion};

impl Qp {
    /// An inbound response packet (ACK, NAK or read response) for our requests.
    pub(crate) fn on_response(&mut self, ctx: &mut Ctx<'_>, pkt: &ParsedPacket<'_>) {
        let psn = pkt.hdrs.bth.psn;
        if !self.outstanding() || !psn.before(self.req.max_psn) {
            // A ghost: nothing it could acknowledge is in flight.
            ctx.stats.rx_ghost += 1;
            return;
        }
        match pkt.hdrs.bth.opcode.info().class {
            OpClass::Ack => self.on_ack(ctx, pkt, psn),
            OpClass::ReadResponse => self.on_read_response(ctx, pkt, psn),
            _ => ctx.stats.rx_dropped += 1,
        }
    }

    /// Where an acknowledgement must stop: the next response PSN of the first READ still
    /// waiting for data. A READ's data only arrives in its responses, so no ACK may retire it.
    pub(super) fn read_limit(&self) -> Option<Psn> {
        for (i, w) in self.sq.iter().enumerate() {
            if !w.started {
                return None;
            }
            if w.wr.op.is_read() {
                return Some(if i == 0 { self.comp.psn } else { w.first_psn });
            }
        }
        None
    }

    fn on_ack(&mut self, ctx: &mut Ctx<'_>, pkt: &ParsedPacket<'_>, psn: Psn) {
        let Some(aeth) = pkt.hdrs.aeth else {
            ctx.stats.rx_dropped += 1;
            return;
        };
        if psn.before(self.comp.psn) {
            return; // old ACK, or a NAK for something already retired
        }
        match aeth.syndrome {
            AethSyndrome::Ack { .. } => {
                // The responder executed past a READ whose responses we lack: they were lost.
                if !self.ack_before(ctx, psn.add(1)) {
                    self.retry_once(ctx, self.comp.psn);
                }
            }
            AethSyndrome::RnrNak { timer } => {
                ctx.stats.rnr_naks_rx += 1;
                if !self.ack_before(ctx, psn) {
                    self.retry_once(ctx, self.comp.psn);
                    return;
                }
                if self.comp.rnr_left == 0 {
                    self.fail_head(ctx, WcStatus::RnrRetryExcErr);
                    return;
                }
                if self.comp.rnr_left != 7 {
                    self.comp.rnr_left -= 1;
                }
                let us = super::rnr_timer_us(timer);
                self.comp.rnr_until = Some(Instant(ctx.now.0 + us * 1000));
                self.comp.stop_timers();
                self.seek_req(psn);
            }
            AethSyndrome::Nak(NakCode::PsnSequenceError) => {
                ctx.stats.seq_naks_rx += 1;
                // The NAK acknowledges everything before its PSN (IBA 9.7.5.1.2).
                self.ack_before(ctx, psn);
                self.retry_once(ctx, self.comp.psn);
            }
            AethSyndrome::Nak(code) => {
                ctx.stats.naks_rx += 1;
                self.ack_before(ctx, psn);
                let status = match code {
                    NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                    NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                    _ => WcStatus::RemInvReqErr,
                };
                self.fail_head(ctx, status);
            }
            AethSyndrome::Reserved(_) => ctx.stats.rx_dropped += 1,
        }
    }

    fn on_read_response(&mut self, ctx: &mut Ctx<'_>, pkt: &ParsedPacket<'_>, psn: Psn) {
        // A read response acknowledges every request before it.
        self.ack_before(ctx, psn);
        let Some(front) = self.sq.front() else {
            return;
        };
        if !front.started || !front.wr.op.is_read() {
            ctx.stats.rx_ghost += 1;
            return;
        }
        let expected = self.comp.psn;
        if !front.contains(psn) {
            // A later READ answered while this one is incomplete: responses were lost.
            if psn.after(front.last_psn()) {
                self.retry_once(ctx, expected);
            }
            return;
        }
        if psn.before(expected) {
            return; // duplicate of one already placed
        }
        if psn.after(expected) {
            self.retry_once(ctx, expected);
            return;
        }
        let mtu = self.attr.seg_bytes();
        let k = psn.diff(front.first_psn) as u32;
        let offset = k * mtu;
        let want_len = (front.len - offset).min(mtu) as usize;
        let (wr, len, last) = (front.wr, front.len, front.last_psn());
        // A retried READ is a new request for the rest, so its first response may say FIRST
        // or ONLY where the original would have said MIDDLE or LAST: only "ends here or not"
        // must agree with our own count.
        let ends = pkt.hdrs.bth.opcode.info().pos.ends();
        if ends != (psn == last) || pkt.payload.len() != want_len {
            ctx.stats.rx_dropped += 1;
            self.fail_head(ctx, WcStatus::BadRespErr);
            return;
        }
        if !self.scatter(ctx, &wr.sgl, offset, pkt.payload) {
            self.fail_head(ctx, WcStatus::LocProtErr);
            return;
        }
        self.comp.psn = psn.add(1);
        if psn == last {
            self.sq.pop_front();
            self.shift_req();
            if wr.signaled {
                ctx.complete(
                    self.send_cq,
                    WorkCompletion {
                        wr_id: wr.wr_id,
                        status: WcStatus::Success,
                        opcode: WcOpcode::RdmaRead,
                        qpn: self.qpn,
                        byte_len: len,
                        imm: None,
                        invalidated: None,
                    },
                );
            }
        }
        self.progress(ctx);
    }

    /// Everything before `end` is acknowledged: move the oldest-unacked PSN forward (never
    /// into a READ still owed data) and retire the WQEs now wholly behind it. Returns false
    /// when `end` reached past such a READ, i.e. its responses were lost.
    fn ack_before(&mut self, ctx: &mut Ctx<'_>, end: Psn) -> bool {
        let mut target = end;
        let mut clean = true;
        if let Some(limit) = self.read_limit() {
            if limit.before(target) {
                target = limit;
                clean = false;
            }
        }
        if !target.after(self.comp.psn) {
            return clean;
        }
        self.comp.psn = target;
        while let Some(front) = self.sq.front() {
            if !front.started || front.wr.op.is_read() || !front.last_psn().before(target) {
                break;
            }
            let Some(w) = self.sq.pop_front() else { break };
            self.shift_req();
            if w.wr.signaled {
                ctx.complete(
                    self.send_cq,
                    WorkCompletion {
                        wr_id: w.wr.wr_id,
                        status: WcStatus::Success,
                        opcode: w.wr.op.wc_opcode(),
                        qpn: self.qpn,
                        byte_len: w.len,
                        imm: None,
                        invalidated: None,
                    },
                );
            }
        }
        self.progress(ctx);
        clean
    }

    /// The head WQE left the queue: keep the requester's index pointing at the same WQE.
    fn shift_req(&mut self) {
        if self.req.next > 0 {
            self.req.next -= 1;
        } else {
            self.req.pkt = 0;
        }
    }

    /// Forward progress resets the retry budget and the timers (IBA 9.7.6.1.3), and
    /// completes the RTT sample (and so ends the backoff) if the timed packet is now
    /// acknowledged.
    fn progress(&mut self, ctx: &mut Ctx<'_>) {
        self.comp.retry_left = self.attr.retry_cnt.min(7);
        self.comp.rnr_left = self.attr.rnr_retry.min(7);
        self.comp.rewound_at = None;
        // After a timeout, the first ACK that moves things forward ends the one-packet
        // resend (`CompState::lone_resend`).
        self.comp.lone_resend = false;
        if self.req.psn.before(self.comp.psn) {
            self.seek_req(self.comp.psn);
        }
        if let Some((psn, sent)) = self.comp.timed {
            if psn.before(self.comp.psn) {
                self.comp.timed = None;
                self.comp.rtt.sample(ctx.now.0.saturating_sub(sent.0));
                self.comp.rtt.reset_backoff();
            }
        }
        // Karn's algorithm keeps the backed-off timeout until a packet sent once is
        // acknowledged; go-back-N sends nothing new while it resends, so here it ends once
        // everything outstanding at the last expiry is acknowledged. Not before: progress
        // from resent packets alone must not bring back the timeout that just proved too
        // short (a READ resent early makes the responder drop and redo its queued
        // responses, and an RTO that keeps firing early keeps it starting over).
        if self
            .comp
            .backoff_until
            .is_some_and(|end| !self.comp.psn.before(end))
        {
            self.comp.backoff_until = None;
            self.comp.rtt.reset_backoff();
        }
        self.comp.probed = false;
        self.comp.probe_due = false;
        if self.outstanding() {
            self.arm_timer(ctx);
        } else {
            self.comp.stop_timers();
        }
    }

    /// Rewind to `psn` at once (the peer told us of a loss: a sequence NAK, or responses
    /// past a READ whose own are missing) unless this very gap was already retried since
    /// the last progress: one fast retransmit per loss episode.
    fn retry_once(&mut self, ctx: &mut Ctx<'_>, psn: Psn) {
        if self.comp.rewound_at == Some(psn) {
            return;
        }
        if self.retry(ctx, psn) {
            ctx.stats.fast_retransmits += 1;
        }
    }

    /// Spend one retry and go back to `psn`, or fail the head WQE when none are left.
    /// Returns whether it went back.
    pub(super) fn retry(&mut self, ctx: &mut Ctx<'_>, psn: Psn) -> bool {
        if self.comp.retry_left == 0 {
            self.fail_head(ctx, WcStatus::RetryExcErr);
            return false;
        }
        self.comp.retry_left -= 1;
        self.rewind(ctx, psn);
        self.arm_timer(ctx);
        true
    }

    /// Go back to `psn` and send everything from there again (go-back-N).
    pub(super) fn rewind(&mut self, ctx: &mut Ctx<'_>, psn: Psn) {
        self.comp.rewound_at = Some(psn);
        // Karn: an ACK after a resend says nothing about the round trip.
        self.comp.timed = None;
        ctx.stats.retransmits += 1;
        self.seek_req(psn);
    }

    fn fail_head(&mut self, ctx: &mut Ctx<'_>, status: WcStatus) {
        if self.sq.is_empty() {
            self.enter_error(ctx);
        } else {
            self.fail_front_or(ctx, 0, status);
        }
    }

    /// Place `data` at byte `offset` of a local SGL (read responses, received sends).
    pub(super) fn scatter(
        &self,
        ctx: &mut Ctx<'_>,
        sgl: &Sgl,
        mut offset: u32,
        mut data: &[u8],
    ) -> bool {
        for sge in sgl.entries() {
            if data.is_empty() {
                break;
            }
            if offset >= sge.len {
                offset -= sge.len;
                continue;
            }
            let take = ((sge.len - offset) as usize).min(data.len());
            match ctx.mrs.resolve(
                self.pd,
                sge.lkey,
                sge.addr + offset as u64,
                take as u64,
                Access::LOCAL_WRITE,
                false,
            ) {
                Ok(Some(r)) => {
                    r.mem.write(r.offset, &data[..take]);
                }
                Ok(None) => {}
                Err(_) => return false,
            }
            data = &data[take..];
            offset = 0;
        }
        data.is_empty()
    }
}

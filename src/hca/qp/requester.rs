//! Requester: turn send WQEs into request packets (IBA 9.5; rxe_req.c). Messages are split at
//! the path MTU; each WQE's PSN range is fixed the first time it goes out, so a retry can
//! start again from any PSN.

use super::{Ctx, Qp, QpState, ACK_EVERY};
use crate::hca::wire::{
    finish_packet, BthRepr, IcrcContext, MsgPos, Opcode, PacketHeaders, RethRepr,
};
use crate::verbs::Access;
use crate::verbs::Psn;
use crate::verbs::SendOp;
use crate::verbs::Sgl;
use crate::verbs::{WcStatus, WorkCompletion};

/// Packets a message of `len` bytes needs at `mtu` (a zero-length message still needs one).
pub(crate) fn packets_for(len: u32, mtu: u32) -> u32 {
    len.div_ceil(mtu).max(1)
}

pub(crate) fn pos_of(k: u32, n: u32) -> MsgPos {
    match (k, n) {
        (_, 1) => MsgPos::Only,
        (0, _) => MsgPos::First,
        (k, n) if k + 1 == n => MsgPos::Last,
        _ => MsgPos::Middle,
    }
}

fn request_opcode(op: SendOp, pos: MsgPos) -> Opcode {
    use MsgPos::*;
    match (op, pos) {
        (SendOp::Read { .. }, _) => Opcode::RC_RDMA_READ_REQUEST,
        (SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_), First) => {
            Opcode::RC_SEND_FIRST
        }
        (SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_), Middle) => {
            Opcode::RC_SEND_MIDDLE
        }
        (SendOp::Send, Last) => Opcode::RC_SEND_LAST,
        (SendOp::Send, Only) => Opcode::RC_SEND_ONLY,
        (SendOp::SendWithImm(_), Last) => Opcode::RC_SEND_LAST_WITH_IMMEDIATE,
        (SendOp::SendWithImm(_), Only) => Opcode::RC_SEND_ONLY_WITH_IMMEDIATE,
        (SendOp::SendWithInv(_), Last) => Opcode::RC_SEND_LAST_WITH_INVALIDATE,
        (SendOp::SendWithInv(_), Only) => Opcode::RC_SEND_ONLY_WITH_INVALIDATE,
        (SendOp::Write { .. } | SendOp::WriteWithImm { .. }, First) => Opcode::RC_RDMA_WRITE_FIRST,
        (SendOp::Write { .. } | SendOp::WriteWithImm { .. }, Middle) => {
            Opcode::RC_RDMA_WRITE_MIDDLE
        }
        (SendOp::Write { .. }, Last) => Opcode::RC_RDMA_WRITE_LAST,
        (SendOp::Write { .. }, Only) => Opcode::RC_RDMA_WRITE_ONLY,
        (SendOp::WriteWithImm { .. }, Last) => Opcode::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
        (SendOp::WriteWithImm { .. }, Only) => Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
    }
}

impl Qp {
    pub(super) fn requester_can_send(&self, now: crate::verbs::Instant) -> bool {
        let sending_ok = match self.attr.state {
            QpState::Rts => true,
            // SQD finishes the messages already started and starts no new one (IBA
            // 10.3.1.7). "Finishes" includes retransmitting them: a rewind into a started
            // WQE lands on its first packet (pkt 0) as often as not.
            QpState::Sqd => self.sq.get(self.req.next).is_some_and(|w| w.started),
            _ => false,
        };
        if !sending_ok || self.req.next >= self.sq.len() {
            return false;
        }
        if self.comp.rnr_until.is_some_and(|t| t > now) {
            return false;
        }
        let window = if self.comp.lone_resend {
            1
        } else {
            self.attr.max_unacked
        };
        if self.req.psn.diff(self.comp.psn) as u32 >= window {
            return false;
        }
        let wqe = &self.sq[self.req.next];
        if wqe.wr.op.is_read() {
            let in_flight = self
                .sq
                .iter()
                .take(self.req.next)
                .filter(|w| w.wr.op.is_read())
                .count();
            if in_flight >= self.attr.max_rd_atomic.max(1) as usize {
                return false;
            }
        }
        true
    }

    /// Put the requester at `psn`: the WQE that holds it, or the first not yet started.
    pub(super) fn seek_req(&mut self, psn: Psn) {
        for (i, w) in self.sq.iter().enumerate() {
            if !w.started {
                self.req.next = i;
                self.req.pkt = 0;
                self.req.psn = psn;
                return;
            }
            if w.contains(psn) {
                self.req.next = i;
                self.req.pkt = psn.diff(w.first_psn) as u32;
                self.req.psn = psn;
                return;
            }
        }
        self.req.next = self.sq.len();
        self.req.pkt = 0;
        self.req.psn = psn;
    }

    /// A tail-loss probe is due and may go out now.
    pub(super) fn probe_can_send(&self, now: crate::verbs::Instant) -> bool {
        self.comp.probe_due
            && matches!(self.attr.state, QpState::Rts | QpState::Sqd)
            && self.comp.rnr_until.is_none_or(|t| t <= now)
            && self.outstanding()
    }

    /// Send the tail-loss probe: the last packet sent, again, with AckReq (RFC 8985 7.3).
    /// The responder answers it whatever happened to the tail: an ACK if only ACKs were
    /// lost or the probe filled the hole, a sequence NAK (and so a fast retransmit) if
    /// earlier packets are missing. The requester's own position is left as it was.
    pub(super) fn probe_poll(
        &mut self,
        ctx: &mut Ctx<'_>,
        icrc: Option<&IcrcContext>,
        out: &mut Vec<u8>,
    ) -> bool {
        if !self.probe_can_send(ctx.now) {
            return false;
        }
        self.comp.probe_due = false;
        if self.req.psn != self.req.max_psn {
            // Already resending (go-back-N): that covers the tail.
            return false;
        }
        let saved = (
            self.req.next,
            self.req.pkt,
            self.req.psn,
            self.req.since_ack_req,
        );
        self.seek_req(self.req.max_psn.add(Psn::MASK));
        let sent = self.req.next < self.sq.len() && self.emit_request(ctx, icrc, out, true);
        if self.attr.state != QpState::Err {
            (
                self.req.next,
                self.req.pkt,
                self.req.psn,
                self.req.since_ack_req,
            ) = saved;
        }
        if sent {
            ctx.stats.tail_probes += 1;
            self.comp.timed = None;
        }
        sent
    }

    /// Emit the next request packet, if any.
    pub(super) fn requester_poll(
        &mut self,
        ctx: &mut Ctx<'_>,
        icrc: Option<&IcrcContext>,
        out: &mut Vec<u8>,
    ) -> bool {
        if !self.requester_can_send(ctx.now) {
            return false;
        }
        // The lone packet resent after a timeout asks for its ACK: nothing more goes until
        // one comes, and a packet in the middle of a message is otherwise acknowledged only
        // with a later one.
        let lone = self.comp.lone_resend;
        self.emit_request(ctx, icrc, out, lone)
    }

    /// Emit the packet at the requester's position and move past it. `ack_req`: ask for an
    /// ACK whatever its place in the message.
    fn emit_request(
        &mut self,
        ctx: &mut Ctx<'_>,
        icrc: Option<&IcrcContext>,
        out: &mut Vec<u8>,
        ack_req: bool,
    ) -> bool {
        let mtu = self.attr.seg_bytes();
        let psn = self.req.psn;
        let idx = self.req.next;
        let wqe = &mut self.sq[idx];
        if !wqe.started {
            wqe.started = true;
            wqe.first_psn = psn;
            wqe.npkts = packets_for(wqe.len, mtu);
        }
        let k = self.req.pkt;
        let wr = wqe.wr;
        let (len, npkts, first_psn) = (wqe.len, wqe.npkts, wqe.first_psn);
        let offset = k * mtu;

        let start = out.len();
        // Whether this packet asks for an ACK (a READ request always does).
        let mut asked = true;
        if let SendOp::Read { remote_addr, rkey } = wr.op {
            // A retried READ asks only for what has not arrived yet (IBA 9.4.4).
            let mut h = PacketHeaders::new(BthRepr::new(
                Opcode::RC_RDMA_READ_REQUEST,
                self.attr.dest_qpn,
                psn,
            ));
            h.bth.ack_req = true;
            h.reth = Some(RethRepr {
                va: remote_addr + offset as u64,
                rkey,
                dma_len: len - offset.min(len),
            });
            h.emit_into(out);
            finish_packet(out, start, icrc);
            self.req.psn = first_psn.add(npkts);
            self.req.next += 1;
            self.req.pkt = 0;
            self.req.since_ack_req = 0;
        } else {
            let pos = super::requester::pos_of(k, npkts);
            let n = (len - offset).min(mtu);
            let mut h = PacketHeaders::new(BthRepr::new(
                request_opcode(wr.op, pos),
                self.attr.dest_qpn,
                psn,
            ));
            self.req.since_ack_req += 1;
            h.bth.ack_req = ack_req || pos.ends() || self.req.since_ack_req >= ACK_EVERY;
            if h.bth.ack_req {
                self.req.since_ack_req = 0;
            }
            asked = h.bth.ack_req;
            h.bth.solicited = wr.solicited && pos.ends();
            match wr.op {
                SendOp::Write { remote_addr, rkey }
                | SendOp::WriteWithImm {
                    remote_addr, rkey, ..
                } if pos.starts() => {
                    h.reth = Some(RethRepr {
                        va: remote_addr,
                        rkey,
                        dma_len: len,
                    });
                }
                _ => {}
            }
            if pos.ends() {
                match wr.op {
                    SendOp::SendWithImm(imm) | SendOp::WriteWithImm { imm, .. } => {
                        h.imm = Some(imm)
                    }
                    SendOp::SendWithInv(k) => h.ieth = Some(k),
                    _ => {}
                }
            }
            h.emit_into(out);
            if !self.gather(ctx, &wr.sgl, offset, n, out) {
                // The local buffer went away under the WQE: complete it with a protection
                // error and stop the QP, as hardware does (IBA 10.8.3).
                out.truncate(start);
                self.fail_front_or(ctx, idx, WcStatus::LocProtErr);
                return false;
            }
            finish_packet(out, start, icrc);
            self.req.psn = psn.add(1);
            self.req.pkt += 1;
            if self.req.pkt == npkts {
                self.req.next += 1;
                self.req.pkt = 0;
            }
        }
        // Never sent before: a candidate for an RTT sample (Karn; and only a packet the
        // responder acknowledges at once, not one whose ACK waits for the message's end),
        // and new data re-arms the tail-loss probe (RFC 8985 7.2).
        let fresh = !psn.before(self.req.max_psn);
        if self.req.psn.after(self.req.max_psn) {
            self.req.max_psn = self.req.psn;
        }
        if fresh && asked && self.comp.timed.is_none() {
            self.comp.timed = Some((psn, ctx.now));
        }
        if self.comp.timer.is_none() {
            self.arm_timer(ctx);
        } else if fresh {
            self.arm_probe(ctx);
        }
        true
    }

    /// Append `n` bytes starting `offset` bytes into the SGL.
    fn gather(
        &self,
        ctx: &mut Ctx<'_>,
        sgl: &Sgl,
        mut offset: u32,
        mut n: u32,
        out: &mut Vec<u8>,
    ) -> bool {
        for sge in sgl.entries() {
            if n == 0 {
                break;
            }
            if offset >= sge.len {
                offset -= sge.len;
                continue;
            }
            let take = (sge.len - offset).min(n);
            match ctx.mrs.resolve(
                self.pd,
                sge.lkey,
                sge.addr + offset as u64,
                take as u64,
                Access::empty(),
                false,
            ) {
                Ok(Some(r)) => {
                    r.mem.append_to(r.offset, take as usize, out);
                }
                Ok(None) => {}
                Err(_) => return false,
            }
            n -= take;
            offset = 0;
        }
        n == 0
    }

    /// Complete WQE `idx` with an error. Errors complete in order, so a WQE behind the head
    /// fails the whole queue the same way once everything ahead of it is flushed.
    pub(super) fn fail_front_or(&mut self, ctx: &mut Ctx<'_>, idx: usize, status: WcStatus) {
        if let Some(w) = self.sq.remove(idx) {
            ctx.complete(
                self.send_cq,
                WorkCompletion {
                    wr_id: w.wr.wr_id,
                    status,
                    opcode: w.wr.op.wc_opcode(),
                    qpn: self.qpn,
                    byte_len: 0,
                    imm: None,
                    invalidated: None,
                },
            );
        }
        self.enter_error(ctx);
    }
}

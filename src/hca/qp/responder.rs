//! Responder: execute inbound SEND, RDMA WRITE and RDMA READ requests in PSN order, generate
//! ACKs, NAKs and read responses (IBA 9.7.5; rxe_resp.c). One NAK per gap; duplicates are
//! re-acknowledged, duplicate READs are executed again from memory.

use super::requester::{packets_for, pos_of};
use super::{Ctx, Qp, ReadCtx, RespMsg};
use crate::hca::wire::{
    finish_packet, AethRepr, AethSyndrome, BthRepr, IcrcContext, MsgPos, NakCode, OpClass, Opcode,
    PacketHeaders, ParsedPacket,
};
use crate::verbs::Access;
use crate::verbs::AsyncEvent;
use crate::verbs::RecvWr;
use crate::verbs::{Instant, MemKey, Psn};
use crate::verbs::{WcOpcode, WcStatus, WorkCompletion};

/// What went wrong with a request, and so which NAK answers it.
enum Fault {
    /// Recoverable: ask the requester to come back later.
    Rnr,
    /// Fatal for the QP: NAK and enter ERR.
    Nak(NakCode),
}

impl Qp {
    /// An inbound request packet (we are the responder).
    pub(crate) fn on_request(&mut self, ctx: &mut Ctx<'_>, pkt: &ParsedPacket<'_>) {
        let psn = pkt.hdrs.bth.psn;
        let d = psn.diff(self.resp.epsn);
        if d > 0 {
            // A gap: one NAK until the expected PSN shows up (IBA 9.7.5.1.2).
            if !self.resp.nak_sent {
                self.resp.nak =
                    Some((self.resp.epsn, AethSyndrome::Nak(NakCode::PsnSequenceError)));
                self.resp.nak_sent = true;
                ctx.stats.seq_naks_tx += 1;
            }
            return;
        }
        if d < 0 {
            self.on_duplicate(ctx, pkt);
            return;
        }
        self.resp.nak_sent = false;
        match self.execute(ctx, pkt) {
            Ok(consumed) => {
                self.resp.epsn = psn.add(consumed);
                self.resp.ack_pkts = self.resp.ack_pkts.saturating_add(consumed);
                if pkt.hdrs.bth.ack_req && pkt.hdrs.bth.opcode.info().class != OpClass::ReadRequest
                {
                    self.owe_ack(ctx, psn);
                }
            }
            Err(Fault::Rnr) => {
                self.resp.nak = Some((
                    psn,
                    AethSyndrome::RnrNak {
                        timer: self.attr.min_rnr_timer,
                    },
                ));
                self.resp.nak_sent = true;
                ctx.stats.rnr_naks_tx += 1;
            }
            Err(Fault::Nak(code)) => {
                self.resp.nak = Some((psn, AethSyndrome::Nak(code)));
                ctx.stats.naks_tx += 1;
                if code == NakCode::RemoteAccessError {
                    ctx.events.push_back(AsyncEvent::QpAccessError(self.qpn));
                } else {
                    ctx.events.push_back(AsyncEvent::QpFatal(self.qpn));
                }
                // The NAK still has to leave: keep it past the flush.
                let nak = self.resp.nak.take();
                self.enter_error(ctx);
                self.resp.nak = nak;
            }
        }
    }

    /// Run one in-order request packet. Returns how many PSNs it consumed.
    fn execute(&mut self, ctx: &mut Ctx<'_>, pkt: &ParsedPacket<'_>) -> Result<u32, Fault> {
        let info = pkt.hdrs.bth.opcode.info();
        let mtu = self.attr.seg_bytes() as usize;
        // Opcode sequence (IBA 9.7.5.1.3 / rxe check_op_seq).
        let in_msg = match &self.resp.cur {
            Some(RespMsg::Send { .. }) => Some(OpClass::Send),
            Some(RespMsg::Write { .. }) => Some(OpClass::Write),
            None => None,
        };
        let seq_ok = match in_msg {
            Some(c) => c == info.class && matches!(info.pos, MsgPos::Middle | MsgPos::Last),
            None => info.pos.starts(),
        };
        if !seq_ok {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        }
        // Length (IBA 9.7.5.1.4): FIRST and MIDDLE carry exactly one MTU.
        let plen = pkt.payload.len();
        let len_ok = match info.pos {
            MsgPos::First | MsgPos::Middle => plen == mtu,
            MsgPos::Last | MsgPos::Only => plen <= mtu,
        };
        if !len_ok {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        }
        if !self.attr.access.contains(match info.class {
            OpClass::Write => Access::REMOTE_WRITE,
            OpClass::ReadRequest => Access::REMOTE_READ,
            _ => Access::empty(),
        }) {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        }
        match info.class {
            OpClass::Send => self.exec_send(ctx, pkt, info.pos).map(|_| 1),
            OpClass::Write => self.exec_write(ctx, pkt, info.pos).map(|_| 1),
            OpClass::ReadRequest => self.exec_read(ctx, pkt, false),
            _ => Err(Fault::Nak(NakCode::InvalidRequest)),
        }
    }

    fn exec_send(
        &mut self,
        ctx: &mut Ctx<'_>,
        pkt: &ParsedPacket<'_>,
        pos: MsgPos,
    ) -> Result<(), Fault> {
        if pos.starts() {
            let wqe = self.rq.pop_front().ok_or(Fault::Rnr)?;
            self.resp.cur = Some(RespMsg::Send { wqe, offset: 0 });
        }
        let Some(RespMsg::Send { wqe, offset }) = self.resp.cur.take() else {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        };
        if offset as u64 + pkt.payload.len() as u64 <= wqe.sgl.total_len() {
            if !self.scatter(ctx, &wqe.sgl, offset, pkt.payload) {
                self.complete_recv(ctx, &wqe, WcStatus::LocProtErr, 0, None, None);
                return Err(Fault::Nak(NakCode::RemoteOperationalError));
            }
        } else {
            // The message is longer than the receive buffer (IBA 9.9.3.1.1).
            self.complete_recv(ctx, &wqe, WcStatus::LocLenErr, 0, None, None);
            return Err(Fault::Nak(NakCode::InvalidRequest));
        }
        let offset = offset + pkt.payload.len() as u32;
        if !pos.ends() {
            self.resp.cur = Some(RespMsg::Send { wqe, offset });
            return Ok(());
        }
        let mut invalidated = None;
        if let Some(rkey) = pkt.hdrs.ieth {
            if ctx.mrs.invalidate(self.pd, rkey).is_err() {
                self.complete_recv(ctx, &wqe, WcStatus::LocQpOpErr, 0, None, None);
                return Err(Fault::Nak(NakCode::RemoteOperationalError));
            }
            invalidated = Some(rkey);
        }
        self.resp.msn = self.resp.msn.wrapping_add(1);
        self.complete_recv(
            ctx,
            &wqe,
            WcStatus::Success,
            offset,
            pkt.hdrs.imm,
            invalidated,
        );
        Ok(())
    }

    fn exec_write(
        &mut self,
        ctx: &mut Ctx<'_>,
        pkt: &ParsedPacket<'_>,
        pos: MsgPos,
    ) -> Result<(), Fault> {
        if pos.starts() {
            let Some(reth) = pkt.hdrs.reth else {
                return Err(Fault::Nak(NakCode::InvalidRequest));
            };
            self.check_remote(ctx, reth.rkey, reth.va, reth.dma_len, Access::REMOTE_WRITE)?;
            self.resp.cur = Some(RespMsg::Write {
                va: reth.va,
                rkey: reth.rkey,
                len: reth.dma_len,
                offset: 0,
            });
        }
        let Some(RespMsg::Write {
            va,
            rkey,
            len,
            offset,
        }) = self.resp.cur
        else {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        };
        let n = pkt.payload.len() as u32;
        let end = offset as u64 + n as u64;
        if end > len as u64 || (pos.ends() && end != len as u64) {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        }
        // Write with immediate needs a receive WQE: check before touching memory so an RNR
        // retry finds nothing half done.
        if pos.ends() && pkt.hdrs.imm.is_some() && self.rq.is_empty() {
            return Err(Fault::Rnr);
        }
        match ctx.mrs.resolve(
            self.pd,
            rkey,
            va + offset as u64,
            n as u64,
            Access::REMOTE_WRITE,
            true,
        ) {
            Ok(Some(r)) => {
                r.mem.write(r.offset, pkt.payload);
            }
            Ok(None) => {}
            Err(_) => return Err(Fault::Nak(NakCode::RemoteAccessError)),
        }
        if !pos.ends() {
            self.resp.cur = Some(RespMsg::Write {
                va,
                rkey,
                len,
                offset: end as u32,
            });
            return Ok(());
        }
        self.resp.cur = None;
        self.resp.msn = self.resp.msn.wrapping_add(1);
        if let Some(imm) = pkt.hdrs.imm {
            if let Some(wqe) = self.rq.pop_front() {
                self.complete_recv_op(
                    ctx,
                    &wqe,
                    WcStatus::Success,
                    WcOpcode::RecvRdmaWithImm,
                    len,
                    Some(imm),
                    None,
                );
            }
        }
        Ok(())
    }

    /// Queue the responses for a READ request. `dup` re-executes a duplicate.
    fn exec_read(
        &mut self,
        ctx: &mut Ctx<'_>,
        pkt: &ParsedPacket<'_>,
        dup: bool,
    ) -> Result<u32, Fault> {
        let Some(reth) = pkt.hdrs.reth else {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        };
        self.check_remote(ctx, reth.rkey, reth.va, reth.dma_len, Access::REMOTE_READ)?;
        let psn = pkt.hdrs.bth.psn;
        let npkts = packets_for(reth.dma_len, self.attr.seg_bytes());
        let max = self.attr.max_dest_rd_atomic.max(1) as usize;
        if dup {
            // Only a part of a READ we executed and still remember (rxe's rule: else a
            // class D error, dropped).
            let (va, end) = (reth.va, reth.va.checked_add(reth.dma_len as u64));
            let ours = self.resp.served.iter().any(|r| {
                r.rkey == reth.rkey
                    && r.first_psn.diff(psn) <= 0
                    && psn.diff(r.first_psn.add(r.npkts)) < 0
                    && va >= r.va
                    && end.is_some_and(|e| e <= r.va + r.len as u64)
            });
            // (A duplicate's error is dropped by `on_duplicate`: nothing is sent.)
            if !ours {
                ctx.stats.dup_reads_dropped += 1;
                return Err(Fault::Nak(NakCode::InvalidRequest));
            }
            // The requester will ask again for everything after this READ too: drop responses
            // queued at or after it and answer this one afresh.
            self.resp
                .reads
                .retain(|r| r.first_psn.before(psn) && r.first_psn.add(r.npkts).diff(psn) <= 0);
            if self.resp.reads.len() >= max {
                ctx.stats.dup_reads_dropped += 1;
                return Err(Fault::Nak(NakCode::InvalidRequest));
            }
        } else if self.resp.served.len() >= max {
            // A new READ: the requester keeps at most `max` in flight, so the oldest one
            // remembered is complete there. Whatever of it is still queued (answers to its
            // duplicates, sent after the originals had arrived) is owed to no one.
            if let Some(old) = self.resp.served.pop_front() {
                let end = old.first_psn.add(old.npkts);
                self.resp
                    .reads
                    .retain(|r| r.first_psn.before(old.first_psn) || !r.first_psn.before(end));
            }
        }
        if !dup && self.resp.reads.len() >= max {
            return Err(Fault::Nak(NakCode::InvalidRequest));
        }
        let read = ReadCtx {
            va: reth.va,
            rkey: reth.rkey,
            len: reth.dma_len,
            first_psn: psn,
            npkts,
            next: 0,
        };
        if !dup {
            self.resp.msn = self.resp.msn.wrapping_add(1);
            self.resp.served.push_back(read);
        }
        self.resp.reads.push_back(read);
        Ok(npkts)
    }

    fn check_remote(
        &self,
        ctx: &mut Ctx<'_>,
        rkey: MemKey,
        va: u64,
        len: u32,
        need: Access,
    ) -> Result<(), Fault> {
        match ctx.mrs.resolve(self.pd, rkey, va, len as u64, need, true) {
            Ok(_) => Ok(()),
            Err(_) => {
                ctx.stats.access_errors += 1;
                Err(Fault::Nak(NakCode::RemoteAccessError))
            }
        }
    }

    fn on_duplicate(&mut self, ctx: &mut Ctx<'_>, pkt: &ParsedPacket<'_>) {
        ctx.stats.rx_duplicates += 1;
        match pkt.hdrs.bth.opcode.info().class {
            OpClass::ReadRequest => {
                // A bad duplicate is dropped: the original already answered it.
                let _ = self.exec_read(ctx, pkt, true);
            }
            _ => {
                // Re-acknowledge the latest, at once, so a requester whose ACK was lost
                // moves on.
                self.resp.ack = Some(self.resp.epsn.add(Psn::MASK));
                self.resp.ack_due = Some(ctx.now);
            }
        }
    }

    /// Record that request `psn` asked for an ACK. It leaves with our next packet to the
    /// peer, or alone once `ack_delay` has passed, or at once after `ACK_NOW_PKTS` packets.
    fn owe_ack(&mut self, ctx: &Ctx<'_>, psn: Psn) {
        self.resp.ack = Some(psn);
        let due = if self.resp.ack_pkts >= super::ACK_NOW_PKTS {
            ctx.now
        } else {
            ctx.now + ctx.ack_delay
        };
        self.resp.ack_due = Some(self.resp.ack_due.map_or(due, |d| d.min(due)));
    }

    /// When the owed ACK must leave even with nothing to ride on.
    pub(super) fn ack_deadline(&self) -> Option<Instant> {
        if self.attr.state == super::QpState::Reset || self.resp.ack.is_none() {
            return None;
        }
        self.resp.ack_due
    }

    /// An owed ACK leaves now: it is due, or request packets of ours went out this turn
    /// (it follows them).
    fn ack_ready(&self, now: Instant) -> bool {
        self.resp.ack.is_some()
            && (self.resp.ack_due.is_none_or(|t| t <= now)
                || self.resp.ride
                || self.attr.state == super::QpState::Err)
    }

    pub(super) fn responder_wants_transmit(&self, now: Instant) -> bool {
        self.attr.state != super::QpState::Reset
            && (self.resp.nak.is_some() || !self.resp.reads.is_empty() || self.ack_ready(now))
    }

    /// Emit one responder packet: a NAK first, then read responses. The coalesced ACK comes
    /// from [`Qp::responder_ack`], after these (so an ACK never overtakes the data of a READ
    /// before it) and after the requester's packets.
    pub(super) fn responder_poll(
        &mut self,
        ctx: &mut Ctx<'_>,
        icrc: Option<&IcrcContext>,
        out: &mut Vec<u8>,
    ) -> bool {
        let start = out.len();
        if let Some((psn, syndrome)) = self.resp.nak.take() {
            let aeth = AethRepr {
                syndrome,
                msn: self.resp.msn,
            };
            self.emit_acknowledge(psn, aeth, icrc, out);
            return true;
        }
        if self.attr.state == super::QpState::Err {
            self.resp.reads.clear();
            self.resp.forget_ack();
            return false;
        }
        if let Some(read) = self.resp.reads.front_mut() {
            let mtu = self.attr.seg_bytes();
            let k = read.next;
            let pos = pos_of(k, read.npkts);
            let offset = k * mtu;
            let n = (read.len - offset.min(read.len)).min(mtu);
            let opcode = match pos {
                MsgPos::Only => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
                MsgPos::First => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
                MsgPos::Middle => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
                MsgPos::Last => Opcode::RC_RDMA_READ_RESPONSE_LAST,
            };
            let psn = read.first_psn.add(k);
            let mut h = PacketHeaders::new(BthRepr::new(opcode, self.attr.dest_qpn, psn));
            if pos != MsgPos::Middle {
                h.aeth = Some(AethRepr::ack(self.resp.msn));
            }
            h.emit_into(out);
            let (va, rkey) = (read.va, read.rkey);
            read.next += 1;
            if read.next == read.npkts {
                self.resp.reads.pop_front();
            }
            match ctx.mrs.resolve(
                self.pd,
                rkey,
                va + offset as u64,
                n as u64,
                Access::REMOTE_READ,
                true,
            ) {
                Ok(Some(r)) => {
                    r.mem.append_to(r.offset, n as usize, out);
                }
                Ok(None) => {}
                Err(_) => {
                    // The region was deregistered while the READ was queued.
                    out.truncate(start);
                    self.resp.reads.clear();
                    self.resp.nak = Some((psn, AethSyndrome::Nak(NakCode::RemoteAccessError)));
                    return self.responder_poll(ctx, icrc, out);
                }
            }
            finish_packet(out, start, icrc);
            return true;
        }
        false
    }

    /// Emit the coalesced ACK if it is ready to leave.
    pub(super) fn responder_ack(
        &mut self,
        ctx: &mut Ctx<'_>,
        icrc: Option<&IcrcContext>,
        out: &mut Vec<u8>,
    ) -> bool {
        if self.attr.state == super::QpState::Reset || !self.ack_ready(ctx.now) {
            return false;
        }
        let Some(psn) = self.resp.forget_ack() else {
            return false;
        };
        self.emit_acknowledge(psn, AethRepr::ack(self.resp.msn), icrc, out);
        ctx.stats.acks_tx += 1;
        true
    }

    /// Append an ACK or NAK packet for `psn` carrying `aeth`.
    fn emit_acknowledge(
        &self,
        psn: Psn,
        aeth: AethRepr,
        icrc: Option<&IcrcContext>,
        out: &mut Vec<u8>,
    ) {
        let start = out.len();
        let mut h = PacketHeaders::new(BthRepr::new(
            Opcode::RC_ACKNOWLEDGE,
            self.attr.dest_qpn,
            psn,
        ));
        h.aeth = Some(aeth);
        h.emit_into(out);
        finish_packet(out, start, icrc);
    }

    fn complete_recv(
        &mut self,
        ctx: &mut Ctx<'_>,
        wqe: &RecvWr,
        status: WcStatus,
        byte_len: u32,
        imm: Option<u32>,
        invalidated: Option<MemKey>,
    ) {
        self.complete_recv_op(ctx, wqe, status, WcOpcode::Recv, byte_len, imm, invalidated)
    }

    #[allow(clippy::too_many_arguments)]
    fn complete_recv_op(
        &mut self,
        ctx: &mut Ctx<'_>,
        wqe: &RecvWr,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        invalidated: Option<MemKey>,
    ) {
        ctx.complete(
            self.recv_cq,
            WorkCompletion {
                wr_id: wqe.wr_id,
                status,
                opcode,
                qpn: self.qpn,
                byte_len,
                imm,
                invalidated,
            },
        );
    }
}

//! Completion: work completions and response capsules in, requests out (a request ends
//! when both its SEND completion and its response are in), retries, timeouts, and the
//! report to recovery when the connection breaks.

use crate::verbs::{DeviceContext, Instant};

use super::*;

impl<D: DeviceContext> QueueCore<D> {
    /// The connection broke under the queue: hold what is out and tell recovery.
    pub(super) fn fail_connection(&mut self, c: Cause) {
        if matches!(self.phase, Phase::Attached | Phase::Live) {
            self.go_down(c == Cause::Transport);
            self.inbox.report_in(self.epoch, Event::Failed(c));
        }
    }

    /// Feed one work completion.
    pub fn on_wc(&mut self, wc: &WorkCompletion) {
        if self.verbs.is_none() {
            return;
        }
        let kind = wc.wr_id >> 32;
        let idx = (wc.wr_id & 0xFFFF_FFFF) as usize;
        if wc.status != WcStatus::Success {
            // A flush on a dead device is the device's failure; any other error (and a flush
            // on a live device: the QP went to error, e.g. the target broke an MR's rules)
            // is this connection's.
            let c = match self.device_cause() {
                Some(dev) if wc.status == WcStatus::WrFlushErr => dev,
                _ => Cause::Transport,
            };
            self.fail_connection(c);
            return;
        }
        match (kind, wc.opcode) {
            (WR_SEND, WcOpcode::Send) => {
                if let Some(s) = self.slots.get_mut(idx) {
                    if s.state == SlotState::Posted {
                        s.send_done = true;
                        self.try_finish(idx);
                    }
                }
            }
            (WR_RECV, WcOpcode::Recv) => {
                self.on_response(idx, wc.byte_len as usize, wc.invalidated)
            }
            _ => {}
        }
    }

    /// The device behind the CQ is dead and drained.
    pub fn on_device_gone(&mut self) {
        self.cq_gone = true;
        let c = self.device_cause().unwrap_or(Cause::DeviceFatal);
        self.fail_connection(c);
    }

    /// If the device under the queue is dead: why (reset or hot-remove).
    pub(super) fn device_cause(&self) -> Option<Cause> {
        match self.verbs.as_ref()?.dev.lifecycle() {
            Lifecycle::Live => None,
            Lifecycle::Removed => Some(Cause::DeviceRemoved),
            _ => Some(Cause::DeviceFatal),
        }
    }

    pub(super) fn on_response(&mut self, r: usize, len: usize, invalidated: Option<MemKey>) {
        let Some(v) = &self.verbs else { return };
        if r >= self.spec.size {
            return;
        }
        let mut b = [0u8; CQE_LEN];
        self.rsp.read(r * CQE_LEN, &mut b);
        // The buffer is copied out: give it back to the target this turn.
        self.recvs.push(recv_wr(&v.rsp_mr, r));
        if len != CQE_LEN {
            self.stats.bad_response_len += 1;
            tracing::warn!(len, "response capsule of the wrong size ignored");
            return;
        }
        let Ok(cqe) = Cqe::parse(&b) else {
            self.bogus_invalidation(invalidated);
            return;
        };
        let slot = (cqe.cid & ((1 << SLOT_BITS) - 1)) as usize;
        let gen = cqe.cid >> SLOT_BITS;
        let Some(s) = self.slots.get(slot) else {
            self.stats.unknown_cid += 1;
            self.bogus_invalidation(invalidated);
            return;
        };
        let answers = s.gen == gen
            && (s.state == SlotState::Posted || (s.state == SlotState::Held && s.held_out));
        if let Some(k) = invalidated {
            if answers && s.key_live && k == self.slot_mr(slot).rkey {
                self.slots[slot].key_live = false;
                self.stats.remote_invalidations += 1;
            } else {
                // The target shut a key that is not this command's (maybe another one's in
                // flight): this connection can no longer be trusted with its keys.
                self.bogus_invalidation(invalidated);
                return;
            }
        }
        let s = &mut self.slots[slot];
        if s.state == SlotState::Held && s.held_out && s.gen == gen {
            // The connection failed while this command was out, but the target had run it:
            // complete it with its answer rather than send it again.
            s.state = SlotState::Posted;
            s.send_done = true;
            s.held_out = false;
            s.cqe = Some(cqe);
            self.stats.late_answers += 1;
            self.try_finish(slot);
            return;
        }
        if s.state != SlotState::Posted || s.gen != gen {
            self.stats.unknown_cid += 1;
            tracing::warn!(
                cid = cqe.cid,
                "completion for a command ID not in flight ignored"
            );
            return;
        }
        if s.cqe.is_some() {
            self.stats.duplicate_completion += 1;
            tracing::warn!(cid = cqe.cid, "duplicate completion ignored");
            return;
        }
        s.cqe = Some(cqe);
        self.try_finish(slot);
    }

    /// A response invalidated a key that was not its command's (or came with no command):
    /// fail the connection; recovery sends what is out again on a new one.
    pub(super) fn bogus_invalidation(&mut self, invalidated: Option<MemKey>) {
        if let Some(k) = invalidated {
            self.stats.bogus_invalidations += 1;
            tracing::warn!(
                rkey = k.0,
                "the target invalidated a key of no command in flight"
            );
            self.fail_connection(Cause::Transport);
        }
    }

    /// The command in slot `i` is done with its data region: the target must not reach it
    /// any more (Linux nvme-rdma posts a LOCAL_INV unless the target sent with invalidate).
    pub(super) fn release_key(&mut self, i: usize) {
        if !std::mem::take(&mut self.slots[i].key_live) {
            return;
        }
        if let Some(v) = &self.verbs {
            v.dev.invalidate_mr(&self.slot_mr(i));
            self.stats.local_invalidations += 1;
        }
    }

    pub(super) fn try_finish(&mut self, i: usize) {
        let s = &self.slots[i];
        if !(s.state == SlotState::Posted && s.send_done) {
            return;
        }
        let Some(cqe) = s.cqe else { return };
        // Before the data is read out: nothing the target writes later lands in it.
        self.release_key(i);
        let s = &self.slots[i];
        if i == self.control_slot() {
            let opcode = s.sqe.opcode;
            self.slots[i].state = SlotState::Free;
            self.slots[i].cqe = None;
            self.control = Some(ControlDone::Completed(cqe));
            self.control_fresh = true;
            if opcode == crate::nvme::admin::opcode::admin::KEEP_ALIVE
                && cqe.nvme_status().is_success()
            {
                self.inbox.report_in(self.epoch, Event::KeepAliveOk);
            }
            return;
        }
        let st = cqe.nvme_status();
        let (retries, posted_at, data_in) = (s.retries, s.posted_at, s.data_in);
        if !st.is_success() && !st.dnr && retries < self.max_retries {
            // A retryable error: send it again (Linux nvme_decide_disposition), now if the
            // queue is live, else when it is again.
            self.stats.retried += 1;
            let s = &mut self.slots[i];
            s.retries += 1;
            if self.phase == Phase::Live {
                self.post(i, posted_at);
            } else {
                s.state = SlotState::Held;
                s.cqe = None;
                s.send_done = false;
                s.held_out = false;
            }
            return;
        }
        let mut data = Vec::new();
        if st.is_success() && data_in > 0 && self.slots[i].region.is_none() {
            let off = i * self.spec.max_io;
            let _apart = self.slots[i]
                .audit_apart
                .then(crate::harness::alloc_audit::enter);
            data = self.spare.pop().unwrap_or_default();
            data.clear();
            self.data
                .with_range(off, data_in, |b| data.extend_from_slice(b));
            self.stats.count_copy(data_in);
        }
        self.stats.completed += 1;
        self.finish(i, Ok(Response { cqe, data }));
    }

    pub(super) fn finish(&mut self, i: usize, r: Result<Response, HostError>) {
        self.release_key(i);
        if let Some((id, chunk)) = self.slots[i].region.take() {
            if let Some(g) = self.regions.get_mut(id as usize).and_then(Option::as_mut) {
                g.busy[chunk as usize] = false;
                if g.orphan {
                    self.unregister(id);
                }
            }
        }
        let s = &mut self.slots[i];
        if let Some(tx) = s.reply.take() {
            let _ = tx.send(r);
        }
        s.state = SlotState::Free;
        s.cqe = None;
        s.send_done = false;
        s.held_out = false;
        s.stale = false;
        s.gated = false;
        self.free.push(i);
    }

    /// A posted command older than the I/O timeout means the connection is stuck: recover.
    /// The command counts one retry, so a command that always hangs fails in the end.
    pub fn check_timeouts(&mut self, now: Instant) {
        if self.io_timeout.is_zero() || !matches!(self.phase, Phase::Live | Phase::Attached) {
            return;
        }
        let mut expired = false;
        for i in 0..self.slots.len() {
            let s = &mut self.slots[i];
            if s.state == SlotState::Posted
                && s.cqe.is_none()
                && !waits_for_an_event(self.spec.qid, &s.sqe)
                && s.posted_at + self.io_timeout <= now
            {
                expired = true;
                self.stats.timeouts += 1;
                s.retries += 1;
                if s.retries > self.max_retries && i != self.control_slot() {
                    self.stats.failed += 1;
                    self.finish(
                        i,
                        Err(HostError::Timeout("command timed out too often".into())),
                    );
                }
            }
        }
        if expired {
            self.fail_connection(Cause::IoTimeout);
        }
    }
}

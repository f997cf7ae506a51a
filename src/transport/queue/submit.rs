//! Submission: a caller's request into a slot, and the slot onto the wire (capsule, keyed
//! SGL or in-capsule data, a key per command), posted in batches; and the commands of a dead
//! connection that safe retry holds back.

use crate::verbs::{DeviceContext, Instant};

use super::*;

impl<D: DeviceContext> QueueCore<D> {
    /// Take a caller's request: it is sent now if LIVE, held otherwise.
    pub fn submit(&mut self, now: Instant, req: Request) {
        self.submit_parts(
            now,
            req.sqe,
            req.data_out.as_deref(),
            req.data_in,
            req.region,
            req.reply,
            req.audit_apart,
        );
    }

    /// [`QueueCore::submit`] with the outgoing data borrowed: it is copied into the slot.
    /// With `region` the data stays in the caller's registered buffer (`data_out` and
    /// `data_in` are then unused): no copy.
    // The request's parts, one argument each, so the fast path borrows its data.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit_parts(
        &mut self,
        now: Instant,
        sqe: Sqe,
        data_out: Option<&[u8]>,
        data_in: usize,
        region: Option<RegionIo>,
        reply: oneshot::Sender<Result<Response, HostError>>,
        audit_apart: bool,
    ) {
        if let Phase::Closed(why) = self.phase {
            let _ = reply.send(Err(HostError::Path(why)));
            return;
        }
        if let (Some(why), false) = (self.failfast, self.is_live()) {
            let _ = reply.send(Err(HostError::Path(why)));
            return;
        }
        let max_io = self.spec.max_io;
        let (out_len, data_in) = match region {
            Some(r) => {
                if let Err(e) = self.check_region(r) {
                    let _ = reply.send(Err(e));
                    return;
                }
                if r.write {
                    (r.len, 0)
                } else {
                    (0, r.len)
                }
            }
            None => (data_out.map_or(0, |v| v.len()), data_in),
        };
        if out_len > max_io || data_in > max_io {
            let _ = reply.send(Err(HostError::Invalid(format!(
                "transfer larger than {max_io} bytes"
            ))));
            return;
        }
        let Some(i) = self.free.pop() else {
            let _ = reply.send(Err(HostError::Invalid("queue full".into())));
            return;
        };
        let off = i * max_io;
        if let Some(r) = region {
            // The data is the caller's, in place: nothing to copy, nothing to clear (a read
            // lands where the caller's own bytes were, never another request's).
            if let Some(g) = self.regions.get_mut(r.id as usize).and_then(Option::as_mut) {
                g.busy[r.chunk as usize] = true;
            }
            self.slots[i].region = Some((r.id, r.chunk));
        } else if let Some(data) = data_out {
            self.data.write(off, data);
            self.stats.count_copy(data.len());
        } else if data_in > 0 {
            // A target that reports success without writing the data must not hand this
            // caller the bytes of the slot's previous request.
            self.data.with_range(off, data_in, |b| b.fill(0));
        }
        let s = &mut self.slots[i];
        s.sqe = sqe;
        s.data_out = out_len;
        s.data_in = data_in;
        s.retries = 0;
        s.audit_apart = audit_apart;
        s.reply = Some(reply);
        s.state = SlotState::Held;
        self.stats.submitted += 1;
        if self.is_live() {
            self.post(i, now);
        }
    }

    /// Build slot `i`'s capsule with a fresh command ID and the current keys, and queue its
    /// SEND for [`QueueCore::flush_posts`].
    pub(super) fn post(&mut self, i: usize, now: Instant) {
        let Some(v) = &self.verbs else { return };
        let spec = self.spec;
        let capsule = self.capsule();
        // User slots in flight, this one included (the last slot is the reserved one).
        let in_flight = self.slots.len() - 1 - self.free.len();
        let (out, inn) = (self.slots[i].data_out, self.slots[i].data_in);
        let in_capsule =
            out > 0 && spec.qid > 0 && out <= spec.inline && in_flight <= spec.inline_depth;
        let keyed = (out > 0 && !in_capsule) || (out == 0 && inn > 0);
        let invalidate = keyed && v.per_use_keys;
        if invalidate {
            // A key of its own for this command, the previous one refused from now on: it
            // reaches the transfer's bytes only, and only the way the data goes (a target
            // reads what the host sends and writes what it reads).
            let mut access = Access::empty();
            if out > 0 {
                access |= Access::REMOTE_READ;
            }
            if inn > 0 {
                access |= Access::REMOTE_WRITE | Access::LOCAL_WRITE;
            }
            let mr = slot_mr(
                &mut self.data_mrs,
                &mut self.regions,
                i,
                self.slots[i].region,
            );
            if v.dev.rekey_mr(mr, out.max(inn), access).is_err() {
                let s = &mut self.slots[i];
                s.state = SlotState::Held;
                s.cqe = None;
                s.send_done = false;
                let c = self.device_cause().unwrap_or(Cause::Transport);
                self.fail_connection(c);
                return;
            }
            self.slots[i].key_live = true;
        }
        let mr = self.slot_mr(i);
        let local = match self.slots[i].region {
            Some((id, _)) => self.region(id).map(|r| r.local.lkey),
            None => None,
        };
        let Some(v) = &self.verbs else { return };
        let local = local.unwrap_or(v.data_local.lkey);
        let s = &mut self.slots[i];
        s.gen = (s.gen + 1) & ((1 << (16 - SLOT_BITS)) - 1);
        let mut sqe = s.sqe;
        sqe.cid = (i as u16) | (s.gen << SLOT_BITS);
        let mut sges = [Sge::default(); 2];
        sges[0] = Sge {
            addr: v.cmd_mr.addr + (i * capsule) as u64,
            len: SQE_LEN as u32,
            lkey: v.cmd_mr.lkey,
        };
        let mut nsge = 1;
        let sgl = if in_capsule {
            self.stats.in_capsule += 1;
            sges[1] = Sge {
                addr: mr.addr,
                len: s.data_out as u32,
                lkey: local,
            };
            nsge = 2;
            SglDescriptor::InCapsule {
                offset: 0,
                len: s.data_out as u32,
            }
        } else if keyed {
            SglDescriptor::keyed(mr.addr, out.max(inn) as u64, mr.rkey.0, invalidate)
                .unwrap_or(SglDescriptor::NULL)
        } else {
            SglDescriptor::NULL
        };
        let _ = sgl.emit(&mut sqe.dptr);
        let mut bytes = [0u8; SQE_LEN];
        sqe.emit(&mut bytes);
        self.cmd.write(i * capsule, &bytes);
        s.state = SlotState::Posted;
        s.send_done = false;
        s.cqe = None;
        s.stale = false;
        s.posted_at = now;
        self.last_contact = self.last_contact.max(now);
        self.sends.push(SendWr::signaled(
            (WR_SEND << 32) | i as u64,
            SendOp::Send,
            Sgl::new(&sges[..nsge]).unwrap_or_default(),
        ));
    }

    /// Post the turn's sends and receive re-posts under one lock, with one driver kick. A
    /// post the device refuses means the connection is gone: recovery takes over.
    pub fn flush_posts(&mut self) {
        if self.sends.is_empty() && self.recvs.is_empty() {
            return;
        }
        let Some(v) = &self.verbs else {
            self.sends.clear();
            self.recvs.clear();
            return;
        };
        if v.dev.post(v.qpn, &mut self.recvs, &mut self.sends).is_err() {
            let c = self.device_cause().unwrap_or(Cause::Transport);
            self.fail_connection(c);
        }
    }
}

/// Safe retry's side of the queue: commands of a dead connection held back, and the last
/// contact on the queue.
impl<D: DeviceContext> QueueCore<D> {
    /// Offer each held command that was out on a connection that died (and is not held back
    /// yet) to `gate` with its slot and opcode; those it answers true for stay held back
    /// from [`QueueCore::resume`] until [`QueueCore::ungate`].
    pub fn gate_stale(&mut self, mut gate: impl FnMut(usize, u8) -> bool) {
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.state == SlotState::Held && s.stale && !s.gated {
                s.gated = gate(i, s.sqe.opcode);
            }
        }
    }

    /// Let held-back command `slot` go: sent now if the queue is live, else at the next
    /// [`QueueCore::resume`]. False if the slot holds no such command (it ended another way).
    pub fn ungate(&mut self, slot: usize, now: Instant) -> bool {
        let Some(s) = self.slots.get_mut(slot) else {
            return false;
        };
        if !(s.state == SlotState::Held && s.gated) {
            return false;
        }
        s.gated = false;
        if self.phase == Phase::Live {
            self.post(slot, now);
            self.flush_posts();
        }
        true
    }

    /// Commands held back by safe retry now.
    pub fn gated(&self) -> usize {
        self.slots.iter().filter(|s| s.gated).count()
    }

    /// The last command posted or completion taken on this queue, on the controller's
    /// clock; `torn_down`, when the last teardown found answers still in the CQ.
    pub fn last_contact(&self, torn_down: Instant) -> Instant {
        if self.heard_at_teardown {
            torn_down
        } else {
            self.last_contact
        }
    }

    /// Completions were taken at `now`.
    pub(super) fn heard(&mut self, now: Instant) {
        self.last_contact = self.last_contact.max(now);
    }
}

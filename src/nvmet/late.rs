//! A dead controller's held commands on the engine: the late-writes fault mode (writes the
//! backend held when their controller died, stalled or waiting for a worker, run later, as
//! a slow backend's would), the
//! controller deaths that feed [`super::quiesce`], and the CCRs whose end is reported to
//! their source. What runs, is dropped or waits is [`super::quiesce::Quiesce`]'s call.

use std::sync::atomic::Ordering;

use crate::nvme::admin::opcode;
use crate::nvme::ccr::{self, CcrState, CtrlInstance};
use crate::nvme::{Sqe, Status};
use crate::verbs::{DeviceContext, HostBuffer, Instant};

use super::backend::Op;
use super::command::{Ctrl, Done, SQE_LEN};
use super::engine::Engine;
use super::io::{lba, nlb};
use super::port::QRef;
use super::quiesce::{Death, LateWrite, Reset, Verdict, NO_WAKE};
use super::rdma::{Io, Stage};

impl<D: DeviceContext> Engine<D> {
    /// Controller `id` (`ctrl`, just taken out of the registry) died: with the late-writes
    /// fault on, the writes its queues still held (stalled with their data in staging, or
    /// waiting for a worker) are kept to run later; without it they go with their queues.
    /// Either way the death is recorded, so that CQT and CCR apply to it.
    pub(super) fn ctrl_died(&mut self, id: u16, ctrl: &Ctrl) {
        let inst = ctrl.instance(id);
        let due = self
            .late_writes_ms
            .map(|ms| Instant(self.now.0.saturating_add(u64::from(ms) * 1_000_000)));
        let mut held = 0;
        // Jobs a worker has started cannot be stopped mid-step: each is counted until it
        // reports (done or stopped). Those still waiting for a worker go now.
        let mut running = 0;
        for (qpn, _) in &ctrl.queues {
            let Some(q) = self.queues.get(qpn) else {
                continue;
            };
            let executing = q
                .cmds
                .iter()
                .filter(|c| c.stage == Stage::Executing)
                .count();
            if executing == 0 {
                continue;
            }
            let token = q.token;
            let waiting = self.pool.purge(token);
            let started = executing.saturating_sub(waiting.len());
            if started > 0 {
                self.ending.insert(token, (inst, started));
                running += started;
            }
            let Some(due) = due else {
                continue;
            };
            for job in waiting {
                if let Op::Write { off, len } = job.op {
                    self.late.push(LateWrite {
                        inst,
                        due,
                        ns: job.ns,
                        off,
                        len,
                        staging: job.staging,
                        at: job.at,
                    });
                    held += 1;
                }
            }
        }
        if let Some(due) = due {
            let subsys = self.core.subsystem(ctrl).cloned();
            let mut i = 0;
            while i < self.stalled.len() {
                let (qpn, c) = self.stalled[i];
                let late = ctrl
                    .queues
                    .iter()
                    .any(|(q, qid)| *q == qpn && *qid > 0)
                    .then(|| self.late_write(qpn, c, subsys.as_ref()?, inst, due))
                    .flatten();
                match late {
                    Some(w) => {
                        self.stalled.swap_remove(i);
                        self.late.push(w);
                        held += 1;
                    }
                    None => i += 1,
                }
            }
        }
        let death = Death {
            inst,
            subsys: ctrl.subsys,
            hostnqn: &ctrl.hostnqn,
            kato_ms: ctrl.kato_ms,
            held,
            running,
        };
        self.core.quiesce.died(death, self.now);
        self.rearm_late();
    }

    /// Stalled command `c` of queue `qpn` as a late write, if it is a write whose data came
    /// in its capsule (that data is in its staging; a keyed write's never arrived).
    fn late_write(
        &self,
        qpn: QRef,
        c: usize,
        subsys: &super::Subsystem,
        inst: CtrlInstance,
        due: Instant,
    ) -> Option<LateWrite<D::Mem>> {
        let q = self.queues.get(&qpn)?;
        let cmd = q.cmds.get(c)?;
        let sqe = cmd.sqe;
        if sqe.opcode != opcode::io::WRITE {
            return None;
        }
        let ns = subsys.namespaces.iter().find(|n| n.nsid == sqe.nsid)?;
        let (off, len) = ns.range(lba(&sqe), nlb(&sqe)).ok()?;
        if len > cmd.capsule_len.saturating_sub(SQE_LEN) || len > q.staging_len {
            return None;
        }
        Some(LateWrite {
            inst,
            due,
            ns: ns.clone(),
            off,
            len,
            staging: q.data.0.clone(),
            at: c * q.staging_len,
        })
    }

    /// Run the late writes that are due, drop those CQT or a CCR stopped, and report the
    /// CCRs that ended with them.
    pub(super) fn run_late(&mut self, d: &mut Io<D>) {
        let now = self.now;
        let mut i = 0;
        while i < self.late.len() {
            let w = &self.late[i];
            let verdict = self.core.quiesce.verdict(&w.inst, w.due, now);
            if verdict == Verdict::Wait {
                i += 1;
                continue;
            }
            let w = self.late.swap_remove(i);
            if verdict == Verdict::Run {
                let ok = w
                    .staging
                    .with_range(w.at, w.len, |g| w.ns.write(w.off, g).is_ok());
                tracing::info!(
                    cntlid = w.inst.cntlid,
                    offset = w.off,
                    bytes = w.len,
                    ok,
                    "late write of a dead controller ran"
                );
                self.core.stats.late_writes_run += 1;
            } else {
                self.core.stats.late_writes_dropped += 1;
            }
            let ended = self.core.quiesce.held_ended(&w.inst);
            self.resets_ended(d, ended);
        }
        self.core.quiesce.forget(now);
        self.rearm_late();
    }

    /// A worker's job of queue incarnation `token` reported after its queue went: if it
    /// belonged to a dead controller, it no longer runs.
    pub(super) fn job_ended(&mut self, d: &mut Io<D>, token: u64) {
        let Some((inst, left)) = self.ending.get_mut(&token) else {
            return;
        };
        let inst = *inst;
        *left -= 1;
        if *left == 0 {
            self.ending.remove(&token);
        }
        let ended = self.core.quiesce.running_ended(&inst);
        self.resets_ended(d, ended);
    }

    /// CCRs that finished after they were answered: each source's log entry says success
    /// and the source gets the event that tells it to read the log.
    pub(super) fn resets_ended(&mut self, d: &mut Io<D>, ended: Vec<Reset>) {
        for r in ended {
            let Some(src) = self.core.ctrls.get_mut(&r.source) else {
                continue;
            };
            for e in src.ccr_log.iter_mut() {
                if e.state == CcrState::InProgress && e.is_for(&r.impacted) {
                    e.state = CcrState::Success;
                }
            }
            self.raise(d, r.source, ccr::ccr_aen_dw0());
        }
    }

    /// A CCR ran on queue `qpn` with answer `r`: what it fenced is stopped before the host
    /// hears of it. A live controller it tore down that had worker jobs started turns the
    /// answer from IRS to in progress (they show only once it is torn down).
    pub(super) fn after_ccr(
        &mut self,
        d: &mut Io<D>,
        qpn: QRef,
        sqe: &Sqe,
        r: &mut Result<Done, Status>,
    ) {
        self.tear_down(d);
        let source = self.queues.get(&qpn).and_then(|q| q.cntlid);
        if let (Ok(Done::Respond { result, .. }), Some(source), Ok(inst)) =
            (r, source, ccr::parse_cross_ctrl_reset(sqe))
        {
            if *result != 0 && self.core.quiesce.still_running(source, inst) {
                *result = 0;
                let log = self.core.ctrls.get_mut(&source).map(|c| &mut c.ccr_log);
                if let Some(e) = log.and_then(|l| l.iter_mut().rev().find(|e| e.is_for(&inst))) {
                    e.state = CcrState::InProgress;
                }
            }
        }
        self.run_late(d);
    }

    /// Tear down the live controllers `Core::tear_down` lists, each as if its connection
    /// died.
    pub(super) fn tear_down(&mut self, d: &mut Io<D>) {
        while let Some(id) = self.core.tear_down.pop() {
            let admin = self
                .core
                .ctrls
                .get(&id)
                .and_then(|c| c.queues.iter().find(|(_, qid)| *qid == 0).map(|(q, _)| *q));
            match admin {
                Some(qpn) => self.remove_queue(d, qpn),
                None => {
                    if let Some(ctrl) = self.core.ctrls.remove(&id) {
                        self.ctrl_died(id, &ctrl);
                    }
                }
            }
        }
    }

    /// When the engine next needs to look at the late writes (`NO_WAKE`: none held).
    fn rearm_late(&self) {
        let next = self
            .late
            .iter()
            .map(|w| self.core.quiesce.wake_at(&w.inst, w.due).0)
            .min()
            .unwrap_or(NO_WAKE);
        self.late_wake.store(next, Ordering::Release);
    }
}

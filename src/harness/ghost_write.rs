//! The ghost-write model: a seeded, sans-I/O simulation of the hazard safe retry exists for,
//! and of the rule that removes it ([`crate::reconnect::hold`]).
//!
//! - The target executes each command a few milliseconds after it arrives. When a connection
//!   dies, the commands it had not executed yet are either dropped or executed late (a slow
//!   backend), but all are finished within CQT of the target noticing the loss, and the
//!   target notices within KATO of the last packet it got from the host (it honours CQT).
//!   A Cross-Controller Reset drops the impacted controller's unfinished commands at once.
//! - The host keeps a few reads and writes in flight to a handful of blocks (never two at
//!   once to the same block, as a file system or fio's verify does), over one path or two
//!   (two controllers of the same subsystem, failover: the first live path). It sends keep
//!   alives every KATO / 2, notices a dead connection when one goes unanswered, resends what
//!   the hold rule lets go on a live path, sends CCRs through a live path, and reconnects the
//!   dead one (a new controller instance).
//! - The checker: every read of a block returns the last write the host saw acknowledged for
//!   it, and at the end, once the target has nothing left to run, so does every block.
//!
//! With `SafeRetry::Off` a write resent at once can be acknowledged, followed by a newer write
//! to the same block, and then overwritten by the stale original: the checker sees it. With
//! `Cqt` or `Ccr` it must never happen. Everything is driven by one seed and virtual time in
//! milliseconds, so a failing seed replays exactly.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::nvme::ccr::CtrlInstance;
use crate::reconnect::hold::{
    CcrOutcome, CmdClass, Hold, HoldPolicy, LostController, SafeRetry, DEFAULT_CQT,
};
use crate::verbs::Instant;

/// One run's knobs.
#[derive(Debug, Clone, Copy)]
pub struct GhostConfig {
    pub seed: u64,
    pub mode: SafeRetry,
    /// The target implements CCR (Identify CCRL non-zero).
    pub ccr_offered: bool,
    /// Keep Alive Timeout, ms.
    pub kato_ms: u64,
    /// The target's Command Quiesce Time, ms, which it reports and honours.
    pub cqt_ms: u16,
    /// Paths (controllers of the subsystem): 1 or 2.
    pub paths: usize,
    pub blocks: usize,
    pub queue_depth: usize,
    /// Reads and writes the workload issues.
    pub ops: usize,
    /// Connection deaths during the run.
    pub faults: usize,
}

impl GhostConfig {
    pub fn new(seed: u64, mode: SafeRetry) -> GhostConfig {
        GhostConfig {
            seed,
            mode,
            ccr_offered: true,
            kato_ms: 100,
            cqt_ms: 150,
            paths: 1,
            blocks: 4,
            queue_depth: 4,
            ops: 240,
            faults: 3,
        }
    }
}

/// What a run saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GhostOutcome {
    /// Blocks whose final content is not the last acknowledged write.
    pub corrupted_blocks: usize,
    /// Reads that returned something other than the last acknowledged write.
    pub bad_reads: usize,
    pub writes_acked: usize,
    pub reads_done: usize,
    /// Connection deaths the host noticed.
    pub faults_seen: usize,
    /// Stale writes the target executed after their connection died.
    pub stale_writes_executed: usize,
    /// CCRs that completed successfully.
    pub ccr_succeeded: usize,
    /// Sum over faults of the time from noticing the death to the last held command let go, ms.
    pub held_ms: u64,
    /// Virtual time at the end, ms.
    pub end_ms: u64,
}

impl GhostOutcome {
    pub fn corrupt(&self) -> bool {
        self.corrupted_blocks != 0 || self.bad_reads != 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

#[derive(Debug, Clone, Copy)]
struct Cmd {
    kind: Kind,
    block: usize,
    /// The value a write stores; unique per write.
    value: u64,
    /// Generation of the connection it was last sent on; `None` while held or ready.
    on_gen: Option<u32>,
    done: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// The target runs command `cmd` that arrived on connection `gen`, if its queue entry
    /// still carries `token` (a late run replaces the on-time one).
    TargetExec {
        cmd: usize,
        gen: u32,
        token: u64,
    },
    /// A response reaches the host.
    Response {
        cmd: usize,
        gen: u32,
        value: u64,
    },
    KeepAliveSend {
        gen: u32,
    },
    KeepAliveAnswer {
        gen: u32,
    },
    KeepAliveCheck {
        gen: u32,
        sent: u64,
    },
    LinkDeath,
    Reconnect {
        path: usize,
    },
    /// A CCR for the controller of connection `gen` reaches the target.
    CcrArrives {
        gen: u32,
    },
    CcrAnswer {
        gen: u32,
    },
    HoldTimer,
}

struct Conn {
    path: usize,
    instance: CtrlInstance,
    /// Time the link died; packets sent at or after it are lost.
    died_at: Option<u64>,
    /// The host has noticed and stopped using it.
    abandoned: bool,
    last_send: u64,
    last_recv: u64,
    last_ka_answer: u64,
    /// The last packet the target got on it.
    target_last_rx: u64,
}

struct Sim {
    cfg: GhostConfig,
    rng: SmallRng,
    now: u64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    conns: Vec<Conn>,
    /// Per path, the generation of the connection the host uses; `None` while reconnecting.
    live: Vec<Option<u32>>,
    cmds: Vec<Cmd>,
    /// Commands let go by the hold rule, waiting for a live connection.
    ready: Vec<usize>,
    hold: Hold<usize>,
    /// Per block: the last acknowledged write's value, and whether a command is outstanding.
    expected: Vec<u64>,
    busy: Vec<bool>,
    /// Target state.
    media: Vec<u64>,
    /// Commands the target has but has not run: (cmd, gen, token); a CCR drops them.
    target_queue: Vec<(usize, u32, u64)>,
    issued: usize,
    next_value: u64,
    faults_left: usize,
    fault_notice_at: Option<u64>,
    out: GhostOutcome,
}

impl Sim {
    fn new(cfg: GhostConfig) -> Sim {
        let policy = HoldPolicy {
            mode: cfg.mode,
            default_cqt: DEFAULT_CQT,
        };
        let mut s = Sim {
            cfg,
            rng: SmallRng::seed_from_u64(cfg.seed),
            now: 0,
            seq: 0,
            events: BinaryHeap::new(),
            conns: Vec::new(),
            live: vec![None; cfg.paths.max(1)],
            cmds: Vec::new(),
            ready: Vec::new(),
            hold: Hold::new(policy, cfg.ops),
            expected: vec![0; cfg.blocks],
            busy: vec![false; cfg.blocks],
            media: vec![0; cfg.blocks],
            target_queue: Vec::new(),
            issued: 0,
            next_value: 1,
            faults_left: cfg.faults,
            fault_notice_at: None,
            out: GhostOutcome::default(),
        };
        for path in 0..cfg.paths.max(1) {
            s.connect(path);
        }
        s.schedule_fault();
        s
    }

    fn at(&mut self, delay: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((self.now + delay, self.seq, ev)));
    }

    fn kato(&self) -> u64 {
        self.cfg.kato_ms
    }

    fn connect(&mut self, path: usize) {
        let gen = self.conns.len() as u32;
        self.conns.push(Conn {
            path,
            instance: CtrlInstance {
                cntlid: path as u16 + 1,
                ciu: gen as u8,
                cirn: self.rng.random(),
            },
            died_at: None,
            abandoned: false,
            last_send: self.now,
            last_recv: self.now,
            last_ka_answer: self.now,
            target_last_rx: self.now,
        });
        self.live[path] = Some(gen);
        self.at(self.kato() / 2, Ev::KeepAliveSend { gen });
    }

    fn schedule_fault(&mut self) {
        if self.faults_left > 0 {
            self.faults_left -= 1;
            let d = self.rng.random_range(20..150);
            self.at(d, Ev::LinkDeath);
        }
    }

    /// The connection new commands go on: the first live path.
    fn current(&self) -> Option<u32> {
        self.live.iter().flatten().copied().next()
    }

    fn is_current(&self, gen: u32) -> bool {
        self.live[self.conns[gen as usize].path] == Some(gen)
    }

    fn alive(&self, gen: u32) -> bool {
        self.conns[gen as usize].died_at.is_none()
    }

    /// The host sends a packet on `gen`: does it arrive?
    fn send(&mut self, gen: u32) -> bool {
        let now = self.now;
        let c = &mut self.conns[gen as usize];
        c.last_send = now;
        if c.died_at.is_none() {
            c.target_last_rx = now;
            true
        } else {
            false
        }
    }

    fn submit(&mut self, cmd: usize) {
        let Some(gen) = self.current() else {
            self.ready.push(cmd);
            return;
        };
        self.cmds[cmd].on_gen = Some(gen);
        if self.send(gen) {
            self.seq += 1;
            let token = self.seq;
            self.target_queue.push((cmd, gen, token));
            let service = self.rng.random_range(1..6);
            self.at(service, Ev::TargetExec { cmd, gen, token });
        }
    }

    fn issue_more(&mut self) {
        if self.current().is_none() {
            return;
        }
        let outstanding = self.cmds.iter().filter(|c| !c.done).count();
        let mut room = self.cfg.queue_depth.saturating_sub(outstanding);
        while room > 0 && self.issued < self.cfg.ops {
            let free: Vec<usize> = (0..self.cfg.blocks).filter(|&b| !self.busy[b]).collect();
            if free.is_empty() {
                return;
            }
            let block = free[self.rng.random_range(0..free.len())];
            let kind = if self.rng.random_bool(0.7) {
                Kind::Write
            } else {
                Kind::Read
            };
            let value = self.next_value;
            self.next_value += 1;
            self.busy[block] = true;
            self.cmds.push(Cmd {
                kind,
                block,
                value,
                on_gen: None,
                done: false,
            });
            self.issued += 1;
            room -= 1;
            self.submit(self.cmds.len() - 1);
        }
    }

    fn target_exec(&mut self, cmd: usize, gen: u32, token: u64) {
        let Some(i) = self
            .target_queue
            .iter()
            .position(|&q| q == (cmd, gen, token))
        else {
            return; // dropped (quiesced or reset), or moved to a later run
        };
        self.target_queue.swap_remove(i);
        let c = self.cmds[cmd];
        let stale = !self.alive(gen);
        let value = match c.kind {
            Kind::Write => {
                self.media[c.block] = c.value;
                if stale {
                    self.out.stale_writes_executed += 1;
                }
                c.value
            }
            Kind::Read => self.media[c.block],
        };
        if self.alive(gen) {
            self.at(1, Ev::Response { cmd, gen, value });
        }
    }

    fn response(&mut self, cmd: usize, gen: u32, value: u64) {
        if self.conns[gen as usize].abandoned {
            return;
        }
        self.conns[gen as usize].last_recv = self.now;
        let c = self.cmds[cmd];
        if c.done || c.on_gen != Some(gen) {
            return;
        }
        self.cmds[cmd].done = true;
        self.busy[c.block] = false;
        match c.kind {
            Kind::Write => {
                self.expected[c.block] = c.value;
                self.out.writes_acked += 1;
            }
            Kind::Read => {
                self.out.reads_done += 1;
                if value != self.expected[c.block] {
                    self.out.bad_reads += 1;
                }
            }
        }
        self.issue_more();
    }

    /// The link of the live connection dies. Its unfinished commands run late or are
    /// dropped, all within CQT of the target noticing (KATO after its last packet).
    fn link_death(&mut self) {
        let up: Vec<u32> = self.live.iter().flatten().copied().collect();
        if up.is_empty() {
            self.schedule_fault();
            return;
        }
        let gen = up[self.rng.random_range(0..up.len())];
        if !self.alive(gen) {
            return;
        }
        self.conns[gen as usize].died_at = Some(self.now);
        let noticed = self.conns[gen as usize].target_last_rx + self.kato();
        let quiesced = noticed + u64::from(self.cfg.cqt_ms);
        let mut stale: Vec<usize> = Vec::new();
        self.target_queue.retain(|q| {
            if q.1 == gen {
                stale.push(q.0);
                false
            } else {
                true
            }
        });
        for cmd in stale {
            if self.rng.random_bool(0.5) {
                continue; // dropped
            }
            let latest = quiesced.max(self.now + 1);
            let when = self.rng.random_range(self.now..latest) - self.now;
            self.seq += 1;
            let token = self.seq;
            self.target_queue.push((cmd, gen, token));
            self.at(when, Ev::TargetExec { cmd, gen, token });
        }
    }

    fn keep_alive_send(&mut self, gen: u32) {
        if !self.is_current(gen) || self.finished() {
            return;
        }
        let sent = self.now;
        if self.send(gen) {
            self.at(1, Ev::KeepAliveAnswer { gen });
        }
        self.at(self.kato() / 2, Ev::KeepAliveCheck { gen, sent });
        self.at(self.kato() / 2, Ev::KeepAliveSend { gen });
    }

    fn keep_alive_check(&mut self, gen: u32, sent: u64) {
        let c = &self.conns[gen as usize];
        if !self.is_current(gen) || c.last_ka_answer >= sent {
            return;
        }
        self.connection_lost(gen);
    }

    /// The host notices `gen` is dead: hold its in-flight commands, reconnect.
    fn connection_lost(&mut self, gen: u32) {
        self.out.faults_seen += 1;
        let path = self.conns[gen as usize].path;
        self.live[path] = None;
        let now = Instant::from_nanos(self.now * 1_000_000);
        let c = &mut self.conns[gen as usize];
        c.abandoned = true;
        let lost = LostController {
            instance: c.instance,
            last_contact: Instant::from_nanos(c.last_send.max(c.last_recv) * 1_000_000),
            kato: Duration::from_millis(self.cfg.kato_ms),
            cqt_ms: self.cfg.cqt_ms,
            traffic_based_keep_alive: false,
            ccr_possible: self.cfg.ccr_offered,
        };
        self.hold.on_connection_lost(&lost);
        for i in 0..self.cmds.len() {
            let c = self.cmds[i];
            if c.done || c.on_gen != Some(gen) {
                continue;
            }
            self.cmds[i].on_gen = None;
            let class = match c.kind {
                Kind::Read => CmdClass::Idempotent,
                Kind::Write => CmdClass::Mutating,
            };
            // The table holds every command the workload can issue: it cannot be full.
            if self.hold.hold(now, &lost, i, class).is_err() {
                self.ready.push(i);
            }
        }
        self.fault_notice_at = Some(self.now);
        self.send_ccrs();
        self.release();
        let delay = self.rng.random_range(1..50);
        self.at(delay, Ev::Reconnect { path });
    }

    /// CCRs through a live controller of the subsystem: the other path, or the new
    /// connection of the same one.
    fn send_ccrs(&mut self) {
        let Some(via) = self.current() else {
            return;
        };
        while let Some(impacted) = self.hold.poll_ccr() {
            if let Some(old) = self.conns.iter().position(|c| c.instance == impacted) {
                if self.send(via) {
                    let d = self.rng.random_range(1..20);
                    self.at(d, Ev::CcrArrives { gen: old as u32 });
                }
            }
        }
    }

    fn reconnect(&mut self, path: usize) {
        self.connect(path);
        self.send_ccrs();
        let ready = std::mem::take(&mut self.ready);
        for cmd in ready {
            self.submit(cmd);
        }
        self.schedule_fault();
        self.issue_more();
    }

    fn ccr_arrives(&mut self, old: u32) {
        // The impacted controller is reset: what it had not run is dropped.
        self.target_queue.retain(|q| q.1 != old);
        if let Some(live) = self.current() {
            if self.alive(live) {
                self.at(1, Ev::CcrAnswer { gen: old });
            }
        }
    }

    fn ccr_answer(&mut self, old: u32) {
        self.out.ccr_succeeded += 1;
        let now = Instant::from_nanos(self.now * 1_000_000);
        self.hold.on_ccr(
            now,
            self.conns[old as usize].instance,
            CcrOutcome::Succeeded,
        );
        self.release();
    }

    /// Resend what the hold rule lets go now; arm the timer for the rest.
    fn release(&mut self) {
        let now = Instant::from_nanos(self.now * 1_000_000);
        let mut let_go = Vec::new();
        self.hold.release_due(now, |t| let_go.push(t));
        for cmd in let_go {
            self.submit(cmd);
        }
        match self.hold.poll_timeout() {
            Some(t) => {
                let ms = t.as_nanos().div_ceil(1_000_000);
                self.at(ms.saturating_sub(self.now), Ev::HoldTimer);
            }
            None => {
                if let Some(t) = self.fault_notice_at.take() {
                    self.out.held_ms += self.now - t;
                }
            }
        }
    }

    fn finished(&self) -> bool {
        self.issued == self.cfg.ops && self.cmds.iter().all(|c| c.done)
    }

    fn run(mut self) -> GhostOutcome {
        self.issue_more();
        while let Some(Reverse((t, _, ev))) = self.events.pop() {
            self.now = t;
            match ev {
                Ev::TargetExec { cmd, gen, token } => self.target_exec(cmd, gen, token),
                Ev::Response { cmd, gen, value } => self.response(cmd, gen, value),
                Ev::KeepAliveSend { gen } => self.keep_alive_send(gen),
                Ev::KeepAliveAnswer { gen } => {
                    let now = self.now;
                    let c = &mut self.conns[gen as usize];
                    c.last_ka_answer = now;
                    c.last_recv = now;
                }
                Ev::KeepAliveCheck { gen, sent } => self.keep_alive_check(gen, sent),
                Ev::LinkDeath => {
                    if !self.finished() {
                        self.link_death();
                    }
                }
                Ev::Reconnect { path } => self.reconnect(path),
                Ev::CcrArrives { gen } => self.ccr_arrives(gen),
                Ev::CcrAnswer { gen } => self.ccr_answer(gen),
                Ev::HoldTimer => self.release(),
            }
        }
        self.out.end_ms = self.now;
        self.out.corrupted_blocks = (0..self.cfg.blocks)
            .filter(|&b| self.media[b] != self.expected[b])
            .count();
        self.out
    }
}

/// Run one seeded simulation to the end (the workload done, the target idle) and check it.
pub fn run(cfg: GhostConfig) -> GhostOutcome {
    Sim::new(cfg).run()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEEDS: u64 = 200;

    /// Run `SEEDS` seeds; fail naming the seed if a run did not finish its workload.
    fn sweep(mode: SafeRetry, ccr_offered: bool, paths: usize) -> Vec<(u64, GhostOutcome)> {
        (0..SEEDS)
            .map(|seed| {
                let mut cfg = GhostConfig::new(seed, mode);
                cfg.ccr_offered = ccr_offered;
                cfg.paths = paths;
                let o = run(cfg);
                assert_eq!(
                    o.writes_acked + o.reads_done,
                    cfg.ops,
                    "seed {seed} ({mode}, {paths} paths): workload did not finish: {o:?}"
                );
                (seed, o)
            })
            .collect()
    }

    fn assert_clean(mode: SafeRetry, ccr_offered: bool, paths: usize) -> Vec<(u64, GhostOutcome)> {
        let runs = sweep(mode, ccr_offered, paths);
        for (seed, o) in &runs {
            assert!(
                !o.corrupt(),
                "seed {seed} ({mode}, ccr offered {ccr_offered}, {paths} paths): ghost write: {o:?}"
            );
        }
        // The hazard was there to be missed: stale writes did land late.
        assert!(runs.iter().any(|(_, o)| o.stale_writes_executed > 0));
        runs
    }

    fn held(runs: &[(u64, GhostOutcome)]) -> u64 {
        runs.iter().map(|(_, o)| o.held_ms).sum()
    }

    #[test]
    fn off_lets_ghost_writes_corrupt_blocks() {
        for paths in [1, 2] {
            let runs = sweep(SafeRetry::Off, true, paths);
            let bad = runs.iter().filter(|(_, o)| o.corrupt()).count();
            assert!(
                bad > 0,
                "no corruption in {SEEDS} seeds on {paths} paths with safe retry off: the \
                 model lost its hazard"
            );
        }
    }

    #[test]
    fn cqt_never_corrupts() {
        for paths in [1, 2] {
            let runs = assert_clean(SafeRetry::Cqt, true, paths);
            assert!(runs.iter().all(|(_, o)| o.ccr_succeeded == 0));
        }
    }

    #[test]
    fn ccr_never_corrupts_and_recovers_sooner_than_cqt() {
        for paths in [1, 2] {
            let ccr = assert_clean(SafeRetry::Ccr, true, paths);
            assert!(ccr.iter().any(|(_, o)| o.ccr_succeeded > 0));
            let cqt = sweep(SafeRetry::Cqt, true, paths);
            assert!(
                held(&ccr) < held(&cqt),
                "{paths} paths: CCR held {} ms in total, CQT {} ms",
                held(&ccr),
                held(&cqt)
            );
        }
    }

    #[test]
    fn ccr_mode_without_ccr_on_the_target_falls_back_to_time() {
        for paths in [1, 2] {
            let runs = assert_clean(SafeRetry::Ccr, false, paths);
            assert!(runs.iter().all(|(_, o)| o.ccr_succeeded == 0));
        }
    }

    #[test]
    fn a_seed_replays_exactly() {
        let mut cfg = GhostConfig::new(7, SafeRetry::Off);
        assert_eq!(run(cfg), run(cfg));
        cfg.paths = 2;
        assert_eq!(run(cfg), run(cfg));
    }
}

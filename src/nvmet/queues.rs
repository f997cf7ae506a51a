//! Queue admission and lifetime: a CM REQ makes a queue of one slot, its RTU (or first
//! capsule) counts it against its address's budgets, a successful Fabrics Connect grows it
//! to full size, and it goes on disconnect, transport error, or keep-alive expiry of its
//! controller.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::nvme::fabrics;
use crate::nvme::Status;
use crate::verbs::{Access, DeviceContext, Instant, QpCaps, Qpn, RecvWr, Sgl};

use super::ana::MAX_GROUPS;
use super::budget::{Holder, Usage};
use super::command::SQE_LEN;
use super::engine::{ConnParams, ConnReject, Engine, CQES_PER_SLOT};
use super::fabrics::CONNECT_DATA;
use super::port::{port_index, QRef};
use super::rdma::{alloc_rings, rc_attr, repost, wr_id, Io, TQueue, WR_RECV};
use super::MAX_NAMESPACES;
use crate::nvme::ana;

/// Admin queues carry no in-capsule data (as Linux sets up).
const ADMIN_CAPSULE: usize = SQE_LEN;
/// Staging per admin slot: Connect data is 1024 bytes, Identify 4096, and a host reads the
/// whole ANA log in one command (Linux sizes it from NANAGRPID and MNAN: 8208 bytes).
pub(super) const ADMIN_STAGING: usize =
    ana::max_log_len(MAX_GROUPS, MAX_NAMESPACES as u32).next_multiple_of(4096);
/// The largest admin (and discovery) queue a host may ask for: Linux nvmet refuses more
/// (`NVME_AQ_DEPTH`), and a host needs no more for admin commands.
const MAX_ADMIN_QUEUE: usize = 32;
/// A queue without a controller this long after it was accepted is dropped.
const ORPHAN_QUEUE_NS: u64 = 10_000_000_000;

/// What an established queue holds before its Fabrics Connect: one slot.
const ONE_SLOT: Usage = Usage {
    queues: 1,
    cqes: CQES_PER_SLOT,
};

/// A queue's source address before its Connect names a host.
fn unnamed(ip: IpAddr) -> Holder<'static> {
    Holder {
        ip,
        host: None,
        listed: false,
    }
}

impl<D: DeviceContext> Engine<D> {
    /// Linux nvmet: a controller that hears nothing from its host for KATO is torn down with
    /// its queues (the host's recovery makes a new one). Any command counts as traffic.
    pub(super) fn expire_controllers(&mut self, d: &mut Io<D>, now: Instant) {
        let mut dead = Vec::new();
        for (id, c) in self.core.ctrls.iter_mut() {
            let seen = *c.last_seen.get_or_insert(now);
            if c.kato_ms > 0 && now.0.saturating_sub(seen.0) > c.kato_ms as u64 * 1_000_000 {
                dead.push((*id, c.queues.first().map(|(q, _)| *q)));
            }
        }
        // A queue whose host never sent Fabrics Connect (it died mid-connect) belongs to no
        // controller that could expire; give it the longest KATO we allow.
        let orphans: Vec<QRef> = self
            .queues
            .iter()
            .filter(|(_, q)| q.cntlid.is_none() && now.0.saturating_sub(q.born.0) > ORPHAN_QUEUE_NS)
            .map(|(qpn, _)| *qpn)
            .collect();
        for qpn in orphans {
            self.remove_queue(d, qpn);
        }
        for (id, admin) in dead {
            tracing::info!(cntlid = id, "keep-alive timeout: controller torn down");
            self.core.stats.kato_expired += 1;
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

    pub(super) fn add_queue(
        &mut self,
        d: &mut Io<D>,
        port: u16,
        p: ConnParams,
        bind: impl FnOnce(Qpn) -> bool,
    ) -> Result<(Qpn, u16), ConnReject> {
        let size = p.hsqsize as usize + 1;
        self.admit_req(d, port, &p, size)?;
        let (pd, cq) = (self.port(port).pd, self.port(port).cq);
        let ip = p.peer.addr.ip();
        let admin = p.qid == 0;
        let capsule_len = if admin {
            ADMIN_CAPSULE
        } else {
            SQE_LEN + self.core.cfg.inline_data as usize
        };
        let io_staging_len = if admin {
            ADMIN_STAGING
        } else {
            self.core.cfg.max_transfer as usize
        };
        let Some((rings, cmds)) = alloc_rings(d, port, pd, 1, capsule_len, CONNECT_DATA) else {
            self.core.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        };
        let [recv, rsp, data] = rings;
        let caps = QpCaps {
            max_send_wr: (size * 3) as u32,
            max_recv_wr: size as u32,
        };
        let mrs = [recv.1, rsp.1, data.1];
        let cleanup = |d: &mut Io<D>| {
            for mr in &mrs {
                d.dev(port).dereg_mr(mr);
            }
        };
        let qpn = match d.dev(port).create_rc_qp(pd, cq, caps, Access::empty()) {
            Ok(q) => q,
            Err(_) => {
                cleanup(d);
                self.core.stats.refused_queues += 1;
                return Err(ConnReject::NoResources);
            }
        };
        let psn = p.local_psn;
        let recv_wr = RecvWr {
            wr_id: wr_id(WR_RECV, 0),
            sgl: Sgl::one(recv.1.addr, capsule_len as u32, recv.1.lkey),
        };
        let key = QRef { port, qpn };
        let ok = bind(qpn)
            && d.dev(port)
                .rc_to_rts(qpn, p.peer, psn, &rc_attr(p.path_mtu))
                .is_ok()
            && d.post_recv(key, recv_wr).is_ok();
        if !ok {
            d.dev(port).destroy_qp(qpn);
            cleanup(d);
            self.core.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        }
        self.queues.insert(
            key,
            TQueue {
                port,
                qid: p.qid,
                mtu: p.path_mtu.bytes(),
                size,
                slots: 1,
                cntlid: None,
                born: self.now,
                capsule_len,
                staging_len: CONNECT_DATA,
                io_staging_len,
                grown: false,
                boot_held: false,
                peer_ip: ip,
                established: false,
                charged: Usage::default(),
                host: None,
                recv,
                rsp,
                data,
                cmds,
                free: vec![0],
                held: VecDeque::new(),
                dead: false,
                token: self.next_token,
                alive: Arc::new(AtomicBool::new(true)),
            },
        );
        self.next_token += 1;
        *self.pre_rtu_per_ip.entry(ip).or_insert(0) += 1;
        self.pre_rtu += 1;
        self.port_mut(port).cqes_used += CQES_PER_SLOT;
        self.core.stats.queues_connected += 1;
        Ok((qpn, size as u16))
    }

    /// The checks of a CM REQ for a queue of `size` entries, before anything is allocated.
    /// A REQ costs a queue of one slot in the pre-RTU table, never a share of the budgets:
    /// its source address may be forged. A peer already holding its share of established
    /// queues is refused here rather than after its RTU.
    fn admit_req(
        &mut self,
        d: &mut Io<D>,
        port: u16,
        p: &ConnParams,
        size: usize,
    ) -> Result<(), ConnReject> {
        if p.qid == 0 && !(fabrics::MIN_ADMIN_SQ_ENTRIES as usize..=MAX_ADMIN_QUEUE).contains(&size)
        {
            return Err(ConnReject::InvalidHsqsize);
        }
        if size < 2 || size > self.core.cfg.max_queue_size as usize {
            return Err(ConnReject::InvalidHsqsize);
        }
        if (p.hrqsize as usize) < size {
            return Err(ConnReject::InvalidHrqsize);
        }
        let ip = p.peer.addr.ip();
        let of_ip = self.per_ip.get(&ip).copied().unwrap_or(0);
        let waiting = self.pre_rtu_per_ip.get(&ip).copied().unwrap_or(0);
        if of_ip >= self.core.cfg.max_unconnected_per_ip
            || waiting >= self.core.cfg.max_pre_rtu_per_ip
            || self.pre_rtu_cap == 0
            || self.ledger.admits(unnamed(ip), ONE_SLOT).is_err()
        {
            self.core.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        }
        if self.pre_rtu >= self.pre_rtu_cap {
            self.evict_oldest_pre_rtu(d);
        }
        let res = self.port(port);
        if res.cqes_used + CQES_PER_SLOT > res.cqes {
            self.core.stats.refused_queues += 1;
            return Err(ConnReject::NoResources);
        }
        Ok(())
    }

    /// The oldest queue still waiting for its RTU goes, to make room in the pre-RTU table:
    /// a real host's RTU comes back within a round trip, so the oldest is the likeliest to
    /// be a forged REQ's.
    pub(super) fn evict_oldest_pre_rtu(&mut self, d: &mut Io<D>) {
        let oldest = self
            .queues
            .iter()
            .filter(|(_, q)| !q.established)
            .min_by_key(|(_, q)| q.token)
            .map(|(qpn, _)| *qpn);
        if let Some(qpn) = oldest {
            self.remove_queue(d, qpn);
        }
    }

    /// The peer of `qpn` answered our REP (its RTU, or a first capsule, which it could
    /// send only after reading the REP): the queue leaves the pre-RTU table and counts
    /// against its address's share and `max_unconnected_per_ip`. Past them it goes, and
    /// `false` says so.
    pub(super) fn establish(&mut self, d: &mut Io<D>, qpn: QRef) -> bool {
        let Some(q) = self.queues.get(&qpn) else {
            return false;
        };
        if q.established {
            return true;
        }
        let ip = q.peer_ip;
        let unconnected = self.per_ip.get(&ip).copied().unwrap_or(0);
        let verdict = self.ledger.admits(unnamed(ip), ONE_SLOT);
        if unconnected >= self.core.cfg.max_unconnected_per_ip || verdict.is_err() {
            tracing::debug!(peer = %ip, "established queue dropped: over its address's share");
            self.core.stats.refused_queues += 1;
            self.remove_queue(d, qpn);
            return false;
        }
        self.leave_pre_rtu(ip);
        self.ledger.charge(unnamed(ip), ONE_SLOT);
        *self.per_ip.entry(ip).or_insert(0) += 1;
        if let Some(q) = self.queues.get_mut(&qpn) {
            q.established = true;
            q.charged = ONE_SLOT;
        }
        true
    }

    pub(super) fn leave_pre_rtu(&mut self, ip: IpAddr) {
        self.pre_rtu = self.pre_rtu.saturating_sub(1);
        if let Some(n) = self.pre_rtu_per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.pre_rtu_per_ip.remove(&ip);
            }
        }
    }

    /// Fabrics Connect is about to succeed on `qpn` for `host` (`listed`: named in its
    /// subsystem's allow-list): charge the queue's full size to its address, network and
    /// host, give it its full rings and post every receive buffer, before the Connect
    /// response tells the host it may send. The one pre-Connect slot is carried over (it
    /// holds the Connect). Past a share, or out of memory, is a Connect failure, not an
    /// abort.
    pub(super) fn grow(
        &mut self,
        d: &mut Io<D>,
        qpn: QRef,
        host: &str,
        listed: bool,
    ) -> Result<(), Status> {
        let no_mem = Status::INTERNAL_ERROR;
        let pd = self.port(qpn.port).pd;
        let q = self.queues.get(&qpn).ok_or(no_mem)?;
        if q.grown {
            return Ok(());
        }
        let (ip, had) = (q.peer_ip, q.charged);
        let full = Usage {
            queues: 1,
            cqes: q.size * CQES_PER_SLOT,
        };
        let named = Holder {
            ip,
            host: Some(host),
            listed,
        };
        self.ledger.refund(unnamed(ip), had);
        let verdict = self.ledger.admits(named, full);
        self.ledger.charge(unnamed(ip), had);
        if let Err(over) = verdict {
            tracing::info!(peer = %ip, host, "Fabrics Connect refused: {over}");
            self.core.stats.refused_queues += 1;
            return Err(Status::CONNECT_CONTROLLER_BUSY);
        }
        let res = &self.ports[port_index(qpn.port)];
        let (cqes_used, cqes) = (res.cqes_used, res.cqes);
        let q = self.queues.get_mut(&qpn).ok_or(no_mem)?;
        let (size, old) = (q.size, q.cmds.len());
        // The CQ is shared by every queue of the port: one that could overrun it is not
        // grown.
        let more = (size - q.slots) * CQES_PER_SLOT;
        if cqes_used + more > cqes {
            return Err(no_mem);
        }
        let (rings, extra) = alloc_rings(d, qpn.port, pd, size, q.capsule_len, q.io_staging_len)
            .map(|(r, c)| (r, c.into_iter().skip(old)))
            .ok_or(no_mem)?;
        let mut free = Vec::new();
        let fits = free.try_reserve_exact(size).is_ok()
            && q.held.try_reserve(size).is_ok()
            && q.cmds.try_reserve_exact(size - old).is_ok();
        let [recv, rsp, data] = rings;
        if !fits {
            for mr in [recv.1, rsp.1, data.1] {
                d.dev(qpn.port).dereg_mr(&mr);
            }
            return Err(no_mem);
        }
        q.cmds.extend(extra);
        free.extend((old..size).rev());
        free.extend_from_slice(&q.free);
        q.free = free;
        for (now, new) in [(&mut q.recv, recv), (&mut q.rsp, rsp), (&mut q.data, data)] {
            let gone = std::mem::replace(now, new);
            d.dev(qpn.port).dereg_mr(&gone.1);
        }
        q.slots = size;
        self.ports[port_index(qpn.port)].cqes_used += more;
        q.staging_len = q.io_staging_len;
        q.grown = true;
        q.charged = full;
        q.host = Some(host.into());
        self.ledger.refund(unnamed(ip), had);
        self.ledger.charge(named, full);
        for r in 0..size {
            if !repost(d, qpn, q, r) {
                return Err(no_mem);
            }
        }
        Ok(())
    }

    /// A queue of `ip` stops counting as unconnected (Connect succeeded, or it went).
    pub(super) fn connected_or_gone(&mut self, ip: IpAddr) {
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }

    pub(super) fn remove_queue(&mut self, d: &mut Io<D>, qpn: QRef) {
        let Some(q) = self.queues.remove(&qpn) else {
            return;
        };
        q.alive.store(false, Ordering::Release);
        drop(self.pool.purge(q.token));
        d.dev(qpn.port).destroy_qp(qpn.qpn);
        for mr in [q.recv.1, q.rsp.1, q.data.1] {
            d.dev(qpn.port).dereg_mr(&mr);
        }
        let res = self.port_mut(qpn.port);
        res.cqes_used = res.cqes_used.saturating_sub(q.slots * CQES_PER_SLOT);
        if !q.established {
            self.leave_pre_rtu(q.peer_ip);
        } else {
            let who = Holder {
                ip: q.peer_ip,
                host: q.host.as_deref(),
                listed: false,
            };
            self.ledger.refund(who, q.charged);
            if q.cntlid.is_none() {
                self.connected_or_gone(q.peer_ip);
            }
        }
        self.core.stats.queues_dropped += 1;
        if let Some(tx) = &self.port(qpn.port).dropped {
            let _ = tx.send(qpn.qpn);
        }
        if let Some(c) = q.cntlid {
            if q.qid == 0 {
                if let Some(ctrl) = self.core.ctrls.remove(&c) {
                    tracing::info!(
                        cntlid = c,
                        host = %ctrl.hostnqn,
                        "host disconnected: controller torn down"
                    );
                    self.ctrl_died(c, &ctrl);
                    for (other, _) in ctrl.queues {
                        if other != qpn {
                            self.remove_queue(d, other);
                        }
                    }
                }
            } else if let Some(ctrl) = self.core.ctrls.get_mut(&c) {
                ctrl.queues.retain(|(x, _)| *x != qpn);
            }
        }
    }
}

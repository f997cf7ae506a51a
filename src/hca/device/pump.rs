//! The packet pump of a soft-HCA context: datagrams in (`handle_datagram`, `handle_ipv4`,
//! `handle_loopback`, `handle_timeout`), packets, deadlines and events out (`poll_transmit`,
//! `poll_timeout`, `poll_event`), and the management datagrams of QP1.

use std::net::SocketAddr;

use super::super::qp::Ctx;
use super::super::wire::{
    emit_packet, BthRepr, DethRepr, IcrcContext, Ipv4Udp, OpClass, Opcode, PacketHeaders,
    ParsedPacket, WireError, GSI_QKEY,
};
use super::{Device, IcrcCheck, GSI_QUEUE, MAD_LEN};
use crate::verbs::AsyncEvent;
use crate::verbs::VerbsError;
use crate::verbs::{Instant, Psn, Qpn};

/// Append the RoCEv2 packet that carries `mad` to QP1 (UD SEND_ONLY with the GSI Q_Key),
/// its ICRC over `icrc`, to `buf`.
pub fn emit_gsi(psn: Psn, mad: &[u8; MAD_LEN], icrc: &IcrcContext, buf: &mut Vec<u8>) {
    let mut h = PacketHeaders::new(BthRepr::new(Opcode::UD_SEND_ONLY, Qpn::GSI, psn));
    h.deth = Some(DethRepr {
        qkey: GSI_QKEY,
        src_qp: Qpn::GSI,
    });
    emit_packet(&h, mad, icrc, buf);
}

impl Device {
    /// A UDP datagram arrived from `src` (its payload, without the IP header). Malformed
    /// or unexpected input is dropped and counted; it never panics and never disturbs
    /// another QP.
    pub fn handle_datagram(&mut self, now: Instant, src: SocketAddr, data: &[u8]) {
        let assumed = IcrcContext::new(src, self.config.addr);
        let icrc = match self.config.icrc {
            IcrcCheck::Verify => Some(assumed),
            IcrcCheck::RealHeader { .. } if src.is_ipv6() => Some(assumed),
            IcrcCheck::RealHeader { .. } | IcrcCheck::Skip => None,
        };
        self.on_roce(now, src, data, icrc.as_ref(), false);
    }

    /// A UDP datagram from a loopback address: another process of this machine sent it
    /// through the kernel's loopback, memory to memory, where nothing corrupts a packet
    /// that its ICRC would catch, so it is not checked (counted as
    /// `Stats::rx_icrc_unchecked`). Checking it was about a tenth of a target's CPU at
    /// 128 KiB across processes. The sender still fills the ICRC: the wire is unchanged.
    pub fn handle_host_datagram(&mut self, now: Instant, src: SocketAddr, data: &[u8]) {
        self.on_roce(now, src, data, None, false);
    }

    /// A packet another context of this process handed over in memory (the driver's
    /// loopback path): it never crossed a wire, so its ICRC is not checked; counted as
    /// `Stats::rx_loopback`. Everything else is as for [`Device::handle_datagram`].
    pub fn handle_loopback(&mut self, now: Instant, src: SocketAddr, data: &[u8]) {
        self.on_roce(now, src, data, None, true);
    }

    /// An IPv4 datagram arrived whole, header included (a raw socket): the ICRC is checked
    /// against its real identification and DF flag (unless the mode is `Skip`). A header
    /// that is not IPv4/UDP as RoCEv2 sends it is dropped and counted as malformed.
    pub fn handle_ipv4(&mut self, now: Instant, datagram: &[u8]) {
        match Ipv4Udp::parse(datagram) {
            Ok(d) => {
                let icrc = (self.config.icrc != IcrcCheck::Skip).then_some(&d.icrc);
                self.on_roce(now, d.icrc.src, d.payload, icrc, false);
            }
            Err(_) => {
                if self.is_live() {
                    self.stats.rx_packets += 1;
                    self.stats.rx_bytes += datagram.len() as u64;
                    self.stats.rx_malformed += 1;
                }
            }
        }
    }

    /// A RoCEv2 packet (the UDP payload) from `src`; its ICRC is checked against `icrc`,
    /// or not at all when that is `None` (`loopback`: because it never left this process).
    fn on_roce(
        &mut self,
        now: Instant,
        src: SocketAddr,
        data: &[u8],
        icrc: Option<&IcrcContext>,
        loopback: bool,
    ) {
        if !self.is_live() {
            return;
        }
        self.stats.rx_packets += 1;
        self.stats.rx_bytes += data.len() as u64;
        let pkt = match ParsedPacket::parse(data, icrc) {
            Ok(p) => p,
            Err(WireError::IcrcMismatch { .. }) => {
                self.stats.rx_icrc_errors += 1;
                return;
            }
            Err(_) => {
                self.stats.rx_malformed += 1;
                return;
            }
        };
        if icrc.is_some() {
            self.stats.rx_icrc_verified += 1;
        } else if loopback {
            self.stats.rx_loopback += 1;
        } else {
            self.stats.rx_icrc_unchecked += 1;
        }
        // After the ICRC check, which covers the real UDP source port.
        let src = match self.config.peer_port {
            Some(port) => SocketAddr::new(src.ip(), port),
            None => src,
        };
        let qpn = pkt.hdrs.bth.dest_qp;
        if qpn == Qpn::GSI {
            self.on_gsi(src, &pkt);
            return;
        }
        let Some(qp) = self.qps.get_mut(&qpn) else {
            self.stats.rx_unknown_qp += 1;
            return;
        };
        if !qp.attr.state.can_receive() {
            self.stats.rx_dropped += 1;
            return;
        }
        // rxe's check_addr: the packet must come from the peer the QP is connected to. A
        // soft-HCA peer (`peer_port` None) sends from the one UDP port it is bound to, and
        // several share an IP (every process on loopback), so it is matched by its whole
        // socket address: anyone else on that IP could otherwise inject with the right PSN.
        // A RoCEv2 peer (rxe, a NIC) sends from a per-QP source port (0xC000 + hash) that we
        // cannot predict, so for those the IP is all there is to match, as rxe does; `src`
        // carries their port 4791 by now, not the one they sent from.
        let from_peer = match self.config.peer_port {
            None => qp.attr.dest == Some(src),
            Some(_) => qp.attr.dest.is_some_and(|d| d.ip() == src.ip()),
        };
        if !from_peer {
            self.stats.rx_foreign_source += 1;
            return;
        }
        let info = pkt.hdrs.bth.opcode.info();
        if matches!(info.class, OpClass::UdSend) {
            self.stats.rx_dropped += 1;
            return;
        }
        let mut ctx = ctx!(self, now);
        if info.is_request() {
            qp.on_request(&mut ctx, &pkt);
        } else {
            qp.on_response(&mut ctx, &pkt);
        }
        let (sc, rc) = (qp.send_cq, qp.recv_cq);
        self.mark_cq_if_nonempty(sc);
        self.mark_cq_if_nonempty(rc);
        self.after_qp_change(qpn, now);
    }

    /// A UD packet for QP1: keep it if it is a well-formed GSI datagram carrying one MAD.
    fn on_gsi(&mut self, src: SocketAddr, pkt: &ParsedPacket<'_>) {
        let ok = pkt.hdrs.bth.opcode == Opcode::UD_SEND_ONLY
            && pkt.hdrs.deth.is_some_and(|d| d.qkey == GSI_QKEY)
            && pkt.payload.len() == MAD_LEN;
        if !ok {
            self.stats.rx_dropped += 1;
            return;
        }
        if self.gsi_full() {
            self.stats.gsi_overflows += 1;
            return;
        }
        let mut mad = [0u8; MAD_LEN];
        mad.copy_from_slice(pkt.payload);
        self.gsi_rx.push_back((src, mad));
    }

    /// Queue a MAD for the GSI QP of the device at `dst` (what CM sends on QP1).
    pub fn post_gsi(&mut self, dst: SocketAddr, mad: &[u8; MAD_LEN]) -> Result<(), VerbsError> {
        self.live()?;
        if self.gsi_tx.len() >= GSI_QUEUE {
            return Err(VerbsError::QueueFull("GSI send"));
        }
        self.gsi_tx.push_back((dst, *mad));
        Ok(())
    }

    /// Is the queue of received MADs full, so that the next one would be dropped (counted
    /// as `Stats::gsi_overflows`)? The driver asks before it hands over a packet, to give
    /// the queue's reader a chance first (`driver::HandOff`).
    pub fn gsi_full(&self) -> bool {
        self.gsi_rx.len() >= GSI_QUEUE
    }

    /// Are received MADs waiting for [`Device::poll_gsi`]?
    pub fn gsi_pending(&self) -> bool {
        !self.gsi_rx.is_empty()
    }

    /// Next MAD received on QP1, with the address it came from.
    pub fn poll_gsi(&mut self) -> Option<(SocketAddr, [u8; MAD_LEN])> {
        let m = self.gsi_rx.pop_front();
        self.popped += m.is_some() as u64;
        m
    }

    fn gsi_transmit(&mut self, buf: &mut Vec<u8>) -> Option<SocketAddr> {
        let (dst, mad) = self.gsi_tx.pop_front()?;
        let psn = Psn::new(self.gsi_psn);
        self.gsi_psn = self.gsi_psn.wrapping_add(1);
        let start = buf.len();
        emit_gsi(psn, &mad, &IcrcContext::new(self.config.addr, dst), buf);
        self.stats.tx_packets += 1;
        self.stats.tx_bytes += (buf.len() - start) as u64;
        Some(dst)
    }

    /// Append the next packet to `buf` and say where it goes (`buf` is untouched if none).
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<SocketAddr> {
        if !self.is_live() {
            return None;
        }
        if let Some(dst) = self.gsi_transmit(buf) {
            return Some(dst);
        }
        while let Some(qpn) = self.schedule.pop_front() {
            let Some(qp) = self.qps.get_mut(&qpn) else {
                continue;
            };
            qp.scheduled = false;
            let mut ctx = ctx!(self, now);
            let dst = qp.poll_transmit(&mut ctx, buf);
            if qp.wants_transmit(now) {
                qp.scheduled = true;
                self.schedule.push_back(qpn);
            }
            let (sc, rc) = (qp.send_cq, qp.recv_cq);
            self.mark_cq_if_nonempty(sc);
            self.mark_cq_if_nonempty(rc);
            if dst.is_some() {
                return dst;
            }
        }
        None
    }

    /// The earliest time `handle_timeout` should be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if !self.is_live() {
            return None;
        }
        self.qps.values().filter_map(|q| q.poll_timeout()).min()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if !self.is_live() {
            return;
        }
        let due: Vec<Qpn> = self
            .qps
            .values()
            .filter(|q| q.poll_timeout().is_some_and(|t| t <= now))
            .map(|q| q.qpn)
            .collect();
        for qpn in due {
            if let Some(qp) = self.qps.get_mut(&qpn) {
                let mut ctx = ctx!(self, now);
                qp.handle_timeout(&mut ctx);
            }
            self.after_qp_change(qpn, now);
        }
    }

    /// A count that grows whenever an async event or a MAD arrives: the driver wakes
    /// consumers when it changes (an edge, so an unread event does not keep waking them).
    pub fn activity(&self) -> u64 {
        self.popped + (self.events.len() + self.gsi_rx.len()) as u64
    }

    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        let e = self.events.pop_front();
        self.popped += e.is_some() as u64;
        e
    }
}

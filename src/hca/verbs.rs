//! The data-path verbs both backends offer: the soft-HCA's [`Device`] and, with feature `hw`,
//! `hw::verbs::HwVerbs` over a kernel RDMA device. Object creation and connection stay
//! backend-specific (memory is `HostMem` here, pinned pointers there); posting, completions and
//! async events are the same calls with the same types, and [`conformance`] checks both
//! backends with one set of assertions.

use super::cq::{CqId, WcOpcode, WcStatus, WorkCompletion};
use super::device::{Device, VerbsError};
use super::qp::{RecvWr, SendOp, SendWr, Sgl};
use super::types::{Instant, MemKey, Qpn};
use super::AsyncEvent;

/// Posting, reaping and events: what an RC consumer does once its QPs are connected.
pub trait Verbs {
    type Error: std::error::Error + Send + Sync + 'static;
    /// Post a send-queue work request. `now` is the soft-HCA's clock (it is sans-I/O); a
    /// hardware device keeps its own time and ignores it.
    fn post_send(&mut self, now: Instant, qpn: Qpn, wr: SendWr) -> Result<(), Self::Error>;
    fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<(), Self::Error>;
    /// Append up to `max` completions of `cq` to `out`; returns how many.
    fn poll_cq(
        &mut self,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, Self::Error>;
    fn poll_event(&mut self) -> Option<AsyncEvent>;
}

impl Verbs for Device {
    type Error = VerbsError;
    fn post_send(&mut self, now: Instant, qpn: Qpn, wr: SendWr) -> Result<(), VerbsError> {
        Device::post_send(self, now, qpn, wr)
    }
    fn post_recv(&mut self, qpn: Qpn, wr: RecvWr) -> Result<(), VerbsError> {
        Device::post_recv(self, qpn, wr)
    }
    fn poll_cq(
        &mut self,
        cq: CqId,
        max: usize,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<usize, VerbsError> {
        Ok(Device::poll_cq(self, cq, max, out))
    }
    fn poll_event(&mut self) -> Option<AsyncEvent> {
        Device::poll_event(self)
    }
}

/// One connected end as [`conformance`] sees it: QP, CQ and a registered buffer of `len`
/// bytes at `addr` (an address the backend's SGEs and RDMA use).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndInfo {
    pub qpn: Qpn,
    pub cq: CqId,
    pub addr: u64,
    pub len: usize,
    pub lkey: MemKey,
    pub rkey: MemKey,
}

/// Two connected RC ends (0 and 1) and the world they live in.
pub trait VerbsPair {
    type V: Verbs;
    fn end(&self, side: usize) -> EndInfo;
    fn dev(&mut self, side: usize) -> &mut Self::V;
    fn now(&self) -> Instant;
    fn write_buf(&mut self, side: usize, off: usize, data: &[u8]);
    fn read_buf(&mut self, side: usize, off: usize, len: usize) -> Vec<u8>;
    /// Let time pass (step a simulator, or sleep a little); false once the budget is spent.
    fn progress(&mut self) -> bool;
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn wait_wc<P: VerbsPair>(p: &mut P, side: usize, what: &str) -> Result<WorkCompletion, String> {
    let cq = p.end(side).cq;
    let mut out = Vec::new();
    loop {
        p.dev(side)
            .poll_cq(cq, 1, &mut out)
            .map_err(|e| format!("{what}: poll_cq: {e}"))?;
        if let Some(wc) = out.pop() {
            return Ok(wc);
        }
        if !p.progress() {
            return Err(format!("{what}: no completion on side {side}"));
        }
    }
}

fn expect(
    wc: &WorkCompletion,
    wr_id: u64,
    status: WcStatus,
    op: WcOpcode,
    what: &str,
) -> Result<(), String> {
    if wc.wr_id != wr_id || wc.status != status || (status == WcStatus::Success && wc.opcode != op)
    {
        return Err(format!(
            "{what}: got wr_id {:#x} {:?} {:?}, want {wr_id:#x} {status:?} {op:?}",
            wc.wr_id, wc.status, wc.opcode
        ));
    }
    Ok(())
}

fn send<P: VerbsPair>(p: &mut P, side: usize, wr: SendWr, what: &str) -> Result<(), String> {
    let (now, qpn) = (p.now(), p.end(side).qpn);
    p.dev(side)
        .post_send(now, qpn, wr)
        .map_err(|e| format!("{what}: post_send: {e}"))
}

/// The same checks for every backend: SEND/RECV, RDMA WRITE, WRITE with immediate, RDMA READ
/// (bytes and completion fields), then a WRITE with a bad rkey failing with a remote access
/// error (which moves the QP to ERR: run it last). Needs 96 KiB buffers on both ends.
pub fn conformance<P: VerbsPair>(p: &mut P) -> Result<(), String> {
    let (a, b) = (p.end(0), p.end(1));
    if a.len < 96 * 1024 || b.len < 96 * 1024 {
        return Err("conformance needs 96 KiB buffers".into());
    }
    let sgl =
        |e: &EndInfo, off: usize, len: usize| Sgl::one(e.addr + off as u64, len as u32, e.lkey);
    let wr = |wr_id, op, sgl| SendWr::signaled(wr_id, op, sgl);

    // SEND -> RECV
    let msg = pattern(1000, 1);
    p.write_buf(0, 0, &msg);
    p.dev(1)
        .post_recv(
            b.qpn,
            RecvWr {
                wr_id: 0x11,
                sgl: sgl(&b, 0, 4096),
            },
        )
        .map_err(|e| format!("post_recv: {e}"))?;
    send(p, 0, wr(0x12, SendOp::Send, sgl(&a, 0, msg.len())), "SEND")?;
    let wc = wait_wc(p, 0, "SEND")?;
    expect(
        &wc,
        0x12,
        WcStatus::Success,
        WcOpcode::Send,
        "SEND completion",
    )?;
    let wc = wait_wc(p, 1, "RECV")?;
    expect(
        &wc,
        0x11,
        WcStatus::Success,
        WcOpcode::Recv,
        "RECV completion",
    )?;
    if wc.byte_len != msg.len() as u32 || wc.qpn != b.qpn {
        return Err(format!(
            "RECV: byte_len {} qpn {}, want {} {}",
            wc.byte_len,
            wc.qpn,
            msg.len(),
            b.qpn
        ));
    }
    if p.read_buf(1, 0, msg.len()) != msg {
        return Err("RECV: payload differs".into());
    }

    // RDMA WRITE
    let data = pattern(8192, 2);
    p.write_buf(0, 8192, &data);
    let op = SendOp::Write {
        remote_addr: b.addr + 16384,
        rkey: b.rkey,
    };
    send(p, 0, wr(0x21, op, sgl(&a, 8192, data.len())), "WRITE")?;
    let wc = wait_wc(p, 0, "WRITE")?;
    expect(
        &wc,
        0x21,
        WcStatus::Success,
        WcOpcode::RdmaWrite,
        "WRITE completion",
    )?;
    if p.read_buf(1, 16384, data.len()) != data {
        return Err("WRITE: remote bytes differ".into());
    }

    // RDMA WRITE with immediate: data placed, immediate delivered with a receive
    let small = pattern(100, 3);
    p.write_buf(0, 4096, &small);
    p.dev(1)
        .post_recv(
            b.qpn,
            RecvWr {
                wr_id: 0x31,
                sgl: Sgl::empty(),
            },
        )
        .map_err(|e| format!("post_recv: {e}"))?;
    let op = SendOp::WriteWithImm {
        remote_addr: b.addr + 32768,
        rkey: b.rkey,
        imm: 0xdead_beef,
    };
    send(p, 0, wr(0x32, op, sgl(&a, 4096, small.len())), "WRITE_IMM")?;
    let wc = wait_wc(p, 0, "WRITE_IMM")?;
    expect(
        &wc,
        0x32,
        WcStatus::Success,
        WcOpcode::RdmaWrite,
        "WRITE_IMM completion",
    )?;
    let wc = wait_wc(p, 1, "WRITE_IMM receive")?;
    expect(
        &wc,
        0x31,
        WcStatus::Success,
        WcOpcode::RecvRdmaWithImm,
        "WRITE_IMM receive",
    )?;
    if wc.imm != Some(0xdead_beef) {
        return Err(format!("WRITE_IMM: imm {:?}", wc.imm));
    }
    if p.read_buf(1, 32768, small.len()) != small {
        return Err("WRITE_IMM: remote bytes differ".into());
    }

    // RDMA READ of what the WRITE put there
    let op = SendOp::Read {
        remote_addr: b.addr + 16384,
        rkey: b.rkey,
    };
    send(p, 0, wr(0x41, op, sgl(&a, 65536, 4096)), "READ")?;
    let wc = wait_wc(p, 0, "READ")?;
    expect(
        &wc,
        0x41,
        WcStatus::Success,
        WcOpcode::RdmaRead,
        "READ completion",
    )?;
    if p.read_buf(0, 65536, 4096) != data[..4096] {
        return Err("READ: local bytes differ".into());
    }

    // a bad rkey: remote access error on the requester
    let op = SendOp::Write {
        remote_addr: b.addr,
        rkey: MemKey(b.rkey.0 ^ 0x00ff_0000),
    };
    send(p, 0, wr(0x51, op, sgl(&a, 0, 64)), "bad WRITE")?;
    let wc = wait_wc(p, 0, "bad WRITE")?;
    expect(
        &wc,
        0x51,
        WcStatus::RemAccessErr,
        WcOpcode::RdmaWrite,
        "bad rkey",
    )?;
    Ok(())
}

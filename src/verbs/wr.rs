//! Work requests (ibv_send_wr, ibv_recv_wr) with their scatter/gather lists, stored inline so
//! that posting never allocates, and what a QP is created and connected with (MTU, capacities).

use super::{MemKey, WcOpcode};

/// Scatter/gather entries per work request. Fixed so a work request never allocates.
pub const MAX_SGE: usize = 4;

/// One scatter/gather element: `len` bytes at `addr` under local key `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: MemKey,
}

/// A scatter/gather list of up to [`MAX_SGE`] entries, stored inline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sgl {
    n: u8,
    sges: [Sge; MAX_SGE],
}

impl Sgl {
    pub fn new(sges: &[Sge]) -> Option<Sgl> {
        if sges.len() > MAX_SGE {
            return None;
        }
        let mut s = Sgl::default();
        s.sges[..sges.len()].copy_from_slice(sges);
        s.n = sges.len() as u8;
        Some(s)
    }
    pub fn one(addr: u64, len: u32, lkey: MemKey) -> Sgl {
        let mut s = Sgl::default();
        s.sges[0] = Sge { addr, len, lkey };
        s.n = 1;
        s
    }
    pub fn empty() -> Sgl {
        Sgl::default()
    }
    pub fn entries(&self) -> &[Sge] {
        &self.sges[..self.n as usize]
    }
    pub fn total_len(&self) -> u64 {
        self.entries().iter().map(|s| s.len as u64).sum()
    }
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    Send,
    SendWithImm(u32),
    SendWithInv(MemKey),
    Write {
        remote_addr: u64,
        rkey: MemKey,
    },
    WriteWithImm {
        remote_addr: u64,
        rkey: MemKey,
        imm: u32,
    },
    Read {
        remote_addr: u64,
        rkey: MemKey,
    },
}

impl SendOp {
    /// The opcode of this operation's completion.
    pub fn wc_opcode(self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) => WcOpcode::Send,
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
        }
    }
    pub(crate) fn is_read(self) -> bool {
        matches!(self, SendOp::Read { .. })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: SendOp,
    pub sgl: Sgl,
    /// Produce a completion on success (errors always complete).
    pub signaled: bool,
    pub solicited: bool,
}

impl SendWr {
    /// A request that completes on success too, not solicited: what most posters want.
    pub fn signaled(wr_id: u64, op: SendOp, sgl: Sgl) -> SendWr {
        SendWr {
            wr_id,
            op,
            sgl,
            signaled: true,
            solicited: false,
        }
    }

    /// The same without a completion on success (errors still complete).
    pub fn unsignaled(wr_id: u64, op: SendOp, sgl: Sgl) -> SendWr {
        SendWr {
            signaled: false,
            ..SendWr::signaled(wr_id, op, sgl)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sgl: Sgl,
}

/// IB path MTU: the payload bytes of a full packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    Mtu256,
    Mtu512,
    Mtu1024,
    Mtu2048,
    Mtu4096,
}

impl Mtu {
    pub fn bytes(self) -> u32 {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
        }
    }
    pub fn from_bytes(b: u32) -> Option<Mtu> {
        Some(match b {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }
    /// The IBA enum value (1 = 256 … 5 = 4096), as carried in CM messages.
    pub fn ib_enum(self) -> u8 {
        self as u8 + 1
    }
}

/// QP capacities fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
        }
    }
}

//! The soft-HCA: a software RDMA device speaking RoCEv2.

pub mod types;
pub mod wire;

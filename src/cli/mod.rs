//! What the command-line front ends share: option parsing and validation common to the
//! `nvmf-rdma` binary and the fio plugin, the JSON writer of `-o json`, and the metrics
//! HTTP endpoint.

pub mod args;
pub mod device;
pub mod host;
pub mod metrics_http;
pub mod support;
pub mod target;
pub mod units;
pub mod wire_json;

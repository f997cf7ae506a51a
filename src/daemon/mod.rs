//! The daemon as a library: the registry that owns controllers, their recovery and their
//! exports ([`Daemon`]), `discovery.conf` ([`config`]), the control protocol's typed requests
//! and answers ([`proto`], `docs/control-protocol.md`), its socket server and a typed client
//! ([`client`]), the run directory's controllers wherever they are held ([`local`]), its lock
//! ([`pid_lock`]), and a controller held by a process of its own ([`foreground`]). The
//! `nvmf-rdma` binary is one front end over it: it parses flags, forwards signals, prints,
//! and writes the log.

mod answers;
pub mod client;
mod client_io;
pub mod config;
mod connect_all;
pub mod control;
pub mod exports;
pub mod fdpass;
pub mod foreground;
pub mod io;
pub mod local;
pub mod pid_lock;
pub mod proto;
mod registry;
mod server;
mod service;
pub mod stop;
pub mod usage;
mod watch;

use std::sync::Arc;

pub use registry::DaemonConfig;
pub use server::{Signal, CLIENT_TIMEOUT};
pub use service::Daemon;

/// Where a daemon's log lines and its service status go (the process's log file or
/// journal, and systemd's notify socket; a test's buffer).
pub trait Reporter: Send + Sync + 'static {
    /// One line of the log.
    fn say(&self, line: &str);
    /// A state for the service manager, as sd_notify takes it (`READY=1`, `STATUS=...`,
    /// `STOPPING=1`).
    fn notify(&self, _state: &str) {}
}

/// A shared [`Reporter`].
pub type Report = Arc<dyn Reporter>;

/// Lines on stdout (what `connect --foreground` prints).
pub struct Stdout;

impl Reporter for Stdout {
    fn say(&self, line: &str) {
        println!("{line}");
    }
}

/// A line to a [`Report`], formatted.
macro_rules! say {
    ($r:expr, $($t:tt)*) => {
        $r.say(&format!($($t)*))
    };
}
pub(crate) use say;

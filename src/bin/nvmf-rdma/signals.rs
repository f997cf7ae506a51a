//! Stop and reload signals, registered once: a signal that arrives while the process is
//! busy elsewhere waits here and is never lost.

use anyhow::{Context, Result};
use nvmf_rdma::daemon::Signal;

/// SIGINT, SIGTERM and SIGHUP.
pub(crate) struct StopSignals {
    pub(crate) int: tokio::signal::unix::Signal,
    pub(crate) term: tokio::signal::unix::Signal,
    pub(crate) hup: tokio::signal::unix::Signal,
}

impl StopSignals {
    pub(crate) fn new() -> Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        let reg = |k| signal(k).context("cannot install signal handlers");
        Ok(StopSignals {
            int: reg(SignalKind::interrupt())?,
            term: reg(SignalKind::terminate())?,
            hup: reg(SignalKind::hangup())?,
        })
    }

    /// The next stop signal's name.
    pub(crate) async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
            _ = self.hup.recv() => "SIGHUP",
        }
    }

    /// The next signal as the daemon takes it: SIGHUP reloads its config file.
    pub(crate) async fn recv_daemon(&mut self) -> Signal {
        tokio::select! {
            _ = self.int.recv() => Signal::Stop("SIGINT"),
            _ = self.term.recv() => Signal::Stop("SIGTERM"),
            _ = self.hup.recv() => Signal::Reload,
        }
    }
}

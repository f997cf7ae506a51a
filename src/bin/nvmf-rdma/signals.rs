//! Stop and reload signals, registered once: a signal that arrives while the process is
//! busy elsewhere waits here and is never lost.

use anyhow::{Context, Result};

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

    /// Every signal from now on into a channel, as `pick` names it, until the receiver goes.
    pub(crate) fn forward<T: Send + 'static>(
        mut self,
        pick: fn(&'static str) -> T,
    ) -> tokio::sync::mpsc::Receiver<T> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move { while tx.send(pick(self.recv().await)).await.is_ok() {} });
        rx
    }
}

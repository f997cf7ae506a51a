//! One timer for a task's life that only ever moves earlier.
//!
//! The device driver and each host queue task wait on "the next deadline", which changes
//! nearly every turn and mostly slides later (an ACK's, a retransmit timer's, the oldest
//! command's). Making a tokio sleep per turn costs a registration in the runtime's timer
//! wheel and its removal for every completion, and moving a timer earlier wakes tokio's time
//! driver (a syscall). So the timer is moved only when a deadline is earlier than the one it
//! is set to; when the deadline moved later it fires early, once, the owner finds nothing
//! due, and arms it again. An early fire is harmless by contract: owners check their own
//! deadlines against their own clock when it fires.
//!
//! No heap: the sleep lives inside the value, which the owner pins on its stack.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

pin_project_lite::pin_project! {
    /// A timer armed with [`EarliestTimer::arm`]; as a future it is ready once per arming,
    /// at or after the earliest instant it was armed for since it last fired, and never
    /// ready while disarmed.
    pub struct EarliestTimer {
        #[pin]
        sleep: Sleep,
        armed: Option<Instant>,
    }
}

impl Default for EarliestTimer {
    fn default() -> Self {
        Self::new()
    }
}

impl EarliestTimer {
    /// A disarmed timer.
    pub fn new() -> Self {
        EarliestTimer {
            // Any instant will do: it is not polled until armed.
            sleep: tokio::time::sleep(Duration::from_secs(3600)),
            armed: None,
        }
    }

    /// Fire at `at` unless already armed for an earlier instant.
    pub fn arm(self: Pin<&mut Self>, at: Instant) {
        let this = self.project();
        if this.armed.is_none_or(|a| at < a) {
            this.sleep.reset(at);
            *this.armed = Some(at);
        }
    }

    /// The instant it will fire at, if armed.
    pub fn armed(&self) -> Option<Instant> {
        self.armed
    }
}

impl Future for EarliestTimer {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.armed.is_none() {
            // Nothing registers a wakeup: only the owner arms it, and it polls again after.
            return Poll::Pending;
        }
        match this.sleep.poll(cx) {
            Poll::Ready(()) => {
                *this.armed = None;
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;

    /// Poll once: is it ready now?
    async fn ready_now(t: &mut Pin<&mut EarliestTimer>) -> bool {
        poll_fn(|cx| Poll::Ready(t.as_mut().poll(cx).is_ready())).await
    }

    #[tokio::test(start_paused = true)]
    async fn disarmed_never_fires() {
        let t = EarliestTimer::new();
        tokio::pin!(t);
        tokio::time::advance(Duration::from_secs(7200)).await;
        assert!(!ready_now(&mut t).await);
        assert_eq!(t.armed(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn moves_earlier_only_and_fires_once_per_arming() {
        let t = EarliestTimer::new();
        tokio::pin!(t);
        let start = Instant::now();
        t.as_mut().arm(start + Duration::from_millis(50));
        // Later: ignored. Earlier: taken.
        t.as_mut().arm(start + Duration::from_millis(80));
        assert_eq!(t.armed(), Some(start + Duration::from_millis(50)));
        t.as_mut().arm(start + Duration::from_millis(20));
        assert_eq!(t.armed(), Some(start + Duration::from_millis(20)));

        tokio::time::advance(Duration::from_millis(19)).await;
        assert!(!ready_now(&mut t).await);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(ready_now(&mut t).await);
        // Fired: disarmed, and not ready again until armed again.
        assert_eq!(t.armed(), None);
        assert!(!ready_now(&mut t).await);

        // After firing, a later instant is taken.
        t.as_mut().arm(start + Duration::from_millis(80));
        assert_eq!(t.armed(), Some(start + Duration::from_millis(80)));
        (&mut t).await;
        assert_eq!(Instant::now(), start + Duration::from_millis(80));
    }
}

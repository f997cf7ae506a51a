//! The one entry of recovery: a bounded queue of typed reports, allocated at connect, that
//! every cause reports to and the executor ([`super::recovery`]) takes from.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;

use crate::cm::ConnId;
use crate::reconnect::{Cause, Event};

/// Reports an [`Inbox`] holds. Equal reports are merged (see [`Inbox::report_in`]), so the
/// distinct ones that can be pending at once (a failure per cause, the device's last word,
/// a keep-alive answer) stay well below this; one more is dropped and counted.
const INBOX_LEN: usize = 32;

/// One report: an event, and the connection it is about (its epoch), if it is about one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Report {
    epoch: Option<u32>,
    ev: Event,
}

struct Pending {
    ring: [Option<Report>; INBOX_LEN],
    head: usize,
    len: usize,
    /// The CM connection of each queue (admin first) on the current connection: whose
    /// disconnects count.
    conns: Box<[Option<ConnId>]>,
    /// Delete was taken by the executor.
    delete_taken: bool,
    dropped: u64,
}

impl Pending {
    fn iter(&self) -> impl Iterator<Item = (usize, Report)> + '_ {
        (0..self.len).filter_map(|k| {
            let i = (self.head + k) % INBOX_LEN;
            self.ring[i].map(|r| (i, r))
        })
    }

    fn push_back(&mut self, r: Report) -> bool {
        if self.len == INBOX_LEN {
            self.dropped += 1;
            return false;
        }
        self.ring[(self.head + self.len) % INBOX_LEN] = Some(r);
        self.len += 1;
        true
    }

    fn pop_front(&mut self) -> Option<Report> {
        while self.len > 0 {
            let r = self.ring[self.head].take();
            self.head = (self.head + 1) % INBOX_LEN;
            self.len -= 1;
            if r.is_some() {
                return r;
            }
        }
        None
    }

    /// Keep only what `keep` accepts, in order.
    fn retain(&mut self, keep: impl Fn(&Report) -> bool) {
        let n = self.len;
        for _ in 0..n {
            if let Some(r) = self.pop_front() {
                if keep(&r) {
                    self.push_back(r);
                }
            }
        }
    }
}

/// The one entry of recovery: every cause reports here, as a typed [`Event`], and the
/// controller's supervisor takes the reports in order. Bounded and allocated once.
///
/// Reports about a connection carry its epoch. Recovery starts a new epoch when it drops the
/// HCA resources, so what another queue of the old connection still reports (the same reset
/// seen by several queues at once, on other threads) is dropped instead of breaking the new
/// connection a second time. Device events and delete are about no connection.
pub(super) struct Inbox {
    pending: Mutex<Pending>,
    epoch: AtomicU32,
    /// Deletion was asked for: a state, not a report, so that it is never lost to a full
    /// queue and an attempt under way can see it.
    deleting: AtomicBool,
    /// Wakes the executor on each report.
    pub(super) wake: Notify,
    /// Wakes everyone waiting for deletion.
    delete: Notify,
}

impl Inbox {
    /// The entry of a controller with `queues` queues, admin included.
    pub(super) fn new(queues: usize) -> Inbox {
        Inbox {
            pending: Mutex::new(Pending {
                ring: [None; INBOX_LEN],
                head: 0,
                len: 0,
                conns: vec![None; queues].into_boxed_slice(),
                delete_taken: false,
                dropped: 0,
            }),
            epoch: AtomicU32::new(0),
            deleting: AtomicBool::new(false),
            wake: Notify::new(),
            delete: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current connection epoch; a queue stamps its reports with the epoch it attached in.
    pub(super) fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Start a new epoch: whatever the old connection still reports is stale.
    pub(super) fn new_epoch(&self) -> u32 {
        let mut p = self.lock();
        let e = self.epoch.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
        p.conns.iter_mut().for_each(|c| *c = None);
        p.retain(|r| r.epoch.is_none_or(|x| x == e));
        e
    }

    /// Report `ev`, about no connection in particular (the device list, the user).
    pub(super) fn report(&self, ev: Event) {
        self.push(Report { epoch: None, ev });
    }

    /// Report `ev`, seen on the connection of `epoch`: dropped if that connection is gone.
    /// A failure already pending for the connection is not reported twice (the first cause
    /// is the one recovery names); a device event moves behind the others, so that the
    /// device's last word is the one taken last.
    pub(super) fn report_in(&self, epoch: u32, ev: Event) {
        self.push(Report {
            epoch: Some(epoch),
            ev,
        });
    }

    fn push(&self, r: Report) {
        {
            let mut p = self.lock();
            if r.epoch.is_some_and(|e| e != self.epoch()) {
                return;
            }
            let same = |x: &Report| match (x.ev, r.ev) {
                (Event::Failed(_), Event::Failed(_)) => x.epoch == r.epoch,
                _ => *x == r,
            };
            let device = matches!(r.ev, Event::DeviceUp(_) | Event::DeviceDown { .. });
            if device {
                p.retain(|x| !same(x));
            } else if p.iter().any(|(_, x)| same(&x)) {
                return;
            }
            p.push_back(r);
        }
        self.wake.notify_one();
    }

    /// [`Event::Delete`], once, when deletion was asked for: it goes before every report.
    pub(super) fn pop_delete(&self) -> Option<Event> {
        let mut p = self.lock();
        if self.delete_requested() && !p.delete_taken {
            p.delete_taken = true;
            return Some(Event::Delete);
        }
        None
    }

    /// The next report for the executor, in the order they came.
    pub(super) fn pop(&self) -> Option<Event> {
        let mut p = self.lock();
        let epoch = self.epoch();
        while let Some(r) = p.pop_front() {
            if r.epoch.is_none_or(|e| e == epoch) {
                return Some(r.ev);
            }
        }
        None
    }

    /// Reports dropped because the queue was full.
    pub(super) fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// Queue `qi` is connected through CM connection `id`: its disconnect is a failure.
    pub(super) fn connected(&self, qi: usize, id: ConnId) {
        if let Some(c) = self.lock().conns.get_mut(qi) {
            *c = Some(id);
        }
    }

    /// The connection manager says `id` was torn down by the peer or the fabric.
    pub(super) fn disconnected(&self, id: ConnId) {
        let current = self.lock().conns.contains(&Some(id));
        if current {
            self.report_in(self.epoch(), Event::Failed(Cause::CmDisconnect));
        }
    }

    pub(super) fn request_delete(&self) {
        self.deleting.store(true, Ordering::SeqCst);
        self.wake.notify_one();
        // Every registered waiter (an attempt's, a bring-up's): a single permit could go to
        // one that is no longer polled. A waiter not registered yet sees the flag when it
        // registers.
        self.delete.notify_waiters();
    }

    pub(super) fn delete_requested(&self) -> bool {
        self.deleting.load(Ordering::SeqCst)
    }

    /// Resolves once deletion has been asked for (at once if it already was).
    pub(super) async fn deleted(&self) {
        loop {
            let n = self.delete.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.delete_requested() {
                return;
            }
            n.await;
        }
    }

    /// Resolves with the first failure reported on the current connection. Bring-up, which
    /// runs before the executor, ends on it; what was reported before it is passed over
    /// (the executor looks at the device list itself when it starts).
    pub(super) async fn failed(&self) -> Cause {
        loop {
            let n = self.wake.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some(c) = self.take_failure() {
                return c;
            }
            n.await;
        }
    }

    fn take_failure(&self) -> Option<Cause> {
        let mut p = self.lock();
        let epoch = self.epoch();
        while let Some(r) = p.pop_front() {
            match r.ev {
                Event::Failed(c) if r.epoch.is_none_or(|e| e == epoch) => return Some(c),
                _ => {}
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconnect::Identity;
    use crate::verbs::{Guid, PciAddr};

    fn id(n: u8) -> Identity {
        Identity {
            guid: Guid::from_mac([2, 0, 0, 0, 0, n]),
            pci: PciAddr::new(0, n, 0, 0),
        }
    }

    fn drain(i: &Inbox) -> Vec<Event> {
        std::iter::from_fn(|| i.pop()).collect()
    }

    #[test]
    fn a_report_from_the_old_connection_does_not_break_the_new_one() {
        let i = Inbox::new(2);
        let old = i.epoch();
        i.report_in(old, Event::Failed(Cause::DeviceFatal));
        assert_eq!(i.pop(), Some(Event::Failed(Cause::DeviceFatal)));
        // A second queue of the same connection saw the same reset, after it was taken.
        i.report_in(old, Event::Failed(Cause::DeviceFatal));
        // Recovery drops the resources: a new epoch. The late report is stale.
        let new = i.new_epoch();
        assert_ne!(new, old);
        assert_eq!(i.pop(), None);
        // One reported now is about the new connection; a stale one is not taken.
        i.report_in(new, Event::Failed(Cause::CmDisconnect));
        i.report_in(old, Event::Failed(Cause::Transport));
        i.report_in(new, Event::Failed(Cause::IoTimeout));
        assert_eq!(
            drain(&i),
            [Event::Failed(Cause::CmDisconnect)],
            "the first failure of a connection is the one taken"
        );
    }

    #[test]
    fn device_events_outlive_the_connection_and_the_last_word_is_taken_last() {
        let i = Inbox::new(2);
        i.report(Event::DeviceDown { removed: true });
        i.report(Event::DeviceUp(id(1)));
        i.report(Event::DeviceDown { removed: true });
        i.new_epoch();
        assert_eq!(
            drain(&i),
            [Event::DeviceUp(id(1)), Event::DeviceDown { removed: true }]
        );
    }

    #[test]
    fn delete_goes_first_once_and_wakes_a_waiter() {
        let i = Inbox::new(2);
        i.report(Event::DeviceUp(id(1)));
        assert_eq!(i.pop_delete(), None);
        i.request_delete();
        assert_eq!(i.pop_delete(), Some(Event::Delete));
        assert_eq!(i.pop_delete(), None);
        assert_eq!(i.pop(), Some(Event::DeviceUp(id(1))));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(i.deleted());
    }

    #[test]
    fn only_the_current_connections_disconnects_count() {
        let i = Inbox::new(2);
        let (a, b) = (ConnId(7), ConnId(8));
        i.connected(0, a);
        i.disconnected(b);
        assert_eq!(i.pop(), None);
        i.disconnected(a);
        assert_eq!(i.pop(), Some(Event::Failed(Cause::CmDisconnect)));
        i.new_epoch();
        i.disconnected(a);
        assert_eq!(i.pop(), None, "the old connection's disconnect is stale");
    }

    #[test]
    fn the_inbox_is_bounded_and_counts_what_it_drops() {
        let i = Inbox::new(1);
        for n in 0..INBOX_LEN as u8 + 8 {
            i.report(Event::DeviceUp(id(n)));
        }
        assert_eq!(i.dropped(), 8);
        assert_eq!(drain(&i).len(), INBOX_LEN);
    }
}

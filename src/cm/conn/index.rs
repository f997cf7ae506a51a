//! The endpoint's lookups: connections by the peer's comm ID (duplicate REQs, timeout REJs),
//! by the peer's QPN (stale connections) and by deadline (timers), kept in step with the
//! connection table by one function, [`CmEndpoint::sync`].

use super::*;

impl CmEndpoint {
    /// Add a connection and index it.
    pub(super) fn insert_conn(&mut self, key: u32, conn: Conn) {
        if let Some(old) = self.conns.insert(key, conn) {
            // `alloc_id` never returns a key in use; should that change, the old
            // connection's entries must not linger.
            self.unindex(key, old.indexed);
        }
        if let Some(c) = self.conns.get_mut(&key) {
            c.indexed = IndexKeys::default();
        }
        self.sync(key);
    }

    /// Forget a connection and its index entries.
    pub(super) fn remove_conn(&mut self, key: u32) {
        if let Some(c) = self.conns.remove(&key) {
            self.unindex(key, c.indexed);
        }
    }

    /// Bring the indexes up to date with connection `key` after its peer IDs or deadline
    /// changed (nothing to do if it is gone: `remove_conn` took its entries).
    pub(super) fn sync(&mut self, key: u32) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        let (old, new) = (c.indexed, c.index_keys());
        if old == new {
            return;
        }
        c.indexed = new;
        self.unindex(key, old);
        if let Some((ip, g, v)) = new.remote {
            self.by_remote.insert((ip, g, v, key));
        }
        if let Some((ip, g, v)) = new.qpn {
            self.by_qpn.insert((ip, g, v, key));
        }
        if let Some(t) = new.deadline {
            self.timers.insert((t, key));
        }
    }

    pub(super) fn unindex(&mut self, key: u32, k: IndexKeys) {
        if let Some((ip, g, v)) = k.remote {
            self.by_remote.remove(&(ip, g, v, key));
        }
        if let Some((ip, g, v)) = k.qpn {
            self.by_qpn.remove(&(ip, g, v, key));
        }
        if let Some(t) = k.deadline {
            self.timers.remove(&(t, key));
        }
    }

    /// The indexes hold exactly what the connections say (checked in debug builds after
    /// every input and command).
    pub(super) fn indexes_consistent(&self) -> bool {
        let keys = || self.conns.iter().map(|(&k, c)| (k, c.index_keys()));
        let remote: BTreeSet<_> = keys()
            .filter_map(|(k, i)| i.remote.map(|(a, b, c)| (a, b, c, k)))
            .collect();
        let qpn: BTreeSet<_> = keys()
            .filter_map(|(k, i)| i.qpn.map(|(a, b, c)| (a, b, c, k)))
            .collect();
        let timers: BTreeSet<_> = keys()
            .filter_map(|(k, i)| i.deadline.map(|t| (t, k)))
            .collect();
        remote == self.by_remote && qpn == self.by_qpn && timers == self.timers
    }
}

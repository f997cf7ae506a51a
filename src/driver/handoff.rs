//! Bounded queues between the driver's tasks: the device's queue of received MADs (read by
//! the CM's pump) and the listener's backlog of connection requests (read by the target).
//! A producer that finds the queue full yields, so that its reader, a task of the same
//! runtime, drains it before anything is dropped; only a reader that drained nothing in a
//! few yields is behind, and what comes next overflows (counted) until the queue has room
//! again.
//!
//! Why: a producer that does not yield runs on while its reader waits for the thread. A
//! driver that is not busy polling takes batch after batch off a socket a burst filled,
//! with no await between them that yields (the socket stays readable), so a flood of CM
//! REQs would overflow the MAD queue (256) before the CM saw the first, whatever room the
//! socket buffer (16 MiB) still had; and a pump that took those MADs all at once would
//! overflow the listener's backlog (128) before the target took the first request.

/// One producer's side of one bounded queue (see the module's text).
#[derive(Debug, Default)]
pub(crate) struct HandOff {
    /// Yields so far while the queue stayed full.
    yielded: u32,
    /// Times the producer yielded for a full queue.
    pub(crate) waits: u64,
}

impl HandOff {
    /// Yields a producer gives a full queue's reader before it counts it as behind. More
    /// than one: the reader may itself wait for its own reader (the CM's pump for the
    /// listener), and on a one-thread runtime each yield lets every ready task run once.
    pub(crate) const PATIENCE: u32 = 4;

    /// Should the producer yield before it hands over the next item? `full`: the queue has
    /// no room for it. True for the first [`HandOff::PATIENCE`] asks of a stretch of
    /// fullness; after that the item goes in (and overflows), so a reader that stopped
    /// reading cannot stall the producer.
    pub(crate) fn wait(&mut self, full: bool) -> bool {
        if !full {
            self.yielded = 0;
            return false;
        }
        if self.yielded >= Self::PATIENCE {
            return false;
        }
        self.yielded += 1;
        self.waits += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_waits_a_few_times_per_stretch_of_fullness() {
        let mut h = HandOff::default();
        assert!(!h.wait(false));
        // Full: a few waits; still full after them, the reader is behind: no more.
        for _ in 0..HandOff::PATIENCE {
            assert!(h.wait(true));
        }
        assert!(!h.wait(true));
        assert!(!h.wait(true));
        // Room again, then full again: a new chance for the reader.
        assert!(!h.wait(false));
        assert!(h.wait(true));
        assert_eq!(h.waits, u64::from(HandOff::PATIENCE) + 1);
    }
}

//! Completion queues and work completions. A completion's status is data, not an `Err`: the
//! consumer decides what a flushed or failed request means.

use crate::verbs::WorkCompletion;
use std::collections::VecDeque;

pub(crate) struct Cq {
    pub entries: VecDeque<WorkCompletion>,
    pub capacity: usize,
    pub overflowed: bool,
}

impl Cq {
    pub fn new(capacity: usize) -> Cq {
        Cq {
            entries: VecDeque::with_capacity(capacity),
            capacity,
            overflowed: false,
        }
    }

    /// Queue a completion. Returns false on overflow, which the device reports as a CQ error
    /// event; the entry is lost, as on hardware.
    pub fn push(&mut self, wc: WorkCompletion) -> bool {
        if self.entries.len() >= self.capacity {
            self.overflowed = true;
            return false;
        }
        self.entries.push_back(wc);
        true
    }
}

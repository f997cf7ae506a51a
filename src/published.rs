//! Publish a struct of counters through the `metrics` facade as deltas since the last call,
//! so the cores that keep the counters (the soft-HCA, the target's engine) stay free of any
//! metrics dependency and pay nothing when no recorder is installed.

use metrics::{counter, Counter};

/// One published counter: its name, a `reason` label where it has one, and how it is read
/// from the stats.
pub type Published<S> = (&'static str, Option<&'static str>, fn(&S) -> u64);

pub struct Publisher<S: 'static> {
    table: &'static [Published<S>],
    last: S,
    c: Vec<Counter>,
}

impl<S: Clone + Default + PartialEq> Publisher<S> {
    /// Counters of `table`, each labelled `label = value` (and `reason` where it has one).
    pub fn new(table: &'static [Published<S>], label: &'static str, value: &str) -> Publisher<S> {
        let c = table
            .iter()
            .map(|(name, reason, _)| match reason {
                Some(r) => counter!(*name, label => value.to_string(), "reason" => *r),
                None => counter!(*name, label => value.to_string()),
            })
            .collect();
        Publisher {
            table,
            last: S::default(),
            c,
        }
    }

    /// Add what grew since the last call.
    pub fn publish(&mut self, s: &S) {
        if *s == self.last {
            return;
        }
        for (c, (_, _, read)) in self.c.iter().zip(self.table) {
            let d = read(s).saturating_sub(read(&self.last));
            if d > 0 {
                c.increment(d);
            }
        }
        self.last = s.clone();
    }
}

//! Who holds how much of the target's shared budgets: queues and completion-queue entries,
//! counted per source address, per /24 (IPv4) or /64 (IPv6) network, and per host NQN, so
//! that no one peer, network or host identity can take what every other host needs.
//!
//! Pure bookkeeping: no I/O, no clock. The engine asks [`Ledger::admits`] before it takes
//! something for a queue and records it with [`Ledger::charge`]; [`Ledger::refund`] gives
//! back exactly what was charged when the queue goes.

use std::net::IpAddr;

use rustc_hash::FxHashMap;

/// Amounts of the budgets: queues, and completion-queue entries their slots can fill.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Usage {
    pub queues: usize,
    pub cqes: usize,
}

impl Usage {
    fn plus(self, o: Usage) -> Usage {
        Usage {
            queues: self.queues + o.queues,
            cqes: self.cqes + o.cqes,
        }
    }

    fn minus(self, o: Usage) -> Usage {
        Usage {
            queues: self.queues.saturating_sub(o.queues),
            cqes: self.cqes.saturating_sub(o.cqes),
        }
    }

    fn within(self, cap: Usage) -> bool {
        self.queues <= cap.queues && self.cqes <= cap.cqes
    }

    fn pct(self, pct: u8) -> Usage {
        let of = |n: usize| (n * pct.min(100) as usize / 100).max(1);
        Usage {
            queues: of(self.queues),
            cqes: of(self.cqes),
        }
    }

    fn is_zero(self) -> bool {
        self == Usage::default()
    }
}

/// Which budget share a charge was refused by, for the log line and the test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Over {
    Total,
    /// The share kept for hosts named in an allow-list.
    Reserved,
    Address,
    Network,
    Host,
}

impl std::fmt::Display for Over {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Over::Total => "the target's queue budget is spent",
            Over::Reserved => "the rest of the queue budget is kept for allow-listed hosts",
            Over::Address => "this source address holds its share of the queue budget",
            Over::Network => "this source network holds its share of the queue budget",
            Over::Host => "this host NQN holds its share of the queue budget",
        })
    }
}

/// The shares, as percentages of the whole budget (see [`super::TargetConfig`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Shares {
    pub address: u8,
    pub network: u8,
    pub host: u8,
    pub reserved: u8,
}

/// Who a charge is for: the queue's source address, and once Fabrics Connect named it, its
/// host NQN and whether that host is named in the allow-list of the subsystem it joins.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holder<'a> {
    pub ip: IpAddr,
    pub host: Option<&'a str>,
    pub listed: bool,
}

pub(super) struct Ledger {
    whole: Usage,
    shares: Shares,
    total: Usage,
    by_ip: FxHashMap<IpAddr, Usage>,
    by_net: FxHashMap<IpAddr, Usage>,
    by_host: FxHashMap<String, Usage>,
}

/// The /24 of an IPv4 address, the /64 of an IPv6 one (an IPv4-mapped IPv6 address counts
/// as its IPv4 address): what one site usually holds, so a peer with many addresses of one
/// network still gets one network's share.
pub(super) fn network(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(a) => IpAddr::V4((u32::from(a) & 0xFFFF_FF00).into()),
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => network(IpAddr::V4(v4)),
            None => IpAddr::V6((u128::from(a) & !((1u128 << 64) - 1)).into()),
        },
    }
}

fn add<K: std::hash::Hash + Eq>(m: &mut FxHashMap<K, Usage>, k: K, u: Usage) {
    let e = m.entry(k).or_default();
    *e = e.plus(u);
}

fn sub<K, Q>(m: &mut FxHashMap<K, Usage>, k: &Q, u: Usage)
where
    K: std::borrow::Borrow<Q> + std::hash::Hash + Eq,
    Q: std::hash::Hash + Eq + ?Sized,
{
    if let Some(e) = m.get_mut(k) {
        *e = e.minus(u);
        if e.is_zero() {
            m.remove(k);
        }
    }
}

impl Ledger {
    pub fn new(whole: Usage, shares: Shares) -> Ledger {
        Ledger {
            whole,
            shares,
            total: Usage::default(),
            by_ip: FxHashMap::default(),
            by_net: FxHashMap::default(),
            by_host: FxHashMap::default(),
        }
    }

    /// Whether `who` may take `more` on top of what it holds: the first share it would go
    /// past, if any. A holder not yet named by a Connect (`host` is `None`) may use the
    /// whole budget: it holds a queue of one slot, and its Connect is checked again.
    pub fn admits(&self, who: Holder<'_>, more: Usage) -> Result<(), Over> {
        let held = |m: &FxHashMap<IpAddr, Usage>, k: IpAddr| m.get(&k).copied().unwrap_or_default();
        let total = self.total.plus(more);
        if !total.within(self.whole) {
            return Err(Over::Total);
        }
        if who.host.is_some()
            && !who.listed
            && !total.within(self.whole.pct(100 - self.shares.reserved.min(100)))
        {
            return Err(Over::Reserved);
        }
        if !held(&self.by_ip, who.ip)
            .plus(more)
            .within(self.whole.pct(self.shares.address))
        {
            return Err(Over::Address);
        }
        if !held(&self.by_net, network(who.ip))
            .plus(more)
            .within(self.whole.pct(self.shares.network))
        {
            return Err(Over::Network);
        }
        if let Some(h) = who.host {
            let had = self.by_host.get(h).copied().unwrap_or_default();
            if !had.plus(more).within(self.whole.pct(self.shares.host)) {
                return Err(Over::Host);
            }
        }
        Ok(())
    }

    /// Record `more` as held by `who` (after [`Ledger::admits`] said yes).
    pub fn charge(&mut self, who: Holder<'_>, more: Usage) {
        self.total = self.total.plus(more);
        add(&mut self.by_ip, who.ip, more);
        add(&mut self.by_net, network(who.ip), more);
        if let Some(h) = who.host {
            add(&mut self.by_host, h.to_string(), more);
        }
    }

    /// Give back `less`, charged earlier to `who`.
    pub fn refund(&mut self, who: Holder<'_>, less: Usage) {
        self.total = self.total.minus(less);
        sub(&mut self.by_ip, &who.ip, less);
        sub(&mut self.by_net, &network(who.ip), less);
        if let Some(h) = who.host {
            sub(&mut self.by_host, h, less);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHARES: Shares = Shares {
        address: 25,
        network: 50,
        host: 25,
        reserved: 25,
    };

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn q(queues: usize, cqes: usize) -> Usage {
        Usage { queues, cqes }
    }

    #[test]
    fn networks_are_slash_24_and_slash_64() {
        assert_eq!(network(ip("10.1.2.200")), ip("10.1.2.0"));
        assert_eq!(network(ip("::ffff:10.1.2.3")), ip("10.1.2.0"));
        assert_eq!(network(ip("fd00:1:2:3:4:5:6:7")), ip("fd00:1:2:3::"));
    }

    #[test]
    fn one_address_takes_its_share_and_another_still_gets_in() {
        let mut l = Ledger::new(q(100, 1000), SHARES);
        let a = Holder {
            ip: ip("10.0.0.1"),
            host: Some("nqn.a"),
            listed: false,
        };
        for _ in 0..25 {
            l.admits(a, q(1, 10)).unwrap();
            l.charge(a, q(1, 10));
        }
        assert_eq!(l.admits(a, q(1, 10)), Err(Over::Address));
        // The same host NQN from elsewhere is over its own share.
        let a2 = Holder {
            ip: ip("10.9.0.1"),
            ..a
        };
        assert_eq!(l.admits(a2, q(1, 10)), Err(Over::Host));
        let b = Holder {
            ip: ip("10.0.1.1"),
            host: Some("nqn.b"),
            listed: false,
        };
        assert_eq!(l.admits(b, q(1, 10)), Ok(()));
        // A neighbour of A on its /24 gets the rest of the network's share only.
        let n = Holder {
            ip: ip("10.0.0.2"),
            host: Some("nqn.n"),
            listed: false,
        };
        for _ in 0..25 {
            l.charge(n, q(1, 10));
        }
        assert_eq!(l.admits(n, q(1, 10)), Err(Over::Address));
        let n3 = Holder {
            ip: ip("10.0.0.3"),
            host: Some("nqn.n3"),
            listed: false,
        };
        assert_eq!(l.admits(n3, q(1, 10)), Err(Over::Network));
    }

    #[test]
    fn the_reserved_share_is_left_to_allow_listed_hosts() {
        let mut l = Ledger::new(q(100, 1000), SHARES);
        for i in 0..3u8 {
            let h = format!("nqn.{i}");
            let who = Holder {
                ip: IpAddr::from([10, i, 0, 1]),
                host: Some(&h),
                listed: false,
            };
            l.charge(who, q(25, 250));
        }
        let open = Holder {
            ip: ip("10.7.0.1"),
            host: Some("nqn.open"),
            listed: false,
        };
        assert_eq!(l.admits(open, q(1, 10)), Err(Over::Reserved));
        let listed = Holder {
            listed: true,
            host: Some("nqn.listed"),
            ..open
        };
        assert_eq!(l.admits(listed, q(1, 10)), Ok(()));
        // Before its Connect names a host, a queue is held against the whole budget.
        let unnamed = Holder { host: None, ..open };
        assert_eq!(l.admits(unnamed, q(1, 3)), Ok(()));
        l.charge(listed, q(25, 250));
        assert_eq!(l.admits(listed, q(1, 1)), Err(Over::Total));
    }

    #[test]
    fn a_refund_gives_back_exactly_what_was_charged() {
        let mut l = Ledger::new(q(100, 1000), SHARES);
        let a = Holder {
            ip: ip("10.0.0.1"),
            host: Some("nqn.a"),
            listed: false,
        };
        l.charge(a, q(1, 3));
        l.charge(a, q(0, 90));
        l.refund(a, q(1, 93));
        assert_eq!(l.total, Usage::default());
        assert!(l.by_ip.is_empty() && l.by_net.is_empty() && l.by_host.is_empty());
    }
}

//! Native multipath on the host: the controllers to one subsystem NQN (through different
//! host devices or target ports) form one [`Subsystem`]; each of its namespaces
//! ([`MpNamespace`]) sends a command on a path the I/O policy chooses among the usable ones
//! (LIVE, ANA optimized first, non-optimized only when no optimized path is usable), moves
//! it to another path when its path fails under it, and holds it, bounded, while no path is
//! usable but one may become usable again.
//!
//! Layers: [`selector`] (which path; no I/O, no clock) and [`failover`] (what a failed
//! command does next; no I/O) are pure; [`ana`] reads ANA through a controller; [`path`],
//! [`subsystem`] and [`namespace`] put them to work over [`crate::transport::Controller`]s.

pub mod ana;
pub mod failover;
pub mod namespace;
pub mod path;
pub mod selector;
pub mod subsystem;

pub use namespace::MpNamespace;
pub use path::{Path, PathStats};
pub use selector::{Choice, IoPolicy, PathView, Selector};
pub use subsystem::{JoinError, PathInfo, Subsystem, DEFAULT_MAX_HELD};

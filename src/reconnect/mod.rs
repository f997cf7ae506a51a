//! Recovery: one path for every failure. [`machine`] is the pure controller state machine
//! (states, timers, attempts); [`policy`] holds nvme-cli's knobs; [`hold`] decides when
//! commands in flight on a dead connection may be sent again (safe retry). The controller in
//! `transport::controller` runs the machine's actions against the HCA.

pub mod episodes;
pub mod hold;
pub mod machine;
pub mod policy;

pub use episodes::RecoveryLog;
pub use machine::{
    describe, Action, Actions, Cause, CtrlState, Event, FailReason, Machine, Status, Trigger,
    TRANSITIONS,
};
pub use policy::{Identity, IdentityMatch, Policy};

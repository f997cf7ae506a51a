//! Recovery: one path for every failure. [`machine`] is the pure controller state machine
//! (states, timers, attempts); [`policy`] holds nvme-cli's knobs. The controller in
//! `transport::controller` runs the machine's actions against the HCA.

pub mod episodes;
pub mod machine;
pub mod policy;

pub use episodes::RecoveryLog;
pub use machine::{
    describe, Action, Actions, Cause, CtrlState, Event, FailReason, Machine, Status, Trigger,
    TRANSITIONS,
};
pub use policy::{Identity, IdentityMatch, Policy};

//! The safe-retry hold allocates nothing once built: holding a dead connection's commands,
//! asking for a CCR, taking its answer and letting the commands go all run on the recovery
//! path, which allocates nothing (see `tests/recovery_alloc.rs`). A counting global
//! allocator watches them.

use std::time::Duration;

use nvmf_rdma::nvme::admin::opcode;
use nvmf_rdma::nvme::ccr::CtrlInstance;
use nvmf_rdma::reconnect::hold::{
    CcrOutcome, CmdClass, Hold, HoldPolicy, LostController, QueueKind, SafeRetry,
};
use nvmf_rdma::verbs::Instant;

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

#[global_allocator]
static A: counting_alloc::Counting = counting_alloc::Counting;

const SLOTS: usize = 128;

fn ms(n: u64) -> Instant {
    Instant::from_nanos(n * 1_000_000)
}

#[test]
fn holding_and_releasing_allocates_nothing() {
    for mode in [SafeRetry::Ccr, SafeRetry::Cqt, SafeRetry::Off] {
        let mut hold: Hold<u16> = Hold::new(
            HoldPolicy {
                mode,
                ..HoldPolicy::default()
            },
            SLOTS,
        );
        let mut resent = [0u16; SLOTS];
        let mut n = 0;
        counting_alloc::start();
        for round in 0..3u64 {
            let lost = LostController {
                instance: CtrlInstance {
                    cntlid: 1,
                    ciu: round as u8,
                    cirn: 7,
                },
                last_contact: ms(round * 1000),
                kato: Duration::from_millis(100),
                cqt_ms: 50,
                traffic_based_keep_alive: false,
                ccr_possible: true,
            };
            let now = ms(round * 1000 + 10);
            hold.on_connection_lost(&lost);
            for tag in 0..SLOTS as u16 {
                let op = if tag % 3 == 0 {
                    opcode::io::READ
                } else {
                    opcode::io::WRITE
                };
                let _ = hold.hold(now, &lost, tag, CmdClass::of(QueueKind::Io, op));
            }
            let _ = hold.time_left(now);
            hold.release_due(now, |t| {
                resent[n % SLOTS] = t;
                n += 1;
            });
            if let Some(x) = hold.poll_ccr() {
                hold.on_ccr(now, x, CcrOutcome::Succeeded);
            }
            let end = hold.poll_timeout().unwrap_or(now);
            hold.release_due(end, |t| {
                resent[n % SLOTS] = t;
                n += 1;
            });
        }
        let counted = counting_alloc::stop();
        assert_eq!(n, 3 * SLOTS, "{mode}: every held command was let go");
        assert!(hold.is_empty());
        assert_eq!(
            counted.host,
            0,
            "{mode}: the hold allocated {} times (platform {}); first at:\n{}",
            counted.host,
            counted.platform,
            counted.traces.first().map(String::as_str).unwrap_or("")
        );
    }
}

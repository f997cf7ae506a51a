//! `--metrics-addr`: the `metrics` facade the controller and driver record through, served
//! in Prometheus text format over HTTP (any path answers) by `metrics-exporter-prometheus`.
//!
//! The recorder is process-global and must be installed before the first controller or
//! device exists: their handles are bound to the recorder present when they were made.

use std::net::SocketAddr;

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};

/// Buckets of `nvmf_ctrl_recovery_seconds`: from a fast reset (milliseconds) to a card that
/// comes back after minutes. Buckets, not quantiles, so the histogram sums across hosts.
pub const RECOVERY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 600.0,
];

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound, or a recorder is already installed. Permanent.
    #[error("cannot serve metrics on {addr}")]
    Install {
        addr: SocketAddr,
        #[source]
        source: BuildError,
    },
}

/// Install the Prometheus recorder and its HTTP listener on `addr`. The listener is bound
/// before this returns; it runs on the current tokio runtime if there is one, else on a
/// thread of its own.
pub fn install(addr: SocketAddr) -> Result<(), MetricsError> {
    let err = |source| MetricsError::Install { addr, source };
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Full("nvmf_ctrl_recovery_seconds".into()),
            RECOVERY_BUCKETS,
        )
        .map_err(err)?
        .install()
        .map_err(err)?;
    describe();
    Ok(())
}

/// HELP lines for what the controller records.
fn describe() {
    describe_gauge!(
        "nvmf_ctrl_state",
        "Controller state: 0 new, 1 live, 2 resetting, 3 connecting, 4 deleting, 5 dead"
    );
    describe_counter!(
        "nvmf_ctrl_reconnect_attempts_total",
        "Reconnect attempts, over all recoveries"
    );
    describe_counter!(
        "nvmf_ctrl_recoveries_total",
        "Recoveries completed (failure to LIVE)"
    );
    describe_counter!(
        "nvmf_ctrl_requeued_io_total",
        "I/Os held across a failure and resubmitted after reconnecting"
    );
    describe_counter!(
        "nvmf_ctrl_failed_io_total",
        "I/Os failed by the recovery path (fast_io_fail_tmo, ctrl_loss_tmo, delete)"
    );
    describe_counter!(
        "nvmf_ctrl_completed_io_total",
        "Commands completed on the I/O queues (updated at each keep-alive)"
    );
    describe_counter!(
        "nvmf_ctrl_io_copies_total",
        "Payload copies the host made on the I/O path; 0 per I/O with registered buffers"
    );
    describe_counter!(
        "nvmf_ctrl_io_copied_bytes_total",
        Unit::Bytes,
        "Bytes of those payload copies"
    );
    describe_counter!(
        "nvmf_mp_path_io_total",
        "Commands a multipath namespace sent on this path (labels: subsys, path)"
    );
    describe_counter!(
        "nvmf_mp_path_failovers_total",
        "Commands that left this path for another one: its connection failed under a read, \
         or it answered with a path status"
    );
    describe_histogram!(
        "nvmf_ctrl_recovery_seconds",
        Unit::Seconds,
        "Time from a failure to LIVE again"
    );
    describe_counter!(
        "softhca_rx_dropped_by_reason_total",
        "Received packets dropped, by reason: malformed, icrc, unknown_qp, foreign_source \
         (not from the QP's peer), ghost (for a QP that is gone), dup_read (a duplicate READ \
         request for more than was read), other"
    );
    describe_counter!(
        "nvmet_refused_queues_total",
        "Target: connection requests refused (queue caps, memory, a device refusal)"
    );
    describe_counter!(
        "nvmet_malformed_capsules_total",
        "Target: command capsules that did not parse"
    );
    describe_counter!(
        "nvmet_cntlid_exhausted_total",
        "Target: Fabrics Connects refused because no controller ID was free"
    );
    describe_counter!(
        "nvmet_kato_expired_total",
        "Target: controllers torn down because their host went silent for KATO"
    );
    describe_counter!(
        "softhca_access_errors_total",
        "Remote accesses refused by the memory-region checks (key, bounds, rights)"
    );
    describe_counter!(
        "softhca_cq_overflows_total",
        "Completions lost because a completion queue was full"
    );
    describe_counter!(
        "softhca_gsi_overflows_total",
        "CM MADs dropped because the QP1 queue was full"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::nvmf_perf::{self, LocalTarget, DEMO_NQN};
    use std::time::{Duration, Instant};

    /// GET `addr` over plain HTTP/1.1; the body.
    fn scrape(addr: SocketAddr) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        out
    }

    /// The only test of the library that installs the (process-global) recorder.
    #[test]
    fn the_listener_serves_the_controller_and_device_metrics() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        install(addr).unwrap();
        // A second install is refused: the port is taken (and a recorder is in place).
        assert!(install(addr).is_err());
        let t = LocalTarget::start(16 << 20, 9).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let body = rt.block_on(async {
            let c = nvmf_perf::connect_host(t.addr, DEMO_NQN, 1, 32)
                .await
                .unwrap();
            c.write(1, 0, &[1u8; 4096]).await.unwrap();
            let body = tokio::task::spawn_blocking(move || scrape(addr))
                .await
                .unwrap();
            c.disconnect().await;
            body
        });
        let live = format!("nvmf_ctrl_state{{subnqn=\"{DEMO_NQN}\"}} 1");
        assert!(body.contains(&live), "{body}");
        for name in [
            "# HELP nvmf_ctrl_recoveries_total",
            "nvmf_ctrl_reconnect_attempts_total",
            "softhca_tx_packets_total",
        ] {
            assert!(body.contains(name), "no {name}: {body}");
        }
        // Junk at the target's port is dropped and counted by reason.
        let junk = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for _ in 0..3 {
            junk.send_to(b"not a RoCEv2 packet", t.addr).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let malformed = loop {
            let n: u64 = scrape(addr)
                .lines()
                .filter(|l| {
                    l.starts_with("softhca_rx_dropped_by_reason_total")
                        && l.contains("reason=\"malformed\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum();
            if n >= 3 || Instant::now() > deadline {
                break n;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(malformed >= 3, "malformed drops counted: {malformed}");
    }
}

//! QP1 carries 256-byte MADs as UD SEND_ONLY packets with the GSI Q_Key, for CM.

use std::time::Duration;

use nvmf_rdma::hca::device::MAD_LEN;
use nvmf_rdma::hca::sim::{sim_addr, Faults, Sim};
use nvmf_rdma::hca::wire::{BthRepr, DethRepr, IcrcContext, Opcode, PacketHeaders, GSI_QKEY};
use nvmf_rdma::verbs::{Psn, Qpn};

#[test]
fn mads_cross_between_devices_and_bad_ones_are_dropped() {
    let mut sim = Sim::new(7, Faults::NONE, 2);
    let mut mad = [0u8; MAD_LEN];
    mad[0] = 1;
    mad[1] = 7;
    mad[255] = 0xAB;
    sim.devices[0].post_gsi(sim_addr(1), &mad).unwrap();
    let mut got = None;
    assert!(sim.run_until(Duration::from_millis(10), |s| {
        got = s.devices[1].poll_gsi();
        got.is_some()
    }));
    assert_eq!(got, Some((sim_addr(0), mad)));

    // Wrong Q_Key, wrong length: counted and dropped.
    let before = sim.devices[1].stats().rx_dropped;
    for (qkey, len) in [(0x1234, MAD_LEN), (GSI_QKEY, 100)] {
        let mut h = PacketHeaders::new(BthRepr::new(Opcode::UD_SEND_ONLY, Qpn::GSI, Psn::new(0)));
        h.deth = Some(DethRepr {
            qkey,
            src_qp: Qpn::GSI,
        });
        let mut buf = Vec::new();
        nvmf_rdma::hca::wire::emit_packet(
            &h,
            &vec![0u8; len],
            &IcrcContext::new(sim_addr(0), sim_addr(1)),
            &mut buf,
        );
        let now = sim.now;
        sim.devices[1].handle_datagram(now, sim_addr(0), &buf);
    }
    assert_eq!(sim.devices[1].stats().rx_dropped, before + 2);
    assert!(sim.devices[1].poll_gsi().is_none());

    // A zombie refuses to send MADs.
    sim.devices[0].fatal();
    assert!(sim.devices[0].post_gsi(sim_addr(1), &mad).is_err());
}

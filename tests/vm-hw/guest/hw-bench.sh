#!/bin/bash
# In-guest run of the `hw` backend against the kernel NVMe-oF target over soft-RoCE (rxe)
# loopback, side by side with the kernel nvme-rdma host (fio), in one boot.
#   target: nvmet-rdma on <guest IP>:4420, subsystem $NQN,
#           ns1 = /dev/ram0 (brd, 256 MiB), ns2 = a file on the in-memory root (buffered_io=1)
#   1. nvmf-rdma hw list / async events (PORT_ERR / PORT_ACTIVE via eth0 down/up)
#   2. kernel host: nvme connect + fio 4k randread qd32 and 128k seqread qd16 on ns1
#   3. ours (hw backend): connect, write+verify, same two workloads on ns1; verify on ns2
# Knobs (kernel cmdline via EXTRA_APPEND): vmrt=<seconds per workload, default 10>,
#   vmcases=<comma list of: events,devtests,kernel,hw,hwfile,devremove> (default all but devremove)
set -u
IF=${IF:-eth0}
IP=$(ip -4 -o addr show dev "$IF" | awk '{print $4}' | cut -d/ -f1)
NQN=nqn.2024-01.io.example:hw-test
RT=${vmrt:-10}
CASES=${vmcases:-events,devtests,kernel,hw,hwfile}; CASES=" ${CASES//,/ } "
wants() { [[ "$CASES" == *" $1 "* ]]; }
up() { cut -d' ' -f1 /proc/uptime; }
section() { echo; echo "=================== [$(up)] $* ==================="; }
BIN=${BIN:-/usr/bin/nvmf-rdma}

section setup
# rdma_rxe computes its ICRC with the crc32 shash: without crc32_generic `rdma link add` fails
modprobe crc32_generic
for m in rdma_rxe ib_uverbs rdma_ucm nvme-rdma nvmet-rdma; do modprobe $m || echo "modprobe $m failed"; done
modprobe brd rd_nr=1 rd_size=262144
rdma link add rxe0 type rxe netdev "$IF" || { echo "FATAL: rdma link add failed"; exit 1; }
rdma link show
ibv_devices
echo "--- nvmf-rdma hw list"
$BIN hw list

S=/sys/kernel/config/nvmet
mkdir $S/subsystems/$NQN
echo 1 > $S/subsystems/$NQN/attr_allow_any_host
mkdir $S/subsystems/$NQN/namespaces/1
echo /dev/ram0 > $S/subsystems/$NQN/namespaces/1/device_path
echo 1 > $S/subsystems/$NQN/namespaces/1/enable
# a file-backed namespace on the in-memory root: O_DIRECT is refused there, so buffered_io=1
truncate -s 64M /tmp/ns2.img
mkdir $S/subsystems/$NQN/namespaces/2
echo /tmp/ns2.img > $S/subsystems/$NQN/namespaces/2/device_path
echo 1 > $S/subsystems/$NQN/namespaces/2/buffered_io
echo 1 > $S/subsystems/$NQN/namespaces/2/enable || echo "ns2 enable failed"
mkdir $S/ports/1
echo rdma > $S/ports/1/addr_trtype; echo ipv4 > $S/ports/1/addr_adrfam
echo "$IP" > $S/ports/1/addr_traddr; echo 4420 > $S/ports/1/addr_trsvcid
ln -s $S/subsystems/$NQN $S/ports/1/subsystems/$NQN
dmesg | grep -E 'nvmet' | tail -3

if wants events; then
  section "async events: eth0 down/up under nvmf-rdma hw events"
  $BIN hw events --device rxe0 --seconds 8 &
  EPID=$!
  sleep 3; ip link set "$IF" down; sleep 1.5; ip link set "$IF" up; ip route add default via 10.0.2.2 2>/dev/null
  wait $EPID; echo "hw events rc=$?"
  for i in $(seq 30); do rdma link show rxe0/1 | grep -q 'state ACTIVE' && break; sleep 0.5; done
  rdma link show rxe0/1
fi

if wants devtests; then
  section "cargo test --test hw_backend, in the guest against rxe0 and the nvmet target"
  NVMF_HW_TARGET="$IP:4420" NVMF_HW_NQN="$NQN" timeout 180 /usr/bin/hw_backend --test-threads=1 --nocapture
  echo "hw_backend tests rc=$?"
fi

if wants kernel; then
  section "kernel nvme-rdma host + fio (same namespace ns1 = brd)"
  U=$(cat /proc/sys/kernel/random/uuid); mkdir -p /etc/nvme
  echo "nqn.2014-08.org.nvmexpress:uuid:$U" > /etc/nvme/hostnqn; echo "$U" > /etc/nvme/hostid
  t=$EPOCHREALTIME
  nvme connect -t rdma -a "$IP" -s 4420 -n "$NQN"; echo "nvme connect rc=$? in $(bc <<<"$EPOCHREALTIME-$t")s"
  for i in $(seq 50); do [ -b /dev/nvme0n1 ] && break; sleep 0.2; done
  nvme list
  fio --name=k-randread4k --filename=/dev/nvme0n1 --rw=randread --bs=4k --iodepth=32 --ioengine=libaio \
      --direct=1 --time_based --runtime=$RT --output-format=terse --terse-version=3 > /tmp/k1.terse; echo "fio rc=$?"
  fio --name=k-seqread128k --filename=/dev/nvme0n1 --rw=read --bs=128k --iodepth=16 --ioengine=libaio \
      --direct=1 --time_based --runtime=$RT --output-format=terse --terse-version=3 > /tmp/k2.terse; echo "fio rc=$?"
  # terse v3: field 7 read bw KiB/s, 8 read IOPS, 40 read total-latency mean (us), 18-37 clat percentiles ("99.000000%=N" us)
  for f in /tmp/k1.terse /tmp/k2.terse; do
    awk -F';' '{p99="";for(i=18;i<=37;i++){split($i,a,"=");if(a[1]=="99.000000%")p99=a[2]}
      printf "KERNEL-RESULT job=\"%s\" iops=%s mibs=%.2f avg_us=%.0f p99_us=%s\n",$3,$8,$7/1024,$40,p99}' "$f"
  done
  nvme disconnect -n "$NQN"
  sleep 1
fi

if wants hw; then
  section "ours: nvmf-rdma hw run (hw backend over rxe0), ns1 = brd"
  t=$EPOCHREALTIME
  timeout $((RT*2+120)) $BIN hw run -a "$IP" -n "$NQN" --nsid 1 --verify-size 32M --seconds "$RT" --kato-ms 5000
  echo "hw run rc=$? in $(bc <<<"$EPOCHREALTIME-$t")s"
fi

if wants hwfile; then
  section "ours: verify on the file-backed namespace ns2 (buffered_io=1)"
  timeout 120 $BIN hw run -a "$IP" -n "$NQN" --nsid 2 --verify-size 16M --seconds 0
  echo "hw run ns2 rc=$?"
fi

if wants devremove; then
  section "device removal under I/O: rdma link delete rxe0 while hw run reads"
  timeout 120 $BIN hw run -a "$IP" -n "$NQN" --nsid 1 --verify-size 0 --seconds 30 &
  HPID=$!
  sleep 8; timeout 60 rdma link delete rxe0; echo "rdma link delete rc=$?"
  wait $HPID; echo "hw run under removal rc=$? (non-zero expected: the device went away)"
fi
dmesg | grep -E 'nvmet|rxe|infiniband' | tail -15
section done

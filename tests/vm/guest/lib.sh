#!/bin/bash
# Helpers for the command files run by agent.sh: rxe, the nvmet-rdma target in configfs,
# and the kernel nvme-rdma host.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
IF=${IF:-$(ls /sys/class/net | grep -v '^lo$' | head -1)}
IP=$(ip -4 -o addr show dev "$IF" 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -1)
IP=${IP:-192.168.100.2}
CIDR=${IP}/24
NVMET=/sys/kernel/config/nvmet
KNQN=nqn.2026-11.io.nvmf-rdma:linux-nvmet

rxe_up() {  # modules, a 128 MiB brd ramdisk, and rxe0 on the NIC
  modprobe rdma_rxe && modprobe ib_uverbs && modprobe rdma_ucm && modprobe nvmet-rdma &&
    modprobe nvme-rdma || return 1
  [ -b /dev/ram0 ] || modprobe brd rd_nr=1 rd_size=131072 || return 1
  rdma link show rxe0/1 >/dev/null 2>&1 || rdma link add rxe0 type rxe netdev "$IF" || return 1
  rdma link show rxe0/1
  gid_table
}

gid_table() {  # the non-empty GIDs of rxe0 with their type
  local g i v
  for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
    i=${g##*/}; v=$(cat "$g" 2>/dev/null) || continue
    [ "$v" = "0000:0000:0000:0000:0000:0000:0000:0000" ] && continue
    echo "gid $i: $v $(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$i 2>/dev/null)"
  done
  echo "active_mtu: $(ibv_devinfo -d rxe0 2>/dev/null | awk '/active_mtu/{print $2, $3}')"
}

nvmet_up() {  # subsystem $KNQN, namespace 1 = /dev/ram0, port 1 on $IP:4420 (rdma)
  local s=$NVMET/subsystems/$KNQN p=$NVMET/ports/1
  [ -d "$s" ] || {
    mkdir "$s" && echo 1 > "$s/attr_allow_any_host" &&
    mkdir "$s/namespaces/1" && echo /dev/ram0 > "$s/namespaces/1/device_path" &&
    echo 1 > "$s/namespaces/1/enable"; } || return 1
  [ -d "$p" ] || {
    mkdir "$p" && echo rdma > "$p/addr_trtype" && echo ipv4 > "$p/addr_adrfam" &&
    echo "$IP" > "$p/addr_traddr" && echo 4420 > "$p/addr_trsvcid"; } || return 1
  port_enable
}
port_enable() {  # port_enable [PORT]: (re-)link the subsystem to port PORT (1): nvmet starts listening
  local l=$NVMET/ports/${1:-1}/subsystems/$KNQN
  [ -e "$l" ] || ln -s "$NVMET/subsystems/$KNQN" "$l"
}
port_disable() { rm -f "$NVMET/ports/${1:-1}/subsystems/$KNQN"; }
port_cycle() { port_disable; sleep 0.5; port_enable; }
# A second port of the subsystem (the multipath case): port 2 on $IP:SVC. Each port has its
# own ANA group 1, so a state set through one port is what the hosts on that port see.
port2_up() {  # port2_up SVC
  local p=$NVMET/ports/2
  [ -d "$p" ] || { mkdir "$p" && echo rdma > "$p/addr_trtype" && echo ipv4 > "$p/addr_adrfam" &&
    echo "$IP" > "$p/addr_traddr" && echo "$1" > "$p/addr_trsvcid"; } || return 1
  port_enable 2
}
port2_down() { port_disable 2; rmdir "$NVMET/ports/2" 2>/dev/null; ana_set 1 optimized; }
ana_set() {  # ana_set PORT STATE: ANA group 1's state through port PORT (optimized, inaccessible, ...)
  echo "$2" > "$NVMET/ports/$1/ana_groups/1/ana_state"
}

hostnqn() {  # no DMI in the guest: a random UUID host NQN, made once
  [ -s /etc/nvme/hostnqn ] || { mkdir -p /etc/nvme
    echo "nqn.2014-08.org.nvmexpress:uuid:$(cat /proc/sys/kernel/random/uuid)" > /etc/nvme/hostnqn; }
  cat /etc/nvme/hostnqn
}

kconnect() {  # kernel host: connect to $1 (address) subsystem $2 with extra options $3 (k=v,...), port $KPORT (4420)
  local opts="transport=rdma,traddr=$1,trsvcid=${KPORT:-4420},nqn=$2,hostnqn=$(hostnqn)${3:+,$3}" r
  exec 3<>/dev/nvme-fabrics || return 1
  echo "$opts" >&3 || { exec 3>&-; echo "connect failed: $opts"; return 1; }
  read -r r <&3; exec 3>&-
  echo "connected: $r"
  # namespace 1 through this controller: nvmeXn1, or with native multipath the path nvmeYcXn1
  # of the subsystem's device nvmeYn1
  local c=nvme$(echo "$r" | sed -n 's/.*instance=\([0-9]*\).*/\1/p') dev="" n i
  for i in $(seq 100); do
    n=$(ls "/sys/class/nvme/$c" 2>/dev/null | grep -E '^nvme[0-9]+(c[0-9]+)?n1$' | head -1)
    [ -n "$n" ] && dev=/dev/$(echo "$n" | sed 's/c[0-9]*n/n/') && [ -b "$dev" ] && break
    sleep 0.1
  done
  [ -b "$dev" ] || { echo "no namespace 1 on $c"; return 1; }
  echo "device: $dev"
}
kdev() {  # the block device of the kernel controller connected to traddr $1
  local c
  for c in /sys/class/nvme/nvme*; do
    grep -q "traddr=$1," "$c/address" 2>/dev/null && { ls -d /sys/block/"${c##*/}"n* 2>/dev/null | head -1 | sed 's|/sys/block|/dev|'; return; }
  done
}
kdisconnect_all() { nvme disconnect-all; }
ctrl_states() { local c; for c in /sys/class/nvme/nvme*; do [ -e "$c/state" ] && echo "${c##*/}: $(cat $c/state) $(cat $c/address)"; done; }

# The kernel host's side of the chaos comparison: nvme-rdma -> nvmet-rdma over rxe0 in
# this guest, fio 4 KiB randread QD32 for 30 s, BREAK at 5 s, RESTORE after OUTAGE s.
# Prints when the controller was live again (if it was) and how fio ended.
linux_chaos() {  # linux_chaos BREAK RESTORE OUTAGE
  local brk=$1 restore=$2 outage=$3 d p t0 st left=0 back=""
  kconnect "$IP" "$KNQN" "reconnect_delay=2,ctrl_loss_tmo=60" >/dev/null || return 1
  d=$(kdev "$IP"); dmesg -c >/dev/null
  fio --name=lx --filename="$d" --rw=randread --bs=4k --iodepth=32 --ioengine=libaio --direct=1 \
    --time_based --runtime=30 > /tmp/lx-fio.txt 2>&1 & p=$!
  sleep 5; t0=$EPOCHREALTIME
  eval "$brk"
  local i; for ((i = 0; i < 10 * (outage + 30); i++)); do
    [ $i = $((10 * outage)) ] && eval "$restore"
    st=$(cat /sys/class/nvme/nvme*/state 2>/dev/null | head -1); st=${st:-gone}
    [ "$st" != live ] && left=1
    if [ $left = 1 ] && [ "$st" = live ]; then back=$(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $t0}"); break; fi
    [ $i -ge $((10 * outage)) ] && [ "$st" = gone ] && break
    sleep 0.1
  done
  if [ -n "$back" ]; then echo "controller: live again $back s after the break"
  else echo "controller: $st (not live again)"; fi
  timeout 60 bash -c "while kill -0 $p 2>/dev/null; do sleep 1; done"
  if kill -0 $p 2>/dev/null; then echo "fio: still blocked 60 s after its runtime"; kill -9 $p
  else wait $p; echo "fio: exit $?, $(grep -oE 'err= *[0-9]+' /tmp/lx-fio.txt | head -1), $(grep -oE 'IOPS=[0-9.k]+' /tmp/lx-fio.txt | head -1)"; fi
  dmesg | grep -E 'nvme nvme[0-9]|nvmet' | grep -vE 'requeuing|failing I/O' | sed 's/^\[ *[0-9.]*\] //' | sort -u | head -8
  timeout 20 nvme disconnect-all >/dev/null 2>&1
}

# The hw case: our binary built with --features hw, staged by the host in the out share with
# the libraries it links (rdma-core itself is in the initramfs: libibverbs, librdmacm, rxe).
ours() { LD_LIBRARY_PATH=/mnt/out/hw/lib /mnt/out/hw/nvmf-rdma "$@"; }
ours_hw() { ours hw "$@"; }
# fio through our plugin on rxe0 (hw backend) against TRADDR/NQN, with verify=crc32c; 2 s after
# I/O starts flowing rxe0 is deleted, and 2 s later added again on the same netdev.
# The same, but the device that comes back is another card: rxe0 is added again on a macvlan
# of eth0 with its own MAC (so another GUID), its own IP and the route to TRADDR. With
# IDENTITY=both ours must not reconnect through it (the held I/O fails at ctrl_loss_tmo /
# replug_window, 12 s); with IDENTITY=any it must.
wait_io() {  # wait_io FILE [REGEX]: until fio's once-a-second status in FILE shows I/O (at most 90 s)
  local i; for i in $(seq 900); do grep -qE "${2:-IOPS=}" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "fio showed no I/O within 90 s"; return 1
}
hw_fio_other() {  # hw_fio_other TRADDR NQN IDENTITY
  printf '%s\n' '[global]' 'ioengine=external:/mnt/out/hw/libnvmf_rdma_fio.so' 'thread=1' \
    "traddr=$1" "subnqn=$2" 'device=rxe0' "identity=$3" 'filename=ns=1' 'size=32M' 'bs=4k' \
    'iodepth=16' 'ctrl_loss_tmo=12' 'replug_window=12' 'reconnect_delay=1' 'verify=crc32c' \
    'verify_backlog=256' 'verify_fatal=1' 'time_based=1' 'runtime=25' '[hwother]' 'rw=randwrite' > /tmp/hwo.fio
  modprobe dummy 2>/dev/null; ip link add nvmfdummy0 type dummy 2>/dev/null; ip link set nvmfdummy0 up
  rdma link add rxe9 type rxe netdev nvmfdummy0 2>/dev/null
  LD_LIBRARY_PATH=/mnt/out/hw/lib fio --status-interval=1 /tmp/hwo.fio > /tmp/hwo-fio.txt 2>&1 &
  local p=$!
  wait_io /tmp/hwo-fio.txt; sleep 2   # connected and I/O flowing; then 2 s into it
  timeout 60 rdma link delete rxe0; echo "rdma link delete rc=$?"
  ip link add mv0 link "$IF" type macvlan mode bridge; ip link set mv0 address 52:54:00:aa:bb:cc
  ip link set mv0 up; ip addr add 192.168.100.3/24 dev mv0 2>/dev/null
  ip route replace "$1/32" dev mv0 src 192.168.100.3
  rdma link add rxe0 type rxe netdev mv0; echo "rdma link add on mv0 rc=$?"
  rdma link show rxe0 | head -1; cat /sys/class/infiniband/rxe0/node_guid
  wait $p; echo "fio rc=$?"
  rdma link delete rxe0; ip route del "$1/32" dev mv0; ip link del mv0
  rdma link delete rxe9 2>/dev/null; ip link del nvmfdummy0 2>/dev/null
  rdma link add rxe0 type rxe netdev "$IF"
  grep -E 'nvmf-rdma|verify|error' /tmp/hwo-fio.txt | grep -v 'io_u error' | sort -u | head -12
  grep -E 'err=' /tmp/hwo-fio.txt | tail -1
}
hw_fio_replug() {  # hw_fio_replug TRADDR NQN
  printf '%s\n' '[global]' 'ioengine=external:/mnt/out/hw/libnvmf_rdma_fio.so' 'thread=1' \
    "traddr=$1" "subnqn=$2" 'device=rxe0' 'filename=ns=1' 'size=32M' 'bs=4k' 'iodepth=16' \
    'ctrl_loss_tmo=60' 'reconnect_delay=1' 'verify=crc32c' 'verify_backlog=256' 'verify_fatal=1' \
    'time_based=1' 'runtime=20' '[hwreplug]' 'rw=randwrite' > /tmp/hw.fio
  # A second RDMA device (rxe9 on a dummy netdev): librdmacm re-reads the device list to let go
  # of a removed device's context, but gives up when the list is empty, and the kernel finishes
  # removing rxe0 only once that context is closed (see docs/devices.md).
  modprobe dummy 2>/dev/null; ip link add nvmfdummy0 type dummy 2>/dev/null; ip link set nvmfdummy0 up
  rdma link add rxe9 type rxe netdev nvmfdummy0 2>/dev/null
  LD_LIBRARY_PATH=/mnt/out/hw/lib fio --status-interval=1 /tmp/hw.fio > /tmp/hw-fio.txt 2>&1 &
  local p=$!
  wait_io /tmp/hw-fio.txt; sleep 2   # connected and I/O flowing; then 2 s into it
  timeout 60 rdma link delete rxe0; echo "rdma link delete rc=$?"
  sleep 2
  rdma link add rxe0 type rxe netdev "$IF"; echo "rdma link add rc=$?"
  wait $p; echo "fio rc=$?"
  rdma link delete rxe9 2>/dev/null; ip link del nvmfdummy0 2>/dev/null
  grep -E 'nvmf-rdma|verify|error' /tmp/hw-fio.txt | sort -u | head -12
  grep -E 'err=' /tmp/hw-fio.txt | tail -1   # the final report (status lines come before it)
}
kfio_result() {  # kfio_result DEV RW BS QD SECS: one fio job, one KERNEL-RESULT line
  local f=/tmp/kfio-$2-$3.terse
  fio --name="k-$2-$3-qd$4" --filename="$1" --rw="$2" --bs="$3" --iodepth="$4" --ioengine=libaio \
    --direct=1 --time_based --runtime="$5" --output-format=terse --terse-version=3 > "$f" || return 1
  # terse v3: 3 job name, 7 read KiB/s, 8 read IOPS, 40 read latency mean (us), 18-37 clat percentiles
  awk -F';' '{p99=""; for (i = 18; i <= 37; i++) { split($i, a, "="); if (a[1] == "99.000000%") p99 = a[2] }
    printf "KERNEL-RESULT job=\"%s\" iops=%s mibs=%.2f avg_us=%.0f p99_us=%s\n", $3, $8, $7/1024, $40, p99}' "$f"
}
nvmet_file_ns() {  # nvmet_file_ns NSID FILE SIZE: a file-backed namespace of $KNQN (tmpfs: no O_DIRECT, so buffered_io=1)
  local n=$NVMET/subsystems/$KNQN/namespaces/$1
  [ -d "$n" ] && return 0
  truncate -s "$3" "$2" && mkdir "$n" && echo "$2" > "$n/device_path" && echo 1 > "$n/buffered_io" &&
    echo 1 > "$n/enable"
}

# The kernel host's side of the multipath case: nvme-rdma with native multipath to both ports
# of $KNQN (rxe loopback), iopolicy round-robin, mp.fio for SECS s with its JSON status every
# second in /mnt/out/mp-kernel-NAME.json; BREAK 3 s after I/O flows, RESTORE OUTAGE s later.
# Prints the paths before, in the outage and after, and fio's exit status (KMP-RC=N).
kmp_run() {  # kmp_run SVC2 NAME BREAK RESTORE OUTAGE SECS
  local svc2=$1 brk=$3 restore=$4 outage=$5 secs=$6 f=/mnt/out/mp-kernel-$2.json dev s p r
  dev=$(kconnect "$IP" "$KNQN" reconnect_delay=2 | sed -n 's/^device: //p')
  KPORT=$svc2 kconnect "$IP" "$KNQN" reconnect_delay=2 >/dev/null && [ -b "$dev" ] ||
    { echo "connect to both ports failed"; nvme disconnect-all; return 1; }
  s=$(dirname "$(grep -l "$KNQN" /sys/class/nvme-subsystem/*/subsysnqn | head -1)")
  echo round-robin > "$s/iopolicy"
  echo "native multipath=$(cat /sys/module/nvme_core/parameters/multipath), $dev, iopolicy $(cat "$s/iopolicy")"
  kpaths
  rm -f "$f"
  MP_FILE=$dev MP_SECS=$secs fio --status-interval=1 --output-format=json --output="$f" \
    /mnt/scripts/mp.fio 2>/tmp/kmp-fio.err & p=$!
  wait_io "$f" '"total_ios" : [1-9]'; sleep 3
  eval "$brk"; sleep 2
  echo "in the outage:"; kpaths
  sleep $((outage - 2)); eval "$restore"
  wait $p; r=$?
  echo "after:"; kpaths
  echo "KMP-RC=$r"
  nvme disconnect-all >/dev/null
}
kpaths() {  # each controller: state, address, and the ANA state of its path to namespace 1
  local c n
  for c in /sys/class/nvme/nvme*; do
    n=$(ls -d "$c"/nvme*c*n1 2>/dev/null | head -1)
    echo "  ${c##*/}: $(cat "$c/state") $(cat "$c/address") ana=$(cat "$n/ana_state" 2>/dev/null)"
  done
}

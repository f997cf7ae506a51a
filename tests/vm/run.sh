#!/usr/bin/env bash
# Interop with the Linux RDMA stack in a qemu guest (Debian 6.1 kernel, rdma_rxe,
# nvmet-rdma, nvme-rdma), with our binary on the host side of a tap device in a private
# network namespace:
#
#   netns vmnet: tap0 192.168.100.1/24  <-- virtio-net -->  guest eth0 192.168.100.2/24 (rxe0)
#
# Usage (root): tests/vm/run.sh [CASE...]   cases: interop1 interop2 hw chaos hw_fio hw_target bench linux_chaos hw_extra
# multipath (default: all but bench, linux_chaos, hw_extra and multipath). One PASS/FAIL line per check; exits non-zero if any
# failed. The case hw runs our `hw` backend (libibverbs/librdmacm) inside the guest instead.
# Knobs: VM=/tmp/nvmf-vm (work dir), NVMF_BIN (default target/release/nvmf-rdma, built if
# missing), NVMF_HW_BIN (the hw case's binary; default: `cargo build --release --features hw`,
# i.e. target/release/nvmf-rdma with the hw subcommand added), KEEP=1 (leave the guest running
# at the end), ACCEL (qemu accelerator args), NETNS=vmnet (network namespace of the tap; use
# another name to run beside another VM run).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
export VM=${VM:-/tmp/nvmf-vm}
OUT=$VM/out
CMD=$OUT/cmd
NETNS=${NETNS:-vmnet}
HOST_IP=192.168.100.1
GUEST_IP=192.168.100.2
KNQN=nqn.2026-11.io.nvmf-rdma:linux-nvmet    # the guest's nvmet subsystem
ONQN=nqn.2026-11.io.nvmf-rdma:ours           # our target on the host
BIN=${NVMF_BIN:-$REPO/target/release/nvmf-rdma}
CASES=${*:-interop1 interop2 hw chaos hw_fio hw_target}
T0=$SECONDS
FAILS=0
QEMU_PID=""

log() { printf '[%4ss] %s\n' "$((SECONDS - T0))" "$*"; }
pass() { log "PASS $*"; }
fail() { log "FAIL $*"; FAILS=$((FAILS + 1)); }
check() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }
in_ns() { ip netns exec "$NETNS" "$@"; }
ours() { in_ns "$BIN" "$@"; }

# --- guest commands through the agent ---------------------------------------------------
SEQ=0
GX_ID=""
gx_start() {  # run "$*" in the guest in the background; its id is left in GX_ID
  SEQ=$((SEQ + 1)); GX_ID=$(printf 'c%03d' "$SEQ")
  printf '%s\n' "$*" > "$CMD/$GX_ID.tmp" && mv "$CMD/$GX_ID.tmp" "$CMD/$GX_ID.sh"
}
gx_wait() {  # gx_wait ID [TIMEOUT]: wait for it, print its output, return its status
  local id=$1 t=${2:-120} i
  for ((i = 0; i < t * 5; i++)); do [ -e "$CMD/$id.rc" ] && break; sleep 0.2; done
  sed 's/^/    guest| /' "$CMD/$id.out" 2>/dev/null
  [ -e "$CMD/$id.rc" ] || { echo "    guest| (no answer within ${t}s)"; return 124; }
  return "$(cat "$CMD/$id.rc")"
}
gx() { gx_start "$@"; gx_wait "$GX_ID" "${GX_TIMEOUT:-120}"; }

# --- setup -----------------------------------------------------------------------------
netns_up() {
  ip netns add "$NETNS" 2>/dev/null || true
  ip -n "$NETNS" link set lo up
  ip -n "$NETNS" link show tap0 >/dev/null 2>&1 || ip -n "$NETNS" tuntap add dev tap0 mode tap
  ip -n "$NETNS" addr replace "$HOST_IP/24" dev tap0
  ip -n "$NETNS" link set tap0 up
}

accel() {
  # A /dev/kvm backed by PVM (kvm_pvm) runs only PVM-enabled guest kernels at speed; a
  # stock Debian kernel crawls there, so use TCG (emulation) unless KVM is the real thing.
  if [ -n "${ACCEL:-}" ]; then echo "$ACCEL"
  elif [ -d /sys/module/kvm_pvm ] || [ ! -w /dev/kvm ]; then echo "-accel tcg,thread=multi,tb-size=512 -cpu max"
  else echo "-enable-kvm -cpu host"; fi
}

boot() {
  rm -rf "$CMD"; rm -f "$OUT/console.log"; mkdir -p "$CMD" "$OUT"
  # Not through in_ns: a function in the background is a subshell, and $! would be its PID,
  # not qemu's (ip netns exec execs qemu in place), so a guest that no longer powers itself
  # off would outlive shutdown_guest, holding tap0 and the caller's lock.
  # shellcheck disable=SC2046
  ip netns exec "$NETNS" qemu-system-x86_64 $(accel) -m 1536 -smp 2 -machine q35 -nodefaults -no-reboot \
    -display none -serial "file:$OUT/console.log" -monitor none \
    -kernel "$VM/vmlinuz" -initrd "$VM/initramfs.cpio" \
    -append "console=ttyS0 loglevel=4 panic=-1 vmip=$GUEST_IP/24 vmscript=agent.sh" \
    -virtfs "local,path=$HERE/guest,mount_tag=scripts,security_model=none,readonly=on" \
    -virtfs "local,path=$OUT,mount_tag=out,security_model=none" \
    -netdev tap,id=n0,ifname=tap0,script=no,downscript=no \
    -device virtio-net-pci,netdev=n0,mac=52:54:00:12:34:56 &
  QEMU_PID=$!
  local i
  for ((i = 0; i < 600; i++)); do
    grep -q AGENT-READY "$OUT/console.log" 2>/dev/null && return 0
    kill -0 "$QEMU_PID" 2>/dev/null || break
    sleep 0.2
  done
  tail -20 "$OUT/console.log"; return 1
}

shutdown_guest() {
  [ -n "$QEMU_PID" ] || return 0
  touch "$CMD/quit"
  local i; for ((i = 0; i < 100; i++)); do kill -0 "$QEMU_PID" 2>/dev/null || break; sleep 0.2; done
  kill "$QEMU_PID" 2>/dev/null; wait "$QEMU_PID" 2>/dev/null; QEMU_PID=""
}

guest_reboot() {  # power the guest off (killed if its agent no longer answers), boot, set up
  shutdown_guest
  boot || return 1
  GX_TIMEOUT=120 gx 'rxe_up && nvmet_up' >/dev/null
}

BG_PIDS=()
cleanup() {
  local p; for p in "${BG_PIDS[@]}"; do kill "$p" 2>/dev/null; done
  [ -n "${KEEP:-}" ] && return
  shutdown_guest
  ip netns del "$NETNS" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 143' TERM INT


# shellcheck source=tests/vm/cases.sh
source "$HERE/cases.sh"

main() {
  [ "$(id -u)" = 0 ] || { echo "run.sh needs root (netns, tap, qemu)"; exit 2; }
  mkdir -p "$VM"
  log "install (packages + guest kernel)"
  "$HERE/install-deps.sh" > "$VM/install.log" 2>&1 || { tail "$VM/install.log"; fail "install"; exit 1; }
  tail -1 "$VM/install.log"
  # first, as it may build target/release/nvmf-rdma (with --features hw: a superset)
  if [[ " $CASES " == *" hw"* ]]; then hw_stage || { fail "hw: build + stage the hw binaries"; exit 1; }; fi
  if [ ! -x "$BIN" ]; then
    log "build $BIN"
    (cd "$REPO" && cargo build --release --bin nvmf-rdma) || { fail "cargo build"; exit 1; }
  fi
  log "initramfs"
  "$HERE/build-initramfs.sh" || { fail "initramfs"; exit 1; }
  netns_up
  log "boot ($(accel | cut -d' ' -f1-2))"
  if ! boot; then fail "guest boot"; exit 1; fi
  log "guest up: $(grep -o 'GUEST-UP.*' "$OUT/console.log")"
  GX_TIMEOUT=120 gx 'rxe_up && nvmet_up' || { fail "guest rxe + nvmet setup"; exit 1; }
  local c
  for c in $CASES; do "case_$c"; done
  log "done: $FAILS failed"
  [ "$FAILS" = 0 ] && log "RESULT: PASS" || log "RESULT: FAIL"
  [ "$FAILS" = 0 ]
}
[ -n "${RUN_SH_LIB:-}" ] || main "$@"

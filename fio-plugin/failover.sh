#!/usr/bin/env bash
# Failover under fio: the longest I/O stall with two paths to the built-in RAM target
# (round-robin, 4 KiB randwrite QD32, 10 s per run), for each fault kind. Prints each case's
# median stall and range over the runs, and the runs' I/O errors (there must be none).
# usage: bash fio-plugin/failover.sh [plugin.so, default target/release/libnvmf_rdma_fio.so] [runs, default 5]
#   reported:  path 1's HCA reset every 2 s, path 2's unplugged every 3 s for 500 ms
#   frozen:    path 2's target port answers nothing for 1.5 s every 4 s, keep_alive_tmo=1
#   Each case with fio verify=crc32c (verify) and without (flow); RUNTIME_THREADS=N for the
#   runtime on threads of its own (default 0: fio's threads drive it).
set -euo pipefail
SO=$(realpath "${1:-target/release/libnvmf_rdma_fio.so}"); R=${2:-5}
RT=${RUNTIME_THREADS:-0}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cases="reported-verify reported-flow frozen-verify frozen-flow"
for c in $cases; do
  case $c in
    reported-*) faults="chaos_reset_every=2s chaos_unplug_every=3s chaos_unplug_for=500ms" ;;
    frozen-*) faults="keep_alive_tmo=1 chaos_freeze_every=4s chaos_freeze_for=1500ms" ;;
  esac
  verify=""
  case $c in *-verify) verify="verify=crc32c verify_backlog=1024 verify_state_save=0" ;; esac
  # shellcheck disable=SC2086
  printf '%s\n' '[global]' "ioengine=external:$SO" thread=1 "runtime_threads=$RT" \
    builtin_target=256M builtin_ports=2 iopolicy=round-robin filename=ns=1 size=64M bs=4k \
    iodepth=32 reconnect_delay=0 $faults $verify time_based=1 runtime=10 "[$c]" rw=randwrite \
    > "$W/$c.fio"
done
for c in $cases; do
  : > "$W/$c.ms"
  for _ in $(seq "$R"); do
    fio --output=/dev/null "$W/$c.fio" 2> "$W/err" || { cat "$W/err" >&2; exit 1; }
    if grep -q "I/O error" "$W/err"; then cat "$W/err" >&2; exit 1; fi
    sed -n 's/.*longest I\/O stall \([0-9.]*\) ms/\1/p' "$W/err" >> "$W/$c.ms"
  done
  sort -n "$W/$c.ms" | awk -v c="$c" '{v[NR]=$1} END {
    printf "%-16s median %7.1f ms  range %7.1f .. %7.1f ms  (%d runs)\n", c, v[int((NR+1)/2)], v[1], v[NR], NR }'
done

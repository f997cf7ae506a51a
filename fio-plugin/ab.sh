#!/usr/bin/env bash
# Build A vs build B of the plugin, alternated on one machine: fio on the built-in RAM target,
# 4 KiB randread QD32 (768 MiB per run) and 128 KiB read QD8 (6 GiB per run). Prints each
# build's median IOPS with its range, and the B/A ratio's median and range over the pairs.
# usage: bash fio-plugin/ab.sh A.so B.so [pairs, default 5]
#   JOBS="rr4k seq128k rw4k sw128k" adds 4 KiB randwrite QD32 and 128 KiB write QD8;
#   rr4k1 and rw4k1 are 4 KiB randread and randwrite at QD1 (256 MiB per run).
#   e.g. A from `git worktree add /tmp/a <rev>` + `cargo build --release -p nvmf-rdma-fio`
#   (with the env of `fio-plugin/setup.sh --env`), B from this checkout.
#   OPTS_A / OPTS_B: extra fio options (space-separated key=value) for A's and B's runs only,
#   to compare two settings of one build, e.g.
#   OPTS_A=safe_retry=off OPTS_B=safe_retry=ccr bash fio-plugin/ab.sh P.so P.so
#   TARGET_A / TARGET_B: `nvmf-rdma` binaries; with both set, each build's fio runs against
#   its own `nvmf-rdma target --ram 256M` process over UDP on loopback (what users see)
#   instead of the built-in target, e.g.
#   TARGET_A=/tmp/a/target/release/nvmf-rdma TARGET_B=target/release/nvmf-rdma bash fio-plugin/ab.sh A.so B.so
set -euo pipefail
A=$(realpath "$1"); B=$(realpath "$2"); R=${3:-5}
JOBS=${JOBS:-rr4k seq128k}
W=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$W"' EXIT
# Where each build's fio finds its namespace: the built-in target, or its own target process.
where_a=builtin_target=256M where_b=builtin_target=256M
if [ -n "${TARGET_A:-}${TARGET_B:-}" ]; then
  [ -x "${TARGET_A:-}" ] && [ -x "${TARGET_B:-}" ] || {
    echo "ab.sh: TARGET_A and TARGET_B must both name nvmf-rdma binaries" >&2; exit 2; }
  for v in a b; do
    bin=$TARGET_A; [ $v = b ] && bin=$TARGET_B
    port=$(python3 -c "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    "$bin" target --ram 256M --listen "127.0.0.1:$port" > "$W/target-$v.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do grep -qs "listening on" "$W/target-$v.log" && break; sleep 0.1; done
    grep -q "listening on" "$W/target-$v.log" || {
      echo "ab.sh: target $v ($bin) did not start:" >&2; cat "$W/target-$v.log" >&2; exit 1; }
    nqn=$(sed -n 's/^target \([^ ]*\) listening on.*/\1/p' "$W/target-$v.log" | head -n 1)
    printf -v "where_$v" '%s' "traddr=127.0.0.1:$port subnqn=$nqn"
  done
fi
for v in a b; do
  so=$A opts=${OPTS_A:-} where=$where_a
  [ $v = b ] && so=$B opts=${OPTS_B:-} where=$where_b
  for j in $JOBS; do
    case $j in
      rr4k) rw=randread bs=4k qd=32 ios=768m ;;
      rw4k) rw=randwrite bs=4k qd=32 ios=768m ;;
      seq128k) rw=read bs=128k qd=8 ios=6g ;;
      sw128k) rw=write bs=128k qd=8 ios=6g ;;
      rr4k1) rw=randread bs=4k qd=1 ios=256m ;;
      rw4k1) rw=randwrite bs=4k qd=1 ios=256m ;;
      *) echo "unknown job $j (rr4k rw4k seq128k sw128k rr4k1 rw4k1)" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    printf '%s\n' '[global]' "ioengine=external:$so" thread=1 $where filename=ns=1 \
      size=256M "io_size=$ios" "bs=$bs" "iodepth=$qd" $opts "[$j]" "rw=$rw" > "$W/$v-$j.fio"
  done
done
for j in $JOBS; do
  for _ in $(seq "$R"); do
    for v in a b; do
      fio --output-format=json "$W/$v-$j.fio" 2>/dev/null |
        python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(j["read"]["iops"] + j["write"]["iops"])' >> "$W/$j.$v"
    done
  done
  python3 - "$W" "$j" <<'PY'
import sys, statistics as st
w, j = sys.argv[1], sys.argv[2]
a = [float(x) for x in open(f"{w}/{j}.a")]; b = [float(x) for x in open(f"{w}/{j}.b")]
r = [y / x for x, y in zip(a, b)]
print(f"{j}: A median {st.median(a):.0f} IOPS [{min(a):.0f}-{max(a):.0f}], "
      f"B median {st.median(b):.0f} [{min(b):.0f}-{max(b):.0f}], "
      f"B/A median {st.median(r):.3f} [{min(r):.3f}-{max(r):.3f}] over {len(r)} pairs")
PY
done

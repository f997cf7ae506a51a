#!/usr/bin/env bash
# Build A vs build B of the plugin, alternated on one machine: fio on the built-in RAM target,
# 4 KiB randread QD32 (768 MiB per run) and 128 KiB read QD8 (6 GiB per run). Prints each
# build's median IOPS with its range, and the B/A ratio's median and range over the pairs.
# usage: bash fio-plugin/ab.sh A.so B.so [pairs, default 5]
#   e.g. A from `git worktree add /tmp/a <rev>` + `cargo build --release -p nvmf-rdma-fio`
#   (with the env of `fio-plugin/setup.sh --env`), B from this checkout.
set -euo pipefail
A=$(realpath "$1"); B=$(realpath "$2"); R=${3:-5}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
for v in a b; do
  so=$A; [ $v = b ] && so=$B
  for j in rr4k seq128k; do
    if [ $j = rr4k ]; then rw=randread bs=4k qd=32 ios=768m; else rw=read bs=128k qd=8 ios=6g; fi
    printf '%s\n' '[global]' "ioengine=external:$so" thread=1 builtin_target=256M filename=ns=1 \
      size=256M "io_size=$ios" "bs=$bs" "iodepth=$qd" "[$j]" "rw=$rw" > "$W/$v-$j.fio"
  done
done
for j in rr4k seq128k; do
  for _ in $(seq "$R"); do
    for v in a b; do
      fio --output-format=json "$W/$v-$j.fio" 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["read"]["iops"])' >> "$W/$j.$v"
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

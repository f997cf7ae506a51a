#!/usr/bin/env bash
# Side by side, on this machine, in one go:
#   own     `nvmf-rdma bench` (the project's own loop over the same Controller API),
#   plugin  fio through this plugin against the built-in RAM target (in-process, loopback),
#   nbdkit  fio's own nbd engine against `nbdkit memory` over a unix socket,
# for the same jobs: 4 KiB randread/randwrite at QD1 and QD32, 128 KiB sequential read/write
# at QD8. Prints IOPS, average and p50 completion latency, and the ratios.
#
# usage: bash fio-plugin/bench.sh [seconds per job, default 3] [rounds, default 1]
#   Each workload runs on the three engines back to back (own, plugin, nbdkit), so a slow
#   minute on a shared machine hits all three alike. With rounds > 1 the whole set repeats
#   and the table shows medians, the ratios' medians and, beside plugin/own, their range.
#   FIO_EXTRA="iodepth_batch_submit=16 iodepth_batch_complete_min=8" adds job options to
#   both fio runs (space-separated key=value).
# needs: fio-plugin/setup.sh done (fio, nbdkit, the release plugin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
secs=${1:-${BENCH_SECS:-3}}
rounds=${2:-1}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "bench.sh: rounds must be a whole number >= 1, not '$rounds'" >&2; exit 1; }
plugin=${NVMF_FIO_PLUGIN:-$root/target/release/libnvmf_rdma_fio.so}
for tool in fio nbdkit python3; do
  command -v "$tool" >/dev/null || { echo "bench.sh: $tool is missing (run fio-plugin/setup.sh)" >&2; exit 1; }
done
[ -f "$plugin" ] || { echo "bench.sh: no plugin at $plugin (run fio-plugin/setup.sh)" >&2; exit 1; }
(cd "$root" && cargo build -q --release --bin nvmf-rdma)

work=$(mktemp -d)
nbd_pid=
cleanup() {
  [ -n "$nbd_pid" ] && kill "$nbd_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

workloads=("randread 4k 1" "randread 4k 32" "randwrite 4k 1" "randwrite 4k 32" \
           "read 128k 8" "write 128k 8")

# One fio job file: the engine's [global] lines, then one workload.
job() {
  local engine=$1 rw=$2 bs=$3 qd=$4
  echo "$engine"
  cat <<EOF
time_based=1
runtime=$secs
ramp_time=1
norandommap=1
randrepeat=0
size=1G
EOF
  for kv in ${FIO_EXTRA:-}; do echo "$kv"; done
  printf '[%s-%s-qd%s]\nrw=%s\nbs=%s\niodepth=%s\n' "$rw" "$bs" "$qd" "$rw" "$bs" "$qd"
}

# One nbdkit for the whole run, as a long-running server people would use.
nbdkit --foreground -U "$work/nbd.sock" memory size=1G &
nbd_pid=$!
for _ in $(seq 100); do [ -S "$work/nbd.sock" ] && break; sleep 0.1; done
[ -S "$work/nbd.sock" ] || { echo "bench.sh: nbdkit did not start" >&2; exit 1; }

plugin_global=$(printf '[global]\nioengine=external:%s\nthread=1\nbuiltin_target=1G\nfilename=ns=1' "$plugin")
nbd_global=$(printf '[global]\nioengine=nbd\nuri=nbd+unix:///?socket=%s' "$work/nbd.sock")
for r in $(seq "$rounds"); do
  for w in "${workloads[@]}"; do
    set -- $w
    name="$1-$2-qd$3"
    echo "round $r/$rounds: $name (own, plugin, nbdkit)" >&2
    "$root/target/release/nvmf-rdma" bench --seconds "$secs" --job "$name" >"$work/own.$r.$name.txt"
    job "$plugin_global" "$@" >"$work/plugin.fio"
    fio --output-format=json --output="$work/plugin.$r.$name.json" "$work/plugin.fio"
    job "$nbd_global" "$@" >"$work/nbd.fio"
    fio --output-format=json --output="$work/nbd.$r.$name.json" "$work/nbd.fio"
  done
done

python3 - "$work" "$rounds" "${workloads[@]}" <<'EOF'
import json, statistics, sys
work, rounds, workloads = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def fio_row(path):
    j = json.load(open(path))["jobs"][0]
    d = j["write" if "write" in j["jobname"] else "read"]
    return dict(iops=d["iops"], avg=d["clat_ns"]["mean"] / 1e3,
                p50=d["clat_ns"]["percentile"]["50.000000"] / 1e3, errors=j["error"])

def own_row(path):
    # rw bs unit qd IOPS MB/s p50 p99 errors
    f = open(path).read().splitlines()[1].split()
    return dict(iops=float(f[4]), p50=float(f[6]), errors=int(f[8]))

med = statistics.median
hdr = ("workload", "own IOPS", "plugin IOPS", "plugin/own", "nbdkit IOPS", "plugin/nbd",
       "plugin avg/p50 us", "nbdkit avg/p50 us")
fmt = "{:<20} {:>9} {:>11} {:>16} {:>11} {:>10} {:>17} {:>17}"
print(f"{rounds} round(s); " + ("medians across rounds, plugin/own range in brackets"
                                if rounds > 1 else "one round"))
print(fmt.format(*hdr))
errors = 0
for w in workloads:
    rw, bs, qd = w.split()
    name = f"{rw}-{bs}-qd{qd}"
    o = [own_row(f"{work}/own.{r}.{name}.txt") for r in range(1, rounds + 1)]
    p = [fio_row(f"{work}/plugin.{r}.{name}.json") for r in range(1, rounds + 1)]
    n = [fio_row(f"{work}/nbd.{r}.{name}.json") for r in range(1, rounds + 1)]
    errors += sum(x["errors"] for x in o + p + n)
    po = [a["iops"] / b["iops"] for a, b in zip(p, o)]
    pn = [a["iops"] / b["iops"] for a, b in zip(p, n)]
    ratio = f"{med(po):.2f}" + (f" [{min(po):.2f}-{max(po):.2f}]" if rounds > 1 else "")
    print(fmt.format(
        name,
        f"{med(x['iops'] for x in o):.0f}",
        f"{med(x['iops'] for x in p):.0f}",
        ratio,
        f"{med(x['iops'] for x in n):.0f}",
        f"{med(pn):.2f}",
        f"{med(x['avg'] for x in p):.1f}/{med(x['p50'] for x in p):.1f}",
        f"{med(x['avg'] for x in n):.1f}/{med(x['p50'] for x in n):.1f}",
    ))
print(f"errors: {errors}")
EOF

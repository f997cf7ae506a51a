#!/usr/bin/env bash
# Side by side, on this machine, in one go:
#   own     `nvmf-rdma bench` (the project's own loop over the same Controller API),
#   plugin  fio through this plugin against the built-in RAM target (in-process, loopback),
#   nbdkit  fio's own nbd engine against `nbdkit memory` over a unix socket,
# for the same jobs: 4 KiB randread/randwrite at QD1 and QD32, 128 KiB sequential read/write
# at QD8. Prints IOPS, average and p50 completion latency, and the ratios.
#
# usage: bash fio-plugin/bench.sh [seconds per job, default 3]
#   FIO_EXTRA="iodepth_batch_submit=16 iodepth_batch_complete_min=8" adds job options to
#   both fio runs (space-separated key=value).
# needs: fio-plugin/setup.sh done (fio, nbdkit, the release plugin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
secs=${1:-${BENCH_SECS:-3}}
plugin=${NVMF_FIO_PLUGIN:-$root/target/release/libnvmf_rdma_fio.so}
for tool in fio nbdkit python3; do
  command -v "$tool" >/dev/null || { echo "bench.sh: $tool is missing (run fio-plugin/setup.sh)" >&2; exit 1; }
done
[ -f "$plugin" ] || { echo "bench.sh: no plugin at $plugin (run fio-plugin/setup.sh)" >&2; exit 1; }
(cd "$root" && cargo build -q --release --bin nvmf-rdma)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The jobs, one after the other (stonewall), identical for both engines.
jobs() {
  cat <<EOF
time_based=1
runtime=$secs
ramp_time=1
norandommap=1
randrepeat=0
size=1G
EOF
  for kv in ${FIO_EXTRA:-}; do echo "$kv"; done
  for j in "randread 4k 1" "randread 4k 32" "randwrite 4k 1" "randwrite 4k 32" \
           "read 128k 8" "write 128k 8"; do
    set -- $j
    printf '[%s-%s-qd%s]\nstonewall\nrw=%s\nbs=%s\niodepth=%s\n' "$1" "$2" "$3" "$1" "$2" "$3"
  done
}

{ printf '[global]\nioengine=external:%s\nthread=1\nbuiltin_target=1G\nfilename=ns=1\n' "$plugin"; jobs; } >"$work/plugin.fio"
{ printf '[global]\nioengine=nbd\nuri=nbd+unix:///?socket=${unixsocket}\n'; jobs; } >"$work/nbd.fio"

echo "own benchmark: nvmf-rdma bench --seconds $secs" >&2
"$root/target/release/nvmf-rdma" bench --seconds "$secs" >"$work/own.txt"
echo "fio + plugin" >&2
fio --output-format=json --output="$work/plugin.json" "$work/plugin.fio"
echo "fio + nbd engine + nbdkit memory (unix socket)" >&2
nbdkit -U - memory size=1G --run "export unixsocket; fio --output-format=json --output=$work/nbd.json $work/nbd.fio"

python3 - "$work" <<'EOF'
import json, sys
work = sys.argv[1]

def fio_rows(path):
    rows = {}
    for j in json.load(open(path))["jobs"]:
        rw, bs, qd = j["jobname"].split("-")
        d = j["write" if "write" in rw else "read"]
        rows[(rw, bs, qd)] = (d["iops"], d["clat_ns"]["mean"] / 1e3,
                              d["clat_ns"]["percentile"]["50.000000"] / 1e3, j["error"])
    return rows

def own_rows(path):
    rows = {}
    for line in open(path).read().splitlines()[1:]:
        f = line.split()
        # rw bs unit qd IOPS MB/s p50 p99 errors
        rw, bs, qd, iops, p50 = f[0], f[1] + "k", "qd" + f[3], float(f[4]), float(f[6])
        rows[(rw, bs, qd)] = (iops, None, p50, int(f[8]))
    return rows

own, plug, nbd = own_rows(f"{work}/own.txt"), fio_rows(f"{work}/plugin.json"), fio_rows(f"{work}/nbd.json")
hdr = ("workload", "own IOPS", "plugin IOPS", "plugin/own", "nbdkit IOPS", "plugin/nbd",
       "plugin avg/p50 us", "nbdkit avg/p50 us")
fmt = "{:<20} {:>9} {:>11} {:>10} {:>11} {:>10} {:>17} {:>17}"
print(fmt.format(*hdr))
for key in plug:
    p, n, o = plug[key], nbd.get(key), own.get(key)
    print(fmt.format(
        "-".join(key),
        f"{o[0]:.0f}" if o else "-",
        f"{p[0]:.0f}",
        f"{p[0] / o[0]:.2f}" if o else "-",
        f"{n[0]:.0f}" if n else "-",
        f"{p[0] / n[0]:.2f}" if n else "-",
        f"{p[1]:.1f}/{p[2]:.1f}",
        f"{n[1]:.1f}/{n[2]:.1f}" if n else "-",
    ))
errs = sum(r[3] for r in list(plug.values()) + list(nbd.values()) + list(own.values()))
print(f"errors: {errs}")
EOF

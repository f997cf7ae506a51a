#!/usr/bin/env bash
# Host + target CPU per I/O of several builds, alternated in one run, measured as bench.sh's
# "ext" engine does: fio + the plugin against `nvmf-rdma target --ram 1G` running as its own
# process, host = fio's CPU (getrusage), target = the target's (/proc/PID/stat), both over the
# fio run (fio-plugin/cpu.py), divided by the I/Os fio completed.
#
# usage: bash fio-plugin/cpu-ab.sh BUILD_A BUILD_B [BUILD_C...]
#   BUILD    ROOT, or ROOT@GLOBAL_ARGS@FIO_OPTS[@TARGET_ARGS] to run one build two ways: ROOT a checkout
#            with release builds in ROOT/target/release (nvmf-rdma and libnvmf_rdma_fio.so),
#            each build runs its own target and its own plugin; GLOBAL_ARGS go before
#            `target` (e.g. --busy-poll=0), FIO_OPTS (space separated k=v) into the job
#            (e.g. busy_poll=0), TARGET_ARGS after `target` (e.g. --threads 2).
#   ROUNDS=5 rounds; each round runs every job on every build, A B C..., back to back.
#   SECS=3   seconds per fio run (time_based).
#   JOBS="randread-4k-32 randwrite-4k-32"   RW-BS-QD of each job.
# Prints per build and job: median IOPS, host, target and sum µs per I/O [range], and the sum
# as a ratio to the first build's within each round: median [range].
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 2 ] || { echo "usage: cpu-ab.sh ROOT_A ROOT_B [ROOT...]" >&2; exit 2; }
rounds=${ROUNDS:-5}; secs=${SECS:-3}; jobs=${JOBS:-randread-4k-32 randwrite-4k-32}
roots=(); targs=(); fopts=(); tgtargs=()
for b in "$@"; do
  IFS=@ read -r r ta fo tg <<<"$b"
  r=$(realpath "$r")
  targs+=("$ta"); fopts+=("$fo"); tgtargs+=("$tg")
  for f in nvmf-rdma libnvmf_rdma_fio.so; do
    [ -f "$r/target/release/$f" ] || { echo "cpu-ab.sh: no $r/target/release/$f" >&2; exit 1; }
  done
  roots+=("$r")
done
nqn=nqn.2026-11.io.nvmf-rdma:demo
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ports=()
for i in "${!roots[@]}"; do
  port=$(python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # shellcheck disable=SC2086 # GLOBAL_ARGS and TARGET_ARGS split on spaces
  "${roots[$i]}/target/release/nvmf-rdma" ${targs[$i]} target --ram 1G --listen "127.0.0.1:$port" ${tgtargs[$i]} >"$work/target.$i.log" 2>&1 &
  pids+=($!)
  ports+=("$port")
  for _ in $(seq 100); do grep -q "listening on" "$work/target.$i.log" && break; sleep 0.1; done
  grep -q "listening on" "$work/target.$i.log" || { echo "cpu-ab.sh: target $i did not start:" >&2; cat "$work/target.$i.log" >&2; exit 1; }
  echo "build $i: ${roots[$i]} ($(git -C "${roots[$i]}" describe --always --dirty 2>/dev/null || echo ?))" \
       "${targs[$i]:+global: ${targs[$i]} }${tgtargs[$i]:+target: ${tgtargs[$i]} }${fopts[$i]:+fio: ${fopts[$i]}}"
done
for r in $(seq "$rounds"); do
  for j in $jobs; do
    IFS=- read -r rw bs qd <<<"$j"
    for i in "${!roots[@]}"; do
      printf '%s\n' '[global]' "ioengine=external:${roots[$i]}/target/release/libnvmf_rdma_fio.so" \
        thread=1 "traddr=127.0.0.1:${ports[$i]}" "subnqn=$nqn" filename=ns=1 time_based=1 \
        "runtime=$secs" norandommap=1 randrepeat=0 size=1G ${fopts[$i]} "[$j]" "rw=$rw" \
        "bs=$bs" "iodepth=$qd" >"$work/job.fio"
      python3 "$here/cpu.py" "$work/$j.$i.$r.cpu" "${pids[$i]}" \
        fio --output-format=json --output="$work/$j.$i.$r.json" "$work/job.fio"
    done
  done
  echo "round $r/$rounds done (load $(cut -d' ' -f1 /proc/loadavg))" >&2
done
python3 - "$work" "$rounds" "${#roots[@]}" $jobs <<'EOF'
import json, statistics as st, sys
work, rounds, n, jobs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def row(j, i, r):
    with open(f"{work}/{j}.{i}.{r}.json") as f:
        job = json.load(f)["jobs"][0]
    with open(f"{work}/{j}.{i}.{r}.cpu") as f:
        c = json.load(f)
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    return dict(iops=job["read"]["iops"] + job["write"]["iops"], err=job["error"],
                host=c["host_cpu_s"] / ios * 1e6, tgt=c["target_cpu_s"] / ios * 1e6,
                sum=(c["host_cpu_s"] + c["target_cpu_s"]) / ios * 1e6)
def sp(xs, d=2):
    return f"{st.median(xs):.{d}f} [{min(xs):.{d}f}-{max(xs):.{d}f}]"
print(f"{rounds} rounds, medians [min-max]; CPU in µs per I/O")
for j in jobs:
    rows = [[row(j, i, r) for r in range(1, rounds + 1)] for i in range(n)]
    for i in range(n):
        x = rows[i]
        ratio = sp([a["sum"] / b["sum"] for a, b in zip(x, rows[0])], 3)
        print(f"{j:<16} build {i}: IOPS {sp([r['iops'] for r in x], 0)}  host {sp([r['host'] for r in x])}"
              f"  tgt {sp([r['tgt'] for r in x])}  sum {sp([r['sum'] for r in x])}"
              f"  sum/build0 {ratio}  errors {sum(r['err'] for r in x)}")
EOF

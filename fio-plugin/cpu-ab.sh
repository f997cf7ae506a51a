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
#   ENGINE=plugin  the plugin's built-in RAM target instead (`builtin_target=1G`, as bench.sh's
#            "plugin" engine): host and target are one process (fio's), and each job runs
#            twice, SECS and LONG seconds (default 3 x SECS), back to back; the CPU per I/O
#            is the difference of the two runs' CPU over the difference of their I/Os
#            (cpu.py's marginal_us), so the second or so of CPU the target spends on its
#            memory before the first I/O cancels. GLOBAL_ARGS and TARGET_ARGS do not apply.
#            Give it seconds: a same-build pair came out 0.92-1.13 apart at SECS=3, and
#            2.4x apart at SECS=1 LONG=2.
# Prints per build and job: median IOPS, host, target and sum µs per I/O [range], and the sum
# as a ratio to the first build's within each round: median [range]. With ENGINE=plugin, the
# sum is the marginal host + target figure and host/target are not told apart.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 2 ] || { echo "usage: cpu-ab.sh ROOT_A ROOT_B [ROOT...]" >&2; exit 2; }
rounds=${ROUNDS:-5}; secs=${SECS:-3}; jobs=${JOBS:-randread-4k-32 randwrite-4k-32}
engine=${ENGINE:-ext}; long=${LONG:-$((3 * secs))}
case $engine in ext|plugin) ;; *) echo "cpu-ab.sh: ENGINE is ext or plugin, not '$engine'" >&2; exit 2 ;; esac
[ "$long" -gt "$secs" ] || { echo "cpu-ab.sh: LONG ($long) must be more than SECS ($secs)" >&2; exit 2; }
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
  echo "build $i: ${roots[$i]} ($(git -C "${roots[$i]}" describe --always --dirty 2>/dev/null || echo ?))" \
       "${targs[$i]:+global: ${targs[$i]} }${tgtargs[$i]:+target: ${tgtargs[$i]} }${fopts[$i]:+fio: ${fopts[$i]}}"
  [ "$engine" = ext ] || continue
  port=$(python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # shellcheck disable=SC2086 # GLOBAL_ARGS and TARGET_ARGS split on spaces
  "${roots[$i]}/target/release/nvmf-rdma" ${targs[$i]} target --ram 1G --listen "127.0.0.1:$port" ${tgtargs[$i]} >"$work/target.$i.log" 2>&1 &
  pids+=($!)
  ports+=("$port")
  for _ in $(seq 100); do grep -q "listening on" "$work/target.$i.log" && break; sleep 0.1; done
  grep -q "listening on" "$work/target.$i.log" || { echo "cpu-ab.sh: target $i did not start:" >&2; cat "$work/target.$i.log" >&2; exit 1; }
done
# `run I J RW BS QD SECS OUT`: build I's fio job J for SECS seconds; OUT.json and OUT.cpu.
run() {
  local i=$1 j=$2 rw=$3 bs=$4 qd=$5 t=$6 out=$7 target=- where
  if [ "$engine" = ext ]; then
    where=("traddr=127.0.0.1:${ports[$i]}" "subnqn=$nqn")
    target=${pids[$i]}
  else
    where=(builtin_target=1G)
  fi
  # shellcheck disable=SC2086 # FIO_OPTS split on spaces
  printf '%s\n' '[global]' "ioengine=external:${roots[$i]}/target/release/libnvmf_rdma_fio.so" \
    thread=1 "${where[@]}" filename=ns=1 time_based=1 "runtime=$t" norandommap=1 randrepeat=0 \
    size=1G ${fopts[$i]} "[$j]" "rw=$rw" "bs=$bs" "iodepth=$qd" >"$work/job.fio"
  python3 "$here/cpu.py" "$out.cpu" "$target" \
    fio --output-format=json --output="$out.json" "$work/job.fio"
}
for r in $(seq "$rounds"); do
  for j in $jobs; do
    IFS=- read -r rw bs qd <<<"$j"
    for i in "${!roots[@]}"; do
      run "$i" "$j" "$rw" "$bs" "$qd" "$secs" "$work/$j.$i.$r"
      [ "$engine" = ext ] || run "$i" "$j" "$rw" "$bs" "$qd" "$long" "$work/$j.$i.$r.long"
    done
  done
  echo "round $r/$rounds done (load $(cut -d' ' -f1 /proc/loadavg))" >&2
done
python3 - "$here" "$work" "$rounds" "${#roots[@]}" "$engine" $jobs <<'EOF'
import json, statistics as st, sys
here, work, rounds, n, engine, jobs = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                       int(sys.argv[4]), sys.argv[5], sys.argv[6:])
sys.path.insert(0, here)
from cpu import marginal_us
def one(path):
    with open(f"{path}.json") as f:
        job = json.load(f)["jobs"][0]
    with open(f"{path}.cpu") as f:
        c = json.load(f)
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    return dict(iops=job["read"]["iops"] + job["write"]["iops"], err=job["error"], ios=ios,
                host=c["host_cpu_s"] / ios * 1e6, tgt=c["target_cpu_s"] / ios * 1e6,
                cpu_s=c["host_cpu_s"] + c["target_cpu_s"])
def row(j, i, r):
    short = one(f"{work}/{j}.{i}.{r}")
    if engine == "ext":
        return dict(short, sum=short["cpu_s"] / short["ios"] * 1e6)
    long = one(f"{work}/{j}.{i}.{r}.long")
    # None when the long run did no more I/O or CPU (the machine busy with something
    # else): that round is left out of this build's CPU figures and of its ratios.
    us = marginal_us(short, long)
    return dict(long, err=short["err"] + long["err"], host=us, tgt=0.0, sum=us)
def sp(xs, d=2):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{st.median(xs):.{d}f} [{min(xs):.{d}f}-{max(xs):.{d}f}]"
print(f"{rounds} rounds, medians [min-max]; CPU in µs per I/O"
      + ("; plugin: built-in target, marginal CPU (long run - short run), host = sum"
         if engine == "plugin" else ""))
for j in jobs:
    rows = [[row(j, i, r) for r in range(1, rounds + 1)] for i in range(n)]
    for i in range(n):
        x = rows[i]
        ratio = sp([a["sum"] / b["sum"] for a, b in zip(x, rows[0])
                    if a["sum"] is not None and b["sum"] is not None], 3)
        split = (f"  host {sp([r['host'] for r in x])}  tgt {sp([r['tgt'] for r in x])}"
                 if engine == "ext" else "")
        print(f"{j:<16} build {i}: IOPS {sp([r['iops'] for r in x], 0)}{split}"
              f"  sum {sp([r['sum'] for r in x])}"
              f"  sum/build0 {ratio}  errors {sum(r['err'] for r in x)}")
EOF

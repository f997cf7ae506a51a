#!/usr/bin/env bash
# Side by side, on this machine, in one go, for the same jobs (4 KiB randread/randwrite at QD1
# and QD32, 128 KiB sequential read/write at QD8):
#   own      `nvmf-rdma bench -o json` (the project's own loop over the Controller API, with
#            its built-in target in the same process),
#   plugin   fio through this plugin, built-in RAM target in fio's process (`builtin_target`),
#   ext      fio through this plugin against `nvmf-rdma target --ram 1G` as its own process,
#            started once for the whole run (loopback, a free UDP port),
#   nbdkit   fio's own nbd engine against `nbdkit memory size=1G` over a unix socket, also
#            one server for the whole run,
#   raw      `nvmf-rdma bench --hca -o json`: the soft-HCA's raw RDMA READ/WRITE rates,
#   raw 2p   `nvmf-rdma bench --hca --peer-process -o json`: the same with the responder in a
#            process of its own, every packet over UDP (the ceiling of ext), and again with
#            `--region 1G` (the requester's side through 1 GiB, as the target's namespace),
# (own, plugin and raw have host and target in one process: their packets take the in-memory
# loopback path, as rxe's loopback does, unless NVMF_RDMA_LOOPBACK=udp is set; ext and the
# loss runs cross processes over UDP; the header says which),
# and, with LOSS set, 4 KiB QD32 randread/randwrite with verify through the plugin under
# random UDP loss (fio-plugin/loss.sh).
#
# usage: bash fio-plugin/bench.sh [seconds per job, default 3] [rounds, default 1]
#   Every round runs each workload on own, plugin (twice: SECONDS, then twice that, for the
#   CPU table), ext and nbdkit back to back, then the raw table, then the loss runs, so a
#   slow minute on a shared machine hits all of them alike.
#   Figures are medians over the rounds; [a-b] is the range of a ratio over the rounds, each
#   ratio taken within one round. No warm-up is cut (fio's ramp_time=0, as the own loop):
#   every I/O done is counted, which the CPU columns need.
#   LOSS=2,5            also run the loss table at these percentages (and at 0 for the
#                       lossless figure), each round; needs root, ip and nft.
#   FIO_EXTRA="k=v ..." adds job options to every fio run of the main table.
#   EXT_BUSY_POLL=0us   the busy-poll window of ext's two processes (the target's --busy-poll
#                       and the plugin's busy_poll=; default 50us, as a user gets: polling
#                       that goes unanswered stops for 1 ms, up to 100 ms after misses one
#                       after another; docs/performance.md, "Busy polling").
#   EXT_BUSY_POLL_GATE=1 the busy-poll gate on ext's two processes (--busy-poll-gate,
#                       busy_poll_gate=1): spinning stops for a while once it is preempted.
#
# Output: a header with the machine (CPU, cores, kernel, load average), then
#   goal table   the issue's goals on the deployment users have, fio + plugin against a target
#                process (ext), each beside its goal, and the in-process figure (plugin or
#                own: host and target in one process, packets handed over in memory) beside
#                it, labelled as such: ext/nbd IOPS at 4 KiB QD32 and 128 KiB QD8, QD1 average
#                latency ext/nbd, host + target CPU per I/O ext/nbd, ext 128 KiB GB/s over the
#                two-process raw rate of the operation that carries its data, and with LOSS
#                the 4 KiB QD32 fraction of the lossless IOPS at each rate.
#   IOPS table   IOPS of own, plugin, nbdkit; plugin/own and plugin/nbd; fio's average and
#                p50 total latency (µs, `lat`: submission + completion) for plugin and
#                nbdkit, plugin/nbd of the averages, and nbdkit's average submission
#                latency (`slat`, which `clat` leaves out; the plugin's is 0); "own copies/IO" and
#                "own tgt cp/IO" are the `copies_per_io` (host) and `target_copies_per_io`
#                fields of own's result objects, "n/a" where bench has none.
#   CPU table    CPU µs per I/O = (user + system CPU seconds of a process while the fio run
#                lasted, all its threads) / (I/Os fio completed). host = the fio process
#                (getrusage of the child: os.wait4), target = the server process (utime +
#                stime from /proc/PID/stat before and after). ext host/target/sum beside
#                nbdkit host (fio)/target (nbdkit)/sum, and ext/nbd of the sums; "ext tgt
#                cp/IO" is how much the target's nvmet_io_copies_total grew (its
#                --metrics-addr endpoint, read before and after) per I/O fio did.
#                The whole fio process is counted: start-up, connect and exit are in it.
#                "plugin sum": host + target with the built-in target, both in fio's process.
#                Taking and zeroing its 1 GiB, about 1 s of CPU, would swamp a 3 s run, so
#                every plugin job also runs for twice the seconds right after, and the figure
#                is the difference in fio's CPU over the difference in I/Os (cpu.py's
#                marginal_us): the CPU of the I/O phase alone. (own is not measured.)
#                Busy polling (50 µs, the default on both sides) is CPU spent and counted.
#   128 KiB table NVMe-oF 128 KiB QD8 throughput (own, plugin) beside the raw soft-HCA 128 KiB
#                rate of the RDMA operation that carries its data (depth 16): a read's data is
#                the target's RDMA WRITE, a write's data the target's RDMA READ. "raw" reuses
#                depth x 128 KiB of memory on the requester's side, which stays in cache;
#                "raw 1G" moves through 1 GiB there (`bench --hca --region 1G`), as the
#                namespace's data does, and own/raw 1G is own's ratio to that.
#   2-process    the raw soft-HCA between two processes (bench --hca --peer-process): GB/s,
#                packets per second, and packets per CPU-second of each process, with UDP
#                GSO/GRO on and off.
#   loss table   at each LOSS percentage: ext-style target and fio both inside a private
#                network namespace (loss.sh); IOPS as a fraction of the 0% run of the same
#                round, and whether fio's verify was clean in every round.
# Failures: a run that fails (a missing tool, a server that does not start, fio or bench
# exiting non-zero, an I/O or verify error, a loss run without its figures) stops the
# benchmark with a line naming it and the end of its log, exit 1, and no figure at all.
# needs: fio-plugin/setup.sh done (fio, nbdkit, nftables, the release plugin), python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
secs=${1:-${BENCH_SECS:-3}}
rounds=${2:-1}
[[ $secs =~ ^[1-9][0-9]*$ ]] || { echo "bench.sh: seconds must be a whole number >= 1, not '$secs'" >&2; exit 1; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "bench.sh: rounds must be a whole number >= 1, not '$rounds'" >&2; exit 1; }
loss_rates=()
if [ -n "${LOSS:-}" ]; then
  IFS=, read -ra loss_rates <<<"$LOSS"
  for p in "${loss_rates[@]}"; do
    [[ $p =~ ^[0-9]+$ ]] && [ "$p" -ge 1 ] && [ "$p" -le 100 ] ||
      { echo "bench.sh: LOSS takes percentages 1-100 separated by commas (LOSS=2,5), not '$LOSS'" >&2; exit 1; }
  done
fi
ext_busy_poll=${EXT_BUSY_POLL:-50us}
[[ $ext_busy_poll =~ ^[0-9]+us$ ]] || { echo "bench.sh: EXT_BUSY_POLL takes microseconds (0us, 50us), not '$ext_busy_poll'" >&2; exit 1; }
ext_gate=${EXT_BUSY_POLL_GATE:-0}
[[ $ext_gate =~ ^[01]$ ]] || { echo "bench.sh: EXT_BUSY_POLL_GATE takes 0 or 1, not '$ext_gate'" >&2; exit 1; }
plugin=${NVMF_FIO_PLUGIN:-$root/target/release/libnvmf_rdma_fio.so}
for tool in fio nbdkit python3; do
  command -v "$tool" >/dev/null || { echo "bench.sh: $tool is missing (run fio-plugin/setup.sh)" >&2; exit 1; }
done
# The loss runs need a network namespace with an nftables rule: say what is missing before
# the first round, not after the main table has run.
if [ ${#loss_rates[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "bench.sh: LOSS needs root (network namespaces and nftables); run as root or drop LOSS" >&2; exit 1; }
  for tool in ip nft; do
    command -v "$tool" >/dev/null ||
      { echo "bench.sh: LOSS needs $tool (run fio-plugin/setup.sh, which installs iproute2 and nftables)" >&2; exit 1; }
  done
fi
[ -f "$plugin" ] || { echo "bench.sh: no plugin at $plugin (run fio-plugin/setup.sh)" >&2; exit 1; }
(cd "$root" && cargo build -q --release --bin nvmf-rdma)
bin=$root/target/release/nvmf-rdma
nqn=nqn.2026-11.io.nvmf-rdma:demo

work=$(mktemp -d)
nbd_pid=
tgt_pid=
cleanup() {
  for pid in $nbd_pid $tgt_pid; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# `cpu OUT TARGET_PID CMD...`: fio-plugin/cpu.py (CMD's and TARGET_PID's CPU seconds).
cpu() { python3 "$here/cpu.py" "$@"; }

# `must WHAT LOG CMD...`: run CMD with its stderr in LOG; if it fails, say which run failed
# with the end of LOG and stop. A benchmark with a failed run prints no figure at all.
must() {
  local what=$1 log=$2 rc=0
  shift 2
  "$@" 2>"$log" || rc=$?
  if [ "$rc" != 0 ]; then
    echo "bench.sh: $what failed (exit $rc); no figures are printed. Its last lines:" >&2
    tail -n 8 "$log" >&2 2>/dev/null || true
    exit 1
  fi
}

# `to FILE CMD...`: CMD with its stdout in FILE.
to() { local out=$1; shift; "$@" >"$out"; }

# Wait (up to 10 s) for a line matching $2 in file $1, written by the process $3.
wait_for() {
  for _ in $(seq 100); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || break
    sleep 0.1
  done
  echo "bench.sh: no '$2' in $1:" >&2; cat "$1" >&2; return 1
}

workloads=("randread 4k 1" "randread 4k 32" "randwrite 4k 1" "randwrite 4k 32" \
           "read 128k 8" "write 128k 8")

# One fio job file: the engine's [global] lines, then one workload for SECONDS.
job() {
  local engine=$1 seconds=$2 rw=$3 bs=$4 qd=$5
  echo "$engine"
  cat <<EOF
time_based=1
runtime=$seconds
norandommap=1
randrepeat=0
size=1G
lat_percentiles=1
EOF
  for kv in ${FIO_EXTRA:-}; do echo "$kv"; done
  printf '[%s-%s-qd%s]\nrw=%s\nbs=%s\niodepth=%s\n' "$rw" "$bs" "$qd" "$rw" "$bs" "$qd"
}

# The loss job: fill 32 MiB with fio's verify pattern, then 4 KiB QD32 randread and randwrite
# over it, both checking every block they read (randwrite reads back behind itself).
loss_job() {
  cat <<EOF
[global]
ioengine=external:$plugin
thread=1
traddr=127.0.0.1
subnqn=$nqn
filename=ns=1
bs=4k
iodepth=32
size=32M
verify=crc32c
# No local-*-verify.state files left in the caller's directory.
verify_state_save=0
norandommap=1
# A job that fails (its connect included) ends the run: the next would check unwritten data.
exitall_on_error=1
exit_what=all
[fill]
rw=write
do_verify=0
[randread-4k-qd32]
stonewall
rw=randread
time_based=1
runtime=$secs
[randwrite-4k-qd32]
stonewall
rw=randwrite
verify_backlog=1024
time_based=1
runtime=$secs
EOF
}

# Runs inside loss.sh's namespace: a target on its loopback, the loss job, the target stops.
cat >"$work/loss-run.sh" <<EOF
set -u
"$bin" target --ram 64M >"\$1.target.log" 2>&1 &
tgt=\$!
$(declare -f wait_for)
wait_for "\$1.target.log" "listening on" \$tgt || exit 1
fio --output-format=json --output="\$1.json" "$work/loss.fio"
rc=\$?
kill \$tgt; wait \$tgt
exit \$rc
EOF
loss_job >"$work/loss.fio"

# The machine, for the header.
{
  echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)," \
       "$(nproc) cores, kernel $(uname -r); load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "build: $(cd "$root" && git describe --always --dirty 2>/dev/null || echo unknown);" \
       "command: $([ -n "${LOSS:-}" ] && echo "LOSS=$LOSS ")$([ -n "${EXT_BUSY_POLL:-}" ] && echo "EXT_BUSY_POLL=$EXT_BUSY_POLL ")$([ -n "${EXT_BUSY_POLL_GATE:-}" ] && echo "EXT_BUSY_POLL_GATE=$EXT_BUSY_POLL_GATE ")bash fio-plugin/bench.sh $secs $rounds"
  if [ "${NVMF_RDMA_LOOPBACK:-}" = udp ]; then
    echo "paths: every engine's packets through UDP sockets on 127.0.0.1 (NVMF_RDMA_LOOPBACK=udp)"
  else
    echo "paths: own, plugin and raw (host and target in one process) hand packets over in memory" \
         "(the loopback path; NVMF_RDMA_LOOPBACK=udp for UDP); ext and the loss runs (two" \
         "processes) go through UDP sockets; nbdkit through a unix socket"
  fi
} >"$work/header"

# The servers: nbdkit and our target, one each for the whole run, as people would run them.
nbdkit --foreground -U "$work/nbd.sock" memory size=1G &
nbd_pid=$!
# A free loopback port: free_port DGRAM (the target's UDP) or free_port STREAM (metrics).
free_port() {
  python3 -c "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_$1); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}
port=$(free_port DGRAM)
mport=$(free_port STREAM)
"$bin" --busy-poll="$ext_busy_poll" $([ "$ext_gate" = 1 ] && echo --busy-poll-gate) --metrics-addr "127.0.0.1:$mport" target --ram 1G --listen "127.0.0.1:$port" >"$work/target.log" 2>&1 &
tgt_pid=$!
for _ in $(seq 100); do [ -S "$work/nbd.sock" ] && break; sleep 0.1; done
[ -S "$work/nbd.sock" ] || { echo "bench.sh: nbdkit did not start" >&2; exit 1; }
wait_for "$work/target.log" "listening on" "$tgt_pid"

plugin_global=$(printf '[global]\nioengine=external:%s\nthread=1\nbuiltin_target=1G\nfilename=ns=1' "$plugin")
ext_global=$(printf '[global]\nioengine=external:%s\nthread=1\ntraddr=127.0.0.1:%s\nsubnqn=%s\nfilename=ns=1\nbusy_poll=%s\nbusy_poll_gate=%s' \
  "$plugin" "$port" "$nqn" "$ext_busy_poll" "$ext_gate")
nbd_global=$(printf '[global]\nioengine=nbd\nuri=nbd+unix:///?socket=%s' "$work/nbd.sock")
for r in $(seq "$rounds"); do
  for w in "${workloads[@]}"; do
    set -- $w
    name="$1-$2-qd$3"
    echo "round $r/$rounds: $name (own, plugin, ext, nbdkit)" >&2
    must "round $r: own $name" "$work/own.$r.$name.err" \
      to "$work/own.$r.$name.json" "$bin" bench --seconds "$secs" --job "$name" -o json
    for e in plugin plugin-long ext nbd; do
      case $e in plugin*) g=$plugin_global ;; ext) g=$ext_global ;; nbd) g=$nbd_global ;; esac
      t=$secs; [ $e = plugin-long ] && t=$((2 * secs))
      job "$g" "$t" "$@" >"$work/$e.fio"
      run=(fio --output-format=json --output="$work/$e.$r.$name.json" "$work/$e.fio")
      log=$work/$e.$r.$name.err
      case $e in plugin*) must "round $r: fio $e $name" "$log" cpu "$work/$e.$r.$name.cpu" - "${run[@]}" ;;
                 ext) COPIES_URL=http://127.0.0.1:$mport/metrics \
                        must "round $r: fio ext $name" "$log" cpu "$work/$e.$r.$name.cpu" "$tgt_pid" "${run[@]}" ;;
                 nbd) must "round $r: fio nbdkit $name" "$log" cpu "$work/$e.$r.$name.cpu" "$nbd_pid" "${run[@]}" ;; esac
    done
  done
  echo "round $r/$rounds: raw soft-HCA table" >&2
  must "round $r: raw soft-HCA bench" "$work/hca.$r.err" \
    to "$work/hca.$r.json" "$bin" bench --hca --seconds "$secs" -o json
  must "round $r: raw soft-HCA bench --region 1G" "$work/hca1g.$r.err" \
    to "$work/hca1g.$r.json" "$bin" bench --hca --region 1G --seconds "$secs" -o json
  must "round $r: raw soft-HCA bench --peer-process" "$work/hca2p.$r.err" \
    to "$work/hca2p.$r.json" "$bin" bench --hca --peer-process --seconds "$secs" -o json
  must "round $r: raw soft-HCA bench --peer-process --region 1G" "$work/hca2p1g.$r.err" \
    to "$work/hca2p1g.$r.json" "$bin" bench --hca --peer-process --region 1G --seconds "$secs" -o json
  for p in ${loss_rates[@]:+0 "${loss_rates[@]}"}; do
    echo "round $r/$rounds: $p% UDP loss, verify on" >&2
    # fio exits non-zero on a verify error too, so a clean exit is a clean verify.
    must "round $r: the $p% loss run" "$work/loss.$r.$p.log" \
      bash "$here/loss.sh" "$p" -- bash "$work/loss-run.sh" "$work/loss.$r.$p"
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$work/header"

python3 - "$here" "$work" "$rounds" "${loss_rates[*]:-}" "${workloads[@]}" <<'EOF'
import json, statistics, sys

here, work, rounds, loss_rates, workloads = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                             sys.argv[4].split(), sys.argv[5:])
sys.path.insert(0, here)
from cpu import marginal_us
names = ["{}-{}-qd{}".format(*w.split()) for w in workloads]
med = statistics.median

def spread(xs, digits=2):
    """Median, and with several rounds the range: '0.93 [0.88-0.97]'."""
    s = f"{med(xs):.{digits}f}"
    return s + (f" [{min(xs):.{digits}f}-{max(xs):.{digits}f}]" if len(xs) > 1 else "")

def json_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

def cpu(path):
    with open(path) as f:
        return json.load(f)

def fio_row(engine, r, name):
    with open(f"{work}/{engine}.{r}.{name}.json") as f:
        j = json.load(f)["jobs"][0]
    d = j["write" if "write" in j["jobname"] else "read"]
    row = dict(iops=d["iops"], gbps=d["bw_bytes"] / 1e9, ios=d["total_ios"],
               # Total latency: the nbd engine sends its request inside fio's queue call
               # (slat, 2-4 µs at 4 KiB here), which clat leaves out; the plugin queues and
               # issues at commit (slat 0). At QD1, 1/IOPS is lat, not clat.
               avg=d["lat_ns"]["mean"] / 1e3, p50=d["lat_ns"]["percentile"]["50.000000"] / 1e3,
               slat=d["slat_ns"]["mean"] / 1e3,
               errors=j["error"])
    row.update(cpu(f"{work}/{engine}.{r}.{name}.cpu"))
    return row

def own_row(r, name):
    results = [o for o in json_lines(f"{work}/own.{r}.{name}.json") if o["type"] == "result"]
    if len(results) != 1:
        sys.exit(f"bench.sh: own.{r}.{name}.json has {len(results)} result objects, want 1")
    o = results[0]
    return dict(iops=o["iops"], gbps=o["mbps"] / 1e3, ios=o["ios"], errors=o["errors"],
                copies=o.get("copies_per_io"), tgt_copies=o.get("target_copies_per_io"))

def per_io_us(row, key):
    return row[key] / row["ios"] * 1e6

runs = range(1, rounds + 1)
own = {n: [own_row(r, n) for r in runs] for n in names}
fio = {(e, n): [fio_row(e, r, n) for r in runs]
       for e in ("plugin", "plugin-long", "ext", "nbd") for n in names}

def plugin_us(short, long):
    """The built-in target's host + target CPU per I/O of one round (marginal_us); None when
    the longer run did no more I/O or spent no more CPU (a machine busy with something else)."""
    return marginal_us(*(dict(cpu_s=x["host_cpu_s"], ios=x["ios"]) for x in (short, long)))

def known(xs):
    """The rounds that gave a figure; the column says 'k/n' when some did not."""
    return [x for x in xs if x is not None]

def of_rounds(xs):
    return "" if None not in xs else f" ({len(known(xs))}/{len(xs)})"

LOSS_JOBS = ("randread-4k-qd32", "randwrite-4k-qd32")

def loss_iops(r, p):
    """IOPS by job of one loss run; None when a job is missing or reported an error."""
    with open(f"{work}/loss.{r}.{p}.json") as f:
        jobs = {j["jobname"]: j for j in json.load(f)["jobs"]}
    if any(j["error"] for j in jobs.values()) or not all(n in jobs for n in LOSS_JOBS):
        return None
    return {n: jobs[n]["read" if "randread" in n else "write"]["iops"] for n in LOSS_JOBS}

loss = {(r, p): loss_iops(r, p) for r in runs for p in (["0"] + loss_rates if loss_rates else [])}

# A run with an I/O error, or a loss run without its figures, fails the whole benchmark
# before any table is printed: no figure comes from a run that failed.
failed = [f"own {n} round {r}: {x['errors']} I/O errors"
          for n, rows in own.items() for r, x in zip(runs, rows) if x["errors"]]
failed += [f"fio {e} {n} round {r}: error {x['errors']}"
           for (e, n), rows in fio.items() for r, x in zip(runs, rows) if x["errors"]]
failed += [f"the {p}% loss run of round {r}: a job failed or is missing"
           for (r, p), v in loss.items() if v is None or 0 in v.values()]
if failed:
    print("bench.sh: " + "; ".join(failed) + "; no figures are printed", file=sys.stderr)
    sys.exit(1)

with open(f"{work}/header") as f:
    print(f.read(), end="")
print(f"{rounds} round(s) of {len(names)} workloads; "
      + ("medians, [min-max] of each ratio over the rounds" if rounds > 1 else "one round"))

hca = [json_lines(f"{work}/hca.{r}.json") for r in runs]
hca1g = [json_lines(f"{work}/hca1g.{r}.json") for r in runs]
hca2p = [json_lines(f"{work}/hca2p.{r}.json") for r in runs]
hca2p1g = [json_lines(f"{work}/hca2p1g.{r}.json") for r in runs]
def raw(r, op, table=hca):
    return next(x["gbps"] for x in table[r - 1] if x["op"] == op and x["bytes"] == 128 << 10)

def raw2p(r, op, table=hca2p):
    """The two-process raw rate (GB/s, GSO/GRO on) of `op` at 128 KiB in round r."""
    return next(x["gbps"] for x in table[r - 1]
                if x["op"] == op and x["bytes"] == 128 << 10 and x["offload"])

def sum_us(x):
    return per_io_us(x, "host_cpu_s") + per_io_us(x, "target_cpu_s")

print("\nGoals, on the deployment users have: fio + plugin against `nvmf-rdma target` in another "
      "process over UDP (ext). The in-process column is the same ratio with host and target in "
      "one process (plugin: fio + plugin + built-in target; own: `nvmf-rdma bench`), packets "
      "handed over in memory")
gfmt = "{:<47} {:>7} {:>17} {:>4}  {}"
print(gfmt.format("goal", "wanted", "ext", "met", "in-process, same rounds"))
def goal(what, want, xs, ok, inproc):
    print(gfmt.format(what, want, spread(xs), "yes" if ok(med(xs)) else "no", inproc))
for n, want in (("randread-4k-qd32", 2.0), ("randwrite-4k-qd32", 2.0),
                ("read-128k-qd8", 1.5), ("write-128k-qd8", 1.5)):
    e, p, nb = fio["ext", n], fio["plugin", n], fio["nbd", n]
    goal(f"IOPS ext/nbdkit {n}", f">= {want}", [a["iops"] / b["iops"] for a, b in zip(e, nb)],
         lambda m, w=want: m >= w,
         "plugin/nbd " + spread([a["iops"] / b["iops"] for a, b in zip(p, nb)]))
for n in ("randread-4k-qd1", "randwrite-4k-qd1"):
    e, p, nb = fio["ext", n], fio["plugin", n], fio["nbd", n]
    goal(f"avg latency ext/nbdkit {n}", "<= 0.6", [a["avg"] / b["avg"] for a, b in zip(e, nb)],
         lambda m: m <= 0.6,
         "plugin/nbd " + spread([a["avg"] / b["avg"] for a, b in zip(p, nb)]))
for n, want in (("randread-4k-qd32", 0.5), ("randwrite-4k-qd32", 0.5),
                ("read-128k-qd8", 1.0), ("write-128k-qd8", 1.0)):
    e, nb = fio["ext", n], fio["nbd", n]
    nbd_sum = [sum_us(x) for x in nb]
    inproc = known([None if a is None else a / b for a, b in
                    zip([plugin_us(a, b) for a, b in zip(fio["plugin", n], fio["plugin-long", n])],
                        nbd_sum)])
    goal(f"CPU/IO host+target ext/nbdkit {n}", f"<= {want}",
         [sum_us(a) / b for a, b in zip(e, nbd_sum)], lambda m, w=want: m <= w,
         "plugin/nbd " + (spread(inproc) if inproc else "n/a"))
for n, op in (("read-128k-qd8", "RDMA WRITE"), ("write-128k-qd8", "RDMA READ")):
    e, o = fio["ext", n], own[n]
    goal(f"GB/s ext/raw two-process {n}", ">= 0.8",
         [x["gbps"] / raw2p(r, op) for r, x in zip(runs, e)], lambda m: m >= 0.8,
         "own/raw in-process " + spread([x["gbps"] / raw(r, op) for r, x in zip(runs, o)])
         + "; ext/raw two-process 1G " + spread([x["gbps"] / raw2p(r, op, hca2p1g)
                                                for r, x in zip(runs, e)]))
for p in loss_rates:
    for job in LOSS_JOBS:
        goal(f"IOPS {p}% loss/lossless {job}", ">= 0.5",
             [loss[r, p][job] / loss[r, "0"][job] for r in runs], lambda m: m >= 0.5,
             "(measured across processes only)")
print("(ratios per round, median [min-max]; met: the median against the goal; raw two-process: "
      "`bench --hca --peer-process`, GSO/GRO on, 128 KiB depth 16, the operation that carries "
      "the data: a read's is the target's RDMA WRITE, a write's its RDMA READ; 1G: with "
      "--region 1G, the target's side through 1 GiB as the namespace's data is, not in cache)")

print("\nIOPS (plugin: fio + plugin, built-in target in fio's process)")
fmt = "{:<18} {:>9} {:>11} {:>17} {:>11} {:>17} {:>15} {:>15} {:>17} {:>9} {:>12} {:>12}"
print(fmt.format("workload", "own IOPS", "plugin IOPS", "plugin/own", "nbdkit IOPS", "plugin/nbd",
                 "plugin avg/p50", "nbdkit avg/p50", "avg plugin/nbd", "nbd slat",
                 "own copies/IO", "own tgt cp/IO"))
for n in names:
    o, p, nb = own[n], fio["plugin", n], fio["nbd", n]
    copies = [x["copies"] for x in o]
    tgt_copies = [x["tgt_copies"] for x in o]
    print(fmt.format(
        n, f"{med(x['iops'] for x in o):.0f}", f"{med(x['iops'] for x in p):.0f}",
        spread([a["iops"] / b["iops"] for a, b in zip(p, o)]),
        f"{med(x['iops'] for x in nb):.0f}",
        spread([a["iops"] / b["iops"] for a, b in zip(p, nb)]),
        f"{med(x['avg'] for x in p):.1f}/{med(x['p50'] for x in p):.1f}",
        f"{med(x['avg'] for x in nb):.1f}/{med(x['p50'] for x in nb):.1f}",
        spread([a["avg"] / b["avg"] for a, b in zip(p, nb)]),
        f"{med(x['slat'] for x in nb):.1f}",
        # Filled in by bench's own copy counter once it reports one; never guessed here.
        "n/a" if None in copies else f"{med(copies):.2f}",
        "n/a" if None in tgt_copies else f"{med(tgt_copies):.2f}",
    ))
print("(latency: fio's lat, submission + completion, in µs; at QD1 it is 1/IOPS. nbdkit's clat "
      "would leave out its slat, the request it sends inside fio's queue call)")

print("\nCPU µs per I/O, host = fio's process, tgt = the server's "
      "(ext: fio + plugin -> `nvmf-rdma target`; nbd: fio -> nbdkit; plugin: fio + plugin + "
      "built-in target, one process, I/O phase only)")
fmt = "{:<18} {:>9} {:>17} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>17} {:>13} {:>11} {:>17}"
print(fmt.format("workload", "ext IOPS", "ext/nbd", "ext host", "ext tgt", "ext sum",
                 "nbd host", "nbd tgt", "nbd sum", "ext sum/nbd sum", "ext tgt cp/IO",
                 "plugin sum", "plugin sum/nbd"))
for n in names:
    ext, nb = fio["ext", n], fio["nbd", n]
    ext_sum = [per_io_us(x, "host_cpu_s") + per_io_us(x, "target_cpu_s") for x in ext]
    nbd_sum = [per_io_us(x, "host_cpu_s") + per_io_us(x, "target_cpu_s") for x in nb]
    plugin_sum = [plugin_us(a, b) for a, b in zip(fio["plugin", n], fio["plugin-long", n])]
    plugin_nbd = [a / b if a is not None else None for a, b in zip(plugin_sum, nbd_sum)]
    print(fmt.format(
        n, f"{med(x['iops'] for x in ext):.0f}",
        spread([a["iops"] / b["iops"] for a, b in zip(ext, nb)]),
        f"{med(per_io_us(x, 'host_cpu_s') for x in ext):.1f}",
        f"{med(per_io_us(x, 'target_cpu_s') for x in ext):.1f}", f"{med(ext_sum):.1f}",
        f"{med(per_io_us(x, 'host_cpu_s') for x in nb):.1f}",
        f"{med(per_io_us(x, 'target_cpu_s') for x in nb):.1f}", f"{med(nbd_sum):.1f}",
        spread([a / b for a, b in zip(ext_sum, nbd_sum)]),
        # The target's own count (nvmet_io_copies_total) over the run, per I/O fio did.
        f"{med(x['target_copies'] / x['ios'] for x in ext):.2f}",
        f"{med(known(plugin_sum)):.1f}{of_rounds(plugin_sum)}" if known(plugin_sum) else "n/a",
        spread(known(plugin_nbd)) if known(plugin_nbd) else "n/a",
    ))

print("\n128 KiB: NVMe-oF QD8 vs the raw soft-HCA RDMA operation that carries the data (depth 16)")
fmt = "{:<18} {:<10} {:>8} {:>8} {:>17} {:>10} {:>17} {:>8} {:>17}"
print(fmt.format("workload", "raw op", "raw GB/s", "own GB/s", "own/raw", "plugin GB/s",
                 "plugin/raw", "raw 1G", "own/raw 1G"))
for n, op in (("read-128k-qd8", "RDMA WRITE"), ("write-128k-qd8", "RDMA READ")):
    rw = [raw(r, op) for r in runs]
    rg = [raw(r, op, hca1g) for r in runs]
    o, p = own[n], fio["plugin", n]
    print(fmt.format(
        n, op, f"{med(rw):.3f}", f"{med(x['gbps'] for x in o):.3f}",
        spread([x["gbps"] / y for x, y in zip(o, rw)]),
        f"{med(x['gbps'] for x in p):.3f}",
        spread([x["gbps"] / y for x, y in zip(p, rw)]),
        f"{med(rg):.3f}", spread([x["gbps"] / y for x, y in zip(o, rg)]),
    ))
print("(raw: the requester's side of the messages stays in cache, as bench --hca does by "
      "default; raw 1G: it moves through 1 GiB, as the namespace's data does: "
      "bench --hca --region 1G)")


print("\nRaw soft-HCA between two processes over UDP (`bench --hca --peer-process`): packets per "
      "second, and per CPU-second of each process (set-up included)")
fmt = "{:<11} {:>9} {:>6} {:>8} {:>17} {:>12} {:>13} {:>13}"
print(fmt.format("op", "msg size", "depth", "GSO/GRO", "GB/s", "packets/s", "req pkts/CPU",
                 "rsp pkts/CPU"))
for x in hca2p[0]:
    rows = [next(y for y in t if (y["op"], y["bytes"], y["offload"]) ==
                 (x["op"], x["bytes"], x["offload"])) for t in hca2p]
    print(fmt.format(
        x["op"], f"{x['bytes'] >> 10} KiB", x["depth"], "on" if x["offload"] else "off",
        spread([y["gbps"] for y in rows], 3), f"{med(y['packets_per_s'] for y in rows):.0f}",
        f"{med(y['packets'] / max(y['requester_cpu_s'], 1e-9) for y in rows):.0f}",
        f"{med(y['packets'] / max(y['responder_cpu_s'], 1e-9) for y in rows):.0f}"))

if loss_rates:
    print("\nUDP loss (fio-plugin/loss.sh: target and fio in a private namespace, 4 KiB QD32, "
          "verify=crc32c); IOPS as a fraction of the same round's 0% run")
    fmt = "{:<18} {:>6} {:>14} {:>24}"
    print(fmt.format("workload", "loss", "IOPS", "fraction of 0%") + "  verify")
    for job in LOSS_JOBS:
        for p in ["0"] + loss_rates:
            iops = [loss[r, p][job] for r in runs]
            frac = [i / loss[r, "0"][job] for r, i in zip(runs, iops)]
            # Every run got here with fio's exit 0 and no job error: verify was clean.
            print(fmt.format(job, f"{p}%", f"{med(iops):.0f}", spread(frac)) + "  clean")
EOF

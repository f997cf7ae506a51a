"""`python3 cpu.py OUT TARGET_PID CMD...`: run CMD, write its CPU seconds (all threads,
getrusage of the child) and TARGET_PID's CPU seconds over the same span (/proc/PID/stat) to
OUT as JSON ({"host_cpu_s": ..., "target_cpu_s": ...}). Exits with CMD's exit status.
Used by bench.sh and cpu-ab.sh for the CPU µs per I/O of fio (host) and a server (target).
With COPIES_URL set (a target's Prometheus endpoint, `nvmf-rdma --metrics-addr`), also
"target_copies": how much its nvmet_io_copies_total grew over the same span."""
import json, os, subprocess, sys, time, urllib.request

out, target_pid, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
tick = os.sysconf("SC_CLK_TCK")

def proc_cpu(pid):
    # utime and stime are fields 14 and 15; the name (field 2) may hold spaces, so split
    # after its closing parenthesis.
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

def copies(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(l.split()[-1]) for l in lines if l.startswith("nvmet_io_copies_total"))

def settled_copies(url):
    # The target publishes its counters every 250 ms: read until two reads 300 ms apart agree.
    last = copies(url)
    for _ in range(10):
        time.sleep(0.3)
        now = copies(url)
        if now == last:
            break
        last = now
    return last

url = os.environ.get("COPIES_URL")
copies_before = settled_copies(url) if url else None
before = proc_cpu(target_pid)
child = subprocess.Popen(cmd)
_, status, usage = os.wait4(child.pid, 0)
result = {"host_cpu_s": usage.ru_utime + usage.ru_stime,
          "target_cpu_s": proc_cpu(target_pid) - before}
if url:
    result["target_copies"] = settled_copies(url) - copies_before
with open(out, "w") as f:
    json.dump(result, f)
sys.exit(os.waitstatus_to_exitcode(status))

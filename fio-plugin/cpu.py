"""`python3 cpu.py OUT TARGET_PID CMD...`: run CMD, write its CPU seconds (all threads,
getrusage of the child) and TARGET_PID's CPU seconds over the same span (/proc/PID/stat) to
OUT as JSON ({"host_cpu_s": ..., "target_cpu_s": ...}). Exits with CMD's exit status.
TARGET_PID `-`: no server process (the fio plugin's built-in target lives in fio's process,
so host_cpu_s is host + target and target_cpu_s is 0).
Used by bench.sh and cpu-ab.sh for the CPU µs per I/O of fio (host) and a server (target).
With COPIES_URL set (a target's Prometheus endpoint, `nvmf-rdma --metrics-addr`), also
"target_copies": how much its nvmet_io_copies_total grew over the same span.

Imported (bench.sh and cpu-ab.sh put this folder on sys.path), it gives `marginal_us`."""
import json, os, subprocess, sys, time, urllib.request


def marginal_us(short, long):
    """CPU µs per I/O of the I/O phase alone, from two runs of one job that differ only in
    length: {"cpu_s", "ios"} each. A process that holds its target (fio with the plugin's
    built-in RAM target) spends about a second of CPU taking and zeroing its memory before
    the first I/O, and some more connecting and exiting; that cost is the same in both runs
    and cancels. None when the longer run did not do more I/O or spend more CPU (a machine
    busy with something else: no figure rather than a meaningless one)."""
    ios = long["ios"] - short["ios"]
    cpu_s = long["cpu_s"] - short["cpu_s"]
    if ios <= 0 or cpu_s <= 0:
        return None
    return cpu_s / ios * 1e6


def proc_cpu(pid):
    # utime and stime are fields 14 and 15; the name (field 2) may hold spaces, so split
    # after its closing parenthesis.
    tick = os.sysconf("SC_CLK_TCK")
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


def main(argv):
    if len(argv) < 3:
        sys.exit("usage: cpu.py OUT TARGET_PID|- CMD...")
    out, target, cmd = argv[0], argv[1], argv[2:]
    if target != "-" and not target.isdigit():
        sys.exit(f"cpu.py: TARGET_PID is a process ID or -, not '{target}'")
    target_pid = None if target == "-" else int(target)
    url = os.environ.get("COPIES_URL")
    copies_before = settled_copies(url) if url else None
    before = proc_cpu(target_pid) if target_pid else 0.0
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)
    result = {"host_cpu_s": usage.ru_utime + usage.ru_stime,
              "target_cpu_s": proc_cpu(target_pid) - before if target_pid else 0.0}
    if url:
        result["target_copies"] = settled_copies(url) - copies_before
    with open(out, "w") as f:
        json.dump(result, f)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run a command and measure how much CPU the rest of the machine took meanwhile.

The calibration benchmark compares real runs of a CPU-bound engine on a 2-core machine
that other work shares: a run measured while other processes take a core's worth of CPU
runs its engine steps slower, and no cost model fitted on a quiet run can predict it.
This records, every `interval` seconds, the cores the whole machine used (`/proc/stat`),
the cores the command's process tree used (utime + stime of its live processes, plus
cutime + cstime: the reaped children's), and the difference: the other processes'
cores. Linux only.

    python -m prefixflow.sim.cpuwatch --out cpu.json [--quiet-below 0.2 --wait-quiet 300] -- prefixflow run ...

With `--quiet-below` it first waits (at most `--wait-quiet` seconds) until the machine
has used less than that many cores over a few seconds, so runs start on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def machine_ticks() -> int:
    """Busy ticks of all CPUs since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    return user + nice + system + irq + softirq + steal


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, ticks of it and its reaped children)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2 :].split()
        # fields after the command: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based from pid
        ppid = int(rest[1])
        ticks = int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])
        out[int(name)] = (ppid, ticks)
    return out


def tree_ticks(root: int, table: dict[int, tuple[int, int]]) -> int:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            total += table[pid][1]
        stack.extend(children.get(pid, ()))
    return total


def wait_quiet(below: float, timeout: float, window: float = 3.0) -> float:
    """Wait until the machine used fewer than `below` cores over `window` seconds;
    returns the cores measured last (waits at most `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        t0, m0 = time.monotonic(), machine_ticks()
        time.sleep(window)
        cores = (machine_ticks() - m0) / TICK / (time.monotonic() - t0)
        if cores < below or time.monotonic() > deadline:
            return cores


def watch(cmd: list[str], interval: float = 0.25) -> tuple[int, dict]:
    """Run `cmd`, sampling CPU use; (exit code, report)."""
    start = time.time()
    proc = subprocess.Popen(cmd)
    samples = []
    last_t, last_m, last_ours = time.monotonic(), machine_ticks(), 0
    while proc.poll() is None:
        time.sleep(interval)
        t, m = time.monotonic(), machine_ticks()
        ours = tree_ticks(proc.pid, process_table())
        dt = t - last_t
        machine = (m - last_m) / TICK / dt
        mine = max(ours - last_ours, 0) / TICK / dt
        samples.append([round(time.time(), 3), round(machine, 3), round(mine, 3), round(max(machine - mine, 0.0), 3)])
        last_t, last_m, last_ours = t, m, ours
    return proc.returncode, {"command": cmd, "started": start, "ended": time.time(), "interval_s": interval,
                             "cpus": os.cpu_count(), "samples": samples,
                             "columns": ["unix_time", "machine_cores", "command_cores", "other_cores"]}


def others_between(report: dict, t0: float, t1: float) -> float:
    """Mean cores the other processes used between two Unix times."""
    rows = [s for s in report["samples"] if t0 <= s[0] <= t1]
    return sum(s[3] for s in rows) / len(rows) if rows else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON report")
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--quiet-below", type=float, default=0.0, help="wait until the machine uses fewer cores than this")
    ap.add_argument("--wait-quiet", type=float, default=300.0, help="seconds to wait for quiet at most")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command")
    before = wait_quiet(args.quiet_below, args.wait_quiet) if args.quiet_below else None
    code, report = watch(cmd, args.interval)
    report["cores_before"] = before
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())

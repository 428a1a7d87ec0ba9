"""CPU seconds spent by this process and the processes it started: what a stage costs in CPU, which other jobs on
a shared machine do not inflate as they inflate its wall time.

The sandbox's workers are the zygote's children, not this process's: the zygote waits for them (zygote.py), so
their time adds to the zygote's children's time, which /proc shows while the zygote lives and which this process's
own children's time takes in once the zygote is waited for. A worker still running when this is read is not
counted yet (it is, once it has exited and been waited for).
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_s() -> float:
    """User + system CPU seconds of this process, of its children it has waited for, and of its live children with
    the children those have waited for."""
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + waited.ru_utime + waited.ru_stime + sum(map(_live_cpu_s, live_children()))


def live_children() -> list[int]:
    """The pids of this process's running children (Linux lists them per thread that started them)."""
    pids = []
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids += [int(pid) for pid in children.read_text().split()]
        except OSError:  # a thread that has ended since
            continue
    return pids


def _live_cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of a running process (0 if it has just gone: it is then a waited child)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(ticks) for ticks in fields[11:15]) * TICK_S

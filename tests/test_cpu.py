"""`process_tree_cpu_s` counts this process, its children and the children they waited for, so a stage's CPU
seconds include the sandbox's workers (which the zygote now waits for, where it once let them be auto-reaped and
their time vanish)."""

from __future__ import annotations

import subprocess
import sys
import time

from builder.config import SandboxConfig
from builder.cpu import live_children, process_tree_cpu_s
from builder.envs.session import Session
from builder.sandbox.runtime import Sandbox

BURN = "import time\nstart = time.process_time()\nwhile time.process_time() - start < {seconds}:\n    pass\n"
# A child that forks a grandchild burning 0.4 s of CPU, waits for it, says so and then idles.
PARENT_OF_A_BURNER = (
    "import os, sys, time\n"
    "pid = os.fork()\n"
    "if pid == 0:\n" + "".join(f"    {line}\n" for line in BURN.format(seconds=0.4).splitlines()) + "    os._exit(0)\n"
    "os.waitpid(pid, 0)\nprint('waited', flush=True)\ntime.sleep(30)\n"
)

SPINNING_ENV = '''import time


class SpinEnv:
    """Spins the CPU on request."""

    def __init__(self):
        self.spins = {}

    def spin(self, seconds: float) -> int:
        """Burn CPU for a while.

        Args:
            seconds: CPU seconds to burn.

        Returns:
            How many loops that took.
        """
        start, loops = time.process_time(), 0
        while time.process_time() - start < seconds:
            loops += 1
        self.spins[str(len(self.spins))] = loops
        return loops
'''


def test_a_live_childs_waited_grandchild_is_counted_and_stays_counted_once_the_child_is_waited_for():
    before = process_tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", PARENT_OF_A_BURNER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "waited\n"
        assert child.pid in live_children()
        while_alive = process_tree_cpu_s() - before
        assert while_alive >= 0.35  # the grandchild's 0.4 s, read from the live child's /proc entry
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    # Waited for, the child's time (and its grandchild's) moves to this process's children's time: not lost.
    assert process_tree_cpu_s() - before >= while_alive - 0.02
    assert child.pid not in live_children()


def test_sandbox_workers_cpu_is_counted_once_the_zygote_waits_for_them():
    with Sandbox(SandboxConfig()) as sandbox:
        before = process_tree_cpu_s()
        with Session(sandbox, SPINNING_ENV, None) as session:
            assert session.call("spin", {"seconds": 0.4}).ok
        # The zygote waits for finished workers when it forks the next one; the first worker may still be exiting
        # at the next fork, so fork until it has been waited for (a worker lost to the kernel never counts).
        counted = 0.0
        for _ in range(20):
            with Session(sandbox, SPINNING_ENV, None) as session:
                assert session.call("spin", {"seconds": 0.0}).ok
            time.sleep(0.05)
            if (counted := process_tree_cpu_s() - before) >= 0.35:
                break
        assert counted >= 0.35


def test_the_count_only_grows():
    readings = [process_tree_cpu_s() for _ in range(50)]
    assert readings == sorted(readings) and readings[0] > 0

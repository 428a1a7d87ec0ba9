"""Run a command as a watched child; if the owner process dies, end the child's whole process group.

Started by `VLLMServer` as `python reaper.py OWNER_PID GRACE_S COMMAND...` (by file path, so it imports nothing
of builder), as the leader of a new process group that the command joins. A kernel parent-death signal alone
is not enough: vLLM catches SIGTERM and can hang in its own shutdown during start-up, leaving an orphan server.
The reaper checks its parent every half second; once the owner is gone it sends SIGTERM to the group and
SIGKILL after GRACE_S. It ignores SIGTERM itself, so the owner's normal stop (SIGTERM to the group, then
SIGKILL) reaches the command, and the reaper exits with the command's exit code.
"""

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    owner, grace_s, command = int(argv[0]), float(argv[1]), argv[2:]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The command must handle SIGTERM/SIGINT itself again (ignored dispositions survive exec).
    child = subprocess.Popen(command, preexec_fn=_default_signals)
    while child.poll() is None:
        if os.getppid() != owner:
            print(f"[reaper] owner {owner} is gone; stopping the server", file=sys.stderr, flush=True)
            os.killpg(0, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            os.killpg(0, signal.SIGKILL)  # ends the reaper too, and whatever the command left behind
        time.sleep(0.5)
    return child.returncode


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

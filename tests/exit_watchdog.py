"""Turn a test process that does not exit into a report and an exit.

Session 28's s28-2 (benchmarks/NOTES.md, item 33) ran tests/megatron to 100 % on the device
machine, and then pytest did not exit before the call's limit: nothing said what it waited
for. ``arm(seconds)`` (called by tests/conftest.py at the end of the pytest session when
``MOK_TEST_EXIT_WATCHDOG_S`` is set) starts a daemon thread: if the process is still alive
``seconds`` later, it prints to stderr the child processes still alive (pid, state, command
line, from /proc) and every Python thread's stack (``faulthandler``), kills those children
(left alive they hold the GPU, and the write end of a ``pytest | tee`` pipe), then ends the
process with :data:`EXIT_CODE`. The thread covers the stages of interpreter exit that still run Python
(joining non-daemon threads, ``atexit`` handlers such as multiprocessing's join of its
children); ``faulthandler.dump_traceback_later`` is armed a little later as a backstop for a
hang after those (it dumps the stacks and exits 1).

Opt-in only: CI does not set it, and a run that exits in time is not changed at all.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import List

EXIT_CODE = 86            # "the tests ended (see their summary), the process did not exit"
_BACKSTOP_EXTRA_S = 15.0  # faulthandler's own watchdog fires this much after the thread's


def children(pid: int = 0) -> List[str]:
    """One line per live child process of ``pid`` (default: this process) and their children:
    ``pid state command line``; empty where /proc is not readable. Zombies (exited, not yet
    reaped) are left out: they hold nothing."""
    pid = pid or os.getpid()
    out: List[str] = []
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return out
    parent_of = {}
    for e in entries:
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            if state not in "ZX":
                parent_of[int(e)] = (int(ppid), state)
        except (OSError, ValueError):
            continue
    todo = [pid]
    while todo:
        p = todo.pop()
        for c, (ppid, state) in sorted(parent_of.items()):
            if ppid != p:
                continue
            try:
                with open(f"/proc/{c}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            out.append(f"{c} {state} {cmd[:300]}")
            todo.append(c)
    return out


def _fire(seconds: float) -> None:
    time.sleep(seconds)
    err = sys.__stderr__ or sys.stderr
    try:
        err.write(f"\n[exit watchdog] the process has not exited {seconds:g} s after the end of "
                  f"the test session (MOK_TEST_EXIT_WATCHDOG_S); exiting with {EXIT_CODE}.\n")
        kids = children()
        err.write(f"[exit watchdog] {len(kids)} child process(es) alive:\n")
        for line in kids:
            err.write(f"  {line}\n")
        err.write("[exit watchdog] Python threads (their stacks follow, by id):\n")
        for t in threading.enumerate():
            err.write(f"  0x{t.ident or 0:016x} {t.name!r} daemon={t.daemon}\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
        # The children go too: left alive they would hold the GPU and the output pipe (a
        # `pytest | tee` would wait for them).
        for line in kids:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        err.write(f"[exit watchdog] killed the {len(kids)} child process(es).\n")
        err.flush()
    finally:
        os._exit(EXIT_CODE)


def arm(seconds: float) -> None:
    """Report and exit if this process is still alive ``seconds`` from now (see the module)."""
    if seconds <= 0:
        raise ValueError(f"the exit watchdog needs a positive time, got {seconds}")
    threading.Thread(target=_fire, args=(seconds,), name="mok-exit-watchdog", daemon=True).start()
    faulthandler.dump_traceback_later(seconds + _BACKSTOP_EXTRA_S, exit=True,
                                      file=sys.__stderr__ or sys.stderr)

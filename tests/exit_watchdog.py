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
from typing import Dict, List, Tuple

EXIT_CODE = 86            # "the tests ended (see their summary), the process did not exit"
_BACKSTOP_EXTRA_S = 15.0  # faulthandler's own watchdog fires this much after the thread's


def live_processes() -> Dict[int, Tuple[str, int, int]]:
    """``{pid: (state, parent pid, process group)}`` of every process that is not a zombie
    (exited, not yet reaped: it holds nothing); empty where /proc is not readable."""
    out: Dict[int, Tuple[str, int, int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return out
    for e in entries:
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after its ')'
            state, ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        except (OSError, ValueError):
            continue
        if state not in "ZX":
            out[int(e)] = (state, int(ppid), int(pgrp))
    return out


def _descendants(pid: int) -> List[Tuple[int, str]]:
    """``(pid, state)`` of every live child of ``pid`` and of their children, parents first."""
    kids_of: Dict[int, List[Tuple[int, str]]] = {}
    for c, (state, ppid, _) in sorted(live_processes().items()):
        kids_of.setdefault(ppid, []).append((c, state))
    out, todo = [], [pid]
    while todo:
        for c, state in kids_of.get(todo.pop(), []):
            out.append((c, state))
            todo.append(c)
    return out


def _describe(pid: int, state: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid} {state} {cmd[:300]}"


def children(pid: int = 0) -> List[str]:
    """One line per live child process of ``pid`` (default: this process) and their children:
    ``pid state command line``; empty where /proc is not readable."""
    return [_describe(c, state) for c, state in _descendants(pid or os.getpid())]


def _fire(seconds: float) -> None:
    time.sleep(seconds)
    err = sys.__stderr__ or sys.stderr
    try:
        err.write(f"\n[exit watchdog] the process has not exited {seconds:g} s after the end of "
                  f"the test session (MOK_TEST_EXIT_WATCHDOG_S); exiting with {EXIT_CODE}.\n")
        kids = _descendants(os.getpid())
        err.write(f"[exit watchdog] {len(kids)} child process(es) alive:\n")
        for c, state in kids:
            err.write(f"  {_describe(c, state)}\n")
        err.write("[exit watchdog] Python threads (their stacks follow, by id):\n")
        for t in threading.enumerate():
            err.write(f"  0x{t.ident or 0:016x} {t.name!r} daemon={t.daemon}\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
        # The children go too: left alive they would hold the GPU and the output pipe (a
        # `pytest | tee` would wait for them).
        for c, _ in kids:
            try:
                os.kill(c, signal.SIGKILL)
            except OSError:
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

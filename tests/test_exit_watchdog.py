"""The exit watchdog (tests/exit_watchdog.py): a process that hangs on its way out reports its
live children and thread stacks and exits with ``EXIT_CODE``; one that exits in time is not
touched. CPU only: each case runs in its own process group, killed at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import exit_watchdog

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code: str, timeout: float = 60.0, env=None, args=None, cwd=None, before_kill=None):
    """Run ``python -c code`` (or ``python args``) with tests/ importable; kill its whole
    process group afterwards (a stuck child of a watchdog exit would outlive it), after
    calling ``before_kill(process group id)`` if given. Returns (rc, stdout, stderr, seconds)."""
    full_env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    cmd = [sys.executable] + (args if args is not None else ["-c", textwrap.dedent(code)])
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=full_env, cwd=cwd, start_new_session=True)
    try:
        rc = p.wait(timeout=timeout)   # not communicate(): a stuck child holds the pipes open
        secs = time.monotonic() - t0
        if before_kill is not None:
            before_kill(p.pid)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, err = p.communicate()         # small outputs: they fit the pipes' buffers
    return rc, out, err, secs


def test_a_non_daemon_thread_that_never_ends_is_reported_and_the_process_exits():
    rc, out, err, secs = _run("""
        import threading, time, exit_watchdog
        def stuck_forever_in_thread():
            time.sleep(600)
        exit_watchdog.arm(1.0)
        threading.Thread(target=stuck_forever_in_thread).start()   # not a daemon: exit waits
    """)
    assert rc == exit_watchdog.EXIT_CODE, (rc, err[-2000:])
    assert secs < 30
    assert "[exit watchdog] the process has not exited 1 s after" in err
    assert "stuck_forever_in_thread" in err, err[-2000:]        # the stuck thread's stack


def _alive_in_group(pgid: int, delay_s: float = 0.5):
    """The pids of process group ``pgid`` that are alive (not zombies) ``delay_s`` from now."""
    time.sleep(delay_s)
    return {p for p, (_, _, pgrp) in exit_watchdog.live_processes().items() if pgrp == pgid}


def test_a_child_process_that_never_ends_is_listed_and_killed():
    # multiprocessing joins its non-daemon children at exit (an atexit handler): the hang
    # s28-2 may have had, with a rank process that did not end
    alive = []
    rc, out, err, secs = _run("""
        import multiprocessing as mp, time, exit_watchdog
        if __name__ == "__main__":
            p = mp.get_context("fork").Process(target=time.sleep, args=(600,))
            p.start()
            print(p.pid, flush=True)
            exit_watchdog.arm(1.0)
    """, before_kill=lambda pgid: alive.append(_alive_in_group(pgid)))
    assert rc == exit_watchdog.EXIT_CODE, (rc, err[-2000:])
    child = int(out.split()[0])
    assert "1 child process(es) alive" in err, err[-2000:]
    assert f"\n  {child} " in err, err[-2000:]
    assert "killed the 1 child process(es)" in err
    assert child not in alive[0], "the watchdog left its child alive"


def test_a_process_that_exits_in_time_is_not_touched():
    rc, out, err, secs = _run("""
        import exit_watchdog
        exit_watchdog.arm(20.0)
        print("done")
    """)
    assert (rc, out.strip()) == (0, "done"), err
    assert "exit watchdog" not in err
    assert secs < 15          # the process did not wait for the watchdog


def test_children_lists_grandchildren_too():
    rc, out, err, _ = _run("""
        import subprocess, sys, exit_watchdog
        inner = "import subprocess, time; p = subprocess.Popen(['sleep', '30']); time.sleep(30)"
        p = subprocess.Popen([sys.executable, "-c", inner])
        import time
        for _ in range(200):                    # until the grandchild exists
            kids = exit_watchdog.children()
            if len(kids) >= 2:
                break
            time.sleep(0.05)
        print("\\n".join(kids))
        p.kill()
    """)
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    assert "python" in lines[0] and lines[1].split()[2:] == ["sleep", "30"], out


def test_arm_refuses_a_time_that_is_not_positive():
    import pytest
    with pytest.raises(ValueError, match="positive"):
        exit_watchdog.arm(0)


def test_conftest_arms_it_from_the_environment(tmp_path):
    # the conftest of tests/ as a plugin for a one-test session whose test leaves a non-daemon
    # thread behind: the session passes, then the watchdog reports and exits
    (tmp_path / "test_leaves_a_thread.py").write_text(textwrap.dedent("""
        import threading, time
        def left_behind_forever():
            time.sleep(600)
        def test_leaves_a_thread():
            threading.Thread(target=left_behind_forever, name="left-behind").start()
    """))
    rc, out, err, secs = _run("", env={"MOK_TEST_EXIT_WATCHDOG_S": "2"}, cwd=str(tmp_path),
                              args=["-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                                    "test_leaves_a_thread.py"], timeout=120)
    assert rc == exit_watchdog.EXIT_CODE, (rc, out[-2000:], err[-2000:])
    assert "1 passed" in out, out[-2000:]
    assert "[exit watchdog]" in err and "left_behind_forever" in err, err[-2000:]
    assert "'left-behind'" in err, err[-2000:]               # the threads' names, listed

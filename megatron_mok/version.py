"""The package version, in one place (setup.py reads it from here), and the source commit
that reports record."""

import os
import subprocess

__version__ = "0.1.0"


def source_commit() -> str:
    """The short commit of this checkout for a report. ``MOK_COMMIT`` wins: a lent GPU machine
    gets a copy of the tree whose ``.git`` can be stale (run s27-4), so its launchers pass the
    commit they sent. ``"unknown"`` without git or a checkout."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - no git, no checkout: say so
        return "unknown"

"""Assemble one results JSON (benchmarks/results/) from a device run's output folder.

    python3 scripts/results_json.py SRC_DIR DST_JSON --commit C --note "..." --command "..."

Every ``*.json`` under SRC_DIR is embedded under its path (``small/small_batch.json`` ->
key ``small/small_batch``); every ``*.log`` contributes its last ``--tail`` lines (the
pytest summary, the tables the tools print), every ``*.stalls`` (loopback host stalls,
``MOK_LOOPBACK_STALL_LOG``) likewise; ``gpu.txt`` (``nvidia-smi --query-gpu=name
...``) gives the GPU model and count. The date is today's (UTC) unless --date gives the run's. Why a tool: a device run
leaves a folder of per-tool outputs; the results index wants one file per run that names
its date, commit, GPU model/count and exact command (METHOD.md), and a hand-assembled file
is where such fields go missing.

The tools' own JSONs record a commit too (``env.commit``), read from git where they ran; a
device machine's copy can carry stale git metadata (run s27-4 read 1149b9d in a 0125e0e
tree). Every embedded ``commit`` that is not ``--commit`` (neither a prefix of the other) is
listed under ``inner_commits_differ`` and printed as a warning, so such a file says so itself.
"""
import argparse
import datetime
import json
import os
import sys


def _gpu(src):
    path = os.path.join(src, "gpu.txt")
    if not os.path.exists(path):
        return "unknown"
    names = [l.split(",")[0].strip() for l in open(path).read().splitlines()[1:] if l.strip()]
    if not names:
        return "unknown"
    return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else " + ".join(names)


def collect(src, tail):
    """Returns {relative key: parsed JSON or list of a log's last lines}, sorted by key."""
    out = {}
    for root, _, files in os.walk(src):
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(root, f), src)
            key, ext = os.path.splitext(rel)
            if ext == ".json":
                with open(os.path.join(root, f)) as fh:
                    out[key] = json.load(fh)
            elif ext in (".log", ".stalls"):
                with open(os.path.join(root, f), errors="replace") as fh:
                    out[key + ext.replace(".", "_") + "_tail"] = fh.read().splitlines()[-tail:]
    return dict(sorted(out.items()))


def inner_commit_mismatches(parts, commit):
    """``{path: value}`` of every ``commit`` field in ``parts`` (nested dicts and lists) whose
    value is neither a prefix of ``commit`` nor has it as a prefix. Build manifests (a key
    containing ``manifest``) are skipped: they name the commit their libraries were built at,
    which may rightly be older."""
    out = {}

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                p = f"{path}.{k}" if path else str(k)
                if "manifest" in str(k):
                    continue
                if k == "commit" and isinstance(v, str) and v:
                    if not (v.startswith(commit) or commit.startswith(v)):
                        out[p] = v
                else:
                    walk(v, p)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
    walk(parts, "")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--commit", required=True)
    p.add_argument("--note", required=True)
    p.add_argument("--command", required=True, action="append", help="repeat for several")
    p.add_argument("--summary", action="append", default=[], help="a line of findings")
    p.add_argument("--tail", type=int, default=30)
    p.add_argument("--date", default=None, help="the run's UTC date (default: today), for a run recorded after midnight")
    a = p.parse_args(argv)
    if not os.path.isdir(a.src):
        sys.exit(f"results_json: no folder {a.src}")
    doc = {
        "note": a.note,
        "commit": a.commit,
        "gpu": _gpu(a.src),
        "date": a.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commands": a.command,
        "summary": a.summary,
    }
    parts = collect(a.src, a.tail)
    differ = inner_commit_mismatches(parts, a.commit)
    if differ:
        doc["inner_commits_differ"] = differ
        print(f"results_json: WARNING: {len(differ)} embedded commit field(s) are not {a.commit}: "
              + ", ".join(f"{k}={v}" for k, v in list(differ.items())[:5]), file=sys.stderr)
    doc.update(parts)
    with open(a.dst, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(f"wrote {a.dst} ({len(parts)} parts, gpu {doc['gpu']})")


if __name__ == "__main__":
    main()

"""scripts/results_json.py on a hand-made device output folder."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import results_json  # noqa: E402


def _folder(tmp_path, gpus=("NVIDIA H200", "NVIDIA H200")):
    src = tmp_path / "r"
    (src / "small").mkdir(parents=True)
    (src / "gpu.txt").write_text("name, clocks.sm [MHz], clocks.max.sm [MHz]\n"
                                 + "".join(f"{g}, 1980 MHz, 1980 MHz\n" for g in gpus))
    (src / "small" / "small_batch.json").write_text(json.dumps({"cases": [{"tokens": 128}]}))
    (src / "tests.log").write_text("".join(f"line {i}\n" for i in range(50)) + "172 passed in 219 s\n")
    (src / "errors.stalls").write_text("[20:30:04 pid 1] rank 0 stuck for 5+ s at:\n  File x\n")
    return src


def test_one_file_with_date_commit_gpu_command_and_every_part(tmp_path):
    dst = tmp_path / "out.json"
    results_json.main([str(_folder(tmp_path)), str(dst), "--commit", "abc1234", "--note", "a run",
                       "--command", "bash x.sh abc1234", "--command", "python3 y.py",
                       "--summary", "it passed", "--tail", "3"])
    doc = json.loads(dst.read_text())
    assert doc["commit"] == "abc1234" and doc["note"] == "a run"
    assert doc["gpu"] == "2 x NVIDIA H200"
    assert doc["commands"] == ["bash x.sh abc1234", "python3 y.py"]
    assert doc["summary"] == ["it passed"]
    assert len(doc["date"]) == 10 and doc["date"][4] == "-"
    assert doc["small/small_batch"] == {"cases": [{"tokens": 128}]}
    assert doc["tests_log_tail"] == ["line 48", "line 49", "172 passed in 219 s"]
    assert doc["errors_stalls_tail"] == ["[20:30:04 pid 1] rank 0 stuck for 5+ s at:", "  File x"]


def test_mixed_or_missing_gpu_files_are_named_as_they_are(tmp_path):
    src = _folder(tmp_path, gpus=("NVIDIA H200", "NVIDIA H100"))
    assert results_json._gpu(str(src)) == "NVIDIA H200 + NVIDIA H100"
    os.remove(src / "gpu.txt")
    assert results_json._gpu(str(src)) == "unknown"


def test_a_missing_folder_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no folder"):
        results_json.main([str(tmp_path / "nope"), str(tmp_path / "o.json"), "--commit", "c",
                           "--note", "n", "--command", "x"])


def test_embedded_commits_that_are_not_the_runs_are_listed_and_warned(tmp_path, capsys):
    """A tool's own ``env.commit`` read from a stale git copy (run s27-4) is flagged; a
    matching one (full hash or short prefix, either way round) is not."""
    src = _folder(tmp_path)
    (src / "suite").mkdir()
    (src / "suite" / "bench.json").write_text(json.dumps(
        {"env": {"commit": "1149b9d"}, "runs": [{"commit": "0125e0e9f00"}, {"commit": "0125"}]}))
    dst = tmp_path / "out.json"
    results_json.main([str(src), str(dst), "--commit", "0125e0e", "--note", "n", "--command", "x"])
    doc = json.loads(dst.read_text())
    assert doc["inner_commits_differ"] == {"suite/bench.env.commit": "1149b9d"}
    assert "WARNING: 1 embedded commit field(s) are not 0125e0e" in capsys.readouterr().err
    dst2 = tmp_path / "out2.json"
    results_json.main([str(_folder(tmp_path / "b")), str(dst2), "--commit", "0125e0e", "--note", "n",
                       "--command", "x"])
    assert "inner_commits_differ" not in json.loads(dst2.read_text())


def test_build_manifests_may_name_older_commits(tmp_path):
    """A mutant library's manifest names the commit it was built at (rightly older than the
    run's): not flagged."""
    assert results_json.inner_commit_mismatches(
        {"audit": {"commit": "0125e0e", "libs_manifest": {"commit": "521d3a5",
                                                          "mutants": {"m": {"commit": "521d3a5"}}}}},
        "0125e0e") == {}

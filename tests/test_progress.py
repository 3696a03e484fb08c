"""Long searches show their progress on a terminal and nowhere else (pipes, files, --quiet, JSON)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from pipeplan.api import ClusterRequest, PipelineRequest, plan_any
from pipeplan.cluster.presets import PRESETS
from pipeplan.formats.io import load_profile
from pipeplan.progress import reporting, task

PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "gpt2-tiny-cpu.json"
CLUSTER_ARGS = ["plan", str(PROFILE), "--gpus", "4", "--cluster", "pcie-l4", "--global-batch", "16"]


class Recorder:
    """A reporter that keeps what the library told it."""

    def __init__(self):
        self.tasks = []

    def task(self, description, total):
        record = {"description": description, "total": total, "steps": 0, "notes": [], "closed": False}
        self.tasks.append(record)

        class Task:
            def advance(self, steps=1, note=""):
                record["steps"] += steps
                record["notes"].append(note)

            def close(self):
                record["closed"] = True

        return Task()


def test_without_a_reporter_nothing_is_reported():
    with task("work", total=2) as current:
        current.advance(note="x")  # a no-op, and no error


def test_the_cluster_search_reports_every_trial_and_the_best_so_far():
    recorder = Recorder()
    request = ClusterRequest(num_gpus=4, cluster=PRESETS["pcie-l4"], global_batch=16)
    with reporting(recorder):
        plan = plan_any(load_profile(PROFILE), request, profile_sha256="0" * 64)
    outer = recorder.tasks[0]
    assert outer["description"].startswith("cluster search on 4 GPUs")
    assert outer["closed"] and 0 < outer["steps"] <= outer["total"]
    assert f"{plan.predicted.iteration_ms:.1f} ms" in outer["notes"][-1]
    # Each replica's pipeline search is a task of its own (the terminal draws only the outer one).
    assert any(t["description"].startswith("pipeline search") for t in recorder.tasks[1:])
    assert all(t["closed"] for t in recorder.tasks)


def test_the_pipeline_search_reports_its_candidates():
    recorder = Recorder()
    with reporting(recorder):
        plan_any(load_profile(PROFILE), PipelineRequest(stages=2), profile_sha256="0" * 64)
    (only,) = recorder.tasks
    assert only["description"].startswith("pipeline search on 2 ranks") and only["steps"] == only["total"] > 1


def _run_on_a_terminal(args) -> str:
    """The command's stderr when stderr is a terminal (a pseudo-terminal); stdout is a pipe."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pipeplan", *args], stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.communicate(timeout=120)
    os.close(master)
    assert proc.returncode == 0
    return b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal(tmp_path):
    assert "cluster search on 4 GPUs" in _run_on_a_terminal(CLUSTER_ARGS + ["-o", str(tmp_path / "t.json")])


def test_no_progress_in_a_pipe_or_with_quiet(tmp_path):
    piped = subprocess.run([sys.executable, "-m", "pipeplan", *CLUSTER_ARGS, "-o", str(tmp_path / "p.json")],
                           capture_output=True, text=True, check=True)
    assert piped.stderr == "" and "cluster search" not in piped.stdout
    quiet = _run_on_a_terminal(CLUSTER_ARGS + ["-o", str(tmp_path / "q.json"), "--quiet"])
    assert "cluster search" not in quiet

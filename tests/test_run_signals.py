"""``pipeplan run`` as a user's shell sees it: signals to the launcher, a stopped rank, what is echoed.

Each test starts the CLI as a subprocess with ``TMPDIR`` inside the test's folder, so the run's
temporary folder and every process that mentions it can be looked for afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pipeplan.formats.io import write_json_atomic  # noqa: E402
from pipeplan.formats.profile import Profile  # noqa: E402
from pipeplan.run import balanced_plan  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _plan_file(tmp_path: Path) -> Path:
    names = ["embed", "blocks.0", "blocks.1", "norm", "head"]
    profile = Profile.model_validate({
        "schema_version": 1, "model": "gpt2-tiny", "source": "analytic", "device": {"name": "cpu"},
        "dtype": "fp32", "sequence_length": 8,
        "layers": [{"name": n, "param_bytes": 4096, "costs": [
            {"microbatch_size": 1, "forward_ms": 1.0, "backward_ms": 2.0, "activation_bytes": 1024,
             "output_bytes": 1024}]} for n in names]})
    plan = balanced_plan(profile, schedule="1f1b", ranks=2, microbatch_size=1, num_microbatches=2)
    path = tmp_path / "plan.json"
    write_json_atomic(path, plan)
    return path


def _processes_under(folder: Path) -> list[int]:
    """PIDs of live (not zombie) processes whose command line or environment mentions ``folder``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (str(folder).encode() in cmdline or str(folder).encode() in environ):
            found.append(int(pid))
    return found


def _worker_pid(folder: Path, rank: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in _processes_under(folder):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"pipeplan.run.worker" in cmdline and f"RANK={rank}".encode() in environ:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} appeared under {folder}")


def _start_run(tmp_path: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    child_env = {**os.environ, "TMPDIR": str(tmp), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "pipeplan.cli", "run", str(_plan_file(tmp_path)), "--model", "gpt2-tiny",
         "--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq-len", "8",
         "--alone-repeats", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env)


def _after(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    deadline = time.monotonic() + 20
    while _processes_under(tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_under(tmp) == [], "a rank or torchrun outlived the launcher"
    assert [p.name for p in tmp.iterdir() if p.name.startswith("pipeplan-run-")] == [], "temp folder left behind"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_the_launcher_ends_the_whole_job_and_its_temp_folder(tmp_path, signum):
    proc = _start_run(tmp_path, "--steps", "100000", "--timeout", "30", "-q")
    _worker_pid(tmp_path / "tmp", 1)
    time.sleep(1.0)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err
    _after(tmp_path)


def test_a_sigstopped_rank_is_reported_as_hung_and_torchruns_traceback_is_not_shown(tmp_path):
    proc = _start_run(tmp_path, "--steps", "100000", "--timeout", "5")
    pid = _worker_pid(tmp_path / "tmp", 1)
    time.sleep(2.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: run: rank 1 stopped answering (hung or stuck)"), err
    assert "out of host memory" not in err
    # Echoed without -q, but not torchrun's own traceback and failure summary.
    assert "Traceback" not in err and "ChildFailedError" not in err and "Root Cause" not in err, err
    _after(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_stopped_child_is_continued_only_once_told_to_end():
    from pipeplan.run.supervise import wake_stopped_to_end

    # A parent (as torchrun is) with one child (as a rank is) that takes SIGTERM's default.
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               "subprocess.run(['sleep', '60']); sys.exit(0)"])
    try:
        deadline = time.monotonic() + 20
        child = None
        while child is None and time.monotonic() < deadline:
            for entry in Path("/proc").glob("[0-9]*"):
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if stat[stat.rfind(")") + 2:].split()[1] == str(parent.pid):
                    child = int(entry.name)
            time.sleep(0.05)
        assert child is not None
        os.kill(child, signal.SIGSTOP)
        while Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "T":
            time.sleep(0.01)
        assert wake_stopped_to_end(parent.pid) == []  # stopped, but nobody asked it to end
        os.kill(child, signal.SIGTERM)  # pending: a stopped process does not take it
        assert wake_stopped_to_end(parent.pid) == [child]
        assert parent.wait(timeout=20) == 0  # the child ended, so the parent did
    finally:
        parent.kill()
        parent.wait()


def _torchrun_pid(launcher: int) -> int:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == launcher and b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    raise AssertionError("no torchrun under the launcher")


def _gone_within(tmp_path: Path, seconds: float) -> None:
    """Issue 24's test: no rank, no torchrun and no temp folder ``seconds`` after the kill."""
    tmp = tmp_path / "tmp"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (_processes_under(tmp) or any(tmp.glob("pipeplan-run-*"))):
        time.sleep(0.2)
    assert _processes_under(tmp) == [], "a rank or torchrun outlived the launcher"
    assert [p.name for p in tmp.iterdir() if p.name.startswith("pipeplan-run-")] == [], "temp folder left behind"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGQUIT, signal.SIGUSR1])
def test_kill_9_of_the_launcher_leaves_no_process_and_no_temp_folder(tmp_path, signum):
    """SIGKILL, and the signals whose default action ends Python without its handlers (SIGQUIT,
    SIGUSR1): the launcher runs no code of its own; its watchdog sees the pipe close."""
    proc = _start_run(tmp_path, "--steps", "100000", "--timeout", "30", "-q")
    _worker_pid(tmp_path / "tmp", 1)
    proc.send_signal(signum)
    proc.communicate(timeout=30)
    _gone_within(tmp_path, 15)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_kill_9_of_torchrun_ends_the_ranks_at_once(tmp_path):
    proc = _start_run(tmp_path, "--steps", "100000", "--timeout", "300", "-q")
    _worker_pid(tmp_path / "tmp", 1)
    os.kill(_torchrun_pid(proc.pid), signal.SIGKILL)
    _, err = proc.communicate(timeout=60)  # the ranks die with torchrun (not at their 300 s timeout)
    assert proc.returncode != 0 and "Traceback" not in err, err
    _gone_within(tmp_path, 15)

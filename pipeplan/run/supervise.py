"""The torchrun job under watch: its echoed output, the signals that end it, and why it failed.

:func:`pipeplan.run.launch.run_plans` starts torchrun in its own process group; this module
filters what it prints (:class:`TorchrunFilter`), ends the whole group on a signal
(:class:`StopOnSignals`, :func:`terminate_group`) and names the failing rank and its cause from
what the workers wrote and torchrun's summary (:func:`failure_message`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional, Sequence

from pipeplan.errors import PipeplanError

__all__ = ["TorchrunFilter", "pump_output", "RunStoppedError", "StopOnSignals", "terminate_group",
           "wait_for_job", "wake_stopped_to_end", "failure_message"]


class TorchrunFilter:
    """Drops torchrun's own traceback and failure summary from the echoed output.

    The ranks' output passes through; torchrun's ``ChildFailedError`` traceback (30-40 lines,
    whose "Root Cause" may name the wrong rank) and its elastic-agent log lines do not: the
    launcher's one-line message says which rank failed and why. ``--debug`` shows everything.

    >>> f = TorchrunFilter()
    >>> lines = ["rank 0 says hi", "Traceback (most recent call last):",
    ...          '  File "/x/torch/distributed/run.py", line 9, in main',
    ...          "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ...          "=" * 20, "pipeplan.run.worker FAILED", "-" * 20, "Root Cause", "=" * 20, "bye"]
    >>> [out for line in lines for out in f.feed(line)]
    ['rank 0 says hi', 'bye']
    """

    def __init__(self) -> None:
        self._held: list[str] = []
        self._rules_left = 0

    def feed(self, line: str) -> list[str]:
        if self._rules_left:
            if line.startswith("====="):
                self._rules_left -= 1
            return []
        if self._held:
            self._held.append(line)
            if "ChildFailedError" in line:
                self._held = []
                self._rules_left = 2
                return []
            if line.startswith((" ", "\t")) or line.startswith("Traceback"):
                return []
            held, self._held = self._held, []
            if any("torch/distributed/" in h for h in held):
                return []
            return held
        if line.startswith("Traceback (most recent call last):"):
            self._held = [line]
            return []
        if re.match(r"^[WIE]\d{4} .*(torch/distributed/elastic|torch\.distributed\.elastic)", line):
            return []
        return [line]

    def flush(self) -> list[str]:
        held, self._held = self._held, []
        return [] if any("torch/distributed/" in h for h in held) else held


def pump_output(stream: Any, tail: deque, echo: bool, raw_output: bool = False) -> None:
    keep = None if raw_output else TorchrunFilter()
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        tail.append(line)
        if echo:
            for out in ([line] if keep is None else keep.feed(line)):
                sys.stderr.write(out + "\n")
            sys.stderr.flush()
    if echo and keep is not None:
        for out in keep.flush():
            sys.stderr.write(out + "\n")
        sys.stderr.flush()
    stream.close()


class RunStoppedError(PipeplanError):
    """The launcher got SIGTERM or SIGHUP: the job was ended like on Ctrl-C (exit 128 + signal)."""

    def __init__(self, signum: int) -> None:
        self.exit_code = 128 + signum
        super().__init__(f"run: stopped by {signal.Signals(signum).name}; torchrun and every rank were ended, "
                         f"no report written")


class StopOnSignals:
    """While the job runs, SIGTERM and SIGHUP raise :class:`RunStoppedError` in the launcher.

    The exception unwinds through the ``finally`` that ends torchrun's process group and removes
    the run's temporary folder, as Ctrl-C does. Outside the main thread signals cannot be caught
    and nothing changes.
    """

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __enter__(self) -> "StopOnSignals":
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._raise)
        return self

    def _raise(self, signum: int, frame: Any) -> None:
        # Once: a second signal while the group is being ended must not cut that short.
        if not getattr(self, "_stopping", False):
            self._stopping = True
            raise RunStoppedError(signum)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _descendants(root_pid: int) -> list[tuple[int, str]]:
    """``(pid, state)`` of every process below ``root_pid`` (Linux ``/proc``; elsewhere none).

    torchrun starts each rank in a process group of its own, so the ranks are found by parent.
    """
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[0]))
    found, todo = [], [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def _termination_pending(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            mask |= int(line.split()[1], 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def wake_stopped_to_end(root_pid: int) -> list[int]:
    """SIGCONT each stopped process below ``root_pid`` that has a SIGTERM pending; the pids.

    A stopped rank (SIGSTOP, a debugger) cannot take the SIGTERM torchrun sends when another
    rank fails, and torch 2.13's agent then waits its fixed 30 s before SIGKILL
    (``_stop_workers`` ignores ``--shutdown-timeout``). Only a process already told to end is
    continued, so a rank a user stopped on purpose stays stopped while the job runs.
    """
    woken = []
    for pid, state in _descendants(root_pid):
        if state in ("T", "t") and _termination_pending(pid):
            try:
                os.kill(pid, signal.SIGCONT)
                woken.append(pid)
            except ProcessLookupError:
                pass
    return woken


def wait_for_job(proc: subprocess.Popen, timeout_s: Optional[float], out_dir: Path, poll_s: float = 0.25) -> bool:
    """Wait for torchrun to end (True) or ``timeout_s`` to pass (False).

    Once a rank has written its error report to ``out_dir``, stopped ranks that torchrun has
    asked to end are continued (:func:`wake_stopped_to_end`); before that nothing is scanned.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        wait_s = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
        if wait_s <= 0:
            return proc.poll() is not None
        try:
            proc.wait(timeout=wait_s)
            return True
        except subprocess.TimeoutExpired:
            if next(out_dir.glob("error-rank*.json"), None) is not None:
                wake_stopped_to_end(proc.pid)


def terminate_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process in torchrun's process group."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        ticks = 0
        while time.monotonic() < deadline:
            if ticks % 5 == 0:
                # A stopped rank takes the SIGTERM torchrun passes on only once continued.
                wake_stopped_to_end(pgid)
            ticks += 1
            if proc.poll() is not None:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
            time.sleep(0.05)
        else:
            continue
        break
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


#: Errors a rank raises because a peer went away or stopped answering: consequences, not causes.
_SECONDARY = ("connection closed by peer", "timed out", "timeout", "connection reset", "broken pipe",
              "distnetworkerror", "socket closed")


def _is_secondary(error: dict[str, Any]) -> bool:
    text = f"{error.get('type', '')} {error.get('message', '')}".lower()
    return any(marker in text for marker in _SECONDARY)


def _timed_out(error: dict[str, Any]) -> bool:
    """A peer gave up waiting (timeout), as opposed to seeing the connection close."""
    text = f"{error.get('type', '')} {error.get('message', '')}".lower()
    closed = any(marker in text for marker in ("closed", "reset", "broken pipe"))
    return ("timed out" in text or "timeout" in text) and not closed


def _root_cause(tail: Sequence[str]) -> Optional[tuple[int, Optional[int]]]:
    """torchrun's "Root Cause (first observed failure)": (rank, exit code or -signal)."""
    text = "\n".join(tail)
    index = text.rfind("Root Cause")
    section = text[index:] if index >= 0 else text
    rank = re.search(r"rank\s*:\s*(\d+)", section)
    if rank is None:
        return None
    code = re.search(r"exitcode\s*:\s*(-?\d+)", section)
    return int(rank.group(1)), (int(code.group(1)) if code else None)


def _exit_codes(tail: Sequence[str]) -> dict[int, int]:
    """Every (rank -> exit code) torchrun's failure summary lists, root cause or not."""
    text = "\n".join(tail)
    codes: dict[int, int] = {}
    for block in re.split(r"\n\s*\[\d+\]\s*:|Root Cause", text):
        rank = re.search(r"rank\s*:\s*(\d+)", block)
        code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
        if rank and code:
            codes.setdefault(int(rank.group(1)), int(code.group(1)))
    return codes


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "an unknown exit status"
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"{name}" + (" (killed: out of host memory?)" if -code == signal.SIGKILL else "")


#: Lines a process prints as it dies of a signal: the C++ runtime's and the Python fault
#: handler's (which the launcher turns on in every rank), glibc's heap checks.
_DYING_WORDS = re.compile(r"terminate called|what\(\):|Fatal Python error|double free|corrupted|free\(\): invalid")


def _last_words(tail: Sequence[str]) -> str:
    """``: "<line>"`` quoting the first line a dying process printed, or "" if there is none."""
    for line in tail:
        if _DYING_WORDS.search(line):
            return f': "{line.strip()[:160]}"'
    return ""


def failure_message(out_dir: Path, tail: Sequence[str], returncode: Optional[int],
                     timed_out: Optional[float], num_ranks: int) -> str:
    """One line naming the rank that failed first and why."""
    errors = []
    for path in sorted(out_dir.glob("error-rank*.json")):
        try:
            errors.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    errors.sort(key=lambda e: e.get("time", 0))
    reported = {e["rank"] for e in errors}
    primary = [e for e in errors if not _is_secondary(e)]
    root = _root_cause(tail)

    def describe(error: dict[str, Any]) -> str:
        return f"{error['type']}: {error['message'].split('. This is typically')[0]}"

    if primary:
        first = primary[0]
        message = f"rank {first['rank']} failed: {describe(first)}"
        others = sorted(reported - {first["rank"]})
        if others:
            message += f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped too)"
    elif root is not None and root[0] not in reported:
        message = (f"rank {root[0]} died without an error report ({_exit_text(root[1])}){_last_words(tail)}; "
                   f"see its output above")
        if errors:
            message += f"; rank {errors[0]['rank']} then failed: {describe(errors[0])}"
    elif errors:
        silent = sorted(set(range(num_ranks)) - reported)
        first = errors[0]
        # A silent rank that exited on its own (not torchrun's SIGTERM to the survivors) died:
        # the peer's "connection closed" is the consequence, whichever torchrun saw first.
        codes = _exit_codes(tail)
        # A rank killed outright (out of memory) closes its sockets: its peers see "connection
        # closed". A stopped rank (SIGSTOP, a hang) keeps them open: its peers time out, and
        # torchrun's SIGKILL to the unresponsive process is the consequence, not the cause.
        peers_timed_out = all(_timed_out(e) for e in errors)
        died = [r for r in silent if codes.get(r, 0) > 0 or codes.get(r, 0) in (-signal.SIGSEGV, -signal.SIGABRT)
                or (codes.get(r, 0) == -signal.SIGKILL and not peers_timed_out)]
        if died:
            message = (f"rank {died[0]} died without an error report ({_exit_text(codes[died[0]])})"
                       f"{_last_words(tail)}; "
                       f"see its output above; rank {first['rank']} then failed: {describe(first)}")
        elif silent:
            message = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering "
                       f"(hung or stuck); rank {first['rank']} gave up waiting: {describe(first)}")
        else:
            message = f"rank {first['rank']} failed: {describe(first)}"
    elif root is not None:
        message = (f"rank {root[0]} died without an error report ({_exit_text(root[1])}){_last_words(tail)}; "
                   f"see its output above")
    else:
        last = next((line for line in reversed(tail) if line.strip()), "")
        message = f"torchrun exited with code {returncode}: {last.strip()}"
    if timed_out is not None:
        head = f"the job ran past --job-timeout {timed_out:g} s and was stopped"
        return head if not (errors or root) else f"{head}; {message}"
    return message

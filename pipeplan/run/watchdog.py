"""The run's watchdog: ends torchrun, every rank and the temporary folder when the launcher dies.

Started by :class:`pipeplan.run.lifetime.Watchdog` as ``python watchdog.py FOLDER`` in a session
of its own (so Ctrl-C or a hangup aimed at the launcher's terminal does not reach it), with its
standard input the read end of a pipe whose only write end the launcher holds. The launcher
writes ``watch PID`` once torchrun runs and ``done`` when it has ended the job and removed the
folder itself. Standard input ending without ``done`` means the launcher died, however (SIGKILL
included: the kernel closes a dead process's files): then every descendant of each watched pid
and its process group get SIGKILL, and the folder is removed once they are gone.

It imports nothing of pipeplan (it runs by file path, with the standard library only), so it
starts in tens of milliseconds and does not depend on the package's import state.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _tree(roots: list[int]) -> set[int]:
    """The roots and all their descendants, as /proc shows them now."""
    children = _children_map() if os.path.isdir("/proc") else {}
    found, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def end_everything(roots: list[int], folder: str, wait_s: float = 10.0) -> None:
    """SIGKILL ``roots``, their descendants and process groups; then remove ``folder``."""
    doomed = _tree(roots)
    for _ in range(3):  # a child forked while we walked: walk again
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for root in roots:
            try:
                os.killpg(root, signal.SIGKILL)  # torchrun leads its own group
            except OSError:
                pass
        more = _tree(roots) - doomed
        if not more:
            break
        doomed |= more
    deadline = time.monotonic() + wait_s
    while any(_alive(pid) for pid in doomed) and time.monotonic() < deadline:
        time.sleep(0.05)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGTSTP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    folder = argv[0] if argv else ""
    watched: list[int] = []
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "watch" and rest.isdigit():
            watched.append(int(rest))
        elif word == "done":
            return 0
    end_everything(watched, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

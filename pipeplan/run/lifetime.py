"""No process of a run outlives the launcher, whatever ends it (docs/running.md, "When the launcher dies").

Two mechanisms, each where the other cannot reach:

- :class:`Watchdog`: the launcher starts a small process (:mod:`pipeplan.run.watchdog`) that holds
  the read end of a pipe. The kernel closes the launcher's end when the launcher dies, SIGKILL
  included, so the watchdog learns of any death at once without polling; it then kills torchrun,
  every rank and their process groups, and removes the temporary folder. A parent-death signal
  alone cannot remove the folder (a killed process runs no code), and a process group alone
  cannot be signalled by a process that is already dead.
- :func:`die_with_parent`: each rank asks the kernel for SIGKILL when its parent (torchrun) dies
  (``prctl(PR_SET_PDEATHSIG)``). torchrun starts every rank in a session of its own, so its
  process group does not hold them; without this a SIGKILL to torchrun left the ranks running
  ~40 s (until their peers' timeout) and re-creating the temporary folder.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

__all__ = ["Watchdog", "die_with_parent", "LAUNCHER_PID_ENV"]

#: The launcher's pid, in the ranks' environment: a rank whose launcher is already gone exits.
LAUNCHER_PID_ENV = "PIPEPLAN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux); returns
    whether it could. Exits at once if the parent or the launcher is already gone."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    # The parent may have died before prctl: then this process was already handed to init.
    if os.getppid() == 1 or (launcher.isdigit() and not _alive(int(launcher))):
        os._exit(1)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class Watchdog:
    """The launcher's side of :mod:`pipeplan.run.watchdog` (see the module docstring).

    Parameters
    ----------
    folder : path, optional
        The run's temporary folder, removed if the launcher dies; None for a user's ``work_dir``,
        which is left as it is.
    """

    def __init__(self, folder: Optional[str | Path]) -> None:
        self._proc: Optional[subprocess.Popen] = None
        script = Path(__file__).with_name("watchdog.py")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", str(script), str(folder or "")], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, text=True)
        except OSError:
            self._proc = None  # no watchdog: the launcher's own cleanup still runs on every normal end

    def _say(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def watch(self, pid: int) -> None:
        """Kill ``pid`` (torchrun), its descendants and its process group if the launcher dies."""
        self._say(f"watch {pid}")

    def done(self) -> None:
        """The launcher ended the job and removed the folder itself: the watchdog leaves."""
        self._say("done")
        if self._proc is not None:
            try:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                self._proc.wait(timeout=5.0)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass

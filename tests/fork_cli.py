"""``pipeplan`` commands forked from one process that imported the CLI once (tests/test_docs_commands.py).

Each ``pipeplan`` subprocess spends about 1.1 s of CPU importing ``pipeplan.cli`` (numpy, networkx,
pydantic's models, typer, rich) before it does a second of work; the docs' commands start about 80
of them. Here a server imports the CLI once and forks a fresh child per command: the child takes
the caller's standard streams (passed over a Unix socket), working directory, environment and
arguments, runs ``pipeplan.cli.main()`` as ``python -m pipeplan.cli`` would, and the caller exits
with its exit code. Every command still runs in a process of its own, from the same imported
state (nothing of an earlier command's is left in it). The import itself, and a command started
as a real ``python -m pipeplan`` process, are what the ``..._subprocess`` tests check.

``client_script(python, socket, python_path)`` is the ``pipeplan`` on the docs' PATH: it falls
back to ``python -m pipeplan.cli`` when the server is not there. ``serve(socket)`` runs the server
(``python fork_cli.py SOCKET``).
"""

from __future__ import annotations

import os
import socket
import sys

__all__ = ["client_script", "serve"]

_HEADER_BYTES = 8


def client_script(python: str, socket_path: str, python_path: str) -> str:
    """The text of an executable ``pipeplan`` that asks the server at ``socket_path`` to run it."""
    # -I -S: no site packages, no user paths: the client starts in about 15 ms.
    return f'''#!{python} -IS
import json, os, socket, sys
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect({socket_path!r})
except OSError:  # no server: the command as its own process
    env = dict(os.environ)
    env["PYTHONPATH"] = {python_path!r} + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    os.execve({python!r}, [{python!r}, "-m", "pipeplan.cli", *sys.argv[1:]], env)
body = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(conn, [len(body).to_bytes({_HEADER_BYTES}, "big")], [0, 1, 2])
conn.sendall(body)
code = conn.recv(4)
sys.exit(int.from_bytes(code, "big", signed=True) if len(code) == 4 else 1)
'''


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client closed the connection")
        data += chunk
    return data


def _run_command(conn: socket.socket) -> None:
    """In the forked child: become the caller's ``pipeplan`` process, run it, send the exit code."""
    import atexit
    import json
    import signal
    import threading
    import traceback

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    header, fds, _, _ = socket.recv_fds(conn, _HEADER_BYTES, 3)
    request = json.loads(_read_exactly(conn, int.from_bytes(header, "big")))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["pipeplan", *request["argv"]]
    # As `PYTHONPATH="$REPO:$PYTHONPATH" python -m pipeplan.cli` has it: the working directory
    # first, then the checkout, then the caller's PYTHONPATH, then Python's own (not tests/).
    caller = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *_PYTHON_PATH, *caller, *_BASE_PATH]

    def end_with_the_caller() -> None:
        # The caller gone (killed by the test's timeout): end the command as its own process would.
        conn.recv(1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=end_with_the_caller, daemon=True).start()
    code = 0
    try:
        from pipeplan.cli import main

        main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as Python prints an uncaught error
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    conn.sendall(int(code).to_bytes(4, "big", signed=True))
    os._exit(code)


#: The checkout the server imports pipeplan from, and Python's own path (set by serve).
_PYTHON_PATH: list[str] = []
_BASE_PATH: list[str] = []


def serve(socket_path: str) -> None:
    """Import the CLI, listen on ``socket_path`` and fork a child per connection (until killed).

    Started with ``PYTHONPATH`` the checkout, as the fallback client starts ``pipeplan.cli``.
    """
    import signal

    _PYTHON_PATH[:] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in _PYTHON_PATH]
    import pipeplan.cli  # noqa: F401 - the import every command shares

    def stop(signum, frame):
        raise SystemExit(0)

    # Children are reaped with waitpid, not by ignoring SIGCHLD: their CPU time then counts in
    # the server's, and the server's in the test's (RUSAGE_CHILDREN), as a subprocess's would.
    signal.signal(signal.SIGTERM, stop)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(64)
    print("ready", flush=True)
    try:
        while True:
            conn, _ = server.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                server.close()
                try:
                    _run_command(conn)
                finally:
                    os._exit(1)
            conn.close()
            _reap(block=False)
    finally:
        server.close()
        _reap(block=True)


def _reap(block: bool) -> None:
    """Wait for the ended children (all of them with ``block``)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    serve(sys.argv[1])

"""What every CLI command shares: the one error handler (:func:`handled`), ``--debug`` anywhere
on the line, one-line messages escaped for the terminal, the console."""

from __future__ import annotations

import functools
import os
import sys
import traceback
import unicodedata

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typer.core import TyperGroup

from pipeplan.errors import PipeplanError

__all__ = ["state", "Group", "rich_console", "one_line", "handled", "terminal_progress"]

state = {"debug": False}


def _take_debug(args: list[str]) -> list[str]:
    """Remove ``--debug`` wherever it stands (before a ``--``) and remember it."""
    if "--" in args:
        cut = args.index("--")
        head, tail = args[:cut], args[cut:]
    else:
        head, tail = args, []
    if "--debug" in head:
        state["debug"] = True
        head = [a for a in head if a != "--debug"]
    return head + tail


class Group(TyperGroup):
    """The root command: ``--debug`` anywhere, and usage errors as one line like every other error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        state["debug"] = False
        args = _take_debug(list(sys.argv[1:] if args is None else args))
        try:
            result = super().main(args=args, prog_name=prog_name or "pipeplan", complete_var=complete_var,
                                  standalone_mode=False, **extra)
        except typer.Abort:
            typer.echo("interrupted; no output written", err=True)
            code = 130
        except Exception as exc:
            # typer's own (vendored click) usage errors: duck-typed, their classes are private.
            if not (hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int)):
                raise
            ctx = getattr(exc, "ctx", None)
            if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
                typer.echo(ctx.get_help())
                code = 0
            else:
                command = ctx.command_path if ctx is not None else "pipeplan"
                message = " ".join(exc.format_message().split())
                hint = f" (see {command} --help)" if ctx is not None else ""
                typer.echo(f"error: {command}: {message}{hint}", err=True)
                code = exc.exit_code
        else:
            code = result if isinstance(result, int) else 0
        if not standalone_mode:
            return code
        sys.exit(code)


def rich_console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def _printable(line: str) -> str:
    """Control and direction-override characters (from user input) escaped for the terminal."""
    return "".join(f"\\u{ord(ch):04x}" if unicodedata.category(ch)[0] == "C" or unicodedata.category(ch) in ("Zl", "Zp")
                   else ch for ch in line)


def one_line(text: str) -> str:
    """A message on one line: the first line, and how many more there were."""
    lines = [_printable(line) for line in text.splitlines() if line.strip()] or [""]
    if len(lines) == 1:
        return lines[0]
    return f"{lines[0]} (and {len(lines) - 1} more line{'s' if len(lines) > 2 else ''}; --debug shows all)"


def handled(func):
    """Map PipeplanError to its exit code with a one-line message; anything else is a bug."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except PipeplanError as exc:
            if state["debug"]:
                traceback.print_exc()
            kind = "infeasible" if exc.exit_code == 3 else "error"
            typer.echo(f"{kind}: {one_line(str(exc))}", err=True)
            raise typer.Exit(exc.exit_code)
        except RecursionError:
            if state["debug"]:
                raise
            typer.echo("error: input nested too deep to read", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            typer.echo("interrupted; no output written", err=True)
            raise typer.Exit(130)
        except BrokenPipeError:
            # The reader left (`| head`); files were already written. Point stdout at devnull so
            # that the interpreter's final flush does not fail again.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass
            raise typer.Exit(0)
        except Exception as exc:
            if state["debug"]:
                raise
            typer.echo(f"internal error: {type(exc).__name__}: {one_line(str(exc))} (rerun with --debug for the "
                       f"traceback)", err=True)
            raise typer.Exit(1)

    return wrapper


class _Shown:
    """The outermost task, drawn by rich on stderr; it disappears when done."""

    def __init__(self, owner: "_TerminalProgress", description: str, total):
        self.owner = owner
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                                 console=Console(stderr=True), transient=True)
        self.progress.start()
        self.id = self.progress.add_task(_printable(description), total=total, note="")

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.progress.update(self.id, advance=steps, note=_printable(note))

    def close(self) -> None:
        self.progress.stop()
        self.owner.depth -= 1


class _Nested:
    """A task inside another (a replica's pipeline search inside the cluster search): not drawn."""

    def __init__(self, owner: "_TerminalProgress"):
        self.owner = owner

    def advance(self, steps: int = 1, note: str = "") -> None:
        pass

    def close(self) -> None:
        self.owner.depth -= 1


class _TerminalProgress:
    """Draws the outermost task of a command (:mod:`pipeplan.progress`)."""

    def __init__(self):
        self.depth = 0

    def task(self, description: str, total):
        self.depth += 1
        return _Shown(self, description, total) if self.depth == 1 else _Nested(self)


def terminal_progress(quiet: bool = False):
    """A progress reporter for long steps when stderr is a terminal; None in pipes, files and
    with ``--quiet`` (nothing but the result and errors there)."""
    if quiet or not sys.stderr.isatty():
        return None
    return _TerminalProgress()

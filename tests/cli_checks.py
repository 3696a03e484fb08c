"""What the hardening tests share: files written, the CLI invoked, the one-line error checked, a
small profile and its plan (the fixtures ``profile_file`` and ``plan_file``, in conftest.py)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pipeplan.cli import app

runner = CliRunner()


def write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code=2, *needles):
    """The result failed with ``code``, one line on stderr, no traceback, naming every needle."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]

"""The ``pipeplan profile`` command: output file, exit codes, messages."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
cli = pytest.importorskip("pipeplan.cli")
typer_testing = pytest.importorskip("typer.testing")

from pipeplan.formats.io import load_profile  # noqa: E402

pytestmark = pytest.mark.torch

FAST = ["--microbatch-sizes", "1,2", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
        "--layers", "1", "--hidden", "32", "--vocab", "64"]


def _invoke(args):
    runner = typer_testing.CliRunner()
    return runner.invoke(cli.app, args)


def test_profile_command_writes_a_valid_profile(tmp_path):
    out = tmp_path / "sub" / "p.json"
    result = _invoke(["profile", "gpt2-tiny", *FAST, "-o", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.source == "measured" and profile.microbatch_sizes == [1, 2]
    assert [layer.name for layer in profile.layers] == ["embed", "blocks.0", "norm", "head"]
    assert profile.measurement["threads"] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-model"], "not a built-in model"),
        (["gpt2-tiny", "--units", "encoder.layer.*"], "matches no module"),
        (["gpt2-tiny", "--seq-len", "100000"], "lower --seq-len"),
        (["no_such_pkg_xyz:build"], "cannot import module"),
    ],
)
def test_bad_input_exits_2_and_leaves_no_file(tmp_path, args, message):
    out = tmp_path / "p.json"
    base = [a for a in FAST if a not in ("--seq-len", "8")] if "--seq-len" in args else FAST
    result = _invoke(["profile", args[0], *base, *args[1:], "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", " ")
    assert not out.exists()


def test_interrupt_leaves_no_file_and_keeps_an_old_one(tmp_path, monkeypatch):
    import pipeplan.profile.api as api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "profile_model", interrupted)
    out = tmp_path / "p.json"
    result = _invoke(["profile", "gpt2-tiny", *FAST, "-o", str(out)])
    assert result.exit_code == 130 and not out.exists()
    out.write_text("old")
    _invoke(["profile", "gpt2-tiny", *FAST, "-o", str(out)])
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["p.json"]

"""Timeline pictures of a simulation: terminal text and matplotlib images."""

from __future__ import annotations

import pytest

from pipeplan.errors import BadInputError
from pipeplan.plan.simulate import StageCost, simulate
from pipeplan.plan.timeline import render_timeline_text, write_timeline_image


def _sim(schedule="1f1b", p=3, m=4, v=1):
    cost = StageCost(1.0, 1.5, 0.5, send_ms=0.1, static_memory_bytes=2**30, activation_bytes=2**26)
    return simulate([cost] * (p * v), schedule, p, m, v)


def test_text_has_one_row_per_rank_of_the_requested_width():
    sim = _sim("zbv", 3, 6, 2)
    lines = render_timeline_text(sim, width=60).plain.splitlines()
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 3
    for row in rows:
        inner = row.split("|")[1]
        assert len(inner) == 60
    # The first rank starts at once; the last waits for the fill.
    assert rows[0].split("|")[1][0] != "·"
    assert rows[-1].split("|")[1][0] == "·"
    assert "lower case" in lines[-1]


def test_text_idle_share_matches_the_bubble():
    sim = _sim("gpipe", 4, 4)
    text = render_timeline_text(sim, width=200).plain
    cells = "".join(line.split("|")[1] for line in text.splitlines() if line.startswith("rank "))
    assert cells.count("·") / len(cells) == pytest.approx(sim.bubble_fraction, abs=0.02)


def test_text_rejects_tiny_width():
    with pytest.raises(BadInputError, match="width"):
        render_timeline_text(_sim(), width=3)


def test_image_is_written_and_reproducible(tmp_path):
    pytest.importorskip("matplotlib")
    sim = _sim("interleaved", 2, 4, 2)
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    write_timeline_image(sim, first)
    write_timeline_image(sim, second)
    data = first.read_bytes()
    assert data.startswith(b"<?xml") and b"memory" in data
    assert data == second.read_bytes()


def test_image_rejects_unknown_suffix(tmp_path):
    with pytest.raises(BadInputError, match=r"\.svg"):
        write_timeline_image(_sim(), tmp_path / "plan.gif")

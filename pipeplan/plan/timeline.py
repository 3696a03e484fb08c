"""Pictures of a simulated iteration: a terminal timeline and a matplotlib figure.

Ranks are rows, time runs to the right; forwards, input gradients, weight
gradients and whole backwards have their own colours, and idle time stays
blank. The figure adds each rank's memory over time beneath.
matplotlib is imported only by :func:`write_timeline_image`, with the Agg backend.

See docs/schedules.md.
"""

from __future__ import annotations

import io
from pathlib import Path

from rich.text import Text

from pipeplan.errors import BadInputError
from pipeplan.plan.simulate import Simulation
from pipeplan.formats.io import write_bytes_atomic

__all__ = ["KIND_COLORS", "render_timeline_text", "write_timeline_image"]

#: Colour of each action kind in the image: forward, input gradient, weight gradient, whole backward.
KIND_COLORS = {"F": "#4c78a8", "B": "#72b7b2", "W": "#eeca3b", "FULL_B": "#54a24b"}
# Terminal styles from the 16 standard colours, which every terminal has.
_TEXT_STYLES = {"F": "white on blue", "B": "black on cyan", "W": "black on yellow", "FULL_B": "black on green"}
_KIND_NAMES = {"F": "forward", "B": "input grad", "W": "weight grad", "FULL_B": "backward"}
_IMAGE_FORMATS = ("svg", "png", "pdf")


def render_timeline_text(sim: Simulation, width: int = 100) -> Text:
    """The timeline as rich text: one row per rank, ``width`` cells of equal time.

    Each cell shows the action that covers most of it, on the kind's colour:
    the kind's letter in its first cell (``F`` forward, ``I`` input gradient,
    ``W`` weight gradient, ``B`` whole backward; lower case for a rank's second
    and later stages), then the micro-batch's last digit. ``·`` marks idle
    cells. ``Text.plain`` is the same picture without colour.

    Parameters
    ----------
    sim : Simulation
        From :func:`pipeplan.plan.simulate.simulate`.
    width : int, optional
        Cells per row (>= 10).

    Returns
    -------
    rich.text.Text

    Notes
    -----
    ``O(events + ranks * width)``.

    Examples
    --------
    >>> from pipeplan.plan.simulate import StageCost, simulate
    >>> sim = simulate([StageCost(1.0, 1.0, 0.0)] * 2, "1f1b", 2, 2)
    >>> print(render_timeline_text(sim, width=12).plain)  # doctest: +NORMALIZE_WHITESPACE
    1f1b  p=2 m=2 v=1  iteration 6.00 ms  bubble 33.3%
    rank 0 |F0F1··B0··B1|  busy 4.00 ms  idle 2.00 ms
    rank 1 |··F0B0F1B1··|  busy 4.00 ms  idle 2.00 ms
    F forward  I input grad  W weight grad  B backward  · idle  (digits: micro-batch)
    """
    if not isinstance(width, int) or width < 10:
        raise BadInputError(f"timeline width = {width!r} must be an integer >= 10")
    p = sim.num_ranks
    span = sim.iteration_ms if sim.iteration_ms > 0 else 1.0
    cell_ms = span / width
    # Per rank and cell: (overlap, event index) of the event covering most of the cell.
    best: list[list[tuple[float, int]]] = [[(0.0, -1)] * width for _ in range(p)]
    for index, event in enumerate(sim.events):
        first = min(width - 1, int(event.start_ms / cell_ms))
        last = min(width - 1, int(event.end_ms / cell_ms))
        row = best[event.rank]
        for cell in range(first, last + 1):
            overlap = min(event.end_ms, (cell + 1) * cell_ms) - max(event.start_ms, cell * cell_ms)
            if overlap > row[cell][0] + 1e-12:
                row[cell] = (overlap, index)

    letter = {"F": "F", "B": "I", "W": "W", "FULL_B": "B"}
    local_stage = _local_stage_index(sim)
    text = Text()
    text.append(
        f"{sim.schedule}  p={p} m={sim.num_microbatches} v={sim.virtual_stages}  "
        f"iteration {sim.iteration_ms:.2f} ms  bubble {100 * sim.bubble_fraction:.1f}%\n",
        style="bold",
    )
    label_width = len(f"rank {p - 1}")
    for rank in range(p):
        text.append(f"rank {rank}".ljust(label_width) + " |")
        previous = -1
        for overlap, index in best[rank]:
            if index < 0:
                text.append("·", style="dim")
                previous = -1
                continue
            event = sim.events[index]
            style = _TEXT_STYLES[event.kind]
            if index != previous:
                mark = letter[event.kind]
                if local_stage[event.stage] > 0:
                    mark = mark.lower()
                text.append(mark, style=f"bold {style}")
            else:
                text.append(str(event.microbatch % 10), style=style)
            previous = index
        text.append(
            f"|  busy {sim.rank_busy_ms[rank]:.2f} ms  idle {sim.rank_idle_ms[rank]:.2f} ms\n"
        )
    for kind in ("F", "B", "W", "FULL_B"):
        text.append(f"{letter[kind]}", style=_TEXT_STYLES[kind])
        text.append(f" {_KIND_NAMES[kind]}  ")
    text.append("·", style="dim")
    text.append(" idle  (digits: micro-batch")
    text.append("; lower case: a rank's later stages)" if sim.virtual_stages > 1 else ")")
    return text


def write_timeline_image(sim: Simulation, path: str | Path) -> None:
    """Write the timeline, with each rank's memory over time beneath, as SVG, PNG or PDF.

    Parameters
    ----------
    sim : Simulation
        From :func:`pipeplan.plan.simulate.simulate`.
    path : str or Path
        Output file; its suffix picks the format (``.svg``, ``.png``, ``.pdf``).
        Written atomically; the same simulation gives the same bytes.

    Raises
    ------
    BadInputError
        For another suffix.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in _IMAGE_FORMATS:
        raise BadInputError(
            f"timeline image {str(path)!r}: suffix {path.suffix or '(none)'!r} is not one of "
            f"{', '.join('.' + f for f in _IMAGE_FORMATS)}: name the file e.g. plan.svg"
        )
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = sim.num_ranks
    with matplotlib.rc_context({"svg.hashsalt": "pipeplan", "font.size": 9}):
        fig, (ax_time, ax_mem) = plt.subplots(
            2, 1, figsize=(12, 1.2 + 0.45 * p + 2.2), sharex=True,
            gridspec_kw={"height_ratios": [max(1.0, 0.45 * p), 2.2]},
        )
        try:
            span = sim.iteration_ms if sim.iteration_ms > 0 else 1.0
            local_stage = _local_stage_index(sim)
            # One bar collection per (rank, kind, first or later local stage): fast to draw.
            bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
            for event in sim.events:
                key = (event.rank, event.kind, local_stage[event.stage] > 0)
                bars.setdefault(key, []).append((event.start_ms, event.end_ms - event.start_ms))
            for (rank, kind, later), spans in sorted(bars.items()):
                ax_time.broken_barh(
                    spans, (rank - 0.4, 0.8), facecolors=KIND_COLORS[kind],
                    edgecolor="white", linewidth=0.4, alpha=0.6 if later else 1.0,
                )
            # Micro-batch numbers where they fit.
            min_label_ms = span / 120 if len(sim.events) <= 3000 else float("inf")
            for event in sim.events:
                duration = event.end_ms - event.start_ms
                if duration >= min_label_ms:
                    ax_time.text(
                        event.start_ms + duration / 2, event.rank, str(event.microbatch),
                        ha="center", va="center", fontsize=6,
                        color="white" if event.kind in ("F", "FULL_B") else "black",
                    )
            ax_time.set_yticks(range(p), [f"rank {r}" for r in range(p)])
            ax_time.set_ylim(p - 0.5, -0.5)
            ax_time.set_title(
                f"{sim.schedule}: {p} ranks, {sim.num_microbatches} micro-batches, v={sim.virtual_stages}; "
                f"iteration {sim.iteration_ms:.2f} ms, bubble {100 * sim.bubble_fraction:.1f}%"
            )
            ax_time.legend(
                handles=[Patch(color=KIND_COLORS[k], label=_KIND_NAMES[k]) for k in KIND_COLORS]
                + ([Patch(color="grey", alpha=0.6, label="lighter: later stage")] if sim.virtual_stages > 1 else []),
                loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False,
            )
            scale, unit = _memory_unit(max(sim.rank_peak_memory_bytes, default=0))
            for rank, timeline in enumerate(sim.rank_memory_timeline):
                # A free and an allocation at the same instant draw as one step, not a spike.
                steps: dict[float, int] = {}
                for time_ms, memory_bytes in timeline:
                    steps[time_ms] = memory_bytes
                times = list(steps) + [span]
                values = [b / scale for b in steps.values()]
                values.append(values[-1])
                ax_mem.step(times, values, where="post", label=f"rank {rank}", linewidth=1.0)
            ax_mem.set_ylabel(f"memory ({unit})")
            ax_mem.set_xlabel("time (ms)")
            ax_mem.set_xlim(0, span)
            if p <= 16:
                ax_mem.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
            fig.tight_layout()
            buffer = io.BytesIO()
            metadata = {"Date": None} if fmt == "svg" else ({"CreationDate": None} if fmt == "pdf" else {})
            fig.savefig(buffer, format=fmt, metadata=metadata, dpi=120)
        finally:
            plt.close(fig)

    write_bytes_atomic(path, buffer.getvalue())


def _local_stage_index(sim: Simulation) -> list[int]:
    """For each stage, its position among its rank's stages (0 for the first)."""
    seen = [0] * sim.num_ranks
    out = []
    for rank in sim.stage_ranks:
        out.append(seen[rank])
        seen[rank] += 1
    return out


def _memory_unit(peak_bytes: int) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak_bytes >= scale:
            return float(scale), unit
    return 1.0, "bytes"

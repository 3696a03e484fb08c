"""Predicted time with and without the second split balanced by rank (several stages per rank).

For the shipped profiles (``profiles/*.json``) and PipeDream's real profiles (shipped in
``profiles/pipedream/``), plans each under
``--schedule zbv`` and ``--schedule interleaved`` (its ``v`` searched) at 2, 4 and 8 stages, once
as shipped and once with the balanced split switched off (the min-max-stage split alone, as
before it), and prints both predicted iterations, the gain and how the shipped plan's split was
found. Results go to docs/benchmarks.md with this command:

    python benchmarks/bench_rank_balance.py [--only gpt2-cpu]
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: PipeDream's graphs, shipped in the repository (profiles/pipedream/README.md: origin, licence, format).
PIPEDREAM = REPO / "profiles" / "pipedream"

@contextmanager
def min_max_stage_split_only():
    """The planner as it was before the balanced split: ``balance_ranks`` finds nothing."""
    import pipeplan.plan.ranks as ranks
    import pipeplan.plan.search as search

    saved = ranks.balance_ranks
    ranks.balance_ranks = search.balance_ranks = lambda problem, partition, placement: None
    try:
        yield
    finally:
        ranks.balance_ranks = search.balance_ranks = saved


def profiles(only):
    from pipeplan.formats.io import load_profile
    from pipeplan.importers import import_pipedream
    from pipeplan.importers.pipedream import PROFILED_BATCH

    for path in sorted((REPO / "profiles").glob("*.json")):
        if not only or path.stem in only:
            yield path.stem, load_profile(path), {}
    for name, batch in PROFILED_BATCH.items():
        path = PIPEDREAM / f"{name}.graph.txt"
        if not only or name in only:
            # As tests/test_planner_pipedream.py plans them: 16 micro-batches, transfers free.
            yield name, import_pipedream(path, batch), {"global_batch": batch * 16, "bandwidth_bytes_per_s": None}


def main(argv=None) -> int:
    from pipeplan.errors import PipeplanError
    from pipeplan.formats.plan import PlanSettings
    from pipeplan.plan import make_plan

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="a profile name (file stem); repeatable")
    args = parser.parse_args(argv)
    print("| profile | schedule | stages | v | min-max-stage split ms | with the balanced split ms | gain | split |")
    print("|---|---|---|---|---|---|---|---|")
    gains = []
    for name, profile, extra in profiles(args.only):
        for schedule in ("zbv", "interleaved"):
            for stages in (2, 4, 8):
                if stages * 2 > len(profile.layers):
                    continue
                settings = PlanSettings(stages=stages, schedule=schedule, recompute="none", **extra)
                try:
                    new = make_plan(profile, settings, profile_sha256="0" * 64)
                    with min_max_stage_split_only():
                        old = make_plan(profile, settings, profile_sha256="0" * 64)
                except PipeplanError as error:
                    print(f"| {name} | {schedule} | {stages} | | {str(error).splitlines()[0][:60]} | | | |")
                    continue
                old_ms, new_ms = old.predicted.iteration_ms, new.predicted.iteration_ms
                gain = (old_ms - new_ms) / old_ms
                gains.append(gain)
                print(f"| {name} | {schedule} | {stages} | {new.virtual_stages} | {old_ms:.1f} | {new_ms:.1f} | "
                      f"{100 * gain:.1f}% | {new.solver.method} |")
    if gains:
        better = sum(g > 0 for g in gains)
        print(f"\n{len(gains)} plans: {better} faster with the balanced split (largest gain "
              f"{100 * max(gains):.1f}%, median of those {100 * sorted(g for g in gains if g > 0)[better // 2]:.1f}%)"
              if better else f"\n{len(gains)} plans: none faster with the balanced split")
        assert min(gains) >= -1e-9, "a plan got slower with the balanced split"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

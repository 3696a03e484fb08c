"""The cluster search's bounds and pruning keep its winner: the search as shipped against the same
search with every bound and all pruning switched off, on the analytic Llama 3 H100 profiles.

    python benchmarks/check_pruning.py                     # 70B on 1,024 and 64 GPUs, 8B on 64
    python benchmarks/check_pruning.py --only 70b-1024

Prints, per case, whether the two plans are byte-identical but for the runners-up table (the
pruned search lists lower bounds where the full one lists times) and both searches' times. The
full search takes minutes (70B on 1,024 GPUs: about 80-100 s on 2 cores). docs/benchmarks.md
reports its output; ``tests/test_cluster_search.py`` does the same on smaller cases.
"""

from __future__ import annotations

import argparse
import time

CASES = {
    "70b-1024": ("llama3-70b", 1024, 1024),
    "70b-64": ("llama3-70b", 64, 128),
    "8b-64": ("llama3-8b", 64, 256),
}


def _exhaustive(plan):
    """``plan()`` with the layout bounds and the pruning against the best switched off."""
    import pipeplan.cluster.bounds as bounds
    import pipeplan.cluster.search as search

    saved = (search.pipeline_lower_bound_ms, bounds.round_trip_lower_bound_ms, search._unbounded,
             search.PRUNE_AGAINST_BEST)
    search.pipeline_lower_bound_ms = lambda *a, **k: 0.0
    bounds.round_trip_lower_bound_ms = lambda *a, **k: 0.0
    search._unbounded = lambda *a, **k: (0.0, float("inf"), 0)
    search.PRUNE_AGAINST_BEST = False
    try:
        return plan()
    finally:
        (search.pipeline_lower_bound_ms, bounds.round_trip_lower_bound_ms, search._unbounded,
         search.PRUNE_AGAINST_BEST) = saved


def main(argv=None) -> int:
    from pipeplan.analytic.api import analytic_profile
    from pipeplan.facts.gpus import get_gpu
    from pipeplan.cluster.presets import PRESETS
    from pipeplan.cluster.search import plan_cluster
    from pipeplan.formats.io import dump_model
    from pipeplan.formats.plan import PlanSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    args = parser.parse_args(argv)
    different = 0
    for name in args.only or CASES:
        model, gpus, batch = CASES[name]
        profile = analytic_profile(model, get_gpu("h100-sxm"), seq_len=8192, dtype="bf16",
                                   microbatch_sizes=[1, 2, 4], tensor_parallel=[1, 2, 4, 8])
        settings = PlanSettings(num_gpus=gpus, cluster=PRESETS["dgx-h100"], global_batch=batch, schedule="auto",
                                recompute="auto")

        def plan():
            return plan_cluster(profile, settings, profile_sha256="check")

        started = time.perf_counter()
        pruned = plan()
        middle = time.perf_counter()
        full = _exhaustive(plan)
        ended = time.perf_counter()
        same = (dump_model(pruned.model_copy(update={"alternatives": []}))
                == dump_model(full.model_copy(update={"alternatives": []})))
        different += not same
        print(f"{name}: {'identical' if same else 'DIFFERENT'}; pruned {middle - started:.1f} s, "
              f"exhaustive {ended - middle:.1f} s; {pruned.predicted.iteration_ms:.1f} ms and "
              f"{full.predicted.iteration_ms:.1f} ms per iteration", flush=True)
    return 1 if different else 0


if __name__ == "__main__":
    raise SystemExit(main())

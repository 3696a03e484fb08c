"""Time the exact partitioner on PipeDream's profiles and on synthetic chains.

Usage: .venv/bin/python benchmarks/bench_partition.py [--quick]
Prints a markdown table; paste it into docs/benchmarks.md with the machine's load.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import networkx as nx
import numpy as np

from pipeplan.formats.plan import PlanSettings
from pipeplan.importers import import_pipedream
from pipeplan.plan.graph import LayerGraph
from pipeplan.plan import CostModel, PartitionProblem, partition_chain
from pipeplan.plan import make_plan

#: PipeDream's graphs, shipped in the repository (profiles/pipedream/README.md).
DATA = Path(__file__).resolve().parents[1] / "profiles" / "pipedream"
BATCH = {
    "alexnet": 256, "vgg16": 128, "resnet18": 256, "resnet50": 128, "resnext50": 128,
    "resnet101": 64, "resnext101": 64, "squeezenet1_0": 256, "inception_v3": 128,
    "densenet121": 64, "nasnetamobile": 128, "nasnetalarge": 16, "gnmt": 128, "gnmt_large": 128,
}


def pipedream_rows():
    print("| profile | layers | stages | bottleneck ms | lower bound ms | method | proven optimal | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, batch in sorted(BATCH.items()):
        path = DATA / f"{name}.graph.txt"
        profile = import_pipedream(path, batch)
        for stages in (4, 8, 16):
            started = time.perf_counter()
            plan = make_plan(profile, PlanSettings(stages=stages, global_batch=batch * 16, schedule="1f1b",
                                                   recompute="none", bandwidth_bytes_per_s=None),
                             profile_sha256="-")
            seconds = time.perf_counter() - started
            bottleneck = max(s.forward_ms + s.backward_ms for s in plan.stages)
            bound = getattr(plan.solver, "lower_bound_ms", None)
            print(f"| {name} | {len(profile.layers)} | {stages} | {bottleneck:.3f} | "
                  f"{'-' if bound is None else f'{bound:.3f}'} | {plan.solver.method} | "
                  f"{'yes' if plan.solver.optimal else 'no'} | {seconds:.2f} |", flush=True)


def synthetic_chain(n: int, seed: int = 0) -> LayerGraph:
    rng = np.random.default_rng(seed)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((i, i + 1) for i in range(n - 1))
    forward = rng.uniform(0.1, 2.0, n)
    backward = 2 * forward
    return LayerGraph(names=tuple(f"l{i}" for i in range(n)), forward_ms=forward, backward_ms=backward,
                      backward_input_ms=backward / 2, backward_weight_ms=backward / 2, backward_split_measured=False,
                      param_bytes=rng.uniform(1e6, 1e8, n), activation_bytes=rng.uniform(1e6, 1e8, n),
                      output_bytes=rng.uniform(1e5, 1e7, n), graph=g, chain=True)


def chain_rows(quick: bool):
    print()
    print("| layers | stages | method | bottleneck ms | seconds |")
    print("|---|---|---|---|---|")
    sizes = (100, 1000) if quick else (100, 1000, 10000)
    for n in sizes:
        graph = synthetic_chain(n)
        for k in (4, 16, 64):
            problem = PartitionProblem(graph=graph, num_stages=k, in_flight=tuple(min(2 * k, k - s) for s in range(k)),
                                       cost=CostModel(bandwidth_bytes_per_s=25e9, static_bytes_per_param_byte=4.0),
                                       memory_cap_bytes=math.inf)
            started = time.perf_counter()
            found = partition_chain(problem)
            seconds = time.perf_counter() - started
            print(f"| {n} | {k} | {found.method} | {found.bottleneck_ms:.3f} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    pipedream_rows()
    chain_rows(quick)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")

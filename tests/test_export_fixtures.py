"""Small profiles and hand-built plans shared by the export and check tests (no tests here)."""

from __future__ import annotations

import hashlib
import sys
import types

import pytest

from pipeplan.formats.io import dump_model
from pipeplan.formats.plan import Plan, PlanProfileRef, PlanSettings, PlanStage, Predicted, SolverInfo
from pipeplan.formats.profile import Profile

MIB = 2**20


def llama_like_profile(num_blocks: int = 8, *, model: str = "tiny-llama", sizes=(1, 2, 4),
                       head_forward_ms: float = 3.0) -> Profile:
    """A torchtitan-Llama-shaped chain: tok_embeddings, layers.0..N-1, norm, output, with kinds."""
    layers = []

    def layer(name, kind, forward_ms, param_mib, act_mib):
        costs = [
            {"microbatch_size": b, "forward_ms": forward_ms * b, "backward_ms": 2 * forward_ms * b,
             "activation_bytes": act_mib * MIB * b, "output_bytes": MIB * b}
            for b in sizes
        ]
        layers.append({"name": name, "kind": kind, "param_bytes": param_mib * MIB, "costs": costs})

    layer("tok_embeddings", "embedding", 0.5, 64, 1)
    for i in range(num_blocks):
        layer(f"layers.{i}", "block", 2.0 + 0.1 * (i % 3), 32, 8)
    layer("norm", "norm", 0.1, 0, 1)
    layer("output", "head", head_forward_ms, 64, 4)
    return Profile.model_validate({
        "schema_version": 1, "model": model, "source": "analytic",
        "device": {"name": "test"}, "dtype": "bf16", "layers": layers,
    })


def profile_bytes(profile: Profile) -> bytes:
    return dump_model(profile).encode()


def profile_sha(profile: Profile) -> str:
    return hashlib.sha256(profile_bytes(profile)).hexdigest()


def hand_plan(profile: Profile, split: list[int], schedule: str, ranks: int, virtual_stages: int,
              microbatch_size: int, num_microbatches: int, *, memory_cap_bytes=None,
              peak_bytes: int = 100 * MIB, sha: str | None = None) -> Plan:
    """A plan with the given stage sizes (layer counts, in order) and the schedule's placement."""
    from pipeplan.facts.schedules import stage_ranks

    names = [layer.name for layer in profile.layers]
    assert sum(split) == len(names) and len(split) == ranks * virtual_stages
    placement = stage_ranks(schedule, ranks, virtual_stages)
    stages, start = [], 0
    for index, count in enumerate(split):
        chunk = names[start:start + count]
        start += count
        costs = [layer.cost_at(microbatch_size) for layer in profile.layers if layer.name in chunk]
        stages.append(PlanStage(
            index=index, rank=placement[index], layers=chunk,
            forward_ms=sum(c.forward_ms for c in costs), backward_ms=sum(c.backward_ms for c in costs),
            send_bytes=0, peak_memory_bytes=peak_bytes,
        ))
    return Plan(
        schema_version=1,
        profile=PlanProfileRef(model=profile.model, sha256=sha or profile_sha(profile)),
        settings=PlanSettings(stages=ranks, global_batch=microbatch_size * num_microbatches,
                              microbatch_size=microbatch_size, memory_cap_bytes=memory_cap_bytes,
                              schedule=schedule, virtual_stages=virtual_stages),
        schedule=schedule, virtual_stages=virtual_stages, microbatch_size=microbatch_size,
        num_microbatches=num_microbatches, stages=stages,
        predicted=Predicted(iteration_ms=100.0, bubble_fraction=0.1, samples_per_second=80.0,
                            bottleneck_stage=0),
        solver=SolverInfo(method="given", optimal=False, seconds=0.0),
    )


#: (schedule, ranks, virtual stages, micro-batches) that torch's classes accept, one or more each.
SCHEDULE_CASES = [
    ("gpipe", 2, 1, 3),
    ("1f1b", 4, 1, 8),
    ("interleaved", 2, 2, 4),
    ("interleaved", 3, 2, 6),
    ("interleaved", 2, 5, 4),
    ("zb", 2, 1, 4),
    ("zb", 2, 2, 4),
    ("zb", 2, 3, 6),
    ("zbv", 2, 2, 4),
    ("dualpipev", 2, 2, 4),
]


def even_split(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def torchtitan_config_manager():
    """torchtitan's real ConfigManager, loaded without torchtitan/__init__ (which pulls tokenizers)."""
    pytest.importorskip("tyro")
    import importlib.util

    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("torchtitan not installed")
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    try:
        from torchtitan.config import ConfigManager
    except ImportError as exc:  # a torchtitan without the TOML config (>= 0.3)
        pytest.skip(f"torchtitan's TOML ConfigManager is not importable: {exc}")
    return ConfigManager

"""Shared fixtures: small profiles built in code, and the real PipeDream profiles shipped in profiles/pipedream."""

from __future__ import annotations

from pathlib import Path

import pytest

import cli_checks
from pipeplan.importers.pipedream import PROFILED_BATCH

REPO = Path(__file__).resolve().parents[1]
#: PipeDream's graphs, shipped in the repository (profiles/pipedream/README.md: origin, licence, format).
PIPEDREAM = REPO / "profiles" / "pipedream"

#: Profiling batch of each PipeDream graph (from the data's README).
PIPEDREAM_BATCH = PROFILED_BATCH


def pipedream_path(name: str) -> Path:
    # They ship in the repository: a missing one is a broken checkout, not a reason to skip.
    path = PIPEDREAM / f"{name}.graph.txt"
    assert path.is_file(), f"{path} is missing from the checkout"
    return path


def make_profile_dict(n_layers=6, sizes=(1, 2), edges=None, forward_ms=None, param_bytes=1000,
                      activation_bytes=100, output_bytes=10, model="toy"):
    """A valid profile as a dict, easy to break field by field in tests."""
    layers = []
    for i in range(n_layers):
        f = forward_ms[i] if forward_ms else 1.0 + (i % 3)
        layers.append({
            "name": f"layer{i}",
            "param_bytes": param_bytes,
            "costs": [
                {"microbatch_size": b, "forward_ms": f * b, "backward_ms": 2 * f * b,
                 "activation_bytes": activation_bytes * b, "output_bytes": output_bytes * b}
                for b in sizes
            ],
        })
    data = {"schema_version": 1, "model": model, "source": "analytic",
            "device": {"name": "test"}, "dtype": "fp32", "layers": layers}
    if edges is not None:
        data["edges"] = edges
    return data


# A small profile and its plan, written through the CLI (tests/cli_checks.py; the hardening tests).
@pytest.fixture
def profile_file(tmp_path):
    return cli_checks.write(tmp_path, make_profile_dict(n_layers=6), "profile.json")


@pytest.fixture
def plan_file(tmp_path, profile_file):
    out = tmp_path / "plan.json"
    result = cli_checks.invoke("plan", profile_file, "--stages", 2, "--global-batch", 8, "--schedule", "1f1b", "-o", out, "-q")
    assert result.exit_code == 0, result.stderr
    return out

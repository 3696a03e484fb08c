"""Tiny analytic profiles with the built-in GPT-2's unit names, for executor tests (the split only needs names)."""

from __future__ import annotations

from pipeplan.formats.profile import Profile

#: The sequence length the executor tests run the built-in model at.
SEQ_LEN = 8


def gpt2_unit_names(layers: int) -> list[str]:
    """The built-in GPT-2's units: ``embed``, ``blocks.0`` ... ``blocks.{layers-1}``, ``norm``, ``head``."""
    return ["embed", *[f"blocks.{i}" for i in range(layers)], "norm", "head"]


def tiny_gpt2_profile(layers: int) -> Profile:
    """An analytic profile of the built-in GPT-2's units at micro-batch sizes 1 and 2, with round times."""
    return Profile.model_validate({
        "schema_version": 1, "model": "gpt2-tiny", "source": "analytic", "device": {"name": "cpu"},
        "dtype": "fp32", "sequence_length": SEQ_LEN,
        "layers": [{"name": name, "param_bytes": 4096, "costs": [
            {"microbatch_size": b, "forward_ms": 1.0 * b, "backward_ms": 2.0 * b,
             "backward_input_ms": 1.0 * b, "backward_weight_ms": 1.0 * b,
             "activation_bytes": 1024 * b, "output_bytes": 1024 * b} for b in (1, 2)]}
            for name in gpt2_unit_names(layers)],
    })

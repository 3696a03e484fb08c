"""Time ``--schedule auto`` (schedule, stages per rank, micro-batch size and recomputation
searched together, every candidate checked by the simulator) on analytic transformer profiles.

    .venv/bin/python benchmarks/bench_schedule_auto.py            # the table in docs/benchmarks.md
    .venv/bin/python benchmarks/bench_schedule_auto.py --write-profiles   # regenerate profiles/

The profiles are Llama-shaped (hidden 4096, 32 heads, sequence 4096, vocabulary 128256, bf16):
an embedding, ``N`` transformer blocks, a final norm and an output head whose logits (kept in
fp32 for the loss) make it the largest layer. Times assume 400 TFLOP/s of useful bf16 compute;
activations follow Korthikanti et al. (2022) with flash attention: 34 bytes per token per
hidden unit per block. See docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HIDDEN = 4096
FFN = 11008
SEQUENCE = 4096
VOCAB = 128256
DTYPE_BYTES = 2
FLOPS_PER_MS = 400e12 / 1000.0
MICROBATCH_SIZES = (1, 2, 4, 8)


def transformer_profile(num_blocks: int, *, model: str | None = None) -> dict:
    """An analytic profile (a dict in the profile format) of a Llama-shaped model.

    Per block and micro-batch of ``b`` samples (``t = b * SEQUENCE`` tokens):
    forward = (2 * params + 4 * t * HIDDEN) * t / FLOPS (matmuls plus attention scores);
    backward = 2 x forward, split half input gradient and half weight gradient (measured
    profiles give the split); activations = 34 * t * HIDDEN bytes.
    """
    block_params = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
    embed_params = VOCAB * HIDDEN
    layers = []

    def costs(forward_ms_per_sample, activation_per_sample, output_per_sample, split=True):
        out = []
        for b in MICROBATCH_SIZES:
            forward = round(forward_ms_per_sample * b, 6)
            backward = round(2 * forward, 6)
            entry = {
                "microbatch_size": b, "forward_ms": forward, "backward_ms": backward,
                "activation_bytes": int(activation_per_sample * b), "output_bytes": int(output_per_sample * b),
            }
            if split:
                entry["backward_input_ms"] = round(backward / 2, 6)
                entry["backward_weight_ms"] = round(backward - backward / 2, 6)
            out.append(entry)
        return out

    hidden_bytes = SEQUENCE * HIDDEN * DTYPE_BYTES
    # Embedding: a gather, memory-bound; keeps only the token ids.
    layers.append({"name": "tok_embeddings", "kind": "embedding", "param_bytes": embed_params * DTYPE_BYTES,
                   "costs": costs(0.05, SEQUENCE * 8, hidden_bytes)})
    block_ms = (2 * block_params + 4 * SEQUENCE * HIDDEN) * SEQUENCE / FLOPS_PER_MS
    for i in range(num_blocks):
        layers.append({"name": f"layers.{i}", "kind": "block", "param_bytes": block_params * DTYPE_BYTES,
                       "costs": costs(block_ms, 34 * SEQUENCE * HIDDEN, hidden_bytes)})
    layers.append({"name": "norm", "kind": "norm", "param_bytes": HIDDEN * DTYPE_BYTES,
                   "costs": costs(0.05, hidden_bytes, hidden_bytes)})
    # Output head: logits in bf16 plus their fp32 copy for the cross-entropy.
    head_ms = 2 * embed_params * SEQUENCE / FLOPS_PER_MS
    layers.append({"name": "output", "kind": "head", "param_bytes": embed_params * DTYPE_BYTES,
                   "costs": costs(head_ms, hidden_bytes + SEQUENCE * VOCAB * (2 + 4), 4)})
    return {
        "schema_version": 1,
        "model": model or f"transformer{num_blocks}-analytic",
        "source": "analytic",
        "device": {"name": "analytic 400 TFLOP/s bf16", "memory_bytes": 80 * 2**30},
        "dtype": "bf16",
        "sequence_length": SEQUENCE,
        "layers": layers,
    }


def _profile(num_blocks):
    from pipeplan.formats.profile import Profile

    return Profile.model_validate(transformer_profile(num_blocks))


def run(ranks=(8, 16), num_blocks: int = 80, global_batch: int = 128, caps_gib=(80, 40)) -> list[dict]:
    """Plan ``--schedule auto --recompute auto`` at each rank count and cap; wall time and choice."""
    from pipeplan.formats.plan import PlanSettings
    from pipeplan.plan import make_plan

    profile = _profile(num_blocks)
    rows = []
    for cap_gib in caps_gib:
        for p in ranks:
            settings = PlanSettings(stages=p, global_batch=global_batch, memory_cap_bytes=cap_gib * 2**30,
                                    bandwidth_bytes_per_s=25e9, schedule="auto", recompute="auto")
            started, cpu = time.perf_counter(), time.process_time()
            plan = make_plan(profile, settings, profile_sha256="bench")
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
            rows.append({
                "layers": len(profile.layers), "ranks": p, "cap_gib": cap_gib, "seconds": seconds,
                "cpu_seconds": cpu_seconds, "schedule": plan.schedule, "v": plan.virtual_stages,
                "microbatch_size": plan.microbatch_size, "recompute": sum(s.recompute for s in plan.stages),
                "stages": len(plan.stages), "iteration_ms": plan.predicted.iteration_ms,
                "considered": _considered(plan),
            })
    return rows


def _considered(plan) -> int:
    """Configurations the search considered, from the plan's own note."""
    for note in plan.notes:
        found = re.search(r"\((\d+) considered\)", note)
        if found:
            return int(found.group(1))
    return len(plan.alternatives) + 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-profiles", action="store_true",
                        help="write profiles/transformer32-analytic.json and exit")
    parser.add_argument("--blocks", type=int, default=80, help="transformer blocks (layers = blocks + 3)")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--cap-gib", type=int, nargs="+", default=[80, 40])
    args = parser.parse_args(argv)
    if args.write_profiles:
        sys.path.insert(0, str(ROOT))
        from pipeplan.formats.io import dump_model, write_text_atomic

        path = ROOT / "profiles" / "transformer32-analytic.json"
        write_text_atomic(path, dump_model(_profile(32)))
        print(f"wrote {path}")
        return 0
    print("| layers | ranks | cap | micro-batch sizes | configurations | wall s | CPU s | chosen | iteration ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in run(num_blocks=args.blocks, global_batch=args.global_batch, caps_gib=args.cap_gib):
        chosen = (f"{row['schedule']} v={row['v']} b={row['microbatch_size']} "
                  f"recompute {row['recompute']}/{row['stages']} stages")
        print(f"| {row['layers']} | {row['ranks']} | {row['cap_gib']} GiB | {len(MICROBATCH_SIZES)} | {row['considered']} | "
              f"{row['seconds']:.2f} | {row['cpu_seconds']:.2f} | {chosen} | {row['iteration_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

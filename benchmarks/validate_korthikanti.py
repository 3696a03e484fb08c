"""Predict Korthikanti et al. 2022, table 5, from analytic A100 profiles, and report the error.

"Reducing Activation Recomputation in Large Transformer Models" (Korthikanti, Casper, Lym,
McAfee, Andersch, Shoeybi, Catanzaro; MLSys 2023, arXiv 2205.05198), table 5: one iteration on
Selene (DGX A100 80 GB), fp16, sequence 2048, vocabulary 51200, data parallel 1.

Each run is planned with the published configuration fixed (``pipeplan plan --gpus --cluster
dgx-a100 --tensor-parallel --stages --data-parallel 1 --zero 0 --virtual-stages --schedule
--microbatch-size --global-batch --recompute``) and Megatron's optimizer convention
(``adam-fp32-grads``, 18 bytes per parameter). Megatron of 2022 ran without flash attention,
so the profiles keep the s^2 score tensors (``flash_attention=False``); that is the published
configuration, not a tuning. The split is Megatron's, given with ``--layers-per-stage``: the
blocks divided equally over the virtual stages, the embedding on the first, the final norm and
the head with the loss on the last.

Every run is planned under the preset's 80 GB cap (less the reserve). Full recomputation is
modelled as Megatron runs it, one layer at a time: each layer's input is kept per micro-batch in
flight and one layer's activations are rebuilt at once (docs/cost-model.md).

Run (needs the analytic profiles, ``pipeplan.analytic``)::

    python benchmarks/validate_korthikanti.py            # the table of docs/cluster-validation.md
    python benchmarks/validate_korthikanti.py --search   # also let the search choose freely
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

#: GPT-3-style configurations of table 5 (GPT-2's format, the paper's vocabulary of 51200).
MODELS = {
    "22B": {"model_type": "gpt2", "n_embd": 6144, "n_head": 64, "n_layer": 48},
    "175B": {"model_type": "gpt2", "n_embd": 12288, "n_head": 96, "n_layer": 96},
}
COMMON = {"n_positions": 2048, "vocab_size": 51200, "tie_word_embeddings": True,
          "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}

#: (model, GPUs, t, p, v, schedule, micro-batch, global batch, recompute, published seconds)
RUNS = [
    ("22B", 8, 8, 1, 1, "1f1b", 4, 4, "all", 1.42),
    ("22B", 8, 8, 1, 1, "1f1b", 4, 4, "selective", 1.10),
    ("175B", 64, 8, 8, 3, "interleaved", 1, 64, "all", 18.13),
    ("175B", 64, 8, 8, 3, "interleaved", 1, 64, "selective", 13.75),
]


def _profile(model: str, folder: Path, degrees, sizes):
    from pipeplan.analytic.api import analytic_profile
    from pipeplan.facts.gpus import get_gpu

    config = folder / f"gpt-{model.lower()}.json"
    config.write_text(json.dumps({**MODELS[model], **COMMON}))
    return analytic_profile(config, get_gpu("a100-80gb"), seq_len=2048, dtype="fp16", microbatch_sizes=sizes,
                            tensor_parallel=degrees, flash_attention=False)


def _megatron_counts(profile, stages: int) -> list[int]:
    """Megatron's split: blocks equally over the stages; embedding first, norm and head last."""
    kinds = [layer.kind for layer in profile.layers]
    blocks = kinds.count("block")
    if blocks % stages:
        raise SystemExit(f"{blocks} blocks do not divide over {stages} stages")
    counts = [blocks // stages] * stages
    counts[0] += sum(1 for k in kinds if k == "embedding")
    counts[-1] += sum(1 for k in kinds if k in ("norm", "head"))
    return counts


def _megatron_split(plan, profile) -> bool:
    kinds = {layer.name: layer.kind for layer in profile.layers}
    blocks = [sum(kinds[name] == "block" for name in stage.layers) for stage in plan.stages]
    first, last = set(plan.stages[0].layers), set(plan.stages[-1].layers)
    return (len(set(blocks)) == 1
            and all(name in first for name, kind in kinds.items() if kind == "embedding")
            and all(name in last for name, kind in kinds.items() if kind in ("norm", "head")))


def _plan(profile, sha, **settings):
    from pipeplan.cluster.presets import PRESETS
    from pipeplan.cluster.search import plan_cluster
    from pipeplan.formats.plan import PlanSettings

    return plan_cluster(profile, PlanSettings(cluster=PRESETS["dgx-a100"], optimizer="adam-fp32-grads", **settings),
                        profile_sha256=sha)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="store_true", help="also plan each model with the search free")
    args = parser.parse_args(argv)
    try:
        import pipeplan.analytic  # noqa: F401
    except ImportError:
        print("needs pipeplan.analytic (analytic profiles, issue 12)", file=sys.stderr)
        return 2
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profiles = {}
        for model, gpus, t, p, v, schedule, b, G, recompute, published_s in RUNS:
            if (model, b) not in profiles:
                profiles[(model, b)] = _profile(model, folder, [t], [b])
            profile = profiles[(model, b)]
            plan = _plan(profile, "table5", num_gpus=gpus, tensor_parallel=t, stages=p, data_parallel=1,
                         zero_stage=0, virtual_stages=v, schedule=schedule, microbatch_size=b, global_batch=G,
                         recompute=recompute,
                         layers_per_stage=_megatron_counts(profile, p * v))
            if not _megatron_split(plan, profile):
                print(f"{model} {recompute}: the planner's split is not Megatron's: "
                      f"{[len(s.layers) for s in plan.stages]}", file=sys.stderr)
                return 1
            pr = plan.predicted
            predicted_s = pr.iteration_ms / 1e3
            error = predicted_s / published_s - 1
            errors.append(abs(error))
            peak = max(r.peak_memory_bytes for r in plan.ranks) + (plan.reserve_bytes or 0)
            rows.append(f"| {model} | {gpus} | t={t} p={p} v={v} | {recompute} | {published_s:.2f} | "
                        f"{predicted_s:.2f} | {error:+.1%} | {pr.compute_ms / 1e3:.2f} | "
                        f"{(pr.tensor_parallel_ms or 0) / 1e3:.2f} | {(pr.bubble_ms + (pr.overhead_ms or 0)) / 1e3:.2f} | "
                        f"{pr.transfer_ms / 1e3:.3f} | {(pr.optimizer_ms or 0) / 1e3:.3f} | "
                        f"{pr.model_flops_utilization:.1%} | {peak / 2**30:.1f} |")
    print("| model | GPUs | layout | recompute | published s | predicted s | error | compute s | TP s | "
          "bubble s | transfers s | optimizer s | MFU | memory GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nmean |error| {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}")
    if args.search:
        with tempfile.TemporaryDirectory() as tmp:
            for model, gpus, G, fixed_s in (("22B", 8, 4, 1.10), ("175B", 64, 64, 13.75)):
                profile = _profile(model, Path(tmp), [1, 2, 4, 8], [1, 2, 4])
                started = time.perf_counter()
                plan = _plan(profile, "search", num_gpus=gpus, global_batch=G, schedule="auto", recompute="auto")
                seconds = time.perf_counter() - started
                par = plan.parallelism
                print(f"{model} on {gpus} GPUs, batch {G}, search free ({seconds:.0f} s): d={par.data} t={par.tensor} "
                      f"p={par.pipeline} v={par.virtual_stages} {plan.schedule} b={plan.microbatch_size} ZeRO "
                      f"{par.zero_stage}: {plan.predicted.iteration_ms / 1e3:.2f} s predicted, against "
                      f"{fixed_s:.2f} s published for the best table-5 configuration")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

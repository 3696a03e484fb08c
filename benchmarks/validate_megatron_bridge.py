"""Plan NVIDIA's published Megatron Bridge runs at their published configuration and compare.

Each row of ``benchmarks/data/megatron_bridge_runs.json`` (origin and licence in the file) is
planned with every degree, the micro-batch size and the global batch fixed as published, through
pipeplan's own command line (the commands are printed, so any row can be rerun by hand), with
the defaults otherwise: no constant is set for a row. The communication overlap is Megatron
Bridge's own (BRIDGE_DATA_PARALLEL_OVERLAP, BRIDGE_TP_COMM_OVERLAP: its CommOverlapConfig and
recipes), not Megatron-LM's defaults; a recorded recipe's ``recompute_modules`` and
``moe_a2a_overlap`` (``--overlap moe-a2a``) are passed as it sets them. A row pipeplan cannot state yet (a system
without a preset, a precision, context parallelism) is reported as not expressible with the
command line's own reason. Results go to docs/cluster-validation.md with this command:

    python benchmarks/validate_megatron_bridge.py [--only ID] [--markdown]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from validation_rows import parse_args, validate_rows

ROOT = Path(__file__).resolve().parent
RUNS = ROOT / "data" / "megatron_bridge_runs.json"

#: The published system's cluster preset and GPU (pipeplan's names).
SYSTEMS = {"DGX-H100": ("dgx-h100", "h100-sxm"), "DGX-B200": ("dgx-b200", "b200"),
           "DGX-B300": ("dgx-b300", "b300"), "DGX-GB200": ("gb200-nvl72", "gb200"),
           "DGX-GB300": ("gb300-nvl72", "gb300")}

#: Published model names pipeplan ships under another name (Llama 3.1 405B has Llama 3 405B's
#: shapes; only its RoPE scaling differs, which costs nothing).
MODELS = {"llama3.1-405b": "llama3-405b"}

#: The published precision as pipeplan's --precision (BF16: the default, no option).
PRECISIONS = {"BF16": None, "FP8-CS": "fp8", "MXFP8": "mxfp8", "NVFP4": "nvfp4"}

#: Megatron Bridge's communication overlap, as its CommOverlapConfig sets it for every recipe
#: (src/megatron/bridge/training/comm_overlap.py): with data parallelism (d > 1)
#: ``overlap_grad_reduce = overlap_param_gather = True`` and ``bucket_size = 128 * 1024 * 1024``.
BRIDGE_DATA_PARALLEL_OVERLAP = ("grad-reduce", "param-gather")
BRIDGE_BUCKET_PARAMS = 128 * 1024 * 1024

#: Models whose Bridge pretraining recipe turns on tensor-parallel overlap (``CommOverlapConfig(
#: tp_comm_overlap=True, tp_comm_overlap_cfg=userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192)``
#: in src/megatron/bridge/recipes/llama/llama3.py, the 405B configs). The other rows' recipes
#: were not read for it: planned without it.
BRIDGE_TP_COMM_OVERLAP = {"llama3.1-405b"}


def commands(row: dict, workdir: Path) -> tuple[list[str], list[str]]:
    """The profile and plan command lines of one row (``pipeplan`` arguments)."""
    preset, gpu = SYSTEMS[row["system"]]
    precision = PRECISIONS[row["precision"]]
    profile = workdir / f"{row['id']}.profile.json"
    tp = str(row["tp"])
    make = ["profile", MODELS.get(row["model"], row["model"]), "--analytic", "--gpu", gpu, "--seq-len", str(row["seq_len"]),
            "--microbatch-sizes", str(row["mbs"]), "--tensor-parallel", tp, "-o", str(profile)]
    if precision:
        make += ["--precision", precision]
    dp = row["gpus"] // (row["tp"] * row["pp"] * row["cp"])
    plan = ["plan", str(profile), "--gpus", str(row["gpus"]), "--cluster", preset, "--global-batch", str(row["gbs"]),
            "--microbatch-size", str(row["mbs"]), "--data-parallel", str(dp), "--tensor-parallel", tp,
            "--stages", str(row["pp"]), "--zero", "3" if row["fsdp"] else "1", "--launcher", "megatron",
            "--optimizer", "adam-fp32-grads", "-q", "-o", str(workdir / f"{row['id']}.plan.json")]
    # VP n/a: one model chunk per pipeline rank (Megatron's plain 1F1B).
    plan += ["--virtual-stages", str(row["vp"] or 1)]
    if row["cp"] > 1:
        plan += ["--context-parallel", str(row["cp"])]
    if row["ep"] > 1:
        plan += ["--expert-parallel", str(row["ep"])]
    overlap = list(BRIDGE_DATA_PARALLEL_OVERLAP if dp > 1 else ())
    if row["model"] in BRIDGE_TP_COMM_OVERLAP and row["tp"] > 1:
        overlap.append("tp-comm")
    recipe = row.get("recipe") or {}
    if recipe.get("moe_a2a_overlap"):
        # The recipe's moe_a2a_overlap (Megatron Bridge sets megatron-core's overlap_moe_expert_parallel_comm
        # from it): the all-to-alls behind the other micro-batch's compute in the combined 1F1B.
        overlap.append("moe-a2a")
    plan += ["--overlap", ",".join(overlap) or "none"]
    if dp > 1:
        plan += ["--ddp-bucket-size", str(BRIDGE_BUCKET_PARAMS)]
    if recipe.get("recompute_modules"):
        plan += ["--recompute-modules", ",".join(recipe["recompute_modules"])]
    if recipe.get("cpu_offloading_num_layers"):
        # The recipe's CPU activation offload (megatron-core cpu_offloading_num_layers), in place of
        # the recomputation the planner would otherwise choose: Megatron runs no recomputation with it.
        plan += ["--cpu-offload-layers", str(recipe["cpu_offloading_num_layers"])]
    return make, plan


def _pipeplan(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeplan", *args], capture_output=True, text=True)


def validate(row: dict, workdir: Path) -> dict:
    """Plan one row: ``{id, measured_s, predicted_s, error, command, reason}``."""
    out = {"id": row["id"], "measured_s": row["measured_iteration_s"], "predicted_s": None, "error": None,
           "reason": None}
    if row["system"] not in SYSTEMS or row["precision"] not in PRECISIONS:
        out["reason"] = f"{row['system']} {row['precision']}: no mapping"
        return out
    make, plan = commands(row, workdir)
    out["command"] = "pipeplan " + " ".join(plan)
    for args in (make, plan):
        done = _pipeplan(args)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            out["reason"] = f"exit {done.returncode}: {lines[-1] if lines else '?'}"
            return out
    predicted = json.loads(Path(plan[plan.index("-o") + 1]).read_text())["predicted"]["iteration_ms"] / 1e3
    out["predicted_s"] = predicted
    out["error"] = predicted / row["measured_iteration_s"] - 1
    return out


def _print_row(row: dict, result: dict) -> None:
    shown = (f"{result['predicted_s']:.2f} s ({result['error']:+.1%})" if result["error"] is not None
             else f"not expressible: {result['reason']}")
    print(f"{row['id']}: measured {row['measured_iteration_s']:.2f} s, predicted {shown}", flush=True)


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    rows, results = validate_rows(RUNS, args.only, validate, None if args.markdown else _print_row)
    if args.markdown:
        print("| run | measured s | predicted s | error |")
        print("|---|---|---|---|")
        for r in results:
            if r["error"] is None:
                print(f"| {r['id']} | {r['measured_s']:.2f} | not expressible | {r['reason']} |")
            else:
                print(f"| {r['id']} | {r['measured_s']:.2f} | {r['predicted_s']:.2f} | {r['error']:+.1%} |")
    errors = [abs(r["error"]) for r in results if r["error"] is not None]
    if errors:
        print(f"{len(errors)} of {len(results)} expressible; mean |error| {sum(errors) / len(errors):.1%}, "
              f"worst {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

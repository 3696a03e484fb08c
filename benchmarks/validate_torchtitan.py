"""Plan torchtitan's published Llama 3.1 8B runs at their published configuration and compare.

Each row of ``benchmarks/data/torchtitan_runs.json`` (origin and licence per row) is planned with
its degrees, local batch, sequence length and activation checkpointing fixed as published,
through pipeplan's own command line with ``--launcher torchtitan`` (the commands are printed, so
any row can be rerun by hand), and the defaults otherwise: no constant is set for a row. The
Grand Teton hosts the page describes are ``dgx-h100`` (8 GPUs per host on NVLink, 400 Gb/s RDMA
per GPU) with the page's 96 GB per GPU as the cap (``--memory-cap 96GB``); their HBM2e
(2.4 TB/s) and 500 W limit are slower than the H100 SXM the analytic profile is costed on, which
the errors include. Float8 rows plan a ``--precision fp8`` profile; torch.compile is not
modelled (a compiled row is predicted as its eager one). Memory is compared as pipeplan's
per-GPU total (planned peak plus the cluster's reserve) against the page's (torchtitan's
maximum reserved memory). Results go to docs/cluster-validation.md with this command:

    python benchmarks/validate_torchtitan.py [--only ID] [--markdown]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from validation_rows import parse_args, validate_rows

ROOT = Path(__file__).resolve().parent
RUNS = ROOT / "data" / "torchtitan_runs.json"

#: Llama 3.1 8B has Llama 3 8B's shapes (only its RoPE scaling differs, which costs nothing).
MODELS = {"llama3.1-8b": "llama3-8b"}

#: torchtitan's [activation_checkpoint] mode as pipeplan's --recompute.
RECOMPUTE = {"none": "none", "selective": "selective", "full": "all"}

GIB = 2 ** 30


def commands(row: dict, workdir: Path) -> tuple[list[str], list[str]]:
    """The profile and plan command lines of one row (``pipeplan`` arguments)."""
    profile = workdir / f"{row['id']}.profile.json"
    mbs = str(row["local_batch_size"])
    make = ["profile", MODELS.get(row["model"], row["model"]), "--analytic", "--gpu", "h100-sxm",
            "--seq-len", str(row["seq_len"]), "--microbatch-sizes", mbs, "-o", str(profile)]
    if row["float8"]:
        make += ["--precision", "fp8"]
    ac = row["activation_checkpoint"]
    plan = ["plan", str(profile), "--gpus", str(row["gpus"]), "--cluster", "dgx-h100", "--memory-cap", "96GB",
            "--global-batch", str(row["global_batch_size"]), "--microbatch-size", mbs,
            "--data-parallel", str(row["fsdp"]), "--tensor-parallel", str(row["tp"]), "--stages", str(row["pp"]),
            "--zero", "3", "--launcher", "torchtitan", "--recompute", RECOMPUTE[ac["mode"]],
            "-q", "-o", str(workdir / f"{row['id']}.plan.json")]
    if ac["mode"] == "selective":
        plan += ["--selective-ac-option", ac["selective_ac_option"]]
    if row["cp"] > 1:
        plan += ["--context-parallel", str(row["cp"])]
    return make, plan


def _pipeplan(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeplan", *args], capture_output=True, text=True)


def validate(row: dict, workdir: Path) -> dict:
    """Plan one row: measured and predicted seconds and GiB, their errors, the command."""
    out = {"id": row["id"], "measured_s": row["measured_iteration_s"], "measured_gib": row["memory_gib"],
           "predicted_s": None, "error": None, "predicted_gib": None, "memory_error": None, "reason": None}
    make, plan = commands(row, workdir)
    out["command"] = "pipeplan " + " ".join(plan)
    for args in (make, plan):
        done = _pipeplan(args)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            out["reason"] = f"exit {done.returncode}: {lines[-1] if lines else '?'}"
            return out
    result = json.loads(Path(plan[plan.index("-o") + 1]).read_text())
    out["predicted_s"] = result["predicted"]["iteration_ms"] / 1e3
    out["error"] = out["predicted_s"] / row["measured_iteration_s"] - 1
    peak = max(rank["peak_memory_bytes"] for rank in result["ranks"])
    out["planned_gib"] = peak / GIB
    out["predicted_gib"] = (peak + (result.get("reserve_bytes") or 0)) / GIB
    out["memory_error"] = out["predicted_gib"] / row["memory_gib"] - 1
    out["mfu"] = result["predicted"].get("model_flops_utilization")
    return out


def _line(row: dict, r: dict) -> str:
    if r["error"] is None:
        return f"{row['id']}: measured {r['measured_s']:.2f} s {r['measured_gib']:.1f} GiB, not expressible: {r['reason']}"
    return (f"{row['id']}: measured {r['measured_s']:.2f} s, predicted {r['predicted_s']:.2f} s ({r['error']:+.1%}); "
            f"memory {r['measured_gib']:.1f} GiB, predicted {r['predicted_gib']:.1f} GiB ({r['memory_error']:+.1%})")


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    rows, results = validate_rows(RUNS, args.only, validate,
                                  None if args.markdown else lambda row, r: print(_line(row, r), flush=True))
    if args.markdown:
        print("| run | AC | measured s | predicted s | error | measured GiB | predicted GiB (planned + reserve) | error |")
        print("|---|---|---|---|---|---|---|---|")
        for row, r in zip(rows, results):
            ac = row["activation_checkpoint"]
            form = ac["mode"] + (f" {ac['selective_ac_option']}" if ac["mode"] == "selective" else "")
            if r["error"] is None:
                print(f"| {r['id']} | {form} | {r['measured_s']:.2f} | not expressible | {r['reason']} | "
                      f"{r['measured_gib']:.1f} | | |")
            else:
                print(f"| {r['id']} | {form} | {r['measured_s']:.2f} | {r['predicted_s']:.2f} | {r['error']:+.1%} | "
                      f"{r['measured_gib']:.1f} | {r['predicted_gib']:.1f} ({r['planned_gib']:.1f} + "
                      f"{r['predicted_gib'] - r['planned_gib']:.1f}) | {r['memory_error']:+.1%} |")
    done = [r for r in results if r["error"] is not None]
    if done:
        time_errors = [abs(r["error"]) for r in done]
        memory_errors = [abs(r["memory_error"]) for r in done]
        print(f"{len(done)} of {len(results)} expressible; time mean |error| {sum(time_errors) / len(done):.1%}, "
              f"worst {max(time_errors):.1%}; memory mean |error| {sum(memory_errors) / len(done):.1%}, "
              f"worst {max(memory_errors):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

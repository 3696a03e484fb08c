"""The table of docs/models.md: real models from profile to a verified pipeline, one row each.

    .venv/bin/python benchmarks/models_table.py                 # every row, 2 ranks, 1f1b + zbv
    .venv/bin/python benchmarks/models_table.py --only hf:bert --ranks 4

Each row builds a model from a tiny config (no weights), and runs, through the CLI as a user
would: ``pipeplan profile`` (1 repeat, no warm-up: the table is about what runs, not timing),
``pipeplan plan --stages R --schedule S`` and ``pipeplan run --verify --steps 2`` for each
schedule. A cell is ``ok`` or the first line of the error. The two user models are
:mod:`pipeplan.profile.examples`, loaded through the ``module:callable`` contract as a user's own. Prints markdown rows, and the load
average beside them. Needs torch and transformers (``pip install -e ".[dev,hf]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPEPLAN = [sys.executable, "-m", "pipeplan"]
TINY_LM = ["--layers", "4", "--hidden", "32", "--heads", "2", "--vocab", "64"]

#: (row label, MODEL, profile options)
ROWS = [
    ("GPT2LMHeadModel (tied)", "hf:gpt2", TINY_LM),
    ("LlamaForCausalLM", "hf:llama", TINY_LM),
    ("Qwen2ForCausalLM", "hf:qwen2", TINY_LM),
    ("BertForMaskedLM (tied)", "hf:bert", TINY_LM),
    ("ViTForImageClassification", "hf:vit", ["--layers", "4", "--hidden", "32", "--heads", "2"]),
    ("T5ForConditionalGeneration (encoder-decoder; tied)", "hf:t5", TINY_LM),
    ("a conv net whose blocks return tuples", "pipeplan.profile.examples:tuples", []),
    ("a model without a loss", "pipeplan.profile.examples:no_loss", []),
]


def _first_error(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines()
             if line.startswith(("error:", "internal error:", "infeasible:", "verify: FAILED"))]
    return lines[0] if lines else f"exit {done.returncode}"


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def row(label: str, model: str, options: list[str], ranks: int, schedules: list[str], work: Path,
        env: dict[str, str]) -> str:
    profile = work / f"{model.replace(':', '_')}.json"
    done = _run([*PIPEPLAN, "profile", model, *options, "--microbatch-sizes", "1", "--seq-len", "8",
                 "--repeats", "1", "--warmup", "0", "-o", str(profile)], env)
    if done.returncode != 0:
        return f"| {label} | `{model}` | fails: {_first_error(done)} | | | |"
    data = json.loads(profile.read_text())
    measurement = data.get("measurement") or {}
    notes = []
    if data.get("tied_weights"):
        notes.append("tied: " + ", ".join(f"{t['name']} in {' and '.join(t['layers'])}" for t in data["tied_weights"]))
    fallback = (measurement.get("backward_split_fallback") or {}).get("units")
    if fallback:
        notes.append(f"split backward fell back on {', '.join(fallback)}")
    if data.get("edges"):
        notes.append(f"{len(data['edges'])} edges ({measurement.get('edges_method')})")
    builder = (measurement.get("stage_builders") or {}).get("run_uses", "none")
    plan_cells, run_cells = [], []
    for schedule in schedules:
        plan = work / f"{profile.stem}-{schedule}-{ranks}.plan.json"
        done = _run([*PIPEPLAN, "plan", str(profile), "--stages", str(ranks), "--global-batch", "4",
                     "--microbatch-size", "1", "--schedule", schedule, "-o", str(plan), "-q"], env)
        if done.returncode != 0:
            plan_cells.append(f"{schedule}: {_first_error(done)}")
            continue
        plan_cells.append(f"{schedule}: ok")
        done = _run([*PIPEPLAN, "run", str(plan), "--profile", str(profile), "--steps", "2", "--verify",
                     "--alone-repeats", "0", "-q"], env)
        verdict = [line for line in done.stdout.splitlines() if line.startswith("verify: passed")]
        if done.returncode == 0 and verdict:
            largest = verdict[0].split("largest ")[1].split(",")[0]
            run_cells.append(f"{schedule}: ok, verify {largest}")
        else:
            run_cells.append(f"{schedule}: {_first_error(done)}")
    return (f"| {label} | `{model}` | ok | {'; '.join(plan_cells)} | {'; '.join(run_cells)} "
            f"| {builder}; {'; '.join(notes) or '-'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--schedules", default="1f1b,zbv")
    parser.add_argument("--only", default=None, help="Comma-separated MODELs to run.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pipeplan-models-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        print(f"ranks {args.ranks}, schedules {args.schedules}; load average before {os.getloadavg()}")
        print("| model | MODEL | profile | plan | run --verify | stage builder; notes |")
        print("|---|---|---|---|---|---|")
        wanted = set(args.only.split(",")) if args.only else None
        started = time.time()
        for label, model, options in ROWS:
            if wanted and model not in wanted:
                continue
            print(row(label, model, options, args.ranks, args.schedules.split(","), work, env), flush=True)
        print(f"{time.time() - started:.0f} s; load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

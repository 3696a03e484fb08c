"""Measured against predicted: profile a small GPT-2, plan it for 2 ranks under every schedule,
run each plan with ``pipeplan run`` and print one markdown row per run (docs/benchmarks.md).

    .venv/bin/python benchmarks/bench_executor.py                       # every schedule, once
    .venv/bin/python benchmarks/bench_executor.py --repeats 2 --schedules 1f1b,auto
    .venv/bin/python benchmarks/bench_executor.py --calibrate           # and again after calibrating
    .venv/bin/python benchmarks/bench_executor.py --action-overhead-ms 1.0

Needs torch (the ``[dev]`` extra). Each run gets a profile of its own, made just before it:
on the shared 2-core development machine the CPU's own speed drifts by up to 30% within
minutes, even seconds (profiles a few minutes apart timed the whole model at micro-batch 2 at
148 to 226 ms), and the *alone* column measures that drift in each run. On a 2-core machine a
profile takes about 20 s and a run about 30 s. The columns:

- *ratio*: measured / predicted iteration (the median of 19 steps after a warm-up);
- *compute*: per rank, busy time inside forward/backward/weight calls over the plan's
  prediction of it;
- *replayed*: measured / the plan's schedule simulated again with the measured compute, that
  is the error of everything but compute (transfers, the schedule's own work);
- *alone*: the ranks' stages re-timed alone during the run (outside the schedule) over their
  profiled time: the machine's drift since profiling;
- *adjusted*: measured / the prediction scaled by that drift, the cost model's own error;
- *overhead ms/action*: the schedule's own time per action that the run measured (posting
  transfers, bookkeeping); ``--action-overhead-ms`` plans with such a figure.

With ``--profile-once`` every run uses one profile made at the start, as a user plans many
schedules from one profile; the *alone* column then shows the drift grow with time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPEPLAN = [sys.executable, "-m", "pipeplan"]
MODEL = ["gpt2-tiny", "--layers", "6", "--hidden", "256", "--heads", "4"]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "auto")


def _pipeplan(*args: str) -> None:
    subprocess.run([*PIPEPLAN, *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def _row(label: str, report: dict) -> str:
    ranks = report["ranks"]
    compute = " / ".join(f"{r['busy_ratio']:.2f}" for r in ranks)
    return (f"| {label} | {report['schedule']} v={report['virtual_stages']} | "
            f"{report['microbatch_size']} x {report['num_microbatches']} | "
            f"{report['predicted']['iteration_ms']:.1f} | {report['measured']['iteration_ms']:.1f} | "
            f"**{report['ratio']:.2f}** | {compute} | {report.get('replayed_ratio', float('nan')):.2f} | "
            f"{report.get('alone_ratio', float('nan')):.2f} | {report.get('adjusted_ratio', float('nan')):.2f} | "
            f"{report['measured'].get('action_overhead_ms', float('nan')):.2f} | "
            f"{report['run']['load_average_before'][0]:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--keep", help="Keep the profile, plans and reports in this folder.")
    parser.add_argument("--profile-once", action="store_true", help="One profile for every run.")
    parser.add_argument("--action-overhead-ms", help="Plan with this much of the schedule's own time per action.")
    parser.add_argument("--calibrate", action="store_true",
                        help="After each run, calibrate the profile from it, plan again and run that plan too.")
    args = parser.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pipeplan-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print("| run | schedule | b x m | predicted ms | measured ms | ratio | compute per rank | replayed | alone "
          "| adjusted | overhead ms/action | load | profile: whole model at b=2 ms, units / whole |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    shared = work / "profile.json"
    if args.profile_once:
        _pipeplan("profile", *MODEL, "--microbatch-sizes", "1,2,4", "--seq-len", "128", "-o", str(shared))
    for i in range(1, args.repeats + 1):
        for schedule in args.schedules.split(","):
            name = f"{schedule}-{i}"
            profile, plan, report = (work / f"{kind}-{name}.json" for kind in ("profile", "plan", "report"))
            if args.profile_once:
                profile = shared
            else:
                _pipeplan("profile", *MODEL, "--microbatch-sizes", "1,2,4", "--seq-len", "128", "-o", str(profile))
            overhead = ["--action-overhead-ms", args.action_overhead_ms] if args.action_overhead_ms else []
            _pipeplan("plan", str(profile), "--stages", "2", "--global-batch", "16", "--schedule", schedule,
                      *overhead, "-o", str(plan))
            _pipeplan("run", str(plan), "--profile", str(profile), "--steps", str(args.steps),
                      "--report", str(report), "-q")
            checks = {c["microbatch_size"]: c for c in json.loads(profile.read_text())["measurement"]["whole_model_check"]}
            ratios = " / ".join(f"{c['ratio']:.2f}" for _, c in sorted(checks.items()))
            print(_row(name, json.loads(report.read_text())) + f" {checks[2]['whole_model_step_ms']:.0f}, {ratios} |",
                  flush=True)
            if args.calibrate:
                # The loop the executor offers: the run's compute and overhead go into the profile,
                # the schedule is planned again from it (same micro-batch size) and run.
                calibrated, plan2, report2 = (work / f"{kind}-{name}-cal.json" for kind in ("profile", "plan", "report"))
                _pipeplan("calibrate", str(plan), str(report), "-o", str(calibrated))
                size = str(json.loads(plan.read_text())["microbatch_size"])
                _pipeplan("plan", str(calibrated), "--stages", "2", "--global-batch", "16", "--schedule", schedule,
                          "--microbatch-size", size, "-o", str(plan2))
                _pipeplan("run", str(plan2), "--profile", str(calibrated), "--steps", str(args.steps),
                          "--report", str(report2), "-q")
                print(_row(f"{name} calibrated", json.loads(report2.read_text())) + " (calibrated) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

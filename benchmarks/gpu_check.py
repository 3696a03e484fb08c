"""The GPU check of docs/benchmarks.md: profile on CUDA, then check the profile against the device.

    .venv/bin/python benchmarks/gpu_check.py PROFILE.json PLAN.json [--device cuda] [--out figures.json]

For a profile made on the device and a plan of it, checks two things and prints markdown rows:

1. **Sum of units vs the whole step**: each micro-batch size's ``whole_model_check`` ratio
   (sum of the units' forward + backward over a whole-model step) is within 10% of 1.
2. **Predicted peak memory vs measured**: each stage of the plan, run alone on the device as the
   schedule runs it at its peak (its in-flight micro-batches' forwards kept, then their
   backwards, then the optimizer's step), must not allocate more than the plan predicts:
   ``predicted peak_memory_bytes >= torch.cuda.max_memory_allocated``, after
   ``reset_peak_memory_stats`` with only that stage on the device.

On CPU (the dry run) the memory column says n/a: ``max_memory_allocated`` returns 0 there.
Exits 1 when a check fails, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _stage_inputs(built_all, stage_index, example, device):
    """The inputs stage ``stage_index`` receives, by running the stages before it on ``example``."""
    import torch

    from pipeplan.profile.loading import split_inputs

    args, kwargs = split_inputs(example)
    if stage_index == 0:
        return args, kwargs
    values = None
    with torch.no_grad():
        for index in range(stage_index):
            module = built_all.modules[index]
            out = module(*args, **kwargs) if index == 0 else module(*values)
            values = out if isinstance(out, tuple) else (out,)
    return tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values), {}


def stage_memory(profile, plan, device: str) -> list[dict]:
    """Per stage: predicted peak bytes and the measured peak of the stage run alone."""
    import torch

    from pipeplan.plan.memory import stage_in_flight
    from pipeplan.profile.loading import load_bundle, make_microbatch
    from pipeplan.profile.units import model_spec
    from pipeplan.run.stages import build_rank_stages

    model, options, patterns = model_spec(profile)
    dev = torch.device(device)
    bundle = load_bundle(model, seed=0, device=dev, dtype=profile.dtype,
                         **({"materialise": []} if ":" not in model else {}), **options)
    example, target = make_microbatch(bundle, plan.microbatch_size, profile.sequence_length, seed=1,
                                      device=dev, dtype=profile.dtype)
    layers = [s.layers for s in plan.stages]
    everything = build_rank_stages(model, layers, list(range(len(layers))), example_inputs=example, seed=0,
                                   device=dev, dtype=profile.dtype, unit_patterns=patterns, **options)
    in_flight = stage_in_flight(plan.schedule, plan.settings.stages, plan.num_microbatches, plan.virtual_stages)
    rows = []
    for stage in plan.stages:
        args, kwargs = _stage_inputs(everything, stage.index, example, dev)
        # Only this stage on the device: the others to the CPU, caches emptied.
        for index, module in enumerate(everything.modules):
            module.to(dev if index == stage.index else "cpu")
        args = tuple(a.to(dev) if torch.is_tensor(a) else a for a in args)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        module = everything.modules[stage.index]
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-4) if plan.settings.optimizer == "adam" else \
            torch.optim.SGD(module.parameters(), lr=1e-4, momentum=0.9)
        last = stage.index == len(plan.stages) - 1
        outs = []
        for _ in range(in_flight[stage.index]):
            out = module(*args, **kwargs)
            outs.append(everything.loss(out, target) if last else out)
        for out in outs:
            values = [v for v in (out if isinstance(out, tuple) else (out,))
                      if torch.is_tensor(v) and v.requires_grad]
            grads = None if last else [torch.ones_like(v) for v in values]
            torch.autograd.backward(values, grads)
        del outs
        optimizer.step()
        measured = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        rows.append({"stage": stage.index, "in_flight": in_flight[stage.index],
                     "predicted_peak_bytes": stage.peak_memory_bytes, "measured_peak_bytes": measured,
                     "ok": None if measured is None else stage.peak_memory_bytes >= measured})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("plan")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="Write the figures as JSON here.")
    args = parser.parse_args()
    from pipeplan.formats.io import load_plan, load_profile

    profile, plan = load_profile(args.profile), load_plan(args.plan)
    started = time.time()
    failures = []
    checks = (profile.measurement or {}).get("whole_model_check") or []
    print(f"### {profile.model} on {profile.device.name}\n")
    print("| micro-batch | sum of units ms | whole model ms | ratio | within 10% |")
    print("|---|---|---|---|---|")
    for check in checks:
        ok = check.get("ratio") is not None and abs(check["ratio"] - 1) <= 0.10
        failures += [] if ok else [f"sum of units at micro-batch {check['microbatch_size']}: ratio {check.get('ratio')}"]
        print(f"| {check['microbatch_size']} | {check['sum_of_units_ms']} | {check['whole_model_step_ms']} "
              f"| {check['ratio']} | {'yes' if ok else 'NO'} |")
    rows = stage_memory(profile, plan, args.device)
    print(f"\n{plan.schedule}, {len(plan.stages)} stages, micro-batch {plan.microbatch_size} x {plan.num_microbatches}\n")
    print("| stage | in flight | predicted peak MiB | measured peak MiB (stage alone) | predicted >= measured |")
    print("|---|---|---|---|---|")
    for row in rows:
        measured = "n/a (CPU)" if row["measured_peak_bytes"] is None else f"{row['measured_peak_bytes'] / 2**20:.1f}"
        verdict = "n/a" if row["ok"] is None else ("yes" if row["ok"] else "NO")
        if row["ok"] is False:
            failures.append(f"stage {row['stage']}: measured {row['measured_peak_bytes']} > predicted "
                            f"{row['predicted_peak_bytes']}")
        print(f"| {row['stage']} | {row['in_flight']} | {row['predicted_peak_bytes'] / 2**20:.1f} | {measured} | {verdict} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": args.profile, "plan": args.plan, "checks": checks,
                                              "stages": rows, "failures": failures,
                                              "elapsed_s": round(time.time() - started, 1)}, indent=1) + "\n")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

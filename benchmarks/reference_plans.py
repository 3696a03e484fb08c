"""Make or byte-compare reference plans of the PipeDream graphs (a refactor's safety net).

    python benchmarks/reference_plans.py make    DIR   # import + plan each graph at 4, 8, 16 stages
    python benchmarks/reference_plans.py compare DIR   # re-plan and byte-compare with DIR
    python benchmarks/reference_plans.py baselines     # re-plan profiles/baselines/, byte-compare

Uses the CLI (as a user would): ``pipeplan import pipedream`` then ``pipeplan plan`` with the
defaults, plus a capped variant (``--memory-cap`` at 70% of the uncapped plan's peak) for the
4-stage plans. Cases that take longer than ``--skip-over`` seconds in ``make`` are listed in
DIR/skipped.txt and left out of ``compare``.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: PipeDream's graphs, shipped in the repository (profiles/pipedream/README.md).
PIPEDREAM = REPO / "profiles" / "pipedream"

BATCH = {
    "alexnet": 256, "vgg16": 128, "resnet18": 256, "resnet50": 128, "resnext50": 128,
    "resnet101": 64, "resnext101": 64, "squeezenet1_0": 256, "inception_v3": 128,
    "densenet121": 64, "nasnetamobile": 128, "nasnetalarge": 16, "gnmt": 128, "gnmt_large": 128,
}
STAGES = (4, 8, 16)


def _cli(*args, timeout=None):
    return subprocess.run([sys.executable, "-m", "pipeplan", *map(str, args)], check=True, capture_output=True,
                          text=True, timeout=timeout)


def _cases(profile_dir: Path):
    profile_dir.mkdir(parents=True, exist_ok=True)
    for name in sorted(BATCH):
        src = PIPEDREAM / f"{name}.graph.txt"
        if not src.exists():
            continue
        prof = profile_dir / f"{name}.json"
        if not prof.exists():
            _cli("import", "pipedream", src, "--batch-size", BATCH[name], "-o", prof)
        for p in STAGES:
            yield name, prof, p, None


def _plan(prof, p, out, cap=None, timeout=None):
    args = ["plan", prof, "--stages", p, "-o", out, "--quiet"]
    if cap is not None:
        args += ["--memory-cap", str(cap)]
    _cli(*args, timeout=timeout)


def make(dest: Path, skip_over: float):
    dest.mkdir(parents=True, exist_ok=True)
    skipped, timings = [], {}
    for name, prof, p, _ in _cases(dest / "profiles"):
        out = dest / f"{name}-p{p}.plan.json"
        start = time.perf_counter()
        try:
            _plan(prof, p, out, timeout=skip_over)
        except subprocess.TimeoutExpired:
            skipped.append(f"{name}-p{p}")
            print(f"skip {name} p={p}: over {skip_over} s", flush=True)
            continue
        timings[f"{name}-p{p}"] = round(time.perf_counter() - start, 1)
        print(f"{name} p={p}: {timings[f'{name}-p{p}']} s", flush=True)
        if p == 4:
            peak = max(s["peak_memory_bytes"] for s in json.loads(out.read_text())["stages"])
            cap = int(peak * 0.7)
            capped = dest / f"{name}-p{p}-cap.plan.json"
            try:
                _plan(prof, p, capped, cap=cap, timeout=skip_over)
                (dest / f"{name}-p{p}-cap.txt").write_text(f"{cap}\n")
            except subprocess.TimeoutExpired:
                skipped.append(f"{name}-p{p}-cap")
            except subprocess.CalledProcessError as exc:  # infeasible at this cap: record the message
                (dest / f"{name}-p{p}-cap.txt").write_text(f"{cap}\n")
                (dest / f"{name}-p{p}-cap.err").write_text(exc.stderr)
    (dest / "skipped.txt").write_text("".join(f"{s}\n" for s in skipped))
    (dest / "timings.json").write_text(json.dumps(timings, indent=1) + "\n")


def compare(ref: Path) -> int:
    skipped = set((ref / "skipped.txt").read_text().split()) if (ref / "skipped.txt").exists() else set()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, _, p, _ in _cases(tmp / "profiles"):
            key = f"{name}-p{p}"
            prof = ref / "profiles" / f"{name}.json"
            for suffix, cap_file in (("", None), ("-cap", ref / f"{key}-cap.txt")):
                if f"{key}{suffix}" in skipped:
                    continue
                if cap_file is not None and not cap_file.exists():
                    continue
                cap = int(cap_file.read_text()) if cap_file is not None else None
                out = tmp / f"{key}{suffix}.plan.json"
                expected = ref / f"{key}{suffix}.plan.json"
                try:
                    _plan(prof, p, out, cap=cap)
                except subprocess.CalledProcessError as exc:
                    err = ref / f"{key}{suffix}.err"
                    ok = err.exists() and err.read_text() == exc.stderr
                    print(f"{'same' if ok else 'DIFF'} {key}{suffix} (error)", flush=True)
                    bad += not ok
                    continue
                same = expected.exists() and filecmp.cmp(out, expected, shallow=False)
                print(f"{'same' if same else 'DIFF'} {key}{suffix}", flush=True)
                bad += not same
    print(f"{bad} differ")
    return 1 if bad else 0


def baselines() -> int:
    """Re-plan every shipped baseline with its own settings and byte-compare (stricter than
    ``pipeplan check``, which compares throughput and splits)."""
    sys.path.insert(0, str(REPO))
    from pipeplan.formats.io import dump_model, file_sha256, load_plan, load_profile
    from pipeplan.plan import make_plan

    bad = 0
    for base in sorted((REPO / "profiles" / "baselines").glob("*.plan.json")):
        prof = REPO / "profiles" / base.name.replace(".plan.json", ".json")
        plan = make_plan(load_profile(prof), load_plan(base).settings, profile_sha256=file_sha256(prof))
        same = dump_model(plan) == base.read_text()
        print(f"{'same' if same else 'DIFF'} {base.name}", flush=True)
        bad += not same
    print(f"{bad} differ")
    return 1 if bad else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("make", "compare", "baselines"))
    parser.add_argument("dir", type=Path, nargs="?")
    parser.add_argument("--skip-over", type=float, default=60.0)
    args = parser.parse_args()
    if args.action == "baselines":
        return baselines()
    if args.action == "make":
        make(args.dir, args.skip_over)
        return 0
    return compare(args.dir)


if __name__ == "__main__":
    sys.exit(main())

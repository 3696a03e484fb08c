"""Time building analytic profiles (the issue's goal: 405B at 4 sizes x 4 degrees in under a second).

Usage: .venv/bin/python benchmarks/bench_analytic.py [--repeats N]
Prints a markdown table (median of the repeats, in a warm process, and the cold first call that
includes importing pipeplan.analytic and pydantic's model build); paste it into docs/benchmarks.md.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

CASES = [
    ("llama3-8b", "h100-sxm", 8192, [1, 2, 4, 8], [1, 2, 4, 8]),
    ("llama3-70b", "h100-sxm", 8192, [1, 2, 4, 8], [1, 2, 4, 8]),
    ("llama3-405b", "h100-sxm", 8192, [1, 2, 4, 8], [1, 2, 4, 8]),
    ("gemma2-9b", "h100-sxm", 8192, [1, 2, 4, 8], [1, 2, 4, 8]),
    ("gpt3-175b", "a100-80gb", 2048, [1, 2, 4, 8], [1, 2, 4, 8]),
]


def cold_seconds(name: str, gpu: str, seq: int, sizes, degrees) -> float:
    code = (
        "import time; t = time.perf_counter(); "
        "from pipeplan.analytic import analytic_profile, get_gpu; "
        f"analytic_profile({name!r}, get_gpu({gpu!r}), seq_len={seq}, microbatch_sizes={sizes}, "
        f"tensor_parallel={degrees}); print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main(repeats: int = 5) -> None:
    from pipeplan.analytic import analytic_profile, get_gpu
    from pipeplan.formats.io import dump_model

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| model | GPU | seq | sizes x degrees | units | entries | warm s (median) | cold s (with imports) | JSON MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, gpu, seq, sizes, degrees in CASES:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            profile = analytic_profile(name, get_gpu(gpu), seq_len=seq, microbatch_sizes=sizes, tensor_parallel=degrees)
            times.append(time.perf_counter() - started)
        entries = sum(len(layer.costs) for layer in profile.layers)
        size = len(dump_model(profile).encode()) / 2**20
        print(f"| {name} | {gpu} | {seq} | {len(sizes)} x {len(degrees)} | {len(profile.layers)} | {entries} | "
              f"{statistics.median(times):.3f} | {cold_seconds(name, gpu, seq, sizes, degrees):.3f} | {size:.2f} |",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    count = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 5
    main(count)

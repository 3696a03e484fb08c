"""The host's time per eager PyTorch op: the dispatcher part of ``host_us_per_kernel``.

Eager PyTorch (and Megatron-LM, torchtitan, DeepSpeed on it) launches each kernel from Python:
the op's Python call, the dispatcher, autograd's recording, then the CUDA launch. This times the
part before the launch: ``torch.add`` of two 8-element CPU tensors, one recorded by autograd, in
a loop (median of 5 runs of 20,000 ops, one thread). The CUDA driver's own launch (4.9 us from
compiled C: JuliaGPU/CUDAdrv.jl pull request 15) is added to it in
``pipeplan.analytic.efficiency`` (docs/analytic.md, "Host overhead").

Usage: .venv/bin/python benchmarks/bench_host_overhead.py
Measured 2026-12-02 on the development VM (2 cores shared, torch 2.13 CPU): 3.5 us without
autograd, 4.3 us with it.
"""

from __future__ import annotations

import statistics
import time


def per_op_us(grad: bool, ops: int = 20000, runs: int = 5) -> float:
    import torch

    x = torch.ones(8, requires_grad=True)
    y = torch.ones(8)
    context = torch.enable_grad if grad else torch.no_grad
    times = []
    with context():
        for _ in range(ops // 10):
            torch.add(x, y)
        for _ in range(runs):
            start = time.perf_counter()
            for _ in range(ops):
                torch.add(x, y)
            times.append((time.perf_counter() - start) / ops * 1e6)
    return statistics.median(times)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}: no_grad {per_op_us(False):.2f} us per op, autograd {per_op_us(True):.2f} us per op")


if __name__ == "__main__":
    main()

"""Time the cluster search (``pipeplan plan --gpus N --cluster dgx-h100``) on analytic profiles.

Llama 3 70B on 64, 512 and 1,024 H100s, Llama 3 405B on 1,024 and DeepSeek-V3 (671B, 256 routed
experts) on 256 with its expert-parallel degree searched, sequence 8192, bf16, global
batch 1,024 sequences (128 on 64 GPUs), profiles at micro-batch sizes 1, 2, 4 and tensor-parallel
degrees 1, 2, 4, 8. Prints the wall time of each search, its CPU time (this process's, which
the other jobs on a shared machine disturb far less than the wall time), the load average before
it, the layout it chose and its predicted iteration. Results go to docs/benchmarks.md with this
command:

    python benchmarks/bench_cluster_search.py [--only 70b-64]
"""

from __future__ import annotations

import argparse
import os
import time

CASES = {
    "70b-64": ("llama3-70b", 64, 128),
    "70b-512": ("llama3-70b", 512, 1024),
    "70b-1024": ("llama3-70b", 1024, 1024),
    "405b-1024": ("llama3-405b", 1024, 1024),
    # Issue 22's bound: a 671B mixture of experts on 256 GPUs, expert parallelism searched.
    "dsv3-256": ("deepseek-v3", 256, 1024),
    # Issue 26's bound: the same MoE on 1,024 GPUs (NVIDIA's H100 runs: 8,192 sequences of 4,096).
    "dsv3-1024": ("deepseek-v3", 1024, 8192, 4096),
    # Issue 26: Meta's 405B long-context stage (16,384 H100s, 131,072 tokens, 128 sequences), the
    # context-parallel degree searched with every other degree (micro-batch size 1).
    "405b-16384-128k": ("llama3-405b", 16384, 128, 131072),
}


def main(argv=None) -> int:
    from pipeplan.analytic.api import analytic_profile
    from pipeplan.facts.gpus import get_gpu
    from pipeplan.cluster.presets import PRESETS
    from pipeplan.cluster.search import plan_cluster
    from pipeplan.formats.plan import PlanSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    args = parser.parse_args(argv)
    profiles = {}
    for name in args.only or CASES:
        model, gpus, batch, *rest = CASES[name]
        seq = rest[0] if rest else 8192
        if (model, seq) not in profiles:
            profiles[(model, seq)] = analytic_profile(model, get_gpu("h100-sxm"), seq_len=seq, dtype="bf16",
                                                      microbatch_sizes=[1, 2, 4] if seq <= 8192 else [1],
                                                      tensor_parallel=[1, 2, 4, 8])
        settings = PlanSettings(num_gpus=gpus, cluster=PRESETS["dgx-h100"], global_batch=batch, schedule="auto",
                                recompute="auto")
        load = os.getloadavg()[0]
        started, cpu = time.perf_counter(), time.process_time()
        plan = plan_cluster(profiles[(model, seq)], settings, profile_sha256="bench")
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        par = plan.parallelism
        print(f"{name}: {seconds:.1f} s ({cpu:.1f} s CPU, load {load:.1f}); d={par.data} t={par.tensor} p={par.pipeline} v={par.virtual_stages}"
              f"{f' E={par.expert}' if par.expert else ''}{f' C={par.context}' if par.context else ''} "
              f"{plan.schedule} b={plan.microbatch_size} ZeRO {par.zero_stage}: {plan.predicted.iteration_ms / 1e3:.2f} s "
              f"per iteration, MFU {plan.predicted.model_flops_utilization:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

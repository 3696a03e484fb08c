"""One rank of a DeepSpeed pipeline built from a pipeplan export (run under torchrun by the tests).

It uses the PlannedPipelineModule subclass exactly as docs/launchers.md prints it, DeepSpeed's
own engine (its batch-size assertion included), and trains one step on CPU with gloo.

Usage: torchrun --nproc_per_node P deepspeed_pipeline_worker.py EXPORT.json OUT_DIR
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs" / "launchers.md"


def documented_subclass():
    """The PlannedPipelineModule class from docs/launchers.md, executed as written."""
    text = DOCS.read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class PlannedPipelineModule" in b)
    code = block.split("\nexported = ")[0]
    namespace: dict = {}
    exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace["PlannedPipelineModule"]


def main(export_path: str, out_dir: str) -> None:
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm's attribute "torch" is torch itself)

    ds_torch_comm = sys.modules["deepspeed.comm.torch"]

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (minutes, and a C++
    # compiler) that gloo does not need; without it DeepSpeed uses torch.distributed's own.
    ds_torch_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    exported = json.loads(Path(export_path).read_text())
    torch.manual_seed(0)
    width = 8
    layers = [torch.nn.Linear(width, width) for _ in exported["layers"]]
    Planned = documented_subclass()
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(**exported["topology"])
    assert topology.world_size() == world, (exported["topology"], world)
    model = Planned(layers, parts=exported["parts"], loss_fn=torch.nn.MSELoss(), topology=topology,
                    partition_method="uniform", **exported["pipeline_module"])
    ds_config = {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 1000,
                 "zero_allow_untested_optimizer": True}  # SGD under ZeRO 1 (an export with d > 1)
    ds_config.update(exported["ds_config"])  # train_batch_size already counts the data-parallel replicas
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    micro = exported["ds_config"]["train_micro_batch_size_per_gpu"]

    def batches():
        while True:
            yield torch.randn(micro, width), torch.randn(micro, width)

    loss = engine.train_batch(data_iter=batches())
    stage = engine.stage_id
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "stage": stage, "parts": list(model.parts), "local_layers": len(list(model.forward_funcs)),
        "micro_batches": engine.micro_batches, "loss": float(loss),
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""``doctor --fix`` for a DeepSpeed ds_config: its keys kept (JSON has no comments), the batch keys
set in the text, and the partition in ``<output stem>.parts.json`` as ``pipeplan export --format
deepspeed`` writes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeplan.formats.plan import Plan
from pipeplan.launchers.common import compact_json
from pipeplan.launchers.config import LauncherConfig
from pipeplan.launchers.deepspeed.writer import export_deepspeed

__all__ = ["fix_deepspeed"]


def _json_set(text: str, key: str, value: int, after: str) -> str:
    """Set a top-level number in a JSON text in place (or add it after the ``after`` key's line)."""
    pattern = re.compile(rf'("{re.escape(key)}"\s*:\s*)(-?\d+|"[^"]*")')
    if pattern.search(text):
        return pattern.sub(lambda m: m.group(1) + str(value), text, count=1)
    m = re.search(rf'^([ \t]*)"{re.escape(after)}"\s*:[^\n]*$', text, re.M)
    if m is None:
        return text
    line = m.group(0)
    comma = "" if line.rstrip().endswith(",") else ","
    return text[:m.start()] + line.rstrip() + comma + "\n" + f'{m.group(1)}"{key}": {value}' \
        + ("," if comma == "" else "") + text[m.end():]


def fix_deepspeed(config: LauncherConfig, text: str, plan: Plan, output: str) -> dict[str, str]:
    """The ds_config's text with the plan's batch keys (and ZeRO stage), and the partition's sidecar: path to text."""
    data = json.loads(text)
    wanted = dict(data)
    wanted["train_micro_batch_size_per_gpu"] = plan.microbatch_size
    wanted["gradient_accumulation_steps"] = plan.num_microbatches
    if "train_batch_size" in data and config.data_degree:
        wanted["train_batch_size"] = plan.microbatch_size * plan.num_microbatches * config.data_degree
    zero = plan.parallelism.zero_stage if plan.parallelism is not None else config.zero_stage
    if zero != config.zero_stage:  # doctor --cluster found the plan at another ZeRO stage
        section = data.get("zero_optimization") if isinstance(data.get("zero_optimization"), dict) else {}
        wanted["zero_optimization"] = {**section, "stage": zero}
    edited = text
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if key in wanted:
            edited = _json_set(edited, key, wanted[key], "train_micro_batch_size_per_gpu")
    try:
        ok = json.loads(edited) == wanted
    except json.JSONDecodeError:
        ok = False
    if not ok:  # an unusual layout: re-serialise rather than risk a wrong edit
        edited = json.dumps(wanted, indent=2) + "\n"
    parts_path = str(Path(output).with_suffix("")) + ".parts.json"
    sidecar = json.loads(export_deepspeed(plan))
    if plan.parallelism is None:  # doctor without --cluster plans one pipeline; the launcher runs d of them
        d = config.data_degree or 1
        sidecar["topology"].update({"num_dp": d, "num_mp": config.tensor_degree})
        sidecar["ds_config"]["train_batch_size"] = plan.microbatch_size * plan.num_microbatches * d
        sidecar["ds_config"]["zero_optimization"] = {"stage": config.zero_stage}
    return {output: edited, parts_path: compact_json(sidecar) + "\n"}

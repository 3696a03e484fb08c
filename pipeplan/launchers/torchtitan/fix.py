"""``doctor --fix`` for a torchtitan TOML job config: keys replaced, removed or added in their
table, comments and the order of everything else kept.
"""

from __future__ import annotations

import json
import re

from pipeplan.formats.plan import Plan
from pipeplan.launchers.common import TORCH_SCHEDULE_NAME
from pipeplan.launchers.config import LauncherConfig
from pipeplan.launchers.editing import code_part, recompute_mode
from pipeplan.launchers.torchtitan.writer import torchtitan_module_names

__all__ = ["fix_torchtitan", "edit_toml_key"]

_HEADER = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")


def _value_lines(lines: list[str], start: int) -> int:
    """Index after the last line of the value that starts on ``lines[start]``."""
    depth, i = 0, start
    while i < len(lines):
        line = lines[i]
        quote = None
        code = line if i > start else line.split("=", 1)[1]
        for c in code[:code_part(code)]:
            if quote:
                if c == quote:
                    quote = None
            elif c in "'\"":
                quote = c
            elif c == "[":
                depth += 1
            elif c == "]":
                depth -= 1
        i += 1
        if depth <= 0:
            return i
    return i


def edit_toml_key(text: str, table: str, key: str, value: str | None) -> str:
    """Set (``value``, a TOML value's text) or remove a key of ``[table]``, keeping everything else.

    Examples
    --------
    >>> edit_toml_key("[a]\\nx = 1  # why\\n[b]\\n", "a", "x", "2")
    '[a]\\nx = 2\\n[b]\\n'
    >>> edit_toml_key("[a]\\nx = [\\n 1,\\n]\\ny = 3\\n", "a", "x", None)
    '[a]\\ny = 3\\n'
    >>> edit_toml_key("[a]\\nx = 1\\n\\n[b]\\n", "a", "z", '"v"')
    '[a]\\nx = 1\\nz = "v"\\n\\n[b]\\n'
    """
    lines = text.split("\n")
    section, begin, end = None, None, None
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m:
            if section == table and end is None:
                end = i
            section = m.group(1).strip()
            if section == table and begin is None:
                begin = i + 1
    if begin is None:
        if value is None:
            return text
        tail = "" if text.endswith("\n") else "\n"
        return f"{text}{tail}\n[{table}]\n{key} = {value}\n"
    if end is None:
        end = len(lines)
    key_re = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(begin, end):
        if key_re.match(lines[i]):
            stop = _value_lines(lines, i)
            new = [] if value is None else [f"{key} = {value}"]
            return "\n".join(lines[:i] + new + lines[stop:])
    if value is None:
        return text
    last = end
    while last > begin and not lines[last - 1].strip():
        last -= 1
    return "\n".join(lines[:last] + [f"{key} = {value}"] + lines[last:])


def fix_torchtitan(config: LauncherConfig, text: str, plan: Plan, profile) -> str:
    """The TOML's text running ``plan``: its recomputation, and its model parts and schedule (or, without a pipeline, its batch)."""
    mode = recompute_mode(plan)
    if mode != config.recompute:
        # The finding says what changes ("drop recomputation", ...); the fix makes exactly that change.
        text = edit_toml_key(text, "activation_checkpoint", "mode", json.dumps(mode))
    if plan.settings.stages == 1 and config.pipeline_degree == 1:
        # No pipeline: torchtitan runs each local batch whole, gradient accumulation over them
        # (pipeline keys would be accepted and ignored at pipeline_parallel_degree = 1).
        text = edit_toml_key(text, "training", "local_batch_size", str(plan.microbatch_size))
        if plan.num_microbatches > 1 or config.num_microbatches not in (None, 1):
            data = plan.parallelism.data if plan.parallelism is not None else (config.data_degree or 1)
            text = edit_toml_key(text, "training", "global_batch_size",
                                 str(plan.microbatch_size * plan.num_microbatches * data))
        return text
    names = torchtitan_module_names(profile)
    stages = sorted(plan.stages, key=lambda s: s.index)
    parts = [[names[n] for n in s.layers if names.get(n)] for s in stages]
    body = "[\n" + "".join(f"    [{', '.join(json.dumps(n) for n in part)}],\n" for part in parts) + "]"
    text = edit_toml_key(text, "parallelism", "pipeline_parallel_layers_per_stage", None)
    text = edit_toml_key(text, "parallelism", "pipeline_parallel_split_points", None)
    text = edit_toml_key(text, "parallelism", "pipeline_parallel_schedule_csv", None)
    text = edit_toml_key(text, "parallelism", "pipeline_parallel_schedule", json.dumps(TORCH_SCHEDULE_NAME[plan.schedule]))
    text = edit_toml_key(text, "parallelism", "pipeline_parallel_microbatch_size", str(plan.microbatch_size))
    text = edit_toml_key(text, "parallelism", "module_fqns_per_model_part", body)
    return text

"""``--fix``: the user's own file, rewritten to run the best plan, every other setting kept.

Edits are made in the text, not by re-serialising, so comments, variables, arrays and the order
of everything else survive: Megatron flags are replaced where they are written (or in the
variable assignment they read), removed, or added after ``--pipeline-model-parallel-size``;
torchtitan keys are replaced, removed or added in their TOML table; DeepSpeed's ds_config keeps
its keys (JSON has no comments) and the partition goes to ``<output stem>.parts.json``, as
``pipeplan export --format deepspeed`` writes it.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from pipeplan.launchers.config import LauncherConfig
from pipeplan.errors import BadInputError
from pipeplan.launchers.common import compact_json
from pipeplan.formats.plan import Plan
from pipeplan.launchers.megatron.writer import megatron_layout
from pipeplan.launchers.common import TORCH_SCHEDULE_NAME
from pipeplan.launchers.torchtitan.writer import torchtitan_module_names
from pipeplan.launchers.deepspeed.writer import export_deepspeed

__all__ = ["fix_config", "edit_flag", "edit_toml_key"]

_MEGATRON_REMOVED = (
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
)
_SWITCHES = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--recompute-activations")


def _code_part(line: str) -> int:
    """Index where a line's comment starts (outside quotes), or its length."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
    return len(line)


def _token_end(line: str, start: int) -> int:
    i, quote = start, None
    while i < len(line):
        c = line[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in " \t)":
            break
        i += 1
    return i


def edit_flag(text: str, flag: str, value: str | None, *, switch: bool = False, after: tuple[str, ...] = ()) -> str:
    """Set (``value``), or remove (``None``), a command-line flag in a script's text.

    Where the value is a variable (``$PP``, ``${PP}``) set once to a literal, the assignment is
    changed instead. A missing flag is added on its own line after the first of ``after`` found
    (same indentation, continuation kept).

    Examples
    --------
    >>> edit_flag("ARGS=(\\n  --micro-batch-size 1\\n)", "--micro-batch-size", "2")
    'ARGS=(\\n  --micro-batch-size 2\\n)'
    >>> edit_flag("MBS=1\\nrun --micro-batch-size $MBS", "--micro-batch-size", "4")
    'MBS=4\\nrun --micro-batch-size $MBS'
    >>> edit_flag("run --a 1 \\\\\\n  --num-layers-per-virtual-pipeline-stage 2 \\\\\\n  --b",
    ...           "--num-layers-per-virtual-pipeline-stage", None)
    'run --a 1 \\\\\\n  --b'
    """
    pattern = re.compile(r"(?<![\w-])" + re.escape(flag) + r"(?=[\s=\"')]|$)")
    lines: list[str | None] = text.split("\n")
    found = False
    for index, line in enumerate(list(lines)):
        code_end = _code_part(line)
        m = None
        for candidate in pattern.finditer(line):
            if candidate.start() < code_end:
                m = candidate
        if m is None:
            continue
        found = True
        start, end = m.start(), m.end()
        if switch:
            value_start = value_end = end
        elif end < len(line) and line[end] == "=":
            value_start, value_end = end + 1, _token_end(line, end + 1)
        else:
            value_start = end
            while value_start < len(line) and line[value_start] in " \t":
                value_start += 1
            value_end = _token_end(line, value_start)
        if value is None:
            before = line[:start].rstrip(" \t")
            rest = line[value_end:]
            new = (before + rest) if before else (line[:start] + rest.lstrip(" \t"))
            lines[index] = None if new.strip() in ("", "\\") else new
            continue
        if switch:
            continue
        token = line[value_start:value_end]
        var = re.fullmatch(r"\"?\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?\"?", token)
        assignments = [i for i, other in enumerate(lines)
                       if var and other is not None and re.match(rf"^\s*(export\s+)?{var.group(1)}=", other)]
        if len(assignments) == 1:
            i = assignments[0]
            lines[i] = re.sub(rf"^(\s*(?:export\s+)?{var.group(1)}=)(\"[^\"]*\"|'[^']*'|\S*)",
                              lambda mm: mm.group(1) + shlex.quote(value), lines[i], count=1)
            continue
        lines[index] = line[:value_start] + shlex.quote(value) + line[value_end:]
    out = [line for line in lines if line is not None]
    text = "\n".join(out)
    if found or value is None:
        return text
    return _insert_flag(text, flag, None if switch else value, after)


def _insert_flag(text: str, flag: str, value: str | None, after: tuple[str, ...]) -> str:
    words = flag if value is None else f"{flag} {shlex.quote(value)}"
    lines = text.split("\n")
    for anchor in after:
        pattern = re.compile(r"(?<![\w-])" + re.escape(anchor) + r"(?=[\s=\"')]|$)")
        for i, line in enumerate(lines):
            m = pattern.search(line)
            if m is None or m.start() >= _code_part(line):
                continue
            indent = re.match(r"[ \t]*", line).group(0)
            code = line[:_code_part(line)].rstrip()
            if code.strip().startswith(anchor):
                # The anchor starts its line (an array element or a continuation line).
                suffix = " \\" if code.endswith("\\") else ""
                lines.insert(i + 1, f"{indent}{words}{suffix}")
            else:
                value_end = _token_end(line, m.end() + 1) if not line[m.end():m.end() + 1] == "=" else \
                    _token_end(line, m.end() + 1)
                lines[i] = line[:value_end] + " " + words + line[value_end:]
            return "\n".join(lines)
    raise BadInputError(f"--fix: cannot find where to add {flag} (no {' or '.join(after)} in the file)")


# ------------------------------------------------------------------------------------- TOML

_HEADER = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")


def _value_lines(lines: list[str], start: int) -> int:
    """Index after the last line of the value that starts on ``lines[start]``."""
    depth, i = 0, start
    while i < len(lines):
        line = lines[i]
        quote = None
        code = line if i > start else line.split("=", 1)[1]
        for c in code[:_code_part(code)]:
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


# ------------------------------------------------------------------------------------- per launcher


def _recompute_mode(plan: Plan) -> str:
    """``none``, ``selective`` or ``full``: what the plan's stages recompute (the same on all)."""
    modes = {("selective" if s.recompute_granularity == "selective" else "full") if s.recompute else "none"
             for s in plan.stages}
    if len(modes) != 1:
        raise BadInputError("--fix: the best plan recomputes on some stages only, which the launcher cannot say")
    return modes.pop()


def _megatron(config: LauncherConfig, text: str, plan: Plan, profile) -> str:
    anchors = ("--pipeline-model-parallel-size", "--tensor-model-parallel-size", "--num-layers")
    if len(plan.stages) > 1 or config.pipeline_degree > 1:
        # Without a pipeline there is no split to write (a one-stage layout would be a change no
        # finding states: megatron-core's TransformerConfig then holds a layout it did not).
        layout, _, _ = megatron_layout(plan, profile)
        for flag in _MEGATRON_REMOVED:
            text = edit_flag(text, flag, None, switch=flag in _SWITCHES)
        text = edit_flag(text, "--pipeline-model-parallel-layout", layout, after=anchors)
    text = edit_flag(text, "--micro-batch-size", str(plan.microbatch_size), after=anchors)
    zero = plan.parallelism.zero_stage if plan.parallelism is not None else config.zero_stage
    if zero != config.zero_stage:  # the distributed optimizer is ZeRO 1 (doctor --cluster)
        text = edit_flag(text, "--use-distributed-optimizer", "" if zero else None, switch=True, after=anchors)
    mode = _recompute_mode(plan)
    if mode == config.recompute:
        return text
    # The finding says what changes ("drop recomputation", ...); the fix makes exactly that change.
    text = edit_flag(text, "--recompute-activations", None, switch=True)
    for flag in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers"):
        text = edit_flag(text, flag, None)
    if mode == "full":
        text = edit_flag(text, "--recompute-granularity", "full", after=anchors)
        text = edit_flag(text, "--recompute-method", "uniform", after=anchors)
        text = edit_flag(text, "--recompute-num-layers", "1", after=anchors)
    elif mode == "selective":
        text = edit_flag(text, "--recompute-granularity", "selective", after=anchors)
    return text


def _torchtitan(config: LauncherConfig, text: str, plan: Plan, profile) -> str:
    mode = _recompute_mode(plan)
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


def _deepspeed(config: LauncherConfig, text: str, plan: Plan, output: str) -> dict[str, str]:
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


def fix_config(config: LauncherConfig, text: str, plan: Plan, profile, output: str) -> dict[str, str]:
    """The files ``--fix -o output`` writes: path to text, the config first.

    Raises
    ------
    BadInputError
        The plan cannot be said in the launcher's settings (see the exporters).
    """
    if config.launcher == "megatron":
        return {output: _megatron(config, text, plan, profile)}
    if config.launcher == "torchtitan":
        return {output: _torchtitan(config, text, plan, profile)}
    return _deepspeed(config, text, plan, output)

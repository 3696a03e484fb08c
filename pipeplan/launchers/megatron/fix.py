"""``doctor --fix`` for a Megatron-LM launch script: flags replaced where they are written (or in
the variable assignment they read), removed, or added after ``--pipeline-model-parallel-size``;
comments, variables, arrays and the order of everything else kept.
"""

from __future__ import annotations

import re
import shlex

from pipeplan.errors import BadInputError
from pipeplan.formats.plan import Plan
from pipeplan.launchers.config import LauncherConfig
from pipeplan.launchers.editing import code_part, recompute_mode
from pipeplan.launchers.megatron.writer import megatron_layout

__all__ = ["fix_megatron", "edit_flag"]

_MEGATRON_REMOVED = (
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
)
_SWITCHES = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--recompute-activations")


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
        code_end = code_part(line)
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
            if m is None or m.start() >= code_part(line):
                continue
            indent = re.match(r"[ \t]*", line).group(0)
            code = line[:code_part(line)].rstrip()
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


def fix_megatron(config: LauncherConfig, text: str, plan: Plan, profile) -> str:
    """The script's text running ``plan``: its layout, micro-batch size, distributed optimizer and recomputation."""
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
    mode = recompute_mode(plan)
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

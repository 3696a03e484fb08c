"""Megatron-LM: flags from a launch script (or an argument list), and the layers each rank builds.

The flags are read the way Megatron-LM's argparse reads them (the last occurrence wins,
``--flag=value`` or ``--flag value``). The layout follows megatron-core 0.16's own rules
(``get_num_layers_to_build``, ``get_transformer_layer_offset``, ``PipelineParallelLayerLayout``;
tests check the restatement here against them) and Megatron-LM's start-up checks
(``validate_args``). Where current Megatron-LM refuses an uneven split, versions without those
checks rounded down silently; the layout here is what those versions trained, so the lost
layers show (Megatron-LM issues 468 and 1304).

Units are ``embedding``, ``decoder.<i>`` (transformer layer ``i``), ``mtp`` and ``loss`` (the
final norm, the output layer and the loss).
"""

from __future__ import annotations

import re

from pipeplan.launchers.config import LauncherConfig, Layout, LayoutStage, Problem
from pipeplan.launchers.megatron.shell import read_script
from pipeplan.errors import BadInputError
from pipeplan.plan.recompute import check_recompute_modules

__all__ = ["megatron_precision", "parse_megatron", "megatron_layout_of", "MEGATRON_INT_FLAGS",
           "megatron_cpu_offload_layers"]

#: Flags doctor reads that take an integer.
MEGATRON_INT_FLAGS = (
    "--num-layers", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
    "--micro-batch-size", "--global-batch-size", "--recompute-num-layers", "--context-parallel-size",
    "--microbatch-group-size-per-virtual-pipeline-stage", "--seq-length", "--expert-model-parallel-size",
    "--fp8-amax-history-len", "--ddp-bucket-size",
    "--cpu-offloading-num-layers",
)
#: Megatron-LM's overlap flags and the overlaps they switch (pipeplan.cluster.overlap), all off by default.
_OVERLAP_FLAGS = (("--overlap-grad-reduce", "grad-reduce"), ("--overlap-param-gather", "param-gather"),
                  ("--tp-comm-overlap", "tp-comm"))
_CHOICE_FLAGS = {
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    # Megatron-LM's _add_transformer_engine_args.
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise"),
    "--fp8-amax-compute-algo": ("most_recent", "max"),
    "--fp4-format": ("e2m1",),
    "--fp4-recipe": ("nvfp4",),
}
_STR_FLAGS = ("--pipeline-model-parallel-layout",)
_BOOL_FLAGS = (
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--use-distributed-optimizer", "--sequence-parallel", "--recompute-activations", "--fp16", "--bf16",
    "--fp8-param-gather", "--fp4-param-gather", "--grad-reduce-in-bf16",
    *(flag for flag, _ in _OVERLAP_FLAGS),
    "--fp8-param-gather", "--fp4-param-gather", "--grad-reduce-in-bf16", "--cpu-offloading",
)
_MULTI_FLAGS = {"--rampup-batch-size": 3}
_LIST_FLAGS = ("--recompute-modules",)
_LAUNCHERS = ("torchrun", "python", "python3", "deepspeed")


def _world_size(command: list[str], scalars: dict[str, str]) -> int | None:
    """torchrun's --nproc_per_node x --nnodes, where the command gives them as numbers."""
    values = {}
    for i, word in enumerate(command):
        for key in ("--nproc_per_node", "--nproc-per-node", "--nnodes"):
            if word == key and i + 1 < len(command):
                values[key.replace("-", "_").lstrip("_")] = command[i + 1]
            elif word.startswith(key + "="):
                values[key.replace("-", "_").lstrip("_")] = word.split("=", 1)[1]
    nproc = values.get("nproc_per_node")
    nodes = values.get("nnodes", "1")
    if nproc is None or not nproc.isdigit() or not nodes.isdigit():
        return int(scalars["WORLD_SIZE"]) if scalars.get("WORLD_SIZE", "").isdigit() else None
    return int(nproc) * int(nodes)


def _launch_command(script) -> tuple[list[str], list[str]]:
    """(words before the training script, Megatron arguments) of the command that trains."""
    if script.commands and all(words[0].startswith("--") for _, words in script.commands):
        return [], [w for _, words in script.commands for w in words]  # a plain argument list
    best = None
    for _, words in script.commands:
        if any(w in ("--num-layers", "--pipeline-model-parallel-size") or w.startswith("--num-layers=")
               for w in words):
            best = words
    if best is None:
        # pipeplan's own Megatron export (or a file like it) defines the flags as an array for
        # the user's command and runs nothing: read the array that holds them.
        for name, words in script.arrays.items():
            if any(w in ("--num-layers", "--pipeline-model-parallel-size") for w in words):
                return [], list(words)
        return [], []
    for i, word in enumerate(best):
        if word.endswith(".py"):
            return best[:i], best[i + 1:]
    # A plain argument list, or a launcher whose script is not a .py file.
    return ([], best) if best[0].startswith("--") else (best[:1], best[1:])


def _flags(path: str, words: list[str]) -> dict[str, str]:
    """Flag to value (``"true"`` for switches); the last occurrence wins, as in argparse."""
    out: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            i += 1
            continue
        if "=" in word:
            key, value = word.split("=", 1)
            out[key] = value
            i += 1
            continue
        if word in _BOOL_FLAGS:
            out[word] = "true"
            i += 1
            continue
        if word in _LIST_FLAGS:  # argparse nargs="*": every word up to the next flag
            end = next((j for j in range(i + 1, len(words)) if words[j].startswith("--")), len(words))
            out[word] = " ".join(words[i + 1:end])
            i = end
            continue
        if word in _MULTI_FLAGS:
            out[word] = " ".join(words[i + 1:i + 1 + _MULTI_FLAGS[word]])
            i += 1 + _MULTI_FLAGS[word]
            continue
        if word in MEGATRON_INT_FLAGS or word in _CHOICE_FLAGS or word in _STR_FLAGS:
            if i + 1 >= len(words) or (words[i + 1].startswith("--") and word not in _STR_FLAGS):
                raise BadInputError(f"{path}: {word}: expected a value after it")
            out[word] = words[i + 1]
            i += 2
            continue
        # A flag doctor does not read: take the next word as its value unless it is a flag.
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[word] = words[i + 1]
            i += 2
        else:
            out[word] = "true"
            i += 1
    return out


def _int(path: str, flags: dict[str, str], name: str, default: int | None = None) -> int | None:
    raw = flags.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"\d+", raw.strip()):
        hint = " (the script sets it from a variable it does not define: give it with --var NAME=VALUE)" \
            if raw == "" else ""
        raise BadInputError(f"{path}: {name}: {raw!r} is not a non-negative integer{hint}")
    return int(raw)


def megatron_precision(flags: dict[str, str]) -> str | None:
    """The recipe Megatron-LM's flags train with (:mod:`pipeplan.facts.precision`):
    ``--fp4-format`` is nvfp4; ``--fp8-format`` with ``--fp8-recipe mxfp8`` is mxfp8, with the
    per-tensor recipes (``delayed``, Megatron's default, and ``tensorwise``) and ``blockwise`` fp8
    (costed alike: one byte per element); neither: the dtype (None)."""
    if flags.get("--fp4-format"):
        return "nvfp4"
    if flags.get("--fp8-format"):
        return "mxfp8" if flags.get("--fp8-recipe") == "mxfp8" else "fp8"
    return None


def parse_megatron(path: str, text: str, *, variables: dict[str, str] | None = None,
                   world_size: int | None = None) -> LauncherConfig:
    """Read Megatron-LM's pipeline settings from a launch script or an argument list.

    Parameters
    ----------
    path : str
        The file's name, for messages.
    text : str
        A bash script that runs ``pretrain_gpt.py`` (or any script) with Megatron flags, or a
        plain list of flags.
    variables : dict, optional
        Values for variables the script reads but does not set.
    world_size : int, optional
        GPUs in the job; default: torchrun's ``--nproc_per_node`` x ``--nnodes`` in the script.

    Returns
    -------
    LauncherConfig

    Raises
    ------
    BadInputError
        An unparseable script, no ``--num-layers``, or a flag value Megatron-LM's argparse refuses
        (naming the file and the flag).
    """
    script = read_script(path, text, variables)
    prefix, args = _launch_command(script)
    if not args:
        raise BadInputError(f"{path}: no command with --num-layers or --pipeline-model-parallel-size found")
    flags = _flags(path, args)
    for name, choices in _CHOICE_FLAGS.items():
        if name in flags and flags[name] not in choices:
            raise BadInputError(f"{path}: {name}: {flags[name]!r} is not one of {', '.join(choices)}")
    num_layers = _int(path, flags, "--num-layers")
    if num_layers is None:
        raise BadInputError(f"{path}: --num-layers is not set")
    p = _int(path, flags, "--pipeline-model-parallel-size", 1)
    t = _int(path, flags, "--tensor-model-parallel-size", 1)
    cp = _int(path, flags, "--context-parallel-size", 1)
    for name, value in (("--pipeline-model-parallel-size", p), ("--tensor-model-parallel-size", t),
                        ("--context-parallel-size", cp)):
        if value < 1:
            raise BadInputError(f"{path}: {name}: {value} must be at least 1")
    mbs = _int(path, flags, "--micro-batch-size")
    if mbs is None or mbs < 1:
        raise BadInputError(f"{path}: --micro-batch-size: must be set to at least 1")
    for name in MEGATRON_INT_FLAGS:
        _int(path, flags, name)  # every integer flag doctor reads must be an integer
    world = world_size if world_size is not None else _world_size(prefix, script.scalars)
    d = world // (t * p * cp) if world and world % (t * p * cp) == 0 else None
    gbs = _int(path, flags, "--global-batch-size")
    if gbs is None and d is not None:
        gbs = mbs * d  # Megatron's default: one micro-batch per replica
    m = gbs // (mbs * (d or 1)) if gbs is not None and gbs % (mbs * (d or 1)) == 0 else None
    layout = flags.get("--pipeline-model-parallel-layout")
    v = 1
    if layout is not None:
        stages = _layout_stage_count(path, layout)
        v = max(1, stages // p) if stages % p == 0 else 1
    elif "--num-virtual-stages-per-pipeline-rank" in flags:
        v = _int(path, flags, "--num-virtual-stages-per-pipeline-rank")
    elif "--num-layers-per-virtual-pipeline-stage" in flags:
        per_vstage = _int(path, flags, "--num-layers-per-virtual-pipeline-stage")
        if per_vstage < 1:
            raise BadInputError(f"{path}: --num-layers-per-virtual-pipeline-stage: must be at least 1")
        v = max(1, (num_layers // p) // per_vstage)
    if flags.get("--recompute-granularity") == "full":
        recompute = "full"
    elif flags.get("--recompute-granularity") == "selective" or flags.get("--recompute-activations") == "true":
        recompute = "selective"
    else:
        recompute = "none"
    modules = None
    if recompute == "selective" and flags.get("--recompute-modules"):
        modules = tuple(check_recompute_modules(flags["--recompute-modules"].split(),
                                                f"{path}: --recompute-modules"))
    read = [*MEGATRON_INT_FLAGS, *_CHOICE_FLAGS, *_STR_FLAGS, *_BOOL_FLAGS, *_LIST_FLAGS]
    settings = {name: flags[name] for name in read if name in flags}
    if world:
        settings["world size"] = str(world)
    expert = _int(path, flags, "--expert-model-parallel-size") or 1
    return LauncherConfig(
        launcher="megatron", path=path, pipeline_degree=p, virtual_stages=v, expert_degree=expert,
        schedule="interleaved" if v > 1 else "1f1b", microbatch_size=mbs, num_microbatches=m,
        tensor_degree=t, data_degree=d, context_degree=cp, num_layers=num_layers, recompute=recompute,
        sharded_optimizer="--use-distributed-optimizer" in flags,
        zero_stage=1 if "--use-distributed-optimizer" in flags else 0,
        sequence_parallel="--sequence-parallel" in flags, settings=settings, recompute_modules=modules,
        precision=megatron_precision(flags),
        quantized_params="--fp8-param-gather" in flags or "--fp4-param-gather" in flags,
        gradient_reduce_dtype="bf16" if "--grad-reduce-in-bf16" in flags else None,
        overlap=tuple(name for flag, name in _OVERLAP_FLAGS if flag in flags),
        ddp_bucket_size=_int(path, flags, "--ddp-bucket-size"),
    )


def megatron_cpu_offload_layers(settings: dict) -> int | None:
    """N of ``--cpu-offloading --cpu-offloading-num-layers N`` in a parsed config's flags (None
    without ``--cpu-offloading``, or with N = 0: Megatron then offloads nothing)."""
    if settings.get("--cpu-offloading") is None:
        return None
    n = int(settings.get("--cpu-offloading-num-layers") or 0)
    return n if n > 0 else None


def _layout_stage_count(path: str, layout: str) -> int:
    return len(_expand(path, layout))


#: Most characters a ``--pipeline-model-parallel-layout`` may expand to (a layer or a ``|`` each):
#: far above any real model's layers + stages, far below what would exhaust time or memory.
MAX_LAYOUT_CHARS = 1_000_000


def layout_length(layout: str) -> int:
    """How many characters ``layout`` expands to, computed without expanding it.

    Repeats ``X*N`` and ``(...)*N`` (nested too) multiply; everything else counts one.

    >>> layout_length("E|(t|)*3,tL"), layout_length("(t*9999|)*99999")
    (10, 999990000)
    """
    text = layout.replace(",", "").replace(" ", "")
    stack, total, i = [], 0, 0
    last = 0  # the length of the item a following *N repeats
    while i < len(text):
        c = text[i]
        if c == "(":
            stack.append(total)
            total, last = 0, 0
        elif c == ")" and stack:
            last = total
            total = stack.pop() + total
        elif c == "*":
            digits = re.match(r"\d+", text[i + 1:])
            count = int(digits.group()) if digits else 1
            total += last * (count - 1)
            last = last * count
            i += len(digits.group()) if digits else 0
        else:
            total += 1
            last = 1
        i += 1
    return total


def _expand(path: str, layout: str) -> list[str]:
    """Stage strings of a layout, as megatron-core's ``parse_str_to_list`` expands them."""
    import warnings

    if layout_length(layout) > MAX_LAYOUT_CHARS:
        raise BadInputError(f"{path}: --pipeline-model-parallel-layout: {layout[:60]!r} expands to "
                            f"{layout_length(layout):,} entries; pipeplan reads at most {MAX_LAYOUT_CHARS:,}")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError:
        PipelineParallelLayerLayout = None
    if PipelineParallelLayerLayout is not None:
        try:
            parsed = PipelineParallelLayerLayout.parse_str_to_list(layout)
        except Exception as exc:  # megatron-core raises AssertionError/ValueError on bad strings
            raise BadInputError(f"{path}: --pipeline-model-parallel-layout: {layout!r}: {exc}") from None
        symbols = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
        return ["".join(symbols.get(getattr(x, "name", str(x)).lower(), "?") for x in stage) for stage in parsed]
    text = layout.replace(",", "").replace(" ", "")
    text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"([A-Za-z])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    for char in text:
        if char not in "ELtm|":
            raise BadInputError(f"{path}: --pipeline-model-parallel-layout: {layout!r}: {char!r} is not one of "
                                f"E, L, t, m, |")
    return text.split("|")


def megatron_layout_of(config: LauncherConfig) -> Layout:
    """The layers each (rank, virtual stage) builds, with Megatron-LM's rounding.

    Returns
    -------
    Layout
        Stages in virtual-stage-major order (entry ``vstage * p + rank``); ``problems`` lists what
        current Megatron-LM refuses at start-up and what older versions silently dropped.
    """
    # Function length (about 125 lines): megatron-core's own layout rules transcribed in its order
    # (layout string or even split, first/last stage adjustments, virtual stages), so that each
    # branch can be read against the Megatron source it mirrors.
    s = config.settings
    path, p, L = config.path, config.pipeline_degree, config.num_layers
    units = ["embedding"] + [f"decoder.{i}" for i in range(L)] + ["loss"]
    problems: list[Problem] = []

    def refuse(setting, message, fix):
        problems.append(Problem("refused", "error", setting, message, fix))

    chosen = [f for f in ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                          "--pipeline-model-parallel-layout") if f in s]
    if len(chosen) > 1:
        refuse(", ".join(chosen), "Megatron-LM refuses more than one of these at start-up",
               "keep only --pipeline-model-parallel-layout (or one of the others)")
    emb = s.get("--account-for-embedding-in-pipeline-split") == "true"
    loss = s.get("--account-for-loss-in-pipeline-split") == "true"
    first = int(s["--decoder-first-pipeline-num-layers"]) if "--decoder-first-pipeline-num-layers" in s else None
    last = int(s["--decoder-last-pipeline-num-layers"]) if "--decoder-last-pipeline-num-layers" in s else None
    v = config.virtual_stages
    if "--pipeline-model-parallel-layout" in s:
        stage_strings = _expand(path, s["--pipeline-model-parallel-layout"])
        if len(stage_strings) % p:
            refuse(config.setting("--pipeline-model-parallel-layout"),
                   f"the layout has {len(stage_strings)} stages, not a multiple of "
                   f"--pipeline-model-parallel-size {p}", f"give {p} x v stages")
            return Layout((), tuple(units), tuple(problems))
        counts = "".join(stage_strings)
        if counts.count("t") != L:
            refuse(config.setting("--pipeline-model-parallel-layout"),
                   f"the layout has {counts.count('t')} decoder layers (t) but --num-layers is {L}",
                   "make the layout's t count equal --num-layers")
        if counts.count("E") != 1 or counts.count("L") != 1 or not stage_strings[0].startswith("E") \
                or not stage_strings[-1].endswith("L"):
            refuse(config.setting("--pipeline-model-parallel-layout"),
                   "the layout needs one E at the start of the first stage and one L at the end of the last",
                   "start the layout with E and end it with L")
        stages, layer = [], 0
        for index, text in enumerate(stage_strings):
            names = []
            for char in text:
                if char == "E":
                    names.append("embedding")
                elif char == "L":
                    names.append("loss")
                elif char == "m":
                    names.append("mtp")
                else:
                    names.append(f"decoder.{layer}")
                    layer += 1
            stages.append(LayoutStage(index, index % p, index // p, tuple(names)))
        return Layout(tuple(stages), tuple(units), tuple(problems))

    per_rank: list[int] | None = None  # decoder layers per rank (all its virtual stages)
    if first is not None or last is not None:
        if emb or loss:
            refuse("--decoder-first/last-pipeline-num-layers with --account-for-*-in-pipeline-split",
                   "megatron-core refuses the uneven first/last stage beside a standalone embedding or loss stage",
                   "use --pipeline-model-parallel-layout instead")
        if "--num-layers-per-virtual-pipeline-stage" in s:
            refuse(config.setting("--num-layers-per-virtual-pipeline-stage"),
                   "with --decoder-first/last-pipeline-num-layers Megatron-LM needs "
                   "--num-virtual-stages-per-pipeline-rank for the virtual stages",
                   "use --num-virtual-stages-per-pipeline-rank")
        middle_layers = L - (first or 0) - (last or 0)
        middle_ranks = p - (first is not None) - (last is not None)
        if middle_ranks > 0 and middle_layers % middle_ranks:
            refuse(f"--num-layers {L}, --decoder-first/last-pipeline-num-layers",
                   f"the {middle_layers} middle layers do not divide among the {middle_ranks} middle ranks",
                   f"make the middle layers a multiple of {middle_ranks}")
        middle = middle_layers // middle_ranks if middle_ranks > 0 else 0
        per_rank = [middle] * p
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        total = L + emb + loss
        if total % p:
            what = f"--num-layers {L}" + (" (+1 embedding)" if emb else "") + (" (+1 loss)" if loss else "")
            refuse(f"--num-layers {L}, --pipeline-model-parallel-size {p}",
                   f"{what} is not divisible by the pipeline size {p}; current Megatron-LM refuses to start",
                   f"use --pipeline-model-parallel-layout (pipeplan's --fix writes one) or a layer count "
                   f"divisible by {p}")
        per_rank = [total // p] * p  # the older versions' floor
    if v > 1 and any(n % v for n in per_rank):
        setting = config.setting("--num-layers-per-virtual-pipeline-stage") \
            if "--num-layers-per-virtual-pipeline-stage" in s else config.setting("--num-virtual-stages-per-pipeline-rank")
        refuse(setting, f"layers per rank {sorted(set(per_rank))} are not divisible by the {v} virtual stages; "
                        f"current Megatron-LM refuses to start",
               "use --pipeline-model-parallel-layout, or a per-rank layer count divisible by the virtual stages")
    if "--num-layers-per-virtual-pipeline-stage" in s and first is None and last is None:
        chunk = int(s["--num-layers-per-virtual-pipeline-stage"])
        if per_rank[0] % chunk and v > 1 and not any(pr.setting.startswith("--num-layers-per-virtual") for pr in problems):
            refuse(config.setting("--num-layers-per-virtual-pipeline-stage"),
                   f"the {per_rank[0]} layers per rank are not divisible by {chunk} layers per virtual stage; "
                   f"current Megatron-LM refuses to start",
                   "use --pipeline-model-parallel-layout, or a divisor of the layers per rank")
        per_chunk = [[chunk] * v for _ in range(p)]
    else:
        per_chunk = [[n // v] * v for n in per_rank]
    # Built in layer order: virtual stage 0 of every rank, then virtual stage 1, ...
    stages, layer = [], 0
    for vs in range(v):
        for r in range(p):
            count = per_chunk[r][vs]
            if emb and r == 0 and vs == 0:
                count -= 1
            if loss and r == p - 1 and vs == v - 1:
                count -= 1
            count = max(0, count)
            names = [f"decoder.{i}" for i in range(layer, min(L, layer + count))]
            layer += count
            if r == 0 and vs == 0:
                names.insert(0, "embedding")
            if r == p - 1 and vs == v - 1:
                names.append("loss")
            stages.append(LayoutStage(vs * p + r, r, vs, tuple(names)))
    if first is None and last is None and not (emb or loss) and v > 1:
        # Older Megatron-LM offset each virtual stage by num_layers // v, so a remainder left
        # holes between the chunks; restate its offsets exactly.
        per = per_chunk[0][0]
        stages = []
        for vs in range(v):
            for r in range(p):
                start = vs * (L // v) + r * per
                names = [f"decoder.{i}" for i in range(start, min(L, start + per))]
                if r == 0 and vs == 0:
                    names.insert(0, "embedding")
                if r == p - 1 and vs == v - 1:
                    names.append("loss")
                stages.append(LayoutStage(vs * p + r, r, vs, tuple(names)))
    return Layout(tuple(stages), tuple(units), tuple(problems))

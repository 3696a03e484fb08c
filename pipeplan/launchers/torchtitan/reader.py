"""torchtitan: a TOML job config (0.1/0.2 ``--job.config_file``), and the stages it builds.

The keys are torchtitan 0.2's ``JobConfig`` (``[parallelism]``, ``[training]``,
``[activation_checkpoint]``, ``[model]``); where torchtitan's own ``ConfigManager`` imports, it
checks the file too (unknown keys). The stages follow ``pipeline_llm``: the given
``module_fqns_per_model_part``, else ``generate_llm_fqn_per_model_part`` over
``ceil((n_layers + first_less + last_less) / pipeline_parallel_layers_per_stage)`` stages (or one
stage per rank for single-stage schedules, two for looped ones), placed as the schedule class
places them (loop, or V for ``ZBVZeroBubble``/``DualPipeV``). Names torchtitan's model does not
have are silently ignored by torchtitan (empty stages); doctor flags them.
"""

from __future__ import annotations

import math
import re

from pipeplan.launchers.config import LauncherConfig, Layout, LayoutStage, Problem
from pipeplan.launchers.torchtitan.inputs import apply_overrides
from pipeplan.errors import BadInputError
from pipeplan.launchers.registry import launcher_overlaps
from pipeplan.formats.reading import load_toml as load_limited_toml

__all__ = ["torchtitan_precision",
           "parse_torchtitan", "torchtitan_layout_of", "load_toml", "TORCHTITAN_SCHEDULES", "llm_fqns_per_stage",
           "model_layer_count"]

#: torchtitan schedule name (torch's ``get_schedule_class`` names) to pipeplan's.
TORCHTITAN_SCHEDULES = {
    "gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved", "looped_bfs": "interleaved",
    "interleavedzerobubble": "zb", "zbvzerobubble": "zbv", "dualpipev": "dualpipev",
}
_SINGLE_STAGE = ("gpipe", "1f1b")

#: Transformer blocks of torchtitan's built-in Llama 3 flavors (``llama3_args``), for when
#: torchtitan does not import.
_LLAMA3_LAYERS = {"debugmodel": 6, "debugmodel_flex_attn": 6, "debugmodel_varlen_attn": 6, "8B": 32,
                  "8B_flex": 32, "8B_varlen": 32, "70B": 80, "405B": 126}

_TYPES = {
    ("parallelism", "pipeline_parallel_degree"): int,
    ("parallelism", "tensor_parallel_degree"): int,
    ("parallelism", "context_parallel_degree"): int,
    ("parallelism", "expert_parallel_degree"): int,
    ("parallelism", "fsdp_reshard_after_forward"): str,
    ("parallelism", "expert_tensor_parallel_degree"): int,
    ("parallelism", "data_parallel_replicate_degree"): int,
    ("parallelism", "data_parallel_shard_degree"): int,
    ("parallelism", "pipeline_parallel_microbatch_size"): int,
    ("parallelism", "pipeline_parallel_layers_per_stage"): int,
    ("parallelism", "pipeline_parallel_first_stage_less_layers"): int,
    ("parallelism", "pipeline_parallel_last_stage_less_layers"): int,
    ("parallelism", "pipeline_parallel_schedule"): str,
    ("parallelism", "pipeline_parallel_schedule_csv"): str,
    ("parallelism", "module_fqns_per_model_part"): list,
    ("parallelism", "pipeline_parallel_split_points"): list,
    ("parallelism", "enable_async_tensor_parallel"): bool,
    ("training", "local_batch_size"): int,
    ("training", "global_batch_size"): int,
    ("training", "seq_len"): int,
    ("activation_checkpoint", "mode"): str,
    ("activation_checkpoint", "selective_ac_option"): str,
    ("model", "name"): str,
    ("model", "flavor"): str,
}


def _table(data, *keys) -> dict:
    """A nested TOML table (``[quantize.linear.float8]``), or {} where a level is absent or not a table."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else {}


def torchtitan_precision(data: dict) -> tuple[str | None, bool]:
    """``(precision, quantized weights)`` of a job config's model converters (torchao):
    ``quantize.linear.float8`` (0.1: ``float8``) is fp8, with
    ``enable_fsdp_float8_all_gather`` its weights gathered in fp8; ``quantize.linear.mx`` (``mx``)
    mxfp8; neither: the dtype (None)."""
    converters = _table(data, "model").get("converters") or []
    if isinstance(converters, str):
        converters = [c.strip() for c in converters.split(",")]
    names = {c for c in converters if isinstance(c, str)} if isinstance(converters, list) else set()
    if names & {"quantize.linear.float8", "float8"}:
        float8 = _table(data, "quantize", "linear", "float8") or _table(data, "float8")
        return "fp8", float8.get("enable_fsdp_float8_all_gather") is True
    if names & {"quantize.linear.mx", "mx"}:
        return "mxfp8", False
    return None, False


def load_toml(path: str, text: str) -> dict:
    """The TOML as a dict; invalid TOML is a BadInputError naming the file."""
    return load_limited_toml(path, text)


def _get(path: str, data: dict, section: str, key: str, default=None):
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise BadInputError(f"{path}: [{section}] must be a table, not {type(table).__name__}")
    if key not in table:
        return default
    value = table[key]
    kind = _TYPES.get((section, key))
    bad = kind is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool)))
    if bad:
        raise BadInputError(
            f"{path}: {section}.{key}: {value!r} is a {type(value).__name__}; torchtitan expects "
            f"{'an integer' if kind is int else 'a string' if kind is str else 'a boolean' if kind is bool else 'a list'}"
        )
    if key == "module_fqns_per_model_part" and not all(
            isinstance(part, list) and all(isinstance(n, str) for n in part) for part in value):
        raise BadInputError(f"{path}: parallelism.module_fqns_per_model_part: must be a list of lists of "
                            f"module names (strings)")
    return value


def _check_with_torchtitan(path: str, overrides=()) -> None:
    """torchtitan's own ConfigManager on the file, where it imports (it refuses unknown keys)."""
    import importlib.util
    import sys
    import types

    try:
        if "torchtitan" not in sys.modules:
            spec = importlib.util.find_spec("torchtitan")
            if spec is None or not spec.submodule_search_locations:
                return
            # torchtitan/__init__ pulls its model registry (triton); the config needs none of it.
            package = types.ModuleType("torchtitan")
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules["torchtitan"] = package
        from torchtitan.config import ConfigManager
    except Exception:  # not installed, or a torchtitan without the TOML config
        return
    import contextlib
    import io

    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ConfigManager().parse_args(["--job.config_file", path,
                                        *(f"--{o.removeprefix('--')}" for o in overrides)])
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        if "Invalid field names" in first and "pipeline_parallel_split_points" in first and first.count("'") == 2:
            return  # the one key torchtitan 0.2 dropped; doctor reads it and says so
        raise BadInputError(f"{path}: torchtitan's ConfigManager refuses it: {first}") from None
    except SystemExit:
        # tyro prints a box; keep its words (e.g. "Unrecognized options: --parallelism.x").
        words = " ".join(re.sub(r"\x1b\[[0-9;]*m|[│╭╮╰╯─┃━┏┓┗┛]", " ", said.getvalue()).split())
        found = re.search(r"(Unrecognized (?:options|arguments): \S+)", words) or re.search(r"(error: .{0,160})", words)
        raise BadInputError(f"{path}: torchtitan's ConfigManager refuses it"
                            + (f": {found.group(1).strip()[:200]}" if found else " (tyro exited)")) from None


def model_layer_count(name: str, flavor: str) -> int | None:
    """``n_layers`` of a torchtitan model flavor: from torchtitan where it imports, else a table."""
    if name == "llama3":
        return _LLAMA3_LAYERS.get(flavor)
    return None


def parse_torchtitan(path: str, text: str | None, *, num_layers: int | None = None,
                     validate_with_torchtitan: bool = True, world_size: int | None = None,
                     data: dict | None = None, overrides=()) -> LauncherConfig:
    """Read torchtitan's pipeline settings from a TOML job config.

    Parameters
    ----------
    path : str
    text : str
    num_layers : int, optional
        The model's transformer blocks; default: from ``[model] name/flavor`` (torchtitan's
        Llama 3 flavors), else the profile's.
    validate_with_torchtitan : bool
        Also run torchtitan's ``ConfigManager`` on the file when it is installed.
    world_size : int, optional
        GPUs in the job (torchrun's ``NGPU``): fills in ``data_parallel_shard_degree = -1``
        ("the rest"), as torchtitan's ``ParallelDims`` does.
    data : dict, optional
        The job config already read (a Python registry's, :mod:`pipeplan.launchers.torchtitan.inputs`)
        instead of ``text``.
    overrides : sequence of str
        Command-line overrides ``section.key=value``, applied after the job config.

    Raises
    ------
    BadInputError
        Invalid TOML, a key of the wrong type, an unknown schedule, or a file torchtitan's
        ConfigManager refuses; each names the file and the key.
    """
    from_file = data is None
    data = apply_overrides(path, load_toml(path, text) if from_file else data, overrides)
    for (section, key) in _TYPES:
        _get(path, data, section, key)
    if validate_with_torchtitan and from_file:
        _check_with_torchtitan(path, overrides)
    par = lambda key, default=None: _get(path, data, "parallelism", key, default)  # noqa: E731
    p = par("pipeline_parallel_degree", 1)
    t = par("tensor_parallel_degree", 1)
    cp = par("context_parallel_degree", 1)
    ep = par("expert_parallel_degree", 1)
    for key, value in (("pipeline_parallel_degree", p), ("tensor_parallel_degree", t),
                       ("context_parallel_degree", cp), ("expert_parallel_degree", ep)):
        if value < 1:
            raise BadInputError(f"{path}: parallelism.{key}: {value} must be at least 1")
    name = par("pipeline_parallel_schedule", "1F1B")
    schedule = TORCHTITAN_SCHEDULES.get(name.lower())
    if schedule is None and not par("pipeline_parallel_schedule_csv"):
        raise BadInputError(f"{path}: parallelism.pipeline_parallel_schedule: {name!r} is not a schedule torch "
                            f"knows; use one of 1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, "
                            f"ZBVZeroBubble, DualPipeV")
    schedule = schedule or "interleaved"
    mbs = par("pipeline_parallel_microbatch_size", 1)
    local = _get(path, data, "training", "local_batch_size", 8)
    if mbs < 1 or local < 1:
        raise BadInputError(f"{path}: training.local_batch_size ({local}) and "
                            f"parallelism.pipeline_parallel_microbatch_size ({mbs}) must be at least 1")
    model_name = _get(path, data, "model", "name", "llama3")
    flavor = _get(path, data, "model", "flavor", "debugmodel")
    # No [model] table: a fragment to merge into the user's job (pipeplan's own export is one),
    # whose model is the profile's, not torchtitan's default debug model.
    known = "model" in data
    layers = num_layers if num_layers is not None else (model_layer_count(model_name, flavor) if known else None)
    replicate = par("data_parallel_replicate_degree", 1)
    shard = par("data_parallel_shard_degree", -1)
    if shard == -1 and world_size and world_size % (replicate * t * p * cp) == 0:
        shard = world_size // (replicate * t * p * cp)  # ParallelDims: -1 takes the GPUs left over
    d = replicate * shard if shard > 0 else None
    accumulation = _accumulation_steps(path, data, local, d)
    if p == 1:
        # Without a pipeline torchtitan runs each local batch whole, once per gradient-accumulation
        # step (train.py: global_batch_size // (local_batch_size x dp)); pipeline_parallel_
        # microbatch_size only splits batches for a pipeline schedule.
        mbs, microbatches = local, accumulation
    else:
        # Each accumulation step runs the schedule over local_batch_size / microbatch_size.
        microbatches = accumulation * (local // mbs) if local % mbs == 0 else None
    parts = par("module_fqns_per_model_part")
    lps = par("pipeline_parallel_layers_per_stage")
    if parts is not None:
        num_stages = len(parts)
    elif lps is not None and layers is not None:
        num_stages = math.ceil((layers + par("pipeline_parallel_first_stage_less_layers", 1)
                                + par("pipeline_parallel_last_stage_less_layers", 1)) / max(lps, 1))
    else:
        num_stages = p * (1 if schedule in _SINGLE_STAGE else 2)
    v = num_stages // p if num_stages % p == 0 and num_stages >= p else 1
    mode = _get(path, data, "activation_checkpoint", "mode", "selective")
    if mode not in ("selective", "full", "memory_budget", "none"):
        raise BadInputError(f"{path}: activation_checkpoint.mode: {mode!r} is not one of none, selective, full, "
                            f"memory_budget")
    if mode == "selective":
        _selective_ac_option(path, data)
    settings = {}
    for (section, key) in _TYPES:
        value = _get(path, data, section, key)
        if value is not None:
            settings[f"{section}.{key}"] = repr(value) if isinstance(value, list) else str(value)
    settings["parallelism.pipeline_parallel_schedule"] = name
    precision, quantized = torchtitan_precision(data)
    return LauncherConfig(
        launcher="torchtitan", path=path, pipeline_degree=p, virtual_stages=v, schedule=schedule,
        microbatch_size=mbs, num_microbatches=microbatches,
        tensor_degree=t, data_degree=d, context_degree=cp, expert_degree=ep, num_layers=layers,
        # memory_budget: the compiler's partitioner chooses what to keep; not costed (none).
        recompute={"full": "full", "selective": "selective"}.get(mode, "none"),
        sharded_optimizer=shard != 1, zero_stage=_zero_stage(path, data, shard, p),
        sequence_parallel=t > 1, settings=settings, precision=precision, quantized_params=quantized,
        overlap=_overlap(path, data, _zero_stage(path, data, shard, p)),
    )


def _selective_ac_option(path: str, data: dict) -> str:
    """``activation_checkpoint.selective_ac_option`` (default ``"2"``, torchtitan 0.2's) as
    ``apply_ac`` accepts it: ``op``, or digits (``_apply_layer_sac``: ``0`` checkpoints every
    block, N every N-th); anything else torchtitan refuses with a ValueError."""
    option = _get(path, data, "activation_checkpoint", "selective_ac_option", "2")
    if option != "op" and not option.isdigit():
        raise BadInputError(f"{path}: activation_checkpoint.selective_ac_option: {option!r} is not 'op' or a "
                            f"positive whole number (torchtitan's apply_ac refuses it)")
    return option


def _overlap(path: str, data: dict, zero_stage: int):
    """What the job overlaps: torchtitan's own (FSDP2's reduce-scatter stream and prefetch, DDP's
    buckets: :func:`pipeplan.launchers.registry.launcher_overlaps`) and, with
    ``parallelism.enable_async_tensor_parallel``, the tensor-parallel collectives; None: the defaults."""
    if not _get(path, data, "parallelism", "enable_async_tensor_parallel", False):
        return None
    return tuple(sorted(launcher_overlaps("torchtitan", zero_stage) | {"tp-comm"}))


def _zero_stage(path: str, data: dict, shard: int, p: int) -> int:
    """The ZeRO stage whose memory torchtitan's FSDP keeps (pipeplan.launchers.registry): "always"
    reshards the weights after forward (ZeRO 3); "never" keeps them whole, and the gradients whole
    until the step under a pipeline (ZeRO 1) or reduce-scattered per micro-batch (ZeRO 2);
    "default" is "always" without a pipeline and "never" with one (parallelize.py)."""
    if shard <= 1:
        return 0
    policy = _get(path, data, "parallelism", "fsdp_reshard_after_forward", "default")
    if policy not in ("default", "always", "never"):
        raise BadInputError(f"{path}: parallelism.fsdp_reshard_after_forward: {policy!r} is not one of default, "
                            f"always, never")
    if policy == "always" or (policy == "default" and p == 1):
        return 3
    return 1 if p > 1 else 2


def _accumulation_steps(path: str, data: dict, local: int, d: int | None) -> int:
    """torchtitan's gradient-accumulation steps: ``training.global_batch_size`` (default -1:
    ``local_batch_size x dp``) over ``local_batch_size x dp`` (torchtitan 0.2 ``train.py``)."""
    total = _get(path, data, "training", "global_batch_size", -1)
    if total is None or total < 0 or d is None:
        return 1
    if total % (local * d):
        raise BadInputError(f"{path}: training.global_batch_size: {total} is not a multiple of local_batch_size x "
                            f"data-parallel degree = {local} x {d}; torchtitan asserts it is")
    return max(1, total // (local * d))


def llm_fqns_per_stage(num_stages: int, num_layers: int, input_weight: int = 1,
                       output_weight: int = 1) -> list[list[str]]:
    """torchtitan 0.2's ``generate_llm_fqn_per_model_part``, restated (tests compare the two).

    Raises
    ------
    ValueError
        Where torchtitan's raises (more stages than weighted layers, a weight over the share).

    Examples
    --------
    >>> [len(s) for s in llm_fqns_per_stage(4, 8)]
    [3, 3, 2, 3]
    """
    if num_stages < 1:
        raise ValueError("Number of stages must be at least 1")
    if num_stages == 1:
        return [["tok_embeddings"] + [f"layers.{i}" for i in range(num_layers)] + ["norm", "output"]]
    effective = num_layers + input_weight + output_weight
    if num_stages > effective:
        raise ValueError(f"Number of stages ({num_stages}) cannot be greater than effective layers ({effective})")
    share, extra = divmod(effective, num_stages)
    if share == 0:
        raise ValueError("Configuration would result in empty stages")
    if input_weight > share or output_weight > share:
        raise ValueError(f"input/output weight ({input_weight}/{output_weight}) exceeds minimum layers per "
                         f"stage ({share})")
    out, layer = [], 0
    for stage in range(num_stages):
        count = share + (1 if stage < extra else 0)
        names = []
        if stage == 0:
            names.append("tok_embeddings")
            count -= input_weight
        elif stage == num_stages - 1:
            count -= output_weight
        for _ in range(count):
            if layer < num_layers:
                names.append(f"layers.{layer}")
                layer += 1
        if stage == num_stages - 1:
            names += ["norm", "output"]
        out.append(names)
    return out


def _placement(schedule: str, p: int, num_stages: int) -> list[int]:
    if schedule in ("zbv", "dualpipev"):
        return [s if s < p else 2 * p - 1 - s for s in range(num_stages)]
    return [s % p for s in range(num_stages)]


def torchtitan_layout_of(config: LauncherConfig, model_units: list[str], raw_parts=None) -> Layout:
    """The stages torchtitan builds, and the names it would silently ignore.

    Parameters
    ----------
    config : LauncherConfig
    model_units : list of str
        The model's module names in order (``tok_embeddings``, ``layers.0``, ..., ``norm``, ``output``).
    raw_parts : list of list of str, optional
        ``module_fqns_per_model_part`` as written; None to generate it the way torchtitan does.
    """
    s = config.settings
    p, problems = config.pipeline_degree, []
    layers = config.num_layers
    split_points = s.get("parallelism.pipeline_parallel_split_points")
    if raw_parts is None and split_points is not None:
        import ast

        points = ast.literal_eval(split_points) if split_points.startswith("[") else []
        problems.append(Problem(
            "refused", "warning", "parallelism.pipeline_parallel_split_points",
            "torchtitan 0.2 no longer reads split points (older versions did)",
            "use module_fqns_per_model_part (pipeplan's --fix writes it)"))
        raw_parts, current = [], []
        for unit in model_units:
            if unit in points and current:
                raw_parts.append(current)
                current = []
            current.append(unit)
        raw_parts.append(current)
        missing = [n for n in points if n not in model_units]
        if missing:
            problems.append(Problem("unknown-unit", "error", "parallelism.pipeline_parallel_split_points",
                                    f"split points {missing} are not modules of the model", "use the model's names"))
    if raw_parts is None:
        lps = s.get("parallelism.pipeline_parallel_layers_per_stage")
        single = config.schedule in _SINGLE_STAGE
        if lps is not None:
            num_stages = math.ceil((layers + int(s.get("parallelism.pipeline_parallel_first_stage_less_layers", 1))
                                    + int(s.get("parallelism.pipeline_parallel_last_stage_less_layers", 1)))
                                   / int(lps))
            if num_stages % p:
                problems.append(Problem(
                    "refused", "error", config.setting("parallelism.pipeline_parallel_layers_per_stage"),
                    f"{num_stages} stages is not divisible by pipeline_parallel_degree {p}; torchtitan refuses it",
                    "choose layers per stage giving a multiple of the pipeline degree"))
            elif single and num_stages // p != 1:
                problems.append(Problem(
                    "refused", "error", config.setting("parallelism.pipeline_parallel_layers_per_stage"),
                    f"{num_stages} stages on {p} ranks, but {s.get('parallelism.pipeline_parallel_schedule')} "
                    f"runs one stage per rank; torchtitan refuses it", "use a looped schedule or fewer stages"))
            elif not single and num_stages // p < 2:
                problems.append(Problem(
                    "refused", "error", config.setting("parallelism.pipeline_parallel_layers_per_stage"),
                    f"a looped schedule needs at least 2 stages per rank, got {num_stages // p}; torchtitan "
                    f"refuses it", "lower pipeline_parallel_layers_per_stage"))
        else:
            num_stages = p * (1 if single else 2)
        try:
            raw_parts = llm_fqns_per_stage(num_stages, layers,
                                           int(s.get("parallelism.pipeline_parallel_first_stage_less_layers", 1)),
                                           int(s.get("parallelism.pipeline_parallel_last_stage_less_layers", 1)))
        except ValueError as exc:
            problems.append(Problem("refused", "error", "parallelism.pipeline_parallel_degree",
                                    f"torchtitan cannot generate the stages: {exc}", "use fewer stages"))
            return Layout((), tuple(model_units), tuple(problems))
    if len(raw_parts) % p:
        problems.append(Problem(
            "refused", "error", "parallelism.module_fqns_per_model_part",
            f"{len(raw_parts)} model parts is not a multiple of pipeline_parallel_degree {p}",
            f"give {p} x v parts"))
        return Layout((), tuple(model_units), tuple(problems))
    known = set(model_units)
    unknown = sorted({n for part in raw_parts for n in part if n not in known})
    if unknown:
        problems.append(Problem(
            "unknown-unit", "error", "parallelism.module_fqns_per_model_part",
            f"{len(unknown)} names are not modules of the model ({', '.join(unknown[:4])}"
            f"{', ...' if len(unknown) > 4 else ''}); torchtitan silently ignores them",
            f"use the model's names ({', '.join(model_units[:2])}, ..., {model_units[-1]})"))
    placement = _placement(config.schedule, p, len(raw_parts))
    stages = []
    for index, part in enumerate(raw_parts):
        names = tuple(n for n in part if n in known)
        stages.append(LayoutStage(index, placement[index], index // p, names))
    return Layout(tuple(stages), tuple(model_units), tuple(problems))

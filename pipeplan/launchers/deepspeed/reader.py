"""DeepSpeed: a ds_config JSON plus the PipelineModule's partition, and the stage each layer lands on.

The batch keys follow DeepSpeed's rule ``train_batch_size == train_micro_batch_size_per_gpu x
gradient_accumulation_steps x data-parallel size`` (any two give the third). The PipelineModule
arguments live in the user's Python, so doctor takes them as options: ``num_stages``,
``partition_method`` (``uniform``, ``parameters`` (DeepSpeed's default), ``type:<regex>``) or
explicit ``parts`` (S + 1 boundaries, as a subclass sets ``self.parts``), and
``activation_checkpoint_interval``. The partition is computed by DeepSpeed's own
``partition_uniform`` / ``partition_balanced`` where DeepSpeed imports, else by the restatement
here (tests check that they agree). Units are the indices of the PipelineModule's layer list,
which must be the profile's layers in order.
"""

from __future__ import annotations

import re

from pipeplan.launchers.config import LauncherConfig, Layout, LayoutStage, Problem
from pipeplan.errors import BadInputError
from pipeplan.formats.reading import check_integer_digits, parse_json_text

__all__ = ["parse_deepspeed", "deepspeed_layout_of", "partition_uniform", "partition_balanced"]

_INT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``ds_utils.partition_uniform``, restated.

    Examples
    --------
    >>> partition_uniform(10, 4)
    [0, 3, 6, 8, 10]
    >>> partition_uniform(2, 4)
    [0, 1, 2, 2, 2]
    """
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [i * chunk for i in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``ds_utils.partition_balanced`` (the min max-minus-min DP), restated.

    Examples
    --------
    >>> partition_balanced([1, 1, 1, 1], 2)
    [0, 2, 4]
    """
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    dp_max[0][0] = 0
    dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                max_sum = max(dp_max[k][j - 1], prefix[i] - prefix[k])
                min_sum = min(dp_min[k][j - 1], prefix[i] - prefix[k])
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][i])
    parts.reverse()
    return parts


def _deepspeed_partitioners():
    """DeepSpeed's own partition functions where it imports, else the restatements."""
    import contextlib
    import io

    try:
        # DeepSpeed logs its accelerator choice to stdout at import; doctor's stdout is its report.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.utils import partition_balanced as balanced, partition_uniform as uniform
        return uniform, balanced, "deepspeed.runtime.utils"
    except Exception:  # not installed, or it fails to import (no accelerator)
        return partition_uniform, partition_balanced, "pipeplan's restatement"


def _from_export(export: dict, parts, interval, ep_size: int, tensor_degree: int, num_stages):
    """pipeplan's own DeepSpeed export: its ds_config, and the PipelineModule arguments, expert
    and tensor degrees written beside it (options given on the command line win)."""
    if parts is None and num_stages is None and isinstance(export.get("parts"), list):
        parts = [int(x) for x in export["parts"] if isinstance(x, int)]
    if interval is None:
        written = (export.get("pipeline_module") or {}).get("activation_checkpoint_interval")
        interval = written if isinstance(written, int) else None
    if ep_size == 1 and isinstance(export.get("moe"), dict) and isinstance(export["moe"].get("ep_size"), int):
        ep_size = export["moe"]["ep_size"]
    if tensor_degree == 1 and isinstance((export.get("topology") or {}).get("num_mp"), int):
        tensor_degree = export["topology"]["num_mp"]
    return dict(export["ds_config"]), parts, interval, ep_size, tensor_degree


def parse_deepspeed(path: str, text: str, *, num_stages: int | None = None, partition_method: str | None = None,
                    parts: list[int] | None = None, activation_checkpoint_interval: int | None = None,
                    world_size: int | None = None, tensor_degree: int = 1, ep_size: int = 1) -> LauncherConfig:
    """Read a ds_config and the PipelineModule arguments.

    Parameters
    ----------
    path, text : str
        The ds_config JSON.
    num_stages : int, optional
        ``PipelineModule(num_stages=...)``; default ``len(parts) - 1``, else ds_config
        ``pipeline.stages`` when it is a number.
    partition_method : str, optional
        ``uniform``, ``parameters`` (DeepSpeed's default) or ``type:<regex>``.
    parts : list of int, optional
        Explicit stage boundaries; they win over ``partition_method``.
    activation_checkpoint_interval : int, optional
        ``PipelineModule(activation_checkpoint_interval=...)``; default ds_config
        ``pipeline.activation_checkpoint_interval``, else 0.
    world_size : int, optional
        GPUs in the job, for the data-parallel size.
    ep_size : int
        DeepSpeed-MoE's ``MoE(ep_size=...)`` (in the model code, like the PipelineModule's
        arguments: the ds_config has no expert-parallel key); 1 without expert parallelism.

    Raises
    ------
    BadInputError
        Invalid JSON, a batch key that is not a positive integer, an unknown partition method, or
        no stage count.
    """
    check_integer_digits(text, path)
    data = parse_json_text(text, path)
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: a ds_config is a JSON object, not {type(data).__name__}")
    if isinstance(data.get("pipeplan"), dict) and isinstance(data.get("ds_config"), dict):
        data, parts, activation_checkpoint_interval, ep_size, tensor_degree = _from_export(
            data, parts, activation_checkpoint_interval, ep_size, tensor_degree,
            num_stages)
    # DeepSpeed reads a null batch key as not set (its config getters default on None).
    data = {k: v for k, v in data.items() if not (k in _INT_KEYS and v is None)}
    for key in _INT_KEYS:
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            if value == "auto":
                raise BadInputError(f"{path}: {key}: 'auto' is filled in by the HF Trainer integration; "
                                    f"give the number DeepSpeed will use")
            raise BadInputError(f"{path}: {key}: {value!r} must be a positive integer")
    pipeline = data.get("pipeline", {})
    if not isinstance(pipeline, dict):
        raise BadInputError(f"{path}: pipeline: must be an object")
    if parts is not None:
        if len(parts) < 2 or parts[0] != 0 or any(b < a for a, b in zip(parts, parts[1:])):
            raise BadInputError(f"--parts: {parts} must start at 0 and not decrease (S + 1 boundaries)")
        if num_stages is not None and num_stages != len(parts) - 1:
            raise BadInputError(f"--parts: {len(parts) - 1} stages but --num-stages {num_stages}")
        num_stages = len(parts) - 1
    if num_stages is None and isinstance(pipeline.get("stages"), int):
        num_stages = pipeline["stages"]
    if num_stages is None or num_stages < 1:
        raise BadInputError(f"{path}: give the PipelineModule's stage count (--num-stages or --parts)")
    method = partition_method or "parameters"
    if parts is None and not (method in ("uniform", "parameters") or method.startswith("type:")):
        raise BadInputError(f"--partition-method: {method!r} is not one of uniform, parameters, type:<regex> "
                            f"(DeepSpeed raises NotImplementedError for others)")
    if parts is None and method.startswith("type:"):
        try:
            re.compile(method.split(":", 1)[1], re.IGNORECASE)
        except re.error as exc:
            raise BadInputError(f"--partition-method: {method!r}: not a regular expression ({exc})") from None
    interval = activation_checkpoint_interval
    if interval is None:
        interval = pipeline.get("activation_checkpoint_interval", 0)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise BadInputError(f"{path}: pipeline.activation_checkpoint_interval: {interval!r} must be an "
                                f"integer >= 0")
    micro = data.get("train_micro_batch_size_per_gpu")
    gas = data.get("gradient_accumulation_steps")
    total = data.get("train_batch_size")
    p, t = num_stages, tensor_degree
    d = world_size // (p * t) if world_size and world_size % (p * t) == 0 else None
    if d is None and total and micro and gas and total % (micro * gas) == 0:
        d = total // (micro * gas)
    if micro is None and total and gas and d:
        micro = total // (gas * d)
    if gas is None and total and micro and d:
        gas = total // (micro * d)
    if gas is None:
        gas = 1
    if micro is None:
        raise BadInputError(f"{path}: train_micro_batch_size_per_gpu: not set and not derivable from "
                            f"train_batch_size / (gradient_accumulation_steps x data-parallel size)")
    zero = data.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise BadInputError(f"{path}: zero_optimization.stage: {stage!r} is not one of 0, 1, 2, 3")
    settings = {key: str(data[key]) for key in _INT_KEYS if key in data}
    settings["num_stages"] = str(num_stages)
    settings["partition_method"] = "parts" if parts is not None else method
    if parts is not None:
        settings["parts"] = ",".join(map(str, parts))
    settings["activation_checkpoint_interval"] = str(interval)
    if world_size:
        settings["world size"] = str(world_size)
    if ep_size < 1:
        raise BadInputError(f"--ep-size: {ep_size} must be at least 1 (DeepSpeed-MoE's MoE(ep_size=...))")
    if ep_size > 1:
        settings["ep_size"] = str(ep_size)
    if isinstance(zero, dict) and "stage" in zero:
        settings["zero_optimization.stage"] = str(stage)
    overlap = deepspeed_overlap(path, zero if isinstance(zero, dict) else {}, stage, p, settings)
    return LauncherConfig(
        launcher="deepspeed", path=path, pipeline_degree=p, virtual_stages=1, schedule="1f1b",
        microbatch_size=micro, num_microbatches=gas, tensor_degree=t, data_degree=d, expert_degree=ep_size,
        recompute="full" if interval else "none", sharded_optimizer=bool(stage),
        zero_stage=stage, settings=settings, overlap=overlap,
    )


def deepspeed_overlap(path: str, zero: dict, stage: int, pipeline: int, settings: dict) -> tuple[str, ...]:
    """What a DeepSpeed config overlaps (pipeplan.cluster.overlap): ``zero_optimization.overlap_comm``
    (default true at stage 3 only: ``deepspeed/runtime/zero/config.py``, ``overlap_comm_valid``) is
    the gradient reduce behind the backward, ``stage3_prefetch_bucket_size`` above 0 (default 5e7) the
    stage-3 prefetch; with a pipeline (its PipelineEngine reduces after the last backward) or at
    ZeRO 0, nothing."""
    for key in ("overlap_comm", "stage3_prefetch_bucket_size"):
        if key in zero:
            settings[f"zero_optimization.{key}"] = str(zero[key])
    overlap_comm = zero.get("overlap_comm", stage == 3)
    if not isinstance(overlap_comm, bool):
        raise BadInputError(f"{path}: zero_optimization.overlap_comm: {overlap_comm!r} is not true or false")
    prefetch = zero.get("stage3_prefetch_bucket_size", 5e7)
    if isinstance(prefetch, bool) or not isinstance(prefetch, (int, float)):
        raise BadInputError(f"{path}: zero_optimization.stage3_prefetch_bucket_size: {prefetch!r} is not a number")
    if pipeline > 1 or stage == 0:
        return ()
    return tuple(name for name, on in (("grad-reduce", overlap_comm), ("param-gather", stage == 3 and prefetch > 0))
                 if on)


def deepspeed_layout_of(config: LauncherConfig, layer_names: list[str], param_counts: list[int],
                        layer_types: list[str]) -> Layout:
    """The layers each stage gets, by DeepSpeed's partition rules.

    Parameters
    ----------
    config : LauncherConfig
    layer_names : list of str
        The PipelineModule's layers (the profile's, in order).
    param_counts : list of int
        Trainable parameters per layer (for ``parameters``).
    layer_types : list of str
        What ``type:<regex>`` is matched against, per layer.
    """
    s, p, n = config.settings, config.pipeline_degree, len(layer_names)
    units = [str(i) for i in range(n)]
    problems = []
    uniform, balanced, _ = _deepspeed_partitioners()
    method = s["partition_method"]
    if method == "parts":
        parts = [int(x) for x in s["parts"].split(",")]
        if parts[-1] > n:
            problems.append(Problem("refused", "error", f"parts {s['parts']}",
                                    f"the last boundary {parts[-1]} is past the {n} layers; DeepSpeed's "
                                    f"stage {p - 1} would index past the layer list", f"end parts at {n}"))
            parts = [min(b, n) for b in parts]
    elif method == "uniform":
        parts = list(uniform(num_items=n, num_parts=p))
    elif method == "parameters":
        parts = list(balanced(weights=param_counts, num_parts=p))
    else:
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        binary = [1 if pattern.search(kind) else 0 for kind in layer_types]
        if not any(binary):
            problems.append(Problem("refused", "error", f"partition_method {method}",
                                    f"no layer matches {method.split(':', 1)[1]!r}; DeepSpeed raises "
                                    f"'found no valid layers to partition'", "match the blocks' class name"))
            return Layout((), tuple(units), tuple(problems))
        parts = list(balanced(weights=binary, num_parts=p))
    parts = [int(b) for b in parts]
    stages = tuple(LayoutStage(i, i, 0, tuple(units[parts[i]:parts[i + 1]])) for i in range(p))
    return Layout(stages, tuple(units), tuple(problems))

"""``profile_model``: measure a model per unit and micro-batch size into a :class:`Profile`."""

from __future__ import annotations

import os
import platform
import time
from contextlib import nullcontext
from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError
from pipeplan.formats.profile import Device, Layer, LayerCost, Profile, TiedWeight
from pipeplan.profile.allocator import keep_freed_memory
from pipeplan import __version__
from pipeplan.formats.io import write_json_atomic
from pipeplan.profile.tracing import active_dropout

__all__ = ["profile_model", "profile_to_file", "parse_microbatch_sizes", "summary_table",
           "forward_failure"]


def parse_microbatch_sizes(text: str | Sequence[int]) -> list[int]:
    """``'1,2,4'`` to ``[1, 2, 4]`` (sorted, checked).

    Examples
    --------
    >>> parse_microbatch_sizes("4,1,2")
    [1, 2, 4]
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    sizes = []
    for item in items:
        try:
            size = int(str(item).strip())
        except ValueError:
            raise BadInputError(
                f"--microbatch-sizes: {item!r} is not an integer; write e.g. 1,2,4"
            ) from None
        if size <= 0:
            raise BadInputError(f"--microbatch-sizes: {size} must be positive")
        sizes.append(size)
    if not sizes:
        raise BadInputError("--microbatch-sizes: give at least one size, e.g. 1,2,4")
    if len(set(sizes)) != len(sizes):
        raise BadInputError(f"--microbatch-sizes: {sorted(sizes)} repeats a size")
    return sorted(sizes)


def _load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def _device_info(device: Any) -> tuple[Device, dict[str, Any]]:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Device(name=props.name, memory_bytes=int(props.total_memory)), {
            "cuda_version": torch.version.cuda,
            "cpu": _cpu_name(),
        }
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return Device(name=f"cpu ({_cpu_name()}, {os.cpu_count()} cores)", memory_bytes=memory), {
        "cpu": _cpu_name(),
    }


def _r(value: float) -> float:
    return round(float(value), 4)


def forward_failure(exc: Exception, microbatch_size: int, seq_len: Optional[int], what: str) -> BadInputError:
    from pipeplan.profile.memory import is_out_of_memory

    if is_out_of_memory(exc):
        return BadInputError(
            f"{what} does not fit in memory at micro-batch size {microbatch_size}"
            f"{f' and sequence length {seq_len}' if seq_len else ''}; drop that size from "
            f"--microbatch-sizes or lower --seq-len"
        )
    from pipeplan.profile.measure import exception_line

    return BadInputError(
        f"{what} failed at micro-batch size {microbatch_size}"
        f"{f', sequence length {seq_len}' if seq_len else ''}: {exception_line(exc)}; check that the "
        f"inputs fit the model (--seq-len, the batch factory or input spec; --debug shows the cause)"
    )


def profile_model(
    model: str,
    *,
    microbatch_sizes: Sequence[int] | str = (1, 2, 4),
    seq_len: Optional[int] = 128,
    dtype: str = "fp32",
    device: Optional[str] = None,
    repeats: int = 5,
    warmup: int = 2,
    threads: Optional[int] = None,
    units: Optional[Sequence[str]] = None,
    seed: int = 0,
    options: Optional[dict[str, Any]] = None,
    split_backward: bool = True,
    whole_model_check: bool = True,
    progress: bool = False,
) -> Profile:
    """Measure ``model`` per unit at each micro-batch size.

    Parameters
    ----------
    model : str
        Built-in name (``gpt2-tiny``, ``gpt2``, ``llama-tiny``, ``bert-tiny``, ``convnet-tiny``,
        ...) or ``module:callable`` (see docs/profiling.md).
    microbatch_sizes : sequence of int or str
        Samples per micro-batch, e.g. ``[1, 2, 4]`` or ``"1,2,4"``.
    seq_len : int, optional
        Tokens per sample for language models (ignored by the convnet).
    dtype : {'fp32', 'bf16', 'fp16'}
        Training dtype of parameters and floating inputs.
    device : {'cuda', 'cpu'}, optional
        Default: cuda when available.
    repeats, warmup : int
        Timed and untimed iterations per unit and size; times are medians of the repeats.
    threads : int, optional
        ``torch.set_num_threads`` during the measurement. Default: 1 on CPU (one pipeline rank
        per core, as ``pipeplan run`` starts them), torch's own setting on CUDA. Profile with the
        threads each rank will have: two threads on a busy 2-core machine make timings erratic.
    units : sequence of str, optional
        Dotted names or globs of the units (``['encoder.layer.*']``); default: the model's own
        units (built-ins) or the children of the top-level module.
    seed : int
        Weight and batch seed.
    options : dict, optional
        Size options of the model: ``layers``, ``hidden``, ``heads``, ``vocab``, ...
    split_backward : bool
        Measure the input-gradient part of backward apart (``backward_input_ms``).
    whole_model_check : bool
        Time a full forward+backward per size and record it beside the sum of the units.
    progress : bool
        Show a rich progress bar on stderr.

    Returns
    -------
    Profile
        ``source='measured'``; the ``measurement`` field says how, with the whole-model check.

    Raises
    ------
    BadInputError
        Unknown model, unit or option; a model or factory that raises; an input that does not
        fit (out of memory, sequence too long); ``--device cuda`` without CUDA.

    Notes
    -----
    Time is about ``(warmup + repeats) * 3.5`` steps of the model per micro-batch size, plus
    ``warmup + repeats`` steps for the whole-model check.

    Examples
    --------
    >>> prof = profile_model("gpt2-tiny", microbatch_sizes=[1], seq_len=16, repeats=1, warmup=0,
    ...                      options={"layers": 1})
    >>> [layer.name for layer in prof.layers]
    ['embed', 'blocks.0', 'norm', 'head']
    """
    # Function length (about 280 lines): one measurement session. The built model, the device and its
    # allocator state, the timers and the progress display are shared by every step (build, each
    # size's unit timing, the whole-model check, the builder check, the profile's record), and the
    # steps are already the helpers of profile/measure.py, capture.py and memory.py; the session
    # as a class of its own is the next cut.
    started = time.perf_counter()
    sizes = parse_microbatch_sizes(microbatch_sizes)
    for name, value, low in (("--repeats", repeats, 1), ("--warmup", warmup, 0), ("--seed", seed, 0)):
        if not isinstance(value, int) or value < low:
            raise BadInputError(f"{name}: {value!r} must be an integer >= {low}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise BadInputError(f"--threads: {threads!r} must be a positive integer")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise BadInputError(f"--seq-len: {seq_len!r} must be a positive integer")

    import torch

    from pipeplan.profile.loading import load_bundle, make_microbatch
    from pipeplan.profile.capture import capture
    from pipeplan.profile.measure import UnitTimer, WholeModelTimer, timing_rounds
    from pipeplan.profile.memory import is_out_of_memory, parameter_storages
    from pipeplan.profile.models import torch_dtype_of
    from pipeplan.profile.units import default_units, select_units, trace_units

    torch_dtype = torch_dtype_of(dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise BadInputError(f"--device: {device!r} is not known; use cuda or cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise BadInputError("--device cuda: this torch sees no CUDA device; use --device cpu")
    torch_device = torch.device(device)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    load_before = _load_average()
    old_threads = torch.get_num_threads()
    if threads is None and torch_device.type == "cpu":
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    allocator_kept = torch_device.type == "cpu" and keep_freed_memory()
    try:
        bundle = load_bundle(model, seed=seed, device=torch_device, dtype=torch_dtype, **options)
        net = bundle.model
        if units:
            names = select_units(net, list(units))
        else:
            names = select_units(net, list(bundle.units)) if bundle.units else default_units(net)
        try:
            graph = trace_units(net, names)
        except BadInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - fx fails on many models; use the autograd graph
            graph = None
            from pipeplan.profile.measure import exception_line

            fx_error = exception_line(exc)
        else:
            fx_error = None
        uses_seq_len = bundle.config.get("family") in ("gpt2", "llama", "bert")
        exclude = parameter_storages(net)
        costs: dict[str, list[LayerCost]] = {}
        checks: list[dict[str, Any]] = []
        remeasured = 0
        split_fallbacks: dict[str, str] = {}
        order: Optional[list[str]] = None
        repeated: list[str] = []

        bar = _progress(progress)
        with bar if bar is not None else nullcontext():
            task = None
            for size in sizes:
                inputs, target = make_microbatch(bundle, size, seq_len, seed=seed + size,
                                                 device=torch_device, dtype=torch_dtype)
                seq = seq_len if uses_seq_len else None
                try:
                    seen = capture(net, names, inputs)
                except BadInputError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    raise forward_failure(exc, size, seq, "the model's forward") from exc
                if graph is None:
                    graph = seen.graph
                repeated = sorted(set(repeated) | set(seen.graph.repeated) | set(graph.repeated))
                if order is None:
                    order = list(seen.order)
                    if not order:
                        raise BadInputError(
                            "no unit ran in the model's forward; the units named "
                            f"({', '.join(names[:5])}) are not called: choose others with --units"
                        )
                    # The run's order is the execution order; fx agrees on every model traced so far.
                    graph.units = list(order)
                    rounds_per_size = warmup + repeats + (1 if whole_model_check else 0)
                    if bar is not None:
                        task = bar.add_task("profiling", total=len(sizes) * rounds_per_size)
                last = order[-1]
                loss_last = loss_whole = None
                if bundle.loss_fn is not None and target is not None:
                    loss_whole = (lambda out, t=target: bundle.loss_fn(out, t))
                    if graph.output == ("unit", last):
                        loss_last = loss_whole
                elif bundle.loss_in_output:
                    # The model's own loss (HF, from labels) is computed outside every unit: the
                    # whole-model check includes it, the last unit gets a random gradient.
                    from pipeplan.profile.loading import output_loss

                    loss_whole = output_loss
                # One forward+backward of every unit, then of the whole model, per round: a
                # burst of load elsewhere then lands on a round, which the medians drop, instead
                # of on a few units.
                current = "the whole model"
                if torch_device.type == "cuda":  # on CPU these calls raise or return 0
                    torch.cuda.reset_peak_memory_stats(torch_device)
                try:
                    whole = WholeModelTimer(net, inputs, device=torch_device, loss=loss_whole) \
                        if whole_model_check else None
                    if whole is not None:
                        if bar is not None:
                            bar.update(task, description=f"micro-batch {size}: warm-up")
                        whole.sample(record=False)  # also warms every unit's kernels
                        if bar is not None:
                            bar.advance(task)
                    timers = {}
                    for name in order:
                        current = name  # a unit that fails here is named, not the whole model
                        timers[name] = UnitTimer(
                            net.get_submodule(name), seen.calls[name], device=torch_device,
                            exclude=exclude, loss=loss_last if name == last else None,
                            split_backward=split_backward)
                    rounds = timing_rounds(warmup, repeats)
                    for number, (record, input_pass) in enumerate(rounds):
                        if bar is not None:
                            bar.update(task, description=f"micro-batch {size}: round {number + 1}/{len(rounds)}")
                        for name in order:
                            current = name
                            timers[name].sample(record, input_pass)
                        current = "the whole model"
                        if whole is not None:
                            whole.sample(record)
                        if bar is not None:
                            bar.advance(task)
                    noisy = [name for name in order if timers[name].noisy()]
                    for record, input_pass in timing_rounds(0, repeats) if noisy else []:
                        if bar is not None:
                            bar.update(task, description=f"micro-batch {size}: re-measuring {len(noisy)}")
                        for name in noisy:
                            current = name
                            timers[name].sample(record, input_pass)
                except BadInputError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    what = "the whole model" if current == "the whole model" else f"unit {current!r}"
                    raise forward_failure(exc, size, seq, what) from exc
                for name in noisy:
                    timers[name].remeasured = True
                remeasured += len(noisy)
                for name in order:
                    m = timers[name].result()
                    if m.split_fallback is not None:
                        split_fallbacks.setdefault(name, m.split_fallback)
                    backward = _r(m.backward_ms)
                    costs.setdefault(name, []).append(LayerCost(
                        microbatch_size=size,
                        forward_ms=_r(m.forward_ms),
                        backward_ms=backward,
                        activation_bytes=int(m.activation_bytes),
                        output_bytes=int(m.output_bytes),
                        backward_input_ms=None if m.backward_input_ms is None else _r(m.backward_input_ms),
                        backward_weight_ms=None if m.backward_weight_ms is None else _r(m.backward_weight_ms),
                        forward_spread=_r(m.forward_spread),
                        backward_spread=_r(m.backward_spread),
                    ))
                if whole is not None:
                    result = whole.result()
                    units_ms = sum(c.forward_ms + c.backward_ms for n in order for c in costs[n]
                                   if c.microbatch_size == size)
                    checks.append({
                        "microbatch_size": size,
                        "whole_model_step_ms": _r(result["step_ms"]),
                        "whole_model_forward_ms": _r(result["forward_ms"]),
                        "whole_model_backward_ms": _r(result["backward_ms"]),
                        "sum_of_units_ms": _r(units_ms),
                        "ratio": _r(units_ms / result["step_ms"]) if result["step_ms"] > 0 else None,
                        "whole_model_step_spread": _r(result["step_spread"]),
                    })
                    if torch_device.type == "cuda":
                        # Peak over this size's measurement; the whole model's step dominates it.
                        checks[-1]["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(torch_device))
                del inputs, target, seen, timers, whole
        assert order is not None and graph is not None
        from pipeplan.profile.tracing import check_builders

        example, _ = make_microbatch(bundle, sizes[0], seq_len, seed=seed, device=torch_device, dtype=torch_dtype)
        builders = check_builders(model, net, order, graph, example)
        del example
        dropout = active_dropout(net)
        device_model, device_extra = _device_info(torch_device)
        from pipeplan.profile.hf import hf_unit_kinds, is_hf_model

        # Built-ins name their units' roles; an hf: model's are read off its modules.
        kinds = bundle.kinds or (hf_unit_kinds(net, order) if is_hf_model(model) else {})
        layers = []
        counted: set[int] = set()  # tied weights: their bytes go to the first unit that uses them
        for name in order:
            module = net.get_submodule(name)
            own = {id(p): p for p in module.parameters() if id(p) not in counted}
            counted.update(own)
            param_bytes = sum(p.numel() * p.element_size() for p in own.values())
            params = sum(p.numel() for p in module.parameters())
            description = f"{type(module).__name__}, {params:,} parameters"
            if name == order[-1] and bundle.loss_fn is not None and graph.output == ("unit", name):
                description += ", measured with the loss"
            layers.append(Layer(
                name=name,
                param_bytes=int(param_bytes),
                costs=sorted(costs[name], key=lambda c: c.microbatch_size),
                kind=kinds.get(name),
                description=description,
            ))
        tied = _tied_weights(net, order)
        edges = [e for e in graph.edges if e[0] in order and e[1] in order]
        chain = list(zip(order, order[1:]))
        measurement: dict[str, Any] = {
            "tool": "pipeplan profile",
            "pipeplan_version": _version(),
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "device_type": torch_device.type,
            **device_extra,
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "allocator": ("glibc keeps freed memory (pipeplan.profile.allocator)" if allocator_kept
                          else "the C library's defaults"),
            "dtype": dtype,
            "repeats": repeats,
            "warmup": warmup,
            "seed": seed,
            "model_options": options,
            "model_config": {k: v for k, v in bundle.config.items()},
            "units_option": list(units) if units else None,
            "edges_method": graph.method,
            "fx_error": fx_error,
            "timing": ("median of the repeats; "
                       + ("CUDA events" if torch_device.type == "cuda" else "wall clock (CPU ops are synchronous)")
                       + "; each unit rerun alone on inputs captured from a full forward, backward "
                         "driven by a random output gradient (the last unit: by the loss)"),
            "activation_bytes_method": "unique storages saved by autograd (saved_tensors_hooks), "
                                       "parameters and buffers excluded",
            "backward_split": ("backward_input_ms, then backward_weight_ms: torch's stage_backward_input "
                               "and stage_backward_weight, timed apart as the zero-bubble schedules run "
                               "them; their sum exceeds backward_ms by what splitting costs")
            if split_backward else "off (--no-split-backward): whole backward only",
            "backward_split_fallback": {
                "units": split_fallbacks,
                "method": "torch's split backward failed on these units; backward_input_ms and "
                          "backward_weight_ms are each half the measured whole backward (estimated)",
            } if split_fallbacks else None,
            "remeasured_unit_sizes": remeasured,
            "unused_units": list(graph.unused),
            "repeated_units": {
                "units": list(repeated),
                "method": "modules without parameters that the forward calls more than once: not "
                          "units; their calls are code between units, run in the stage that needs them",
            } if repeated else None,
            "stage_builders": builders,
            "dropout": {
                "modules": dropout,
                "method": "dropout modules with p > 0 in training mode: run --verify refuses the model "
                          "(a pipeline and one process draw different masks)",
            } if dropout else None,
            "load_average_before": load_before,
            "load_average_after": _load_average(),
            "whole_model_check": checks,
            "elapsed_s": round(time.perf_counter() - started, 1),
        }
        measurement = {k: v for k, v in measurement.items() if v is not None}
        return Profile(
            schema_version=1,
            model=model,
            source="measured",
            device=device_model,
            dtype=dtype,
            sequence_length=seq_len if (uses_seq_len or _factory_uses_seq_len(bundle)) else None,
            layers=layers,
            edges=None if sorted(edges) == sorted(chain) else edges,
            measurement=measurement,
            tied_weights=tied or None,
        )
    except KeyboardInterrupt:
        raise
    except BadInputError:
        raise
    except Exception as exc:  # noqa: BLE001
        if is_out_of_memory(exc):
            raise BadInputError(
                f"{model} does not fit in memory; lower --microbatch-sizes or --seq-len, or use a smaller model"
            ) from None
        raise
    finally:
        torch.set_num_threads(old_threads)


def _tied_weights(net: Any, order: Sequence[str]) -> list[TiedWeight]:
    """Each parameter that several units use (tied weights), with those units in order."""
    from pipeplan.profile.units import tied_parameter_names

    ties = []
    for canonical, names in tied_parameter_names(net).items():
        holders = [u for u in order if any(n == u or n.startswith(u + ".") for n in names)]
        if len(holders) > 1:
            param = net.get_parameter(canonical)
            ties.append(TiedWeight(name=canonical, layers=holders,
                                   param_bytes=int(param.numel() * param.element_size())))
    return ties


def _factory_uses_seq_len(bundle: Any) -> bool:
    if bundle.make_batch is None or bundle.config.get("family"):
        return False
    from pipeplan.profile.loading import accepts_seq_len

    return accepts_seq_len(bundle.make_batch)


def _version() -> str:
    return __version__


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description:<36}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )


def profile_to_file(model: str, output: str, **kwargs: Any) -> Profile:
    """Profile ``model`` (see :func:`profile_model` for the keywords) and write ``output`` atomically.

    The file appears only once the whole profile is measured: an interrupt (Ctrl-C) or an error
    leaves no partial file, and an existing file stays as it was.
    """
    profile = profile_model(model, **kwargs)
    write_json_atomic(output, profile)
    return profile


def summary_table(profile: Profile) -> Any:
    """A rich table of the whole-model check: one row per micro-batch size."""
    from rich.table import Table

    table = Table(title=f"{profile.model}: {len(profile.layers)} units on {profile.device.name}")
    for column in ("micro-batch", "sum of units ms", "whole model ms", "ratio", "slowest unit"):
        table.add_column(column, justify="right" if column != "slowest unit" else "left")
    checks = {c["microbatch_size"]: c for c in (profile.measurement or {}).get("whole_model_check", [])}
    for size in profile.microbatch_sizes:
        slowest = max(profile.layers, key=lambda layer: layer.cost_at(size).forward_ms + layer.cost_at(size).backward_ms)
        units_ms = sum(layer.cost_at(size).forward_ms + layer.cost_at(size).backward_ms for layer in profile.layers)
        check = checks.get(size, {})
        whole = check.get("whole_model_step_ms")
        ratio = check.get("ratio")
        table.add_row(
            str(size),
            f"{units_ms:.1f}",
            f"{whole:.1f}" if whole is not None else "-",
            f"{ratio:.2f}" if ratio is not None else "-",
            slowest.name,
        )
    measurement = profile.measurement or {}
    notes = [f"threads {measurement.get('threads')}, load average {measurement.get('load_average_before')}"]
    off = [size for size, c in checks.items() if c.get("ratio") is not None and abs(c["ratio"] - 1) > 0.15]
    if off:
        notes.append(
            f"sum of units is off the whole model by over 15% at micro-batch {off}: "
            f"a busy machine? re-profile when it is quiet"
        )
    fallback = (measurement.get("backward_split_fallback") or {}).get("units") or {}
    if fallback:
        names = list(fallback)
        notes.append(
            f"torch's split backward failed on {len(names)} unit(s) ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}: {next(iter(fallback.values()))}); their B/W split "
            f"is estimated as half the whole backward each (measurement.backward_split_fallback)"
        )
    table.caption = "; ".join(notes)
    return table

"""The ``pipeplan`` command line: a thin layer over :mod:`pipeplan.api` and friends.

Each command calls one library function; :func:`handled` turns library errors into a one-line
message and an exit code (2 bad input, 3 infeasible); tracebacks only with ``--debug``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError

from pipeplan import cli_run
from pipeplan.cli_common import Group, echo, handled, rich_console, state, terminal_progress
from pipeplan.progress import reporting
from pipeplan.cluster.overlap import OVERLAPS
from pipeplan.cluster.presets import resolve_cluster
from pipeplan.errors import BadInputError
from pipeplan.formats.limits import MAX_TIMELINE_WIDTH, check_option_range
from pipeplan.quantities import parse_bandwidth, parse_bytes
from pipeplan.requests import ClusterRequest, PipelineRequest
from pipeplan.plan.recompute import parse_recompute_modules
from pipeplan.plan.torchtitan_ac import parse_selective_ac_option
from pipeplan.formats.io import load_plan, refuse_overwriting_input, write_text_atomic
from pipeplan.api import compare_splits, import_profile, make_profile, plan_profile, validate_file
from pipeplan.profile import summary_table
from pipeplan.analytic.tables import gpu_table
from pipeplan.show import comparison_table, plan_tables
from pipeplan.cluster.tables import cluster_table
from pipeplan.formats.schema import json_schema_text
from pipeplan.export import run_export
from pipeplan.doctor import run_doctor_command
from pipeplan.check.commands import run_check, run_diff
from pipeplan.show import simulation_from_plan
from pipeplan.analytic.tables import analytic_summary_table
from pipeplan.cluster.presets import PRESETS
from pipeplan.plan.timeline import render_timeline_text, write_timeline_image

app = typer.Typer(
    cls=Group,
    name="pipeplan",
    help="Exact, memory-aware pipeline-parallel planning: profile -> plan -> run / export / check.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
import_app = typer.Typer(help="Import another tool's profile into pipeplan's format.", no_args_is_help=True)
app.add_typer(import_app, name="import")

@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors (accepted anywhere).")):
    """Exact, memory-aware pipeline-parallel planning."""
    state["debug"] = state["debug"] or debug


def _request(kind, **fields):
    """A request model built from options, its errors named by the option (``--memory-cap``)."""
    try:
        return kind(**fields)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        option = "--" + "-".join(str(p) for p in first["loc"]).replace("_", "-")
        option = {"--memory-cap-bytes": "--memory-cap", "--bandwidth-bytes-per-s": "--bandwidth",
                  "--num-gpus": "--gpus", "--zero-stage": "--zero"}.get(option, option)
        message = f"{option}: {first['msg'].removeprefix('Value error, ')}"
        if first["type"] == "missing":
            message = f"{option}: missing"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise BadInputError(message) from None


def _plan_request(stages, global_batch, microbatch_size, memory_cap, optimizer, bandwidth, schedule,
                  virtual_stages, recompute, solver, action_overhead_ms=None, launcher=None, fp8_param_gather=None,
                  **cluster_options):
    """The request ``plan`` (and ``compare``) options make: a :class:`ClusterRequest` with
    ``--gpus``, else a :class:`PipelineRequest`."""
    if optimizer not in ("auto", "adam", "adam-fp32-grads", "sgd", "none"):
        raise BadInputError(f"--optimizer: {optimizer!r} is not one of auto, adam, adam-fp32-grads, sgd, none")
    if solver not in ("auto", "dp", "ilp"):
        raise BadInputError(f"--solver: {solver!r} is not one of auto, dp, ilp")
    if recompute not in ("auto", "none", "selective", "all"):
        raise BadInputError(f"--recompute: {recompute!r} is not one of auto, none, selective, all")
    if stages is None and cluster_options.get("num_gpus") is None:
        raise BadInputError("--stages: give the pipeline stages, or --gpus to search data x tensor x pipeline")
    common = dict(
        stages=stages,
        global_batch=global_batch,
        microbatch_size=microbatch_size,
        memory_cap_bytes=parse_bytes(memory_cap) if memory_cap is not None else None,
        optimizer=optimizer,
        schedule=schedule,
        virtual_stages=virtual_stages,
        recompute=recompute,
        solver=solver,
        action_overhead_ms=action_overhead_ms,
        launcher=launcher,
        **({"fp8_param_gather": True} if fp8_param_gather else {}),
    )
    cluster = _cluster_options(**cluster_options)
    if cluster:
        # The cluster's links replace --bandwidth (a ClusterRequest has none).
        return _request(ClusterRequest, **common, **cluster)
    bandwidth_value = parse_bandwidth(bandwidth)
    return _request(PipelineRequest, **common,
                    bandwidth_bytes_per_s=None if bandwidth_value == float("inf") else bandwidth_value)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise BadInputError(f"--layers-per-stage: {text!r} is not a list of whole numbers, e.g. 5,7,7,7") from None
    return counts


def _overlaps(text: str) -> list[str]:
    """``--overlap grad-reduce,param-gather`` (or ``none``) as the plan's list."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["none"]:
        return []
    for name in names:
        if name not in OVERLAPS:
            raise BadInputError(f"--overlap: {name!r} is not one of {', '.join(OVERLAPS)} (or none)")
    return sorted(set(names), key=OVERLAPS.index)


def _cluster_options(num_gpus=None, cluster=None, data_parallel=None, tensor_parallel=None, zero=None,
                     data_parallel_overlap=None, expert_parallel=None, expert_tensor_parallel=None,
                     expert_imbalance=None, compare=None, context_parallel=None, overlap=None, ddp_bucket_size=None):
    """The cluster options of ``pipeplan plan`` (docs/cluster-model.md); empty without --gpus."""
    if num_gpus is None:
        given = [name for name, value in (("--cluster", cluster), ("--data-parallel", data_parallel),
                                          ("--tensor-parallel", tensor_parallel), ("--zero", zero),
                                          ("--data-parallel-overlap", data_parallel_overlap),
                                          ("--overlap", overlap), ("--ddp-bucket-size", ddp_bucket_size),
                                          ("--expert-parallel", expert_parallel),
                                          ("--expert-tensor-parallel", expert_tensor_parallel),
                                          ("--expert-imbalance", expert_imbalance),
                                          ("--compare", compare or None),
                                          ("--context-parallel", context_parallel)) if value is not None]
        if given:
            raise BadInputError(f"{given[0]}: needs --gpus (the cluster's GPU count)")
        return {}
    if cluster is None:
        raise BadInputError("--gpus: give --cluster NAME or FILE too (pipeplan cluster lists the presets)")
    return {"num_gpus": num_gpus, "cluster": resolve_cluster(cluster), "data_parallel": data_parallel,
            "tensor_parallel": tensor_parallel, "zero_stage": zero, "data_parallel_overlap": data_parallel_overlap,
            **({"overlap": _overlaps(overlap)} if overlap is not None else {}),
            **({"ddp_bucket_size": ddp_bucket_size} if ddp_bucket_size is not None else {}),
            **{name: value for name, value in (("expert_parallel", expert_parallel),
                                               ("expert_tensor_parallel", expert_tensor_parallel),
                                               ("expert_imbalance", expert_imbalance),
                                               ("compare", list(compare or ()) or None),
                                               ("context_parallel", context_parallel)) if value is not None}}


_PROFILE_ARG = typer.Argument(..., help="Profile JSON file.", show_default=False)
_STAGES = typer.Option(..., "--stages", "-p", help="Pipeline stages (GPUs).", show_default=False)
_GLOBAL_BATCH = typer.Option(None, "--global-batch", "-g", help="Samples per iteration (default: 8 x the largest profiled micro-batch).")
_MICROBATCH = typer.Option(None, "--microbatch-size", "-b", help="Fix the micro-batch size instead of searching.")
_MEMORY_CAP = typer.Option(None, "--memory-cap", help="Per-GPU memory cap, e.g. 80GiB or 16e9.")
# Defaults come from the request models (one source; tests/test_layers.py checks every option).
_DEFAULT = {name: field.default for name, field in PipelineRequest.model_fields.items()}
_OPTIMIZER = typer.Option(_DEFAULT["optimizer"], "--optimizer", help="auto (adam-fp32-grads with --launcher megatron, else adam), adam (16 B/param), adam-fp32-grads (18, Megatron's), sgd (12) or none.")
_BANDWIDTH = typer.Option(f"{_DEFAULT['bandwidth_bytes_per_s'] / 1e9:g}GB/s", "--bandwidth", help="Point-to-point bandwidth, e.g. 25GB/s; inf ignores transfers.")
_SCHEDULE = typer.Option(_DEFAULT["schedule"], "--schedule", help="auto, gpipe, 1f1b, interleaved, zb, zbv or dualpipev.")
_VIRTUAL = typer.Option(None, "--virtual-stages", "-v", help="Stages per rank: interleaved 2 or more, zb 1 or more, zbv and dualpipev 2; default: search (to 4; interleaved to 8 where v divides the layers per rank).")
_RECOMPUTE = typer.Option(_DEFAULT["recompute"], "--recompute", help="Activation recomputation: auto, none, selective (the attention core; analytic profiles) or all.")
_SOLVER = typer.Option(_DEFAULT["solver"], "--solver", help="auto, dp (chain / ideal-lattice DP) or ilp (PuLP + HiGHS).")
_ACTION_OVERHEAD = typer.Option(
    None, "--action-overhead-ms",
    help="The schedule's own time per action on a rank (posting transfers, bookkeeping); `pipeplan run` "
         "measures it. Default: the profile's (from `pipeplan calibrate`), else 0.")


@import_app.command("pipedream")
@handled
def import_pipedream_cmd(
    path: Path = typer.Argument(..., help="PipeDream graph.txt file.", show_default=False),
    batch_size: int = typer.Option(..., "--batch-size", help="The batch the file was profiled at.", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Profile JSON to write.", show_default=False),
    model: Optional[str] = typer.Option(None, "--model", help="Model name (default: from the file name)."),
):
    """Import a PipeDream profile (graph.txt), keeping its layer DAG."""
    refuse_overwriting_input(output, path)
    profile = import_profile("pipedream", path, batch_size, output, model=model)
    edges = len(profile.edges or ())
    echo(f"wrote {output}: {profile.model}, {len(profile.layers)} layers, {edges} edges, micro-batch size {batch_size}")


@app.command()
@handled
def profile(
    model: str = typer.Argument(..., metavar="MODEL", help="Built-in (gpt2-tiny, gpt2, llama-tiny, bert-tiny, convnet-tiny, ...), module:callable, or hf:MODEL_TYPE (transformers, no weights: hf:gpt2, hf:llama, hf:bert, hf:vit, ...); with --analytic: a HF config.json or a shipped config (llama3-8b, ...).", show_default=False),
    microbatch_sizes: str = typer.Option("1,2,4", "--microbatch-sizes", help="Micro-batch sizes to measure, e.g. 1,2,4,8."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sample (language models); default 128, with --analytic the model's pre-training context."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default fp32; bf16 with --analytic): the parameters' and activations' type."),
    precision: Optional[str] = typer.Option(None, "--precision", help="With --analytic: how the GEMMs run, bf16 (default), fp8 (current scaling), mxfp8 or nvfp4 (docs/analytic.md, 'Precision')."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda or cpu (default: cuda when available)."),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs per unit and size (medians)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed runs first."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (default: 1 on CPU, one rank per core)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Blocks of a built-in (or passed to your callable)."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Hidden size / channels of a built-in."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads of a built-in."),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="Vocabulary size of a built-in LM."),
    units: Optional[list[str]] = typer.Option(None, "--units", help="Units by dotted name or glob, e.g. 'encoder.layer.*' (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Weight and batch seed."),
    config: Optional[Path] = typer.Option(None, "--config", help="hf: models: a transformers config.json to build from (the size options override it)."),
    split_backward: bool = typer.Option(True, "--split-backward/--no-split-backward", help="Time the backward's input and weight parts apart (zero-bubble schedules); off: whole backward only."),
    output: Path = typer.Option(..., "-o", "--output", help="Profile JSON to write (atomically).", show_default=False),
    analytic: bool = typer.Option(False, "--analytic", help="Estimate from a model config and a GPU spec instead of measuring (docs/analytic.md)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="With --analytic: a known GPU (pipeplan gpus), e.g. h100-sxm."),
    gpu_spec: Optional[Path] = typer.Option(None, "--gpu-spec", help="With --analytic: a GPU spec TOML file instead of --gpu."),
    tensor_parallel: str = typer.Option("1", "--tensor-parallel-degrees", "--tensor-parallel", help="With --analytic: the tensor-parallel degrees to estimate, e.g. 1,2,4,8 (1 always included; --tensor-parallel is the old name). Not plan's --tensor-parallel, which fixes one degree."),
    sequence_parallel: bool = typer.Option(True, "--sequence-parallel/--no-sequence-parallel", help="With --analytic: Megatron sequence parallelism above degree 1."),
    flash_attention: bool = typer.Option(True, "--flash-attention/--no-flash-attention", help="With --analytic: flash attention (no s^2 activations)."),
    efficiency: Optional[Path] = typer.Option(None, "--efficiency", help="With --analytic: an efficiency model file (what `pipeplan calibrate --runs` writes) instead of the defaults."),
):
    """Measure a torch model per unit (time, activation and output bytes) into a profile, or estimate one (--analytic)."""
    result = make_profile(
        model, output, analytic=analytic, microbatch_sizes=microbatch_sizes, seq_len=seq_len, dtype=dtype,
        gpu=gpu, gpu_spec=gpu_spec, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
        flash_attention=flash_attention, precision=precision, efficiency=efficiency, device=device, repeats=repeats, warmup=warmup, threads=threads,
        options={"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab}, units=units, seed=seed,
        config=config, split_backward=split_backward, progress=True)
    rich_console().print(analytic_summary_table(result) if analytic else summary_table(result))
    echo(f"wrote {output}")


@app.command()
@handled
def gpus():
    """The GPU specifications `profile --analytic --gpu NAME` knows (dense peaks, with sources)."""
    rich_console().print(gpu_table())


@app.command()
@handled
def plan(
    profile: Path = _PROFILE_ARG,
    stages: Optional[int] = typer.Option(None, "--stages", "-p", help="Pipeline stages (ranks); with --gpus: fix p instead of searching."),
    global_batch: Optional[int] = _GLOBAL_BATCH,
    microbatch_size: Optional[int] = _MICROBATCH,
    memory_cap: Optional[str] = _MEMORY_CAP,
    optimizer: str = _OPTIMIZER,
    bandwidth: str = _BANDWIDTH,
    schedule: str = _SCHEDULE,
    virtual_stages: Optional[int] = _VIRTUAL,
    recompute: str = _RECOMPUTE,
    solver: str = _SOLVER,
    action_overhead_ms: Optional[float] = _ACTION_OVERHEAD,
    launcher: Optional[str] = typer.Option(None, "--launcher", help="megatron, torchtitan or deepspeed: plan only schedules and micro-batch counts it runs."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Plan JSON to write."),
    record_time: bool = typer.Option(False, "--record-time", help="Record solver seconds in the plan (breaks byte-identical output)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Plan the whole cluster: search d x t x p = GPUS (needs --cluster)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="A preset (pipeplan cluster) or a cluster TOML file; its links replace --bandwidth."),
    data_parallel: Optional[int] = typer.Option(None, "--data-parallel", help="With --gpus: fix the data-parallel degree d."),
    tensor_parallel: Optional[int] = typer.Option(None, "--tensor-parallel", help="With --gpus: fix the tensor-parallel degree t."),
    zero: Optional[int] = typer.Option(None, "--zero", help="With --gpus: fix the ZeRO stage (0-3); default: search."),
    data_parallel_overlap: Optional[float] = typer.Option(None, "--data-parallel-overlap", help="With --gpus: a further share of the sync the modelled overlaps leave exposed, assumed hidden (default 0)."),
    overlap: Optional[str] = typer.Option(None, "--overlap", help="With --gpus: the communication overlapped with compute, e.g. grad-reduce,param-gather,tp-comm, or none; default: the --launcher's (docs/cluster-model.md)."),
    ddp_bucket_size: Optional[int] = typer.Option(None, "--ddp-bucket-size", help="With --gpus and grad-reduce: parameters per gradient bucket (Megatron's --ddp-bucket-size; default max(40M, 1M x d))."),
    layers_per_stage: Optional[str] = typer.Option(None, "--layers-per-stage", help="Fix the split: units per stage in profile order, e.g. 5,7,7,7 (virtual stages in order); needs a named --schedule."),
    expert_parallel: Optional[int] = typer.Option(None, "--expert-parallel", help="With --gpus, a mixture-of-experts profile: fix the expert-parallel degree E (E x ETP divides t x d; E divides the experts); default: search."),
    expert_tensor_parallel: Optional[int] = typer.Option(None, "--expert-tensor-parallel", help="With --gpus: the experts' tensor-parallel degree (divides t; default 1)."),
    expert_imbalance: Optional[float] = typer.Option(None, "--expert-imbalance", help="With --gpus: the busiest rank's routed tokens over the balanced share (>= 1; default 1)."),
    fp8_param_gather: Optional[bool] = typer.Option(None, "--fp8-param-gather", help="A profile made with --precision: keep the weights quantized (Megatron-LM's --fp8-param-gather; docs/cost-model.md)."),
    compare: Optional[list[str]] = typer.Option(None, "--compare", help="With --gpus (repeatable): also plan this layout in full and record it beside the winner, e.g. d=64,t=8,p=1 (optional zero=.., mbs=.., e=..)."),
    recompute_method: Optional[str] = typer.Option(None, "--recompute-method", help="With --launcher megatron: how full recomputation runs, Megatron's flag: uniform (with --recompute-num-layers 1, the default) or block (the first N blocks of each stage recompute)."),
    recompute_num_layers: Optional[int] = typer.Option(None, "--recompute-num-layers", help="N of --recompute-method (Megatron's flag)."),
    recompute_modules: Optional[str] = typer.Option(None, "--recompute-modules", help="What selective recomputation recomputes, Megatron's module names, e.g. layernorm,moe_act (core_attn, layernorm, mlp, moe_act, moe, shared_experts, mla_up_proj); default: the attention core."),
    context_parallel: Optional[int] = typer.Option(None, "--context-parallel", help="With --gpus: the context-parallel degree C (the sequence split over C GPUs; 2 C divides it; default 1)."),
    selective_ac_option: Optional[str] = typer.Option(None, "--selective-ac-option", help="With --launcher torchtitan: what selective recomputation is, torchtitan's selective_ac_option: op (per-op: every other matmul's and the attention's outputs saved; the default) or N (every N-th block checkpointed in full)."),
    cpu_offload_layers: Optional[int] = typer.Option(None, "--cpu-offload-layers", help="With --gpus and --launcher megatron: offload the first N transformer layers' activations to host memory (Megatron's --cpu-offloading --cpu-offloading-num-layers N; one pipeline rank, no recomputation)."),
):
    """Find the fastest pipeline plan that fits the memory cap (with --gpus: the whole cluster's)."""
    refuse_overwriting_input(output, profile)
    request = _plan_request(stages, global_batch, microbatch_size,
                            memory_cap, optimizer, bandwidth, schedule, virtual_stages, recompute, solver,
                            action_overhead_ms, launcher=launcher, num_gpus=gpus, cluster=cluster,
                            data_parallel=data_parallel, tensor_parallel=tensor_parallel, zero=zero,
                            data_parallel_overlap=data_parallel_overlap, expert_parallel=expert_parallel,
                            expert_tensor_parallel=expert_tensor_parallel, expert_imbalance=expert_imbalance,
                            fp8_param_gather=fp8_param_gather, compare=compare, context_parallel=context_parallel,
                            overlap=overlap, ddp_bucket_size=ddp_bucket_size)
    if layers_per_stage is not None:
        request = request.model_copy(update={"layers_per_stage": _counts(layers_per_stage)})
    if recompute_modules is not None:
        request = request.model_copy(update={"recompute_modules": parse_recompute_modules(recompute_modules)})
    if recompute_method is not None or recompute_num_layers is not None:
        if recompute_method not in (None, "uniform", "block"):
            raise BadInputError(f"--recompute-method: {recompute_method!r} is not one of uniform, block")
        check_option_range("--recompute-num-layers", recompute_num_layers, 1, 100_000)
        request = request.model_copy(update={"recompute_method": recompute_method,
                                             "recompute_num_layers": recompute_num_layers})
    if selective_ac_option is not None:
        request = request.model_copy(update={"selective_ac_option": parse_selective_ac_option(selective_ac_option)})
    if cpu_offload_layers is not None:
        check_option_range("--cpu-offload-layers", cpu_offload_layers, 1, 100_000)
        request = request.model_copy(update={"cpu_offload_layers": cpu_offload_layers})
    with reporting(terminal_progress(quiet)):
        result = plan_profile(profile, request, output, record_time=record_time)
    if not quiet:
        rich_console().print(plan_tables(result))
        if global_batch is None:  # a default that sets the whole plan's scale is said, not silent
            echo(f"note: no --global-batch: planned at {result.settings.global_batch} samples per iteration "
                       f"(8 x the largest profiled micro-batch); give --global-batch for your training's batch", err=True)
        if output:
            echo(f"wrote {output}")


@app.command()
@handled
def cluster(
    spec: Optional[str] = typer.Argument(None, metavar="[NAME|FILE]", help="A preset or a cluster TOML file to check and show."),
):
    """The cluster presets (or one spec): GPUs per node, memory, links; docs/cluster-model.md."""
    specs = list(PRESETS.values()) if spec is None else [resolve_cluster(spec)]
    rich_console().print(cluster_table(specs, "cluster presets" if spec is None else str(spec)))


@app.command()
@handled
def show(
    plan_file: Path = typer.Argument(..., metavar="PLAN", help="Plan JSON file.", show_default=False),
    timeline: bool = typer.Option(False, "--timeline", help="Draw the simulated timeline in the terminal."),
    timeline_out: Optional[Path] = typer.Option(None, "--timeline-out", help="Write the timeline (with memory per rank) to .svg or .png."),
    width: int = typer.Option(100, "--width", help="Timeline width in characters."),
):
    """Show a plan: stages, layers, times, memory, bubble."""
    refuse_overwriting_input(timeline_out, plan_file, option="--timeline-out")
    if timeline:
        check_option_range("--width", width, 10, MAX_TIMELINE_WIDTH)
    loaded = load_plan(plan_file)
    console = rich_console()
    console.print(plan_tables(loaded))
    if timeline or timeline_out:
        sim = simulation_from_plan(loaded)
        if timeline:
            console.print(render_timeline_text(sim, width))
        if timeline_out:
            write_timeline_image(sim, timeline_out)
            echo(f"wrote {timeline_out}")


@app.command()
@handled
def compare(
    profile: Path = _PROFILE_ARG,
    stages: int = _STAGES,
    global_batch: Optional[int] = _GLOBAL_BATCH,
    microbatch_size: Optional[int] = _MICROBATCH,
    memory_cap: Optional[str] = _MEMORY_CAP,
    optimizer: str = _OPTIMIZER,
    bandwidth: str = _BANDWIDTH,
    schedule: str = typer.Option("1f1b", "--schedule", help="gpipe or 1f1b."),
    solver: str = _SOLVER,
    action_overhead_ms: Optional[float] = _ACTION_OVERHEAD,
):
    """Compare the optimal plan with uniform, parameter-balanced and greedy splits."""
    request = _plan_request(stages, global_batch, microbatch_size,
                            memory_cap, optimizer, bandwidth, schedule, None, "none", solver, action_overhead_ms)
    with reporting(terminal_progress()):
        rows = compare_splits(profile, request)
    batch = f", global batch {rows[0].global_batch}" if rows else ""
    rich_console().print(comparison_table(rows, f"{profile}: {stages} stages{batch}",
                                      memory_cap_bytes=request.memory_cap_bytes))


@app.command()
@handled
def validate(path: Path = typer.Argument(..., metavar="FILE", help="Profile, plan, run report or runs JSON.", show_default=False)):
    """Check a profile, plan, run report or runs file and explain any problem."""
    echo(validate_file(path))


@app.command()
@handled
def schema(
    kind: str = typer.Argument(..., metavar="KIND", help="profile, plan, report (a run report) or runs (launcher runs for calibrate --runs).", show_default=False),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write to a file instead of stdout."),
):
    """Print the JSON Schema of the profile, plan, run report or runs format."""
    text = json_schema_text(kind)
    if output:
        write_text_atomic(output, text)
        echo(f"wrote {output}")
    else:
        echo(text, nl=False)


@app.command()
@handled
def export(
    plan_file: Path = typer.Argument(..., metavar="PLAN", help="Plan JSON file.", show_default=False),
    format: str = typer.Option(..., "--format", "-f", help="torchtitan, megatron, deepspeed or torch.", show_default=False),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="File to write (extra files beside it); default: print."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="The plan's profile: needed by megatron (layer roles), sha256-checked."),
    schedule_csv: bool = typer.Option(False, "--schedule-csv", help="torchtitan: also write the simulated per-rank action order as a CSV."),
):
    """Restate a plan for a launcher: torchtitan TOML, Megatron-LM flags, DeepSpeed parts, torch split points."""
    refuse_overwriting_input(output, plan_file, profile)
    text, written = run_export(plan_file, format, output=output, profile_path=profile, with_schedule_csv=schedule_csv)
    if not written:
        echo(text, nl=False)
    for path in written:
        echo(f"wrote {path}")


@app.command()
@handled
def doctor(
    launcher: str = typer.Argument(..., metavar="LAUNCHER", help="megatron, torchtitan or deepspeed.", show_default=False),
    config_file: Path = typer.Argument(..., metavar="CONFIG", help="Launch script / argument list, TOML job config, or ds_config JSON.", show_default=False),
    profile: Path = typer.Option(..., "--profile", help="The model's profile (layers with their kind).", show_default=False),
    memory_cap: Optional[str] = typer.Option(None, "--memory-cap", help="Per-GPU memory cap, e.g. 80GiB (default: the cluster's GPU memory, else the profile's device memory)."),
    optimizer: str = typer.Option("auto", "--optimizer", help="auto (adam-fp32-grads for Megatron-LM, else adam), adam (16 B/param), adam-fp32-grads (18), sgd (12) or none."),
    bandwidth: str = typer.Option("25GB/s", "--bandwidth", help="Without --cluster: point-to-point bandwidth, e.g. 25GB/s; inf ignores transfers."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Cluster preset (pipeplan cluster) or TOML file: cost the layout at its real d x t x p, ZeRO stage and sequence parallelism."),
    search_layouts: bool = typer.Option(True, "--search-layouts/--same-layout", help="With --cluster: also search every d x t x p of the same GPUs for the best plan (slower)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", "--gpus", help="GPUs in the job (default: what the config says)."),
    var: Optional[list[str]] = typer.Option(None, "--var", help="Megatron: NAME=VALUE for a variable the script reads but does not set; torchtitan: a command-line override SECTION.KEY=VALUE (repeatable)."),
    num_stages: Optional[int] = typer.Option(None, "--num-stages", help="DeepSpeed: PipelineModule num_stages."),
    partition_method: Optional[str] = typer.Option(None, "--partition-method", help="DeepSpeed: uniform, parameters (default) or type:REGEX."),
    parts: Optional[str] = typer.Option(None, "--parts", "--layers-per-part", help="DeepSpeed: stage boundaries, e.g. 0,20,40,60,83."),
    checkpoint_interval: Optional[int] = typer.Option(None, "--activation-checkpoint-interval", help="DeepSpeed: PipelineModule activation_checkpoint_interval."),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", help="DeepSpeed: the tensor-parallel size (Megatron-DeepSpeed's; the ds_config does not carry it)."),
    ep_size: int = typer.Option(1, "--ep-size", help="DeepSpeed: DeepSpeed-MoE's MoE(ep_size=...), the expert-parallel size (the ds_config does not carry it)."),
    fix: bool = typer.Option(False, "--fix", help="Write the same launcher's config with the best plan (needs -o)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Where --fix writes."),
    format: str = typer.Option("table", "--format", help="table, markdown or json."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Also write a JUnit XML report here."),
):
    """Read a launcher config, flag what is wrong (lost layers, refused schedules, memory), compare with the best plan; exit 1 on an error finding."""
    with reporting(terminal_progress(format == "json")):
        text, written, code = run_doctor_command(
            launcher, config_file, profile, memory_cap=memory_cap, optimizer=optimizer, bandwidth=bandwidth,
            cluster=cluster, search_layouts=search_layouts, world_size=world_size, tensor_degree=tensor_parallel,
            variables=var or [], num_stages=num_stages, partition_method=partition_method, parts=parts,
            checkpoint_interval=checkpoint_interval, ep_size=ep_size, fix_output=output if fix else None, fix=fix,
            output_format=format, junit=junit)
    echo(text, nl=False)
    for path in written:
        echo(f"wrote {path}")
    raise typer.Exit(code)


@app.command()
@handled
def check(
    profiles: Path = typer.Argument(..., metavar="PROFILES", help="Folder of profiles.", show_default=False),
    baseline: Path = typer.Option(..., "--baseline", help="Folder of baseline plans (<profile name>.plan.json).", show_default=False),
    tolerance: float = typer.Option(0.02, "--tolerance", help="Largest allowed relative throughput drop (0.02 = 2%)."),
    memory_cap: Optional[str] = typer.Option(None, "--memory-cap", help="Check against this cap instead of each baseline's, e.g. 40GiB."),
    format: str = typer.Option("table", "--format", help="table or markdown (for a pull-request comment)."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Also write a JUnit XML report here."),
    update: bool = typer.Option(False, "--update", help="Rewrite the baselines with the re-made plans."),
):
    """Re-plan each profile with its baseline's settings; exit 1 on a throughput drop or a cap overrun."""
    with reporting(terminal_progress()):
        report, text = run_check(profiles, baseline, tolerance=tolerance, memory_cap=memory_cap, format=format,
                                 junit_path=junit, update=update)
    echo(text, nl=False)
    raise typer.Exit(report.exit_code)


@app.command()
@handled
def diff(
    a: Path = typer.Argument(..., metavar="A", help="Plan or profile JSON.", show_default=False),
    b: Path = typer.Argument(..., metavar="B", help="Plan or profile JSON (same kind as A).", show_default=False),
    format: str = typer.Option("table", "--format", help="table or markdown."),
    settings_from: Optional[Path] = typer.Option(None, "--settings-from", help="Profiles: plan both with this plan file's settings."),
    stages: Optional[int] = typer.Option(None, "--stages", "-p", help="Profiles: plan both with this many stages."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", "-g", help="Profiles: samples per iteration."),
    memory_cap: Optional[str] = typer.Option(None, "--memory-cap", help="Profiles: per-GPU memory cap, e.g. 80GiB."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="Profiles: schedule to plan with."),
    microbatch_size: Optional[int] = typer.Option(None, "--microbatch-size", "-b", help="Profiles: compare costs at this micro-batch size."),
):
    """Two plans or two profiles side by side: moved layers, slower or bigger units, effect on the plan."""
    echo(run_diff(a, b, format=format, settings_from=settings_from, microbatch_size=microbatch_size,
                        stages=stages, global_batch=global_batch, memory_cap=memory_cap, schedule=schedule), nl=False)


# The commands that run a plan under torch live in their own module (it imports torch only when
# they run); registered here, on the one app.
app.command()(cli_run.run)
app.command()(cli_run.calibrate)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

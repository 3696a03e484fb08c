"""``pipeplan run``: start one process per pipeline rank under torchrun and collect the results.

:func:`run_plan` checks the plan and the model against each other, writes a config file for the
workers (:mod:`pipeplan.run.worker`), builds the torchrun command line
(:func:`torchrun_command`), runs it in its own process group with a bounded wall-clock limit,
and turns what the workers wrote into a run report (:mod:`pipeplan.run.report`).

Failure handling
----------------
- A rank that raises records its rank, exception and traceback, and exits non-zero; torchrun
  then stops the other ranks within about a second. :func:`run_plan` raises
  :class:`RunFailedError` naming the rank and the cause.
- A rank that dies without a word (killed, out of host memory) is named from torchrun's failure
  summary.
- A rank that hangs: the others wait at most ``timeout_s`` in any collective or point-to-point
  transfer (``init_process_group(timeout=...)``), then fail, and torchrun ends the job.
- A rank stopped (SIGSTOP) or stuck keeps its sockets open, so its peers time out rather than
  see the connection close: it is reported as "stopped answering (hung or stuck)", even though
  torchrun then SIGKILLs it. A stopped rank cannot take torchrun's SIGTERM, and torch 2.13's
  agent waits a fixed 30 s before its SIGKILL; the launcher continues such a rank
  (:func:`~pipeplan.run.supervise.wake_stopped_to_end`), so the job ends seconds after the
  timeout, not 30 s later.
- The whole job gets at most ``job_timeout_s``; on that limit, Ctrl-C, SIGTERM or SIGHUP to the
  launcher, or any exit, the launcher terminates the process group torchrun leads (SIGTERM,
  then SIGKILL) and removes the run's temporary folder, so no rank outlives it.
- Echoed output leaves out torchrun's own traceback and failure summary (its "Root Cause" can
  name the wrong rank); the error names the rank. ``pipeplan --debug run`` shows everything.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional, Sequence

from pipeplan.errors import BadInputError, PipeplanError
from pipeplan.formats.limits import check_option_range
from pipeplan.run.lifetime import LAUNCHER_PID_ENV, Watchdog
from pipeplan.run.supervise import (RunStoppedError, StopOnSignals, failure_message, pump_output, terminate_group,
                                    wait_for_job)
from pipeplan.facts.schedules import check_schedule
from pipeplan.run.report import build_report
from pipeplan.formats.io import (check_output_target, file_sha256, load_plan, load_profile, refuse_overwriting_input,
                                 write_text_atomic)
from pipeplan.run.verify import dropout_refusal

__all__ = [
    "RunFailedError",
    "RunStoppedError",
    "run_plan",
    "run_plans",
    "run_plan_file",
    "torchrun_command",
    "worker_config",
    "resolve_model",
    "check_parallelism",
]

#: Seconds a rank waits for a peer in any collective or transfer before it gives up.
DEFAULT_TIMEOUT_S = 45.0


class RunFailedError(PipeplanError):
    """The pipelined job failed: the message names the rank and the cause."""

    exit_code = 1


def resolve_model(plan: Any, *, profile: Any = None, model: Optional[str] = None,
                  model_options: Optional[dict[str, Any]] = None,
                  seq_len: Optional[int] = None) -> dict[str, Any]:
    """Which model the ranks build, with which options, units, dtype and sequence length.

    With a profile, the model and its size options come from the profile's measurement
    (:func:`pipeplan.profile.model_spec`); ``model`` may still name it (a ``module:callable``
    profiled under another name). Without one, ``model`` is required; for a built-in whose
    ``layers`` is not given, the layer count is read from the plan's ``blocks.<i>`` names.

    Raises
    ------
    BadInputError
        No model; a plan layer the profile does not have.

    Examples
    --------
    >>> from pipeplan.formats.plan import Plan
    >>> plan = Plan.model_validate({"schema_version": 1, "profile": {"model": "gpt2-tiny", "sha256": "0"},
    ...     "settings": {"stages": 1, "global_batch": 1}, "schedule": "gpipe", "microbatch_size": 1,
    ...     "num_microbatches": 1, "predicted": {"iteration_ms": 1, "bubble_fraction": 0,
    ...     "samples_per_second": 1, "bottleneck_stage": 0}, "solver": {"method": "dp-chain",
    ...     "optimal": True, "seconds": 0}, "stages": [{"index": 0, "rank": 0, "forward_ms": 1,
    ...     "backward_ms": 1, "send_bytes": 0, "peak_memory_bytes": 0,
    ...     "layers": ["embed", "blocks.0", "blocks.1", "norm", "head"]}]})
    >>> resolve_model(plan, model="gpt2-tiny")["model_options"]
    {'layers': 2}
    """
    options = {k: v for k, v in (model_options or {}).items() if v is not None}
    patterns = None
    dtype = "fp32"
    if profile is not None:
        from pipeplan.profile.units import model_spec

        name, profiled_options, patterns = model_spec(profile)
        model = model or name
        options = {**profiled_options, **options}
        dtype = profile.dtype
        seq_len = seq_len or profile.sequence_length
        known = {layer.name for layer in profile.layers}
        for stage in plan.stages:
            for layer in stage.layers:
                if layer not in known:
                    raise BadInputError(
                        f"plan stage {stage.index}: layer {layer!r} is not in the profile of "
                        f"{profile.model}; give the profile the plan was made from"
                    )
    if not model:
        raise BadInputError(
            "run: say which model to build: --model NAME (built-in or module:callable) or "
            "--profile PROFILE.json (the profile the plan was made from)"
        )
    if ":" not in model and "layers" not in options:
        blocks = [int(m.group(1)) for s in plan.stages for layer in s.layers
                  for m in [re.fullmatch(r"blocks\.(\d+)", layer)] if m]
        if blocks:
            options["layers"] = max(blocks) + 1
    return {"model": model, "model_options": options, "unit_patterns": patterns, "dtype": dtype,
            "seq_len": seq_len}


def worker_config(plans: Sequence[Any], *, model: str, out_dir: str | Path, steps: int,
                  model_options: Optional[dict[str, Any]] = None,
                  unit_patterns: Optional[Sequence[str]] = None, seq_len: Optional[int] = None,
                  dtype: str = "fp32", threads: Optional[int] = 1, seed: int = 0, lr: float = 1e-3,
                  device: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                  dump_grads: bool = False, alone_repeats: int = 2, verify: bool = False,
                  plan_models: Optional[Sequence[dict[str, Any]]] = None) -> dict[str, Any]:
    """The JSON config every rank reads (see :func:`pipeplan.run.worker.run_rank`).

    ``plan_models``: per plan, the ``model``, ``model_options``, ``unit_patterns``, ``seq_len``
    and ``dtype`` (:func:`resolve_model`) where the plans are of different models.
    """
    config = {
        "plans": [plan.model_dump(mode="json") for plan in plans],
        "model": model,
        "model_options": dict(model_options or {}),
        "unit_patterns": list(unit_patterns) if unit_patterns else None,
        "seq_len": seq_len,
        "dtype": dtype,
        "steps": steps,
        "threads": threads,
        "seed": seed,
        "lr": lr,
        "device": device,
        "timeout_s": timeout_s,
        "out_dir": str(out_dir),
        "dump_grads": dump_grads,
        "alone_repeats": alone_repeats,
        "verify": verify,
    }
    if plan_models is not None:
        config["plan_models"] = [dict(one) for one in plan_models]
    return config


def torchrun_command(config_path: str | Path, nproc_per_node: int, *, nnodes: int = 1,
                     node_rank: Optional[int] = None, rdzv_endpoint: Optional[str] = None,
                     rdzv_id: str = "pipeplan", python: Optional[str] = None) -> list[str]:
    """The torchrun command line that starts the workers.

    One node: ``--standalone`` (torchrun picks a free port on loopback). Several nodes: a c10d
    rendezvous at ``rdzv_endpoint``, every node given the same ``rdzv_id``.

    Examples
    --------
    >>> torchrun_command("c.json", 2, python="python")[3:]
    ['--standalone', '--nnodes', '1', '--nproc-per-node', '2', '--max-restarts', '0', '-m', 'pipeplan.run.worker', 'c.json']
    >>> cmd = torchrun_command("c.json", 1, nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29500", python="python")
    >>> " ".join(cmd[3:13])
    '--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 --rdzv-id pipeplan'
    """
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        if rdzv_endpoint is None:
            raise BadInputError(
                f"--nnodes {nnodes}: several nodes need --rdzv-endpoint HOST:PORT (the same on every node)"
            )
        cmd += ["--nnodes", str(nnodes)]
        if node_rank is not None:
            cmd += ["--node-rank", str(node_rank)]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    cmd += ["--nproc-per-node", str(nproc_per_node), "--max-restarts", "0"]
    # The config travels as one positional path: torchrun takes prefixes of its own options
    # (a script option --run would match --run-path).
    cmd += ["-m", "pipeplan.run.worker", str(config_path)]
    return cmd


def run_plan(plan: Any, **kwargs: Any) -> dict[str, Any]:
    """Run ``plan`` on torchrun and return the run report; see :func:`run_plans` for the keywords."""
    return run_plans([plan], **kwargs)[0]


def check_parallelism(plan: Any, where: str = "plan") -> int:
    """The plan's data-parallel degree ``d``, after refusing what ``run`` does not run.

    ``run`` runs ``d`` replicas of the pipeline (:mod:`pipeplan.run.gradsync`), with ZeRO 1 (the
    optimizer state sharded over the replicas: torch's ``ZeroRedundancyOptimizer``) or without.
    It refuses tensor parallelism (the stage builders build whole layers; torch's
    tensor-parallel API is not wired to them), expert parallelism (likewise) and ZeRO 2 and 3 (every replica keeps whole
    gradients and weights, so a run would not have the plan's memory): the exports hand those to
    a launcher.

    Raises
    ------
    BadInputError
        ``t > 1``, ``E > 1``, ``C > 1`` or ZeRO above 1, naming ``where`` (the plan file).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> check_parallelism(SimpleNamespace(parallelism=None))
    1
    >>> check_parallelism(SimpleNamespace(parallelism=SimpleNamespace(data=2, tensor=1, zero_stage=1)))
    2
    """
    par = getattr(plan, "parallelism", None)
    if par is None:
        return 1
    if par.tensor > 1:
        raise BadInputError(
            f"{where}: parallelism.tensor: t={par.tensor}: pipeplan run does not run tensor parallelism (its stage "
            f"builders build whole layers); train this plan with a launcher (pipeplan export {where} --format "
            f"megatron or torchtitan), or plan with --tensor-parallel 1 to run it here")
    if (getattr(par, "expert", None) or 1) > 1:
        raise BadInputError(
            f"{where}: parallelism.expert: E={par.expert}: pipeplan run does not run expert parallelism (every "
            f"rank would build all of each MoE layer's experts, so it would not run the plan's memory or its "
            f"all-to-alls); train this plan with a launcher (pipeplan export {where} --format megatron or "
            f"torchtitan), or plan with --expert-parallel 1 to run it here")
    if (getattr(par, "context", None) or 1) > 1:
        raise BadInputError(
            f"{where}: parallelism.context: C={par.context}: pipeplan run does not run context parallelism (every "
            f"rank would run whole sequences, without the KV ring); train this plan with a launcher (pipeplan "
            f"export {where} --format megatron or torchtitan), or plan without --context-parallel to run it here")
    if par.zero_stage >= 2:
        sharded = "gradients" if par.zero_stage == 2 else "gradients and weights"
        raise BadInputError(
            f"{where}: parallelism.zero_stage: ZeRO {par.zero_stage}: pipeplan run shards only the optimizer "
            f"state (ZeRO 1) and keeps whole {sharded} on every replica, so it would not run the plan's memory; "
            f"train it with a launcher (pipeplan export {where} --format deepspeed or megatron), or plan with "
            f"--zero 1 or --zero 0 to run it here")
    return int(par.data)


def _check_plan(plan: Any) -> int:
    """The plan's process count (``d x p``), after checking it can run as written."""
    data = check_parallelism(plan)
    num_ranks = 1 + max(s.rank for s in plan.stages)
    ranks_used = {s.rank for s in plan.stages}
    if ranks_used != set(range(num_ranks)):
        missing = sorted(set(range(num_ranks)) - ranks_used)
        raise BadInputError(f"plan: rank {missing[0]} has no stage; every rank 0..{num_ranks - 1} needs one")
    indexes = sorted(s.index for s in plan.stages)
    if indexes != list(range(len(plan.stages))):
        raise BadInputError(f"plan: stage indexes {indexes} must be 0..{len(plan.stages) - 1}, each once")
    check_schedule(plan.schedule, num_ranks, plan.num_microbatches, plan.virtual_stages)
    if len(plan.stages) != num_ranks * plan.virtual_stages:
        raise BadInputError(
            f"plan: {len(plan.stages)} stages for {num_ranks} ranks x {plan.virtual_stages} virtual stages; "
            f"give {num_ranks * plan.virtual_stages}"
        )
    return num_ranks * data


def _seconds(option: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1e7:
        raise BadInputError(f"--{option}: {value!r} must be a finite number of seconds above 0 (at most 1e7)")


def _check_run_options(*, timeout_s, job_timeout_s, nnodes, nproc_per_node, device, seq_len, lr, verify_tolerance,
                       alone_repeats, model_options) -> None:
    """Every option of ``run``, checked before anything starts (a NaN timeout never fired)."""
    _seconds("timeout", timeout_s)
    _seconds("job-timeout", job_timeout_s, optional=True)
    if not isinstance(nnodes, int) or nnodes < 1:
        raise BadInputError(f"--nnodes: {nnodes!r} must be >= 1")
    if nproc_per_node is not None and (not isinstance(nproc_per_node, int) or nproc_per_node < 1):
        raise BadInputError(f"--nproc-per-node: {nproc_per_node!r} must be a positive integer")
    if device not in (None, "cpu", "cuda"):
        raise BadInputError(f"--device: {device!r} is not known; use cpu or cuda")
    check_option_range("--seq-len", seq_len)
    for name, value in (model_options or {}).items():
        if f"--{name}" in ("--layers", "--hidden", "--heads", "--vocab") and value is not None:
            check_option_range(f"--{name}", value)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise BadInputError(f"--lr: {lr!r} must be a finite number >= 0")
    if verify_tolerance is not None and (not isinstance(verify_tolerance, (int, float)) or
                                         not math.isfinite(verify_tolerance) or verify_tolerance <= 0):
        raise BadInputError(f"--verify-tolerance: {verify_tolerance!r} must be a finite number above 0 "
                            f"(with NaN, --verify could never fail)")
    if not isinstance(alone_repeats, int) or alone_repeats < 0:
        raise BadInputError(f"--alone-repeats: {alone_repeats!r} must be an integer >= 0")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInputError("--device cuda: torch sees no CUDA device on this machine (torch "
                                f"{torch.__version__}); use --device cpu")


def run_plans(plans: Sequence[Any], *, model: Optional[str] = None, profile: Any = None,
             profile_path: Optional[str] = None, steps: int = 20, threads: Optional[int] = 1,
             seq_len: Optional[int] = None, model_options: Optional[dict[str, Any]] = None,
             seed: int = 0, lr: float = 1e-3, device: Optional[str] = None,
             nnodes: int = 1, node_rank: Optional[int] = None, rdzv_endpoint: Optional[str] = None,
             rdzv_id: str = "pipeplan", nproc_per_node: Optional[int] = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, job_timeout_s: Optional[float] = 3600.0,
             work_dir: Optional[str | Path] = None, dump_grads: bool = False, alone_repeats: int = 2,
             echo: bool = True, env: Optional[dict[str, str]] = None,
             raw_output: bool = False, verify: bool = False,
             verify_tolerance: Optional[float] = None) -> list[dict[str, Any]]:
    """Run each plan in turn in one torchrun job; return one run report per plan.

    Parameters
    ----------
    plans : sequence of Plan
        All with the same number of processes (``d x p``: data-parallel replicas times pipeline
        ranks; t = 1, ZeRO 0 or 1). One job saves torchrun's start-up (seconds) per plan.
    model : str, optional
        Built-in name or ``module:callable``; default: the profile's model.
    profile : Profile, optional
        The profile the plan was made from: gives the model's size options, units, dtype and
        sequence length, and lets the report add the simulator's prediction. A list gives one
        profile per plan: plans of different models then run in the one job (a benchmark or a
        test saves torchrun's start-up and the imports, ~20 s on 4 ranks of a 2-core CPU).
    profile_path : str, optional
        Recorded in the report, for ``pipeplan calibrate``.
    steps : int
        Training iterations (>= 2: the first is a warm-up the report leaves out).
    threads : int, optional
        ``torch.set_num_threads`` per rank on CPU (and ``OMP_NUM_THREADS``).
    seq_len : int, optional
        Tokens per sample (language models); default the profile's, else 128.
    model_options : dict, optional
        Size options (``layers``, ``hidden``, ...) when there is no profile.
    seed, lr : int, float
        Weight and batch seed; optimizer learning rate (the optimizer is the plan's).
    device : {'cpu', 'cuda'}, optional
        Default: cuda when torch sees one (NCCL), else cpu (gloo).
    nnodes, node_rank, rdzv_endpoint, rdzv_id : optional
        Several nodes: run the same command on each with its ``node_rank``; every node gives the
        same ``rdzv_endpoint`` (``HOST:PORT`` of node 0) and ``rdzv_id``.
    nproc_per_node : int, optional
        Ranks on this node; default ``ranks // nnodes``.
    timeout_s : float
        Seconds a rank waits for a peer before failing (bounds a hang).
    job_timeout_s : float, optional
        Wall-clock limit of the whole job; None for none.
    work_dir : path, optional
        Where the config and per-rank files go; default a temporary folder, removed afterwards.
    dump_grads : bool
        Save each rank's gradients after the first step, before the optimizer
        (``grads-plan<I>-rank<R>.pt`` in ``work_dir``).
    alone_repeats : int
        Timed passes each time the ranks re-time their stages alone (about every fifth step; see
        :mod:`pipeplan.run.report`, ``alone_ratio``); 0 skips it.
    echo : bool
        Copy the ranks' output to stderr as it comes (torchrun's own traceback and failure
        summary left out: the raised error names the failing rank).
    raw_output : bool
        Echo torchrun's output unfiltered (``pipeplan --debug run``).
    env : dict, optional
        Extra environment variables for the ranks.
    verify : bool
        Compare the first step with one process on the same batch (:mod:`pipeplan.run.verify`);
        the report's ``verify`` holds the per-stage figures and the verdict.
    verify_tolerance : float, optional
        Largest relative difference ``verify`` accepts; default by dtype (1e-4 in fp32).

    Returns
    -------
    list of dict
        The run reports (:func:`pipeplan.run.report.build_report`), in the order of ``plans``.

    Raises
    ------
    BadInputError
        Bad options, or a model/profile that does not match the plan.
    RunFailedError
        A rank failed, hung past ``timeout_s``, or the job passed ``job_timeout_s``; the message
        names the rank and the cause.
    RunStoppedError
        The launcher got SIGTERM or SIGHUP; torchrun's process group was ended and the temporary
        folder removed first.
    """
    # Function length (about 110 lines): the torchrun job's lifecycle in order (options checked,
    # config written, launch, the watchdog, collect, clean up); each phase shares the job's temp
    # folder and process handles.
    plans = list(plans)
    if not plans:
        raise BadInputError("run: no plan given")
    if not isinstance(steps, int) or steps < 2:
        raise BadInputError(f"--steps: {steps!r} must be an integer >= 2 (the first step is a warm-up)")
    if threads is not None and (not isinstance(threads, int) or not 1 <= threads <= 1024):
        raise BadInputError(f"--threads: {threads!r} must be an integer from 1 to 1024")
    _check_run_options(timeout_s=timeout_s, job_timeout_s=job_timeout_s, nnodes=nnodes, nproc_per_node=nproc_per_node,
                       device=device, seq_len=seq_len, lr=lr, verify_tolerance=verify_tolerance,
                       alone_repeats=alone_repeats, model_options=model_options)
    rank_counts = [_check_plan(plan) for plan in plans]
    if len(set(rank_counts)) != 1:
        raise BadInputError(f"run: the plans have {sorted(set(rank_counts))} ranks (d x p); one job runs plans of "
                            f"one size")
    num_ranks = rank_counts[0]
    if nproc_per_node is None:
        if num_ranks % nnodes:
            raise BadInputError(
                f"--nnodes {nnodes} does not divide the plan's {num_ranks} ranks; give --nproc-per-node"
            )
        nproc_per_node = num_ranks // nnodes
    if nproc_per_node * nnodes != num_ranks:
        raise BadInputError(f"--nproc-per-node {nproc_per_node} x --nnodes {nnodes} is not the plan's {num_ranks} "
                            f"ranks (d x p)")
    profiles = list(profile) if isinstance(profile, (list, tuple)) else [profile] * len(plans)
    if len(profiles) != len(plans):
        raise BadInputError(f"run: {len(plans)} plans but {len(profiles)} profiles; give one profile per plan")
    specs = [resolve_model(plan, profile=prof, model=model, model_options=model_options, seq_len=seq_len)
             for plan, prof in zip(plans, profiles)]
    for one in specs:
        if one["seq_len"] is None:
            one["seq_len"] = 128
    if verify:
        # Refused before any rank starts; the ranks check the model itself where no profile says.
        for one, prof in zip(specs, profiles):
            dropout = (getattr(prof, "measurement", None) or {}).get("dropout")
            if dropout:
                raise BadInputError(dropout_refusal(one["model"], dropout["modules"]))
    spec = specs[0]

    with StopOnSignals():
        cleanup = None
        if work_dir is None:
            cleanup = tempfile.TemporaryDirectory(prefix="pipeplan-run-")
            out_dir = Path(cleanup.name)
        # Started before anything it guards; it acts only if this process dies (lifetime.py).
        watchdog = Watchdog(out_dir if cleanup is not None else None)
        if cleanup is None:
            out_dir = Path(work_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            for stale in [*out_dir.glob("error-rank*.json"), *out_dir.glob("exit-rank*.json"),
                          *out_dir.glob("ranks.json")]:
                stale.unlink()
        try:
            config = worker_config(plans, model=spec["model"], out_dir=out_dir, steps=steps,
                                   model_options=spec["model_options"], unit_patterns=spec["unit_patterns"],
                                   seq_len=spec["seq_len"], dtype=spec["dtype"], threads=threads, seed=seed,
                                   lr=lr, device=device, timeout_s=timeout_s, dump_grads=dump_grads,
                                   alone_repeats=alone_repeats, verify=verify,
                                   plan_models=specs if any(one != spec for one in specs) else None)
            config_path = out_dir / "config.json"
            config_path.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
            cmd = torchrun_command(config_path, nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                                   rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
            child_env = dict(os.environ)
            if threads is not None:
                child_env["OMP_NUM_THREADS"] = str(threads)
            child_env.setdefault("PYTHONUNBUFFERED", "1")
            # A rank that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python stack.
            child_env.setdefault("PYTHONFAULTHANDLER", "1")
            child_env.update(env or {})
            child_env[LAUNCHER_PID_ENV] = str(os.getpid())
            load_before = _load_average()
            started = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env,
                                    start_new_session=True)
            watchdog.watch(proc.pid)
            tail: deque = deque(maxlen=200)
            pump = threading.Thread(target=pump_output, args=(proc.stdout, tail, echo, raw_output), daemon=True)
            pump.start()
            timed_out = None
            try:
                if not wait_for_job(proc, job_timeout_s, out_dir):
                    timed_out = job_timeout_s
            finally:
                # Whatever happened (normal end, limit, Ctrl-C), no rank outlives the launcher.
                terminate_group(proc)
                pump.join(timeout=5.0)
            elapsed_s = time.monotonic() - started
            result_path = out_dir / "ranks.json"
            if timed_out is not None or proc.returncode != 0 or not result_path.exists():
                raise RunFailedError(
                    "run: " + failure_message(out_dir, list(tail), proc.returncode, timed_out, num_ranks)
                )
            gathered = json.loads(result_path.read_text(encoding="utf-8"))  # [rank][plan]
            reports = [build_report(
                plan, [per_rank[index] for per_rank in gathered], profile=profiles[index], profile_path=profile_path,
                run={"model": specs[index]["model"], "model_options": specs[index]["model_options"],
                     "seq_len": specs[index]["seq_len"], "dtype": specs[index]["dtype"], "steps": steps, "threads": threads, "seed": seed, "lr": lr,
                     "nnodes": nnodes, "nproc_per_node": nproc_per_node, "timeout_s": timeout_s,
                     "wall_s": round(elapsed_s, 2), "load_average_before": load_before,
                     "load_average_after": _load_average(), "cpu_count": os.cpu_count()},
            ) for index, plan in enumerate(plans)]
            if verify:
                from pipeplan.run.verify import attach_verdict

                for index, report in enumerate(reports):
                    attach_verdict(report, [per_rank[index] for per_rank in gathered], specs[index]["dtype"],
                                   verify_tolerance)
            return reports
        finally:
            if cleanup is not None:
                cleanup.cleanup()
            watchdog.done()


def _load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def run_plan_file(plan_path: str | Path, *, report_path: Optional[str | Path] = None,
                  profile_path: Optional[str | Path] = None, **kwargs: Any) -> dict[str, Any]:
    """``pipeplan run``: load the plan (and profile), run it, write the report atomically.

    Keywords are those of :func:`run_plan`.
    """
    if report_path is not None:  # before the run, not after an hour of it
        check_output_target(report_path, "--report")
        refuse_overwriting_input(report_path, plan_path, profile_path, option="--report")
    plan = load_plan(plan_path)
    check_parallelism(plan, str(plan_path))
    profile = None
    if profile_path is not None:
        profile = load_profile(profile_path)
    report = run_plan(plan, profile=profile, profile_path=str(profile_path) if profile_path else None, **kwargs)
    report["plan_path"] = str(plan_path)
    if profile_path is None:
        report.setdefault("notes", []).append(
            "no --profile: the model's sizes come from its preset and the options given, which may differ "
            "from the profile the plan was made from; give --profile to run exactly that model"
        )
    else:
        sha = file_sha256(profile_path)
        report["profile_sha256"] = sha
        if sha != plan.profile.sha256:
            report.setdefault("notes", []).append(
                f"the plan was made from a profile with sha256 {plan.profile.sha256[:12]}..., not "
                f"{profile_path} ({sha[:12]}...): predictions may not match this model"
            )
    if report_path is not None:
        write_text_atomic(report_path, json.dumps(report, indent=2) + "\n")
    return report

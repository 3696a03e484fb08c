"""``pipeplan run`` and ``pipeplan calibrate``: the commands that run a plan and learn from the run.

They register on :data:`pipeplan.cli.app`, with the same error handling as every other command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeplan.cli_common import echo, handled, rich_console, state
from pipeplan.errors import BadInputError
from pipeplan.formats.io import refuse_overwriting_input
from pipeplan.run import report_table, run_plan_file
from pipeplan.run.verify import check_verdict, verdict_lines
from pipeplan.run.calibrate import calibrate_files, calibration_table
from pipeplan.analytic.calibrate import calibrate_analytic_files
from pipeplan.api import calibrate_runs
from pipeplan.show import runs_calibration_lines, runs_calibration_table

__all__ = ["run", "calibrate"]


@handled
def run(
    plan_file: Path = typer.Argument(..., metavar="PLAN", help="Plan JSON file.", show_default=False),
    model: Optional[str] = typer.Option(None, "--model", help="Built-in (gpt2-tiny, ...) or module:callable; default: the profile's."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="The profile the plan was made from (model size, units, dtype, seq-len; adds the simulator's prediction)."),
    steps: int = typer.Option(20, "--steps", help="Training iterations; the first is a warm-up the report leaves out."),
    threads: int = typer.Option(1, "--threads", help="torch threads per rank on CPU."),
    report: Optional[Path] = typer.Option(None, "--report", help="Run report JSON to write (for pipeplan calibrate)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sample (default: the profile's, else 128)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Blocks of a built-in, without --profile (default: read from the plan)."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Hidden size of a built-in, without --profile."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads of a built-in, without --profile."),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="Vocabulary of a built-in LM, without --profile."),
    seed: int = typer.Option(0, "--seed", help="Weight and batch seed."),
    lr: float = typer.Option(1e-3, "--lr", help="Learning rate of the plan's optimizer."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu (gloo) or cuda (NCCL); default: cuda when available."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes; run the same command on each."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's index (several nodes)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous (several nodes)."),
    rdzv_id: str = typer.Option("pipeplan", "--rdzv-id", help="Job id, the same on every node."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Ranks on this node (default: ranks / nodes)."),
    timeout: float = typer.Option(45.0, "--timeout", help="Seconds a rank waits for a peer before the job fails."),
    job_timeout: float = typer.Option(3600.0, "--job-timeout", help="Wall-clock limit of the whole job, seconds."),
    alone_repeats: int = typer.Option(2, "--alone-repeats", min=0, help="Timed passes each time the stages are re-timed alone (about every fifth step: the machine's drift since profiling); 0 skips it."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not echo the ranks' output."),
    verify: bool = typer.Option(False, "--verify", help="Compare the first step's loss and gradients with one process on the same batch; exit 1 above --verify-tolerance."),
    verify_tolerance: Optional[float] = typer.Option(None, "--verify-tolerance", help="Largest relative difference --verify accepts (default 1e-4 in fp32, 2e-2 in bf16/fp16)."),
):
    """Run a plan with torch.distributed.pipelining under torchrun; report measured vs predicted."""
    refuse_overwriting_input(report, plan_file, profile, option="--report")
    result = run_plan_file(
        plan_file, report_path=report, profile_path=profile, model=model, steps=steps, threads=threads,
        seq_len=seq_len, model_options={"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab},
        seed=seed, lr=lr, device=device, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id, nproc_per_node=nproc_per_node, timeout_s=timeout, job_timeout_s=job_timeout,
        alone_repeats=alone_repeats, echo=not quiet, raw_output=state["debug"], verify=verify,
        verify_tolerance=verify_tolerance,
    )
    rich_console().print(report_table(result))
    for note in result.get("notes", []):
        echo(f"note: {note}")
    for line in verdict_lines(result["verify"]) if result.get("verify") else []:
        echo(line)
    if report:
        echo(f"wrote {report}")
    check_verdict(result)


@handled
def calibrate(
    plan_file: Optional[Path] = typer.Argument(None, metavar="PLAN", help="The plan that was run (with --measured: an analytic profile; with --runs: none).", show_default=False),
    report_file: Optional[Path] = typer.Argument(None, metavar="REPORT", help="Its run report (pipeplan run --report).", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Calibrated profile JSON to write (with --runs: the fitted efficiency model).", show_default=False),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Profile to scale (default: the one the report names)."),
    measured: Optional[Path] = typer.Option(None, "--measured", help="Fit the analytic profile PLAN's efficiency model to this measured profile of the same model and GPU (no REPORT)."),
    runs: Optional[Path] = typer.Option(None, "--runs", help="Fit the efficiency model to launcher runs: a runs file (configurations and measured seconds per iteration; pipeplan schema runs). No PLAN or REPORT."),
    fit: Optional[str] = typer.Option(None, "--fit", help="With --runs: the terms to fit, e.g. gemm,attention (default: every bounded term of the efficiency model)."),
    holdout: Optional[list[str]] = typer.Option(None, "--holdout", help="With --runs: runs to leave out of the fit and predict, by name, e.g. 22B-full,175B-full (repeatable)."),
    efficiency: Optional[Path] = typer.Option(None, "--efficiency", help="With --runs: the efficiency model to start from (a file calibrate wrote); the terms not fitted keep its values."),
    allow_underdetermined: bool = typer.Option(False, "--allow-underdetermined", help="With --runs: fit more terms than there are runs to fit them to."),
):
    """Scale a profile's per-layer times by what a run measured, so the next plan uses real numbers;
    or fit the analytic efficiency model to a measured profile (--measured) or to launcher runs (--runs)."""
    if runs is not None:
        _calibrate_runs(plan_file, report_file, profile, measured, runs, output, fit, holdout, efficiency,
                        allow_underdetermined)
        return
    given = [name for name, value in (("--fit", fit), ("--holdout", holdout), ("--efficiency", efficiency),
                                      ("--allow-underdetermined", allow_underdetermined or None)) if value]
    if given:
        raise BadInputError(f"{given[0]}: only with --runs")
    if plan_file is None:
        raise BadInputError("PLAN: missing (the plan that was run, with its REPORT), or give --measured with an "
                            "analytic profile, or --runs RUNS.json")
    if measured is not None:
        if report_file is not None or profile is not None:
            raise BadInputError("--measured: give an analytic profile and no REPORT or --profile")
        refuse_overwriting_input(output, plan_file, measured)
        _, result = calibrate_analytic_files(plan_file, measured, output)
        eff = result["efficiency"]
        echo(f"efficiency fitted to {result['entries']} unit times: gemm {eff['gemm']}, attention {eff['attention']}, "
                   f"memory {eff['memory']}, kernel latency {eff['kernel_latency_us']} us; rms log error "
                   f"{result['rms_log_error_before']:.3f} -> {result['rms_log_error_after']:.3f}")
        echo(f"wrote {output}")
        return
    if report_file is None:
        raise BadInputError("REPORT: missing (the run report of PLAN), or give --measured to fit an analytic profile")

    refuse_overwriting_input(output, plan_file, report_file, profile)
    calibrated, factors = calibrate_files(plan_file, report_file, output, profile_path=profile)
    rich_console().print(calibration_table(factors))
    overhead_ms = (calibrated.measurement or {}).get("action_overhead_ms")
    if overhead_ms is not None:
        echo(f"the schedule's own work: {overhead_ms:.2f} ms per action (plans from {output} count it)")
    echo(f"wrote {output}")


def _calibrate_runs(plan_file, report_file, profile, measured, runs, output, fit, holdout, efficiency,
                    allow_underdetermined) -> None:
    """``calibrate --runs``: the fit, its table and residuals (docs/analytic.md)."""
    stray = [name for name, value in (("PLAN", plan_file), ("REPORT", report_file), ("--profile", profile),
                                      ("--measured", measured)) if value is not None]
    if stray:
        raise BadInputError(f"--runs: give no {stray[0]} (the runs file states each run's model and layout)")
    refuse_overwriting_input(output, runs, efficiency)
    result = calibrate_runs(runs, output, fit=fit, holdout=holdout or (), start=efficiency,
                            allow_underdetermined=allow_underdetermined)
    rich_console().print(runs_calibration_table(result, str(runs)))
    for line in runs_calibration_lines(result):
        echo(line)
    echo(f"wrote {output}")

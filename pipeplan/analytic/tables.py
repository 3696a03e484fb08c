"""Rich tables for ``pipeplan profile --analytic`` and ``pipeplan gpus``."""

from __future__ import annotations

from pipeplan.formats.profile import Profile
from pipeplan.quantities import format_bytes
from pipeplan.analytic.api import summary_rows
from pipeplan.facts.gpus import gpu_rows

__all__ = ["analytic_summary_table", "gpu_table", "parameters_caption"]


def analytic_summary_table(profile: Profile):
    """Per tensor-parallel degree and micro-batch size: one rank's whole-model time and memory."""
    from rich.table import Table

    table = Table(title=f"{profile.model} on {profile.device.name}, sequence {profile.sequence_length}, "
                        f"{profile.dtype} (one rank, all units)")
    for column in ("t", "b", "forward", "backward", "params", "activations", "selective", "TP bytes"):
        table.add_column(column, justify="right")
    for row in summary_rows(profile):
        table.add_row(
            str(row["tensor_parallel"]), str(row["microbatch_size"]), f"{row['forward_ms']:.1f} ms",
            f"{row['backward_ms']:.1f} ms", format_bytes(row["param_bytes"]), format_bytes(row["activation_bytes"]),
            format_bytes(row["selective_activation_bytes"]), format_bytes(row["tp_bytes"]),
        )
    table.caption = parameters_caption(profile)
    return table


def parameters_caption(profile: Profile) -> str | None:
    """``parameters: 46.70 B total, 12.88 B active (8 experts, top-2)``, where the profile counts them.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> parameters_caption(NS(parameters=NS(total=46_702_792_704, active=12_879_925_248),
    ...                       experts=NS(num_experts=8, experts_per_token=2), tied_weights=None))
    'parameters: 46.70 B total, 12.88 B active (8 experts, top-2)'
    """
    counts = profile.parameters
    if counts is None:
        return None
    text = f"parameters: {counts.total / 1e9:.2f} B total"
    if profile.experts is not None:
        text += (f", {counts.active / 1e9:.2f} B active ({profile.experts.num_experts} experts, "
                 f"top-{profile.experts.experts_per_token})")
    if profile.tied_weights:
        text += "; tied weights counted once: " + ", ".join(tie.name for tie in profile.tied_weights)
    return text


def gpu_table():
    """The shipped GPU specifications."""
    from rich.table import Table

    table = Table(title="GPU specifications (dense peaks; link: one direction)")
    for column in ("name", "GPU", "memory", "bf16", "fp8", "nvfp4", "HBM", "link", "source"):
        table.add_column(column, justify="left" if column in ("name", "GPU", "source") else "right")
    for row in gpu_rows():
        table.add_row(
            row["name"], row["description"], f"{row['memory_gib']:.0f} GiB", f"{row['bf16_tflops']:.1f} TF/s",
            f"{row['fp8_tflops']:.1f} TF/s" if row["fp8_tflops"] else "-",
            f"{row['nvfp4_tflops']:.1f} TF/s" if row["nvfp4_tflops"] else "-", f"{row['hbm_tb_per_s']:.2f} TB/s",
            f"{row['link_gb_per_s']:.0f} GB/s", row["source"],
        )
    return table

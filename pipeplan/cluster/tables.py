"""Rich tables for the terminal: cluster specs (``pipeplan cluster``) and cluster plans (``show``)."""

from __future__ import annotations

import math

from rich.table import Table

from pipeplan.formats.cluster import ClusterSpec
from pipeplan.quantities import format_bytes
from pipeplan.cluster.placement import Layout, cluster_layout

__all__ = ["cluster_table", "cluster_plan_tables"]


def _bandwidth(value: float) -> str:
    return f"{value / 1e9:g} GB/s"


def cluster_table(specs: list[ClusterSpec], title: str = "cluster presets") -> Table:
    """One row per spec: GPU, node and NVLink domain size, memory cap, links (per GPU, per direction)."""
    table = Table(title=title)
    for column in ("name", "gpu", "gpus/node", "gpus/NVLink", "memory cap", "intra-node", "latency", "network/GPU",
                   "latency", "efficiency"):
        table.add_column(column, justify="left" if column in ("name", "gpu") else "right")
    for spec in specs:
        table.add_row(
            spec.name, spec.gpu, str(spec.gpus_per_node), str(spec.nvlink_domain_gpus), format_bytes(spec.cap_bytes()),
            _bandwidth(spec.intra_node.bandwidth_bytes_per_s), f"{spec.intra_node.latency_us:g} us",
            _bandwidth(spec.inter_node.bandwidth_bytes_per_s), f"{spec.inter_node.latency_us:g} us",
            f"{spec.intra_node.efficiency:g} / {spec.inter_node.efficiency:g}",
        )
    return table


def cluster_plan_tables(plan):
    """``show`` for a cluster plan: the layout, the iteration's parts, memory per GPU by part."""
    # Function length (about 80 lines): one row per named part of the iteration and of memory, in
    # the order `show` prints them; the rows are the list.
    from rich.console import Group

    par, p = plan.parallelism, plan.predicted
    c = par.context or 1
    cluster = plan.settings.cluster
    # The NVLink domain is the cluster spec's (a plan made before domains has none: the node).
    # Ranks ordered tensor, context, data, pipeline: the d x C ranks of a pipeline rank's data x
    # context group lie as a layout's d x C data ranks do.
    layout = (cluster_layout(cluster, par.data * c, par.tensor, par.pipeline) if cluster is not None
              and cluster.gpus_per_node == par.gpus_per_node else Layout(par.data * c, par.tensor, par.pipeline,
                                                                         par.gpus_per_node))
    title = (f"{plan.profile.model}: {par.num_gpus} GPUs of {cluster.name if cluster else '?'} as d={par.data} x "
             f"t={par.tensor}" + (f" x C={c}" if c > 1 else "") + f" x p={par.pipeline}, {plan.schedule}"
             + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "") + f", ZeRO {par.zero_stage}"
             + (", sequence parallel" if par.sequence_parallel else "")
             + (f", experts E={par.expert} (ETP {par.expert_tensor or 1}, EDP {par.expert_data})"
                if par.expert is not None else ""))
    summary = Table(title=title, show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")

    def share(ms):
        return f"{ms:.1f} ms ({ms / p.iteration_ms:.1%})" if p.iteration_ms else f"{ms:.1f} ms"

    rows = [
        *([("precision", f"{plan.settings.precision} GEMMs, bf16 elsewhere"
                         + (", quantized weights (--fp8-param-gather)" if plan.settings.fp8_param_gather else ""))]
          if plan.settings.precision else []),
        ("global batch", f"{par.data * plan.num_microbatches * plan.microbatch_size} samples "
                         f"(d={par.data} replicas x {plan.num_microbatches} x {plan.microbatch_size})"),
        ("micro-batches per replica", f"{plan.num_microbatches} x {plan.microbatch_size} samples"),
        ("iteration", f"{p.iteration_ms:.1f} ms"),
        ("  compute", share(p.compute_ms)),
        ("  tensor-parallel collectives", share(p.tensor_parallel_ms or 0.0)),
        *([("    hidden behind their GEMMs (tp-comm, not in the iteration)", f"{p.tensor_parallel_hidden_ms:.1f} ms")]
          if p.tensor_parallel_hidden_ms is not None else []),
        *([("  expert dispatch (all-to-all)", share(p.expert_dispatch_ms or 0.0)),
           ("  routed experts", share(p.expert_compute_ms or 0.0)),
           ("  expert combine (all-to-all)", share(p.expert_combine_ms or 0.0)),
           ("  shared experts", share(p.shared_expert_ms or 0.0))] if p.expert_dispatch_ms is not None else []),
        *([("    all-to-alls hidden behind compute (moe-a2a, not in the iteration)",
            f"{p.expert_all_to_all_hidden_ms:.1f} ms")] if p.expert_all_to_all_hidden_ms is not None else []),
        *([(f"  {plan.settings.precision} casts (GEMM inputs, gradients)", share(p.quantize_ms or 0.0))]
          if p.quantize_ms is not None else []),
        *([("  context-parallel exchange", share(p.context_exchange_ms))] if p.context_exchange_ms is not None
          else []),
        *([("  host launches (GPU waiting)", share(p.host_wait_ms))] if p.host_wait_ms is not None else []),
        ("  pipeline bubble", share(p.bubble_ms + (p.overhead_ms or 0.0))),
        ("  pipeline transfers", share(p.transfer_ms)),
        *([(f"  CPU offload copies not covered ({plan.settings.cpu_offload_layers} layers)", share(p.cpu_offload_ms))]
          if p.cpu_offload_ms is not None else []),
        ("  data-parallel sync", share(p.data_parallel_ms or 0.0)),
        *([("    of it gradient reduce (exposed)", share(p.gradient_reduce_ms)),
           ("    of it parameter all-gather (exposed)", share(p.param_gather_ms or 0.0)),
           ("    hidden behind compute (not in the iteration)", f"{p.data_parallel_hidden_ms or 0.0:.1f} ms")]
          if p.gradient_reduce_ms is not None else []),
        ("  optimizer step", share(p.optimizer_ms or 0.0)),
        ("throughput", f"{p.samples_per_second:.2f} samples/s"),
    ]
    if p.tokens_per_second_per_gpu is not None:
        rows.append(("tokens/s per GPU", f"{p.tokens_per_second_per_gpu:.0f}"))
    if p.model_flops_utilization is not None:
        rows.append(("MFU", f"{p.model_flops_utilization:.1%}"))
    cap = plan.settings.cap_bytes()
    rows.append(("memory cap per GPU", "none" if math.isinf(cap) else format_bytes(cap)))
    rows.append(("solver", f"{plan.solver.method}, {'optimal' if plan.solver.optimal else 'not proven optimal'}"))
    for key, value in rows:
        summary.add_row(key, value)

    placement = Table(title="layout (ranks in Megatron's order: tensor, " + ("context, " if c > 1 else "")
                      + "data, pipeline)")
    for column in ("pipeline rank", "GPUs", "stages", "tensor group",
                   "data x context group" if c > 1 else "data group", "to next rank"):
        placement.add_column(column)
    for rank in range(par.pipeline):
        stages = ", ".join(str(s.index) for s in plan.stages if s.rank == rank)
        nxt = "-" if par.pipeline == 1 else layout.pipeline_link(rank, (rank + 1) % par.pipeline)
        placement.add_row(str(rank), layout.describe_stage(rank), stages,
                          f"{layout.tensor_span().size} GPUs ({layout.tensor_span().link})",
                          f"{layout.data_span().size} GPUs ({layout.data_span().link})", nxt)

    stages = Table(title="stages: memory per GPU by part")
    moe = any(s.expert_state_bytes is not None for s in plan.stages)
    quantized = any(s.quantized_weight_bytes is not None for s in plan.stages)
    kv = any(s.context_buffer_bytes is not None for s in plan.stages)
    for column in ("stage", "rank", "layers", "first .. last", "fwd ms", "bwd ms", "weights",
                   *((f"{plan.settings.precision} copies",) if quantized else ()), "grads",
                   "optimizer", *(("experts",) if moe else ()), "activations", *(("of it KV chunks",) if kv else ()),
                   "in flight", "peak"):
        stages.add_column(column, justify="left" if column == "first .. last" else "right")
    for s in plan.stages:
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
        stages.add_row(str(s.index), str(s.rank), str(len(s.layers)), span, f"{s.forward_ms:.2f}",
                       f"{s.backward_ms:.2f}" + (" (rc)" if s.recompute else ""),
                       *(format_bytes(v or 0) for v in (s.weight_bytes,
                                                       *((s.quantized_weight_bytes,) if quantized else ()),
                                                       s.gradient_bytes, s.optimizer_bytes,
                                                       *((s.expert_state_bytes,) if moe else ()),
                                                       s.peak_activation_bytes,
                                                       *((s.context_buffer_bytes,) if kv else ()))),
                       str(s.in_flight), format_bytes(s.peak_memory_bytes))
    ranks = Table(title="memory per GPU")
    for column in ("rank", "planned peak", "reserve", "total", "cap"):
        ranks.add_column(column, justify="right")
    for r in plan.ranks:
        reserve = plan.reserve_bytes or 0
        ranks.add_row(str(r.rank), format_bytes(r.peak_memory_bytes), format_bytes(reserve),
                      format_bytes(r.peak_memory_bytes + reserve), format_bytes(cap) if cap else "none")
    # The loss's working memory (pipeplan.facts.loss), a named part of the activations: a line
    # under the table, which has no width for another column at 160 characters.
    working = [f"stage {s.index}'s activations: of them {format_bytes(s.working_bytes)} the loss's working memory "
               f"(docs/cost-model.md, \"The loss's working memory\")" for s in plan.stages if s.working_bytes]
    parts = [summary, placement, stages, *working, ranks, *_reserve_table(plan)]
    if plan.alternatives:
        parts.extend(_runner_up_tables(plan))
    if plan.comparisons:
        parts.append(_layout_table("compared layouts (--compare), each planned in full", plan.comparisons,
                                   p.iteration_ms, "asked as"))
    parts.extend(f"note: {note}" for note in plan.notes)
    return Group(*parts)


def _reserve_table(plan) -> list:
    """The reserve by part (plan.reserve_parts; none in older plans): they add up to the reserve."""
    r = plan.reserve_parts
    if r is None:
        return []
    table = Table(title="reserve per GPU by part (docs/cluster-model.md, Memory a real job sees)", show_header=False)
    table.add_column("part")
    table.add_column("bytes", justify="right")
    rows = ([("the cluster spec's reserve", r.spec_reserve_bytes)] if r.spec_reserve_bytes is not None else [
        ("CUDA context", r.cuda_context_bytes), ("cuBLAS / cuBLASLt workspaces", r.cublas_workspace_bytes),
        ("NCCL buffers (the layout's communicators)", r.nccl_buffer_bytes)])
    for name, value in [*rows, ("allocator fragmentation (share of the fullest GPU's plan)", r.fragmentation_bytes),
                        ("reserve", plan.reserve_bytes or 0)]:
        table.add_row(name, format_bytes(value))
    return [table]


#: Layouts the search did not plan in full that ``show`` lists after the runners-up planned in full.
SHOWN_BOUND_ROWS = 4


def _runner_up_tables(plan) -> list:
    """The runners-up planned in full (a label says why each is listed), then the first few of the
    layouts cut by their bound, and how many more there are."""
    labelled = [a for a in plan.alternatives if a.label is not None]
    rest = [a for a in plan.alternatives if a.label is None]
    out = []
    if labelled:
        out.append(_layout_table("runners-up planned in full: each layout's own best plan", labelled,
                                 plan.predicted.iteration_ms, "listed as"))
    if rest:
        title = ("other layouts: the best of each" if labelled else "runners-up: the best plan of each layout")
        out.append(_layout_table(title, rest[:SHOWN_BOUND_ROWS] if labelled else rest[:12],
                                 plan.predicted.iteration_ms, None))
        hidden = len(rest) - (SHOWN_BOUND_ROWS if labelled else 12)
        if hidden > 0:
            out.append(f"... and {hidden} more layouts (the plan file's alternatives list each; --compare plans one in full)")
    return out


def _layout_table(title: str, alternatives, winner_ms: float, label_column) -> Table:
    """One row per layout: its plan's choices, time, gap to the winner, MFU, memory, and why."""
    table = Table(title=title)
    columns = ["layout", "schedule", "v", "micro-batch", "recompute", "iteration ms", "vs winner", "MFU",
               "peak memory", "why it lost"]
    for column in ([label_column] if label_column else []) + columns:
        table.add_column(column, justify="right" if column in ("iteration ms", "vs winner", "MFU") else "left")
    for a in alternatives:
        layout, _, why = a.reason.partition(": ")
        gap = "-" if a.iteration_ms is None or not winner_ms else f"{a.iteration_ms / winner_ms - 1:+.1%}"
        table.add_row(*([a.label] if label_column else []), layout, a.schedule, str(a.virtual_stages),
                      str(a.microbatch_size), a.recompute, _iteration_text(a), gap,
                      "-" if a.model_flops_utilization is None else f"{a.model_flops_utilization:.1%}",
                      "-" if a.peak_memory_bytes is None else format_bytes(a.peak_memory_bytes), why or a.reason)
    return table


def _iteration_text(alternative) -> str:
    """Its time; for a pruned layout its lower bound, marked as one."""
    if alternative.iteration_ms is not None:
        return f"{alternative.iteration_ms:.1f}"
    if alternative.lower_bound_ms is not None:
        return f"\u2265 {alternative.lower_bound_ms:.1f} (bound)"
    return "-"

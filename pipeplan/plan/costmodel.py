"""The cost model: one stage's time and memory, as named parts, from its layers and the settings.

Every number the planner uses for a stage comes from here: the exact solvers (chain DP and
bisection, ideal DP, ILP coefficients, orders and refinement), the simulator's inputs
(:class:`pipeplan.plan.simulate.StageCost`), ``compare``, ``show``, :mod:`pipeplan.run.plans`
and the run report's replay. A new term is added here, once.

Terms, per micro-batch of one stage (``sums`` are its layers' profile entries added up)::

    compute_ms      = sum(forward_ms + backward_ms)
    recompute_ms    = recompute rule (below): sum(forward_ms) for "full",
                      sum(selective_recompute_ms) for "selective", for "block" the forward of
                      the stage's first N transformer blocks (block_forward_ms), 0 for "none"
    transfer_ms     = (input-boundary bytes + output-boundary bytes) x ms_per_byte
    stage_time_ms   = compute_ms + recompute_ms + transfer_ms           (what the solvers minimise)

    state_bytes     = static_bytes_per_param_byte x (param_bytes - expert_param_bytes
                                                     + tied_copy_param_bytes)
                      + expert_static_bytes_per_param_byte x expert_param_bytes
                      (weights, grads, optimizer; the copies of tied weights the stage holds; the
                      routed experts' state sharded over the expert-data-parallel group)
    kept_bytes      = per micro-batch in flight: activation_bytes, for "full" sum(input_bytes) (each
                      layer's input, from which it is recomputed), for "selective"
                      sum(selective_activation_bytes), for "block" activation_bytes less the first
                      N blocks' activations plus their inputs
    recompute_bytes = for "full", one layer's activations while it is recomputed, the stage's
                      largest (largest_activation_bytes: a maximum, not a sum); for "selective",
                      one layer's rebuilt attention core (selective_working_bytes); else 0
    working_bytes   = the stage's largest layer's working_bytes: what a layer allocates and frees
                      within one pass above what it keeps (the loss's fp32 copies of the logits at
                      the head, pipeplan.facts.loss); one layer runs at a time, so a maximum
    peak_bytes      = state_bytes + in_flight x kept_bytes + recompute_bytes + working_bytes

The schedule's own time per action (``action_overhead_ms``) is a simulator term: the same for
every stage, so it moves no split and the solvers leave it out.

How the solvers use one definition
----------------------------------
Each term is a function of a :class:`LayerSums`, whose fields may be floats (one stage),
numpy arrays (every stage start and end at once, for the chain and ideal DPs: differences of
prefix sums) or PuLP linear expressions (the ILP's per-stage sums of layer shares). The terms
are linear in the sums and in the boundary bytes, so the same code serves all three;
``tests/test_costmodel.py`` checks that every path agrees on every stage.

Adding a term
-------------
- A per-layer quantity (e.g. tensor-parallel collective bytes): a field of
  :class:`pipeplan.plan.graph.LayerGraph` named in :data:`pipeplan.plan.graph.LAYER_ARRAYS`
  and filled in ``build_layer_graph``; every solver then sums it.
- A time or memory term: a method of :class:`CostModel` and one line in
  :meth:`CostModel.load_ms` (split-independent time), :meth:`CostModel.transfer_ms` (boundary
  time) or :meth:`CostModel.stage_memory_bytes`, plus a named field of :class:`StageTime` or
  :class:`StageMemory`. Settings it needs become fields of :class:`CostModel`
  (:meth:`CostModel.from_settings`).
- A recompute mode (e.g. ``"selective"``): an entry of :data:`RECOMPUTE_MODES` and a branch
  in :meth:`CostModel.recompute_ms`, :meth:`CostModel.kept_bytes` and
  :meth:`CostModel.recompute_bytes`.

See docs/cost-model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from pipeplan.facts.training_state import precision_of, state_bytes_per_param_byte
from pipeplan.plan.graph import LAYER_ARRAYS
from pipeplan.plan.simulate import StageCost

__all__ = [
    "RECOMPUTE_MODES",
    "BLOCK_FIELDS",
    "BLOCK_LARGEST",
    "recompute_mode",
    "LayerSums",
    "LARGEST",
    "WORKING",
    "LARGEST_OF",
    "TIED",
    "tied_copy_bytes",
    "layer_sums",
    "prefix_sums",
    "CostModel",
    "StageTime",
    "StageMemory",
    "StageBreakdown",
]

#: What a stage keeps for its backward. ``none``: every activation, per micro-batch in flight.
#: ``selective``: all but each layer's attention core (scores, softmax, dropout), recomputed from
#: the kept Q, K and V just before that layer's backward (Megatron's
#: ``--recompute-granularity selective``; Korthikanti et al. 2022); profiles give the bytes and
#: the time (``selective_activation_bytes``, ``selective_recompute_ms``).
#: ``full``: only its input; the forward runs again before the backward.
#: ``block``: Megatron's ``--recompute-method block --recompute-num-layers N``: the stage's first N
#: transformer blocks recompute in full (each keeps its input), the rest keep everything
#: (``LayerGraph.recompute_block_layers``; the ``block_*`` sums).
RECOMPUTE_MODES = ("none", "selective", "full", "block")

#: The sums over a stage's first N transformer blocks (``block`` mode), each of the named array.
BLOCK_FIELDS = {"block_forward_ms": "forward_ms", "block_input_bytes": "input_bytes",
                "block_activation_bytes": "activation_bytes"}
#: The largest ``activation_bytes`` of a stage's first N transformer blocks: the ``block`` mode's
#: working memory (one of them rebuilt at a time).
BLOCK_LARGEST = "block_largest_activation_bytes"

def recompute_mode(value: Any) -> str:
    """A stage's recompute mode from a mode name or a bool (True is ``"full"``).

    Raises
    ------
    ValueError
        If it is neither.

    Examples
    --------
    >>> recompute_mode(True), recompute_mode("none")
    ('full', 'none')
    """
    if isinstance(value, bool):
        return "full" if value else "none"
    if value in RECOMPUTE_MODES:
        return value
    raise ValueError(f"recompute mode {value!r} is not one of {', '.join(RECOMPUTE_MODES)}")


class LayerSums:
    """A stage's layers' profile entries added up, one attribute per field of :data:`FIELDS`.

    Values are floats, numpy arrays or linear expressions (see the module docstring). Each
    field is computed on first use by ``get(field)``, so a solver pays only for what the terms
    read.
    """

    #: Per-layer arrays of :class:`pipeplan.plan.graph.LayerGraph` that stages add up
    #: (:data:`pipeplan.plan.graph.LAYER_ARRAYS`, and ``compute_ms``, forward plus backward), and
    #: ``largest_activation_bytes``, the stage's largest single layer's ``activation_bytes`` (a
    #: maximum, not a sum: each solver forms it its own way).
    FIELDS: ClassVar[tuple[str, ...]] = (*LAYER_ARRAYS, "compute_ms", "largest_activation_bytes",
                                         "largest_working_bytes", "tied_copy_param_bytes", *BLOCK_FIELDS,
                                         BLOCK_LARGEST)

    __slots__ = ("_get", "_values")

    def __init__(self, get: Callable[[str], Any]):
        self._get = get
        self._values: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name not in LayerSums.FIELDS:
            raise AttributeError(name)
        values = self._values
        if name not in values:
            values[name] = self._get(name)
        return values[name]

    @classmethod
    def of(cls, **values) -> "LayerSums":
        """Sums given directly, e.g. from a plan file's stage."""
        return cls(lambda name: values[name])


#: The LayerSums fields that are a maximum over the stage's layers, each of the named array:
#: the largest layer's activations (full recomputation's working memory) and its working bytes.
LARGEST = "largest_activation_bytes"
WORKING = "largest_working_bytes"
LARGEST_OF = {LARGEST: "activation_bytes", WORKING: "working_bytes"}
#: The LayerSums field of the tied weights' copies a stage holds (neither a sum nor a maximum:
#: a tied weight counts where the stage holds a later user of it but not its first).
TIED = "tied_copy_param_bytes"


def tied_copy_bytes(graph, inside) -> Any:
    """Bytes of the tied weights a stage keeps a copy of, for ``inside(position)``: whether each
    layer position is in the stage (bools, or boolean arrays for many stages at once)."""
    total = 0.0
    for first, others, size in getattr(graph, "tied_weights", ()):
        if not others:
            continue
        later = inside(others[0])
        for other in others[1:]:
            later = later | inside(other)
        total = total + size * (later & ~inside(first) if not isinstance(later, bool) else
                                (later and not inside(first)))
    return total


def layer_sums(graph, layers) -> LayerSums:
    """The sums of one stage (floats)."""
    index = list(layers)

    def get(name):
        if name in LARGEST_OF:
            return float(getattr(graph, LARGEST_OF[name])[index].max()) if index else 0.0
        if name == TIED:
            held = set(index)
            return float(tied_copy_bytes(graph, lambda v: v in held))
        if name in BLOCK_FIELDS or name == BLOCK_LARGEST:
            first = [v for v in sorted(index) if graph.block_mask[v]][:graph.recompute_block_layers]
            if name == BLOCK_LARGEST:
                return float(graph.activation_bytes[first].max()) if first else 0.0
            return float(getattr(graph, BLOCK_FIELDS[name])[first].sum())
        return float(getattr(graph, name)[index].sum())

    return LayerSums(get)


def prefix_sums(graph):
    """Prefix sums along the layer order: ``between(l, r)`` sums layers ``l .. r - 1``.

    ``l`` and ``r`` may be arrays (broadcast), giving every stage at once.
    """
    import numpy as np

    zero = np.zeros(1)
    cache: dict[str, Any] = {}

    def prefix(name):
        if name not in cache:
            cache[name] = np.concatenate([zero, np.cumsum(getattr(graph, name))])
        return cache[name]

    def largest(lo, hi, key=LARGEST):
        # Range maximum of activation_bytes over lo .. hi - 1 from a sparse table: level k holds
        # the maximum of each run of 2^k layers; two overlapping runs cover any range. Empty: 0.
        # (key BLOCK_LARGEST: of the transformer blocks' alone.)
        if key not in cache:
            values = (graph.activation_bytes * graph.block_mask if key == BLOCK_LARGEST
                      else getattr(graph, LARGEST_OF[key]))
            levels = [np.asarray(values, dtype=float)]
            while 2 ** len(levels) <= len(levels[0]):
                half = 2 ** (len(levels) - 1)
                levels.append(np.maximum(levels[-1][:-half], levels[-1][half:]))
            cache[key] = levels
        levels = cache[key]
        lo, hi = np.broadcast_arrays(np.asarray(lo), np.asarray(hi))
        width = np.maximum(hi - lo, 1)
        k = np.floor(np.log2(width)).astype(int)
        out = np.zeros(lo.shape, dtype=float)
        for level in np.unique(k):
            at = (k == level) & (hi > lo)
            table = levels[level]
            out[at] = np.maximum(table[lo[at]], table[hi[at] - 2 ** level])
        return out if out.ndim else float(out)

    def block_cut(lo, hi):
        # The position after the stage's N-th block (hi if it has fewer): count[r] blocks lie
        # before position r, so it is the first r with count[r] >= count[lo] + N.
        if "block_end" not in cache:
            count = np.concatenate([zero, np.cumsum(graph.block_mask)])
            ends = np.searchsorted(count, count + graph.recompute_block_layers, side="left")
            cache["block_end"] = np.minimum(ends, len(count) - 1)
        return np.minimum(cache["block_end"][lo], hi)

    def get(lo, hi, name):
        if name in LARGEST_OF:
            return largest(lo, hi, name)
        if name == BLOCK_LARGEST:
            return largest(lo, block_cut(lo, hi), BLOCK_LARGEST)
        if name in BLOCK_FIELDS:
            key = "block:" + name
            if key not in cache:
                cache[key] = np.concatenate([zero, np.cumsum(getattr(graph, BLOCK_FIELDS[name]) * graph.block_mask)])
            return cache[key][block_cut(lo, hi)] - cache[key][lo]
        if name == TIED:
            return tied_copy_bytes(graph, lambda v: (np.asarray(lo) <= v) & (v < np.asarray(hi)))
        return prefix(name)[hi] - prefix(name)[lo]

    def between(lo, hi) -> LayerSums:
        return LayerSums(lambda name: get(lo, hi, name))

    return between


@dataclass(frozen=True)
class StageTime:
    """A stage's time per micro-batch, in named parts."""

    forward_ms: float
    backward_ms: float
    """The whole backward as profiled (input and weight gradients at once), without recompute."""
    backward_input_ms: float
    """Input-gradient pass (B) as profiled, without recompute."""
    backward_weight_ms: float
    """Weight-gradient pass (W)."""
    compute_ms: float
    """Forward plus backward, summed per layer (the solvers' figure)."""
    recompute_ms: float
    """The forward again, before the backward (recomputing stages)."""
    transfer_ms: float
    """Receiving the input (forward) and the output's gradient (backward)."""
    send_ms: float
    """Sending the output (and receiving its gradient): the output boundary alone."""
    action_overhead_ms: float
    """The schedule's own time before each action (simulator only)."""
    total_ms: float
    """``compute_ms + recompute_ms + transfer_ms``: the stage time the solvers minimise."""

    @property
    def backward_action_ms(self) -> float:
        """The whole backward as a schedule runs it: a recomputing stage's forward again first."""
        return self.backward_ms + self.recompute_ms

    @property
    def backward_input_action_ms(self) -> float:
        """The input-gradient pass (B) as a split schedule runs it, recompute first."""
        return self.backward_input_ms + self.recompute_ms


@dataclass(frozen=True)
class StageMemory:
    """A stage's peak memory, in named parts."""

    state_bytes: float
    """Weights, gradients and optimizer state."""
    kept_bytes: float
    """Kept for backward per micro-batch in flight."""
    in_flight: int
    """Micro-batches in flight at the stage's peak."""
    recompute_bytes: float
    """One micro-batch's activations while a recomputing stage runs its forward again."""
    peak_bytes: float
    """``state_bytes + in_flight x kept_bytes + recompute_bytes + working_bytes``."""
    tied_copy_param_bytes: float = 0.0
    """Parameter bytes of the tied weights' copies it holds (their state is in ``state_bytes``)."""
    working_bytes: float = 0.0
    """What its largest layer allocates and frees within one pass above what it keeps (the loss's
    working memory at the head)."""


@dataclass(frozen=True)
class StageBreakdown:
    """One stage costed: its layers, boundaries, recompute mode, time and memory."""

    index: int
    layers: tuple[int, ...]
    in_bytes: float
    out_bytes: float
    recompute: str
    time: StageTime
    memory: StageMemory
    last: bool
    """Whether it is the pipeline's last stage (it sends nothing on)."""

    def stage_cost(self):
        """The simulator's :class:`pipeplan.plan.simulate.StageCost`.

        A recomputing stage runs its forward again before its input gradient (so in B and in
        the whole backward), keeps ``kept_bytes`` per micro-batch in flight, and holds
        ``recompute_bytes`` with its static bytes. Bytes are rounded up, so the simulated
        peak never undercuts the solvers' model.
        """
        t, m = self.time, self.memory
        return StageCost(
            forward_ms=t.forward_ms,
            backward_input_ms=t.backward_input_action_ms,
            backward_weight_ms=t.backward_weight_ms,
            full_backward_ms=t.backward_action_ms,
            send_ms=0.0 if self.last else t.send_ms,
            static_memory_bytes=int(math.ceil(m.state_bytes) + math.ceil(m.recompute_bytes)
                                    + math.ceil(m.working_bytes)),
            activation_bytes=int(math.ceil(m.kept_bytes)),
            action_overhead_ms=t.action_overhead_ms,
        )


@dataclass(frozen=True)
class CostModel:
    """The settings that turn a stage's layer sums into its time and memory.

    Every method is a term of the model (see the module docstring); solvers call them with
    floats, arrays or linear expressions.
    """

    bandwidth_bytes_per_s: float = math.inf
    """Point-to-point bandwidth; ``inf`` ignores transfers."""
    static_bytes_per_param_byte: float = 0.0
    """Weights, gradients and optimizer state per byte of parameters."""
    action_overhead_ms: float = 0.0
    """The schedule's own time per action (simulator only: the same for every stage)."""
    selective_working_bytes: float = 0.0
    """Under selective recomputation, the largest one layer's rebuilt attention core for one
    micro-batch (layers are recomputed one at a time, just before their backward): the model's
    largest ``activation_bytes - selective_activation_bytes``, a bound for every stage."""
    expert_static_bytes_per_param_byte: float | None = None
    """The routed experts' training state per byte of their parameters: ZeRO and Megatron's
    distributed optimizer shard it over the expert-data-parallel group (``t x d / (E x ETP)``
    ranks), not over ``d``. None: the same as ``static_bytes_per_param_byte``."""

    def __post_init__(self):
        for name in ("bandwidth_bytes_per_s", "static_bytes_per_param_byte", "action_overhead_ms",
                     "selective_working_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"CostModel.{name} = {value!r} must be a number >= 0")
        expert = self.expert_static_bytes_per_param_byte
        if expert is not None and (not isinstance(expert, (int, float)) or math.isnan(expert) or expert < 0):
            raise ValueError(f"CostModel.expert_static_bytes_per_param_byte = {expert!r} must be a number >= 0")
        if self.bandwidth_bytes_per_s == 0:
            raise ValueError("CostModel.bandwidth_bytes_per_s must be > 0 (inf ignores transfers)")

    @classmethod
    def from_settings(cls, settings, dtype_bytes: int, graph=None) -> "CostModel":
        """The model of a :class:`pipeplan.formats.plan.PlanSettings` for a profile's dtype
        (and, for selective recomputation's working memory, the layer graph)."""
        bandwidth = settings.bandwidth_bytes_per_s
        working = 0.0
        if graph is not None and graph.selective_known and graph.num_layers:
            working = float(max(0.0, (graph.activation_bytes - graph.selective_activation_bytes).max()))
        # The training state's conventions and ZeRO's sharding over d: docs/cluster-model.md.
        static = state_bytes_per_param_byte(settings.optimizer, dtype_bytes, settings.zero_stage or 0,
                                            settings.data_parallel or 1, *precision_of(settings))
        expert = None
        expert_data = getattr(settings, "expert_data_parallel", None)
        if expert_data is not None:
            # The experts' state is sharded over their own data-parallel group (d x t / (E x ETP)).
            expert = state_bytes_per_param_byte(settings.optimizer, dtype_bytes, settings.zero_stage or 0,
                                                expert_data, *precision_of(settings))
            expert = None if expert == static else expert
        return cls(
            bandwidth_bytes_per_s=math.inf if bandwidth is None else float(bandwidth),
            static_bytes_per_param_byte=static,
            action_overhead_ms=float(settings.action_overhead_ms or 0.0),
            selective_working_bytes=working,
            expert_static_bytes_per_param_byte=expert,
        )

    @property
    def ms_per_byte(self) -> float:
        """Milliseconds per byte moved."""
        return 0.0 if math.isinf(self.bandwidth_bytes_per_s) else 1000.0 / self.bandwidth_bytes_per_s

    def needs_boundary_bytes(self, recompute) -> bool:
        """Whether any term reads the boundary bytes (solvers may skip them otherwise)."""
        return self.ms_per_byte > 0 or any(mode != "none" for mode in recompute)

    # -- time ------------------------------------------------------------------------------

    def recompute_ms(self, sums: LayerSums, mode: str):
        """The recompute rule, time: a recomputing stage runs its forward (or, selective, each
        layer's attention core) again."""
        if mode == "full":
            return sums.forward_ms
        if mode == "selective":
            return sums.selective_recompute_ms
        if mode == "block":
            return sums.block_forward_ms
        return 0.0

    def load_ms(self, sums: LayerSums, mode: str):
        """The part of the stage time that does not depend on where the split is cut."""
        return sums.compute_ms + self.recompute_ms(sums, mode)

    def transfer_ms(self, in_bytes, out_bytes):
        """Receiving the input and the output's gradient at the bandwidth."""
        return (in_bytes + out_bytes) * self.ms_per_byte

    def send_ms(self, out_bytes):
        """One boundary's transfer (the simulator's ``send_ms``)."""
        return out_bytes * self.ms_per_byte

    def stage_time_ms(self, sums: LayerSums, in_bytes, out_bytes, mode: str):
        """The stage time per micro-batch the solvers minimise."""
        return self.load_ms(sums, mode) + self.transfer_ms(in_bytes, out_bytes)

    # -- memory ----------------------------------------------------------------------------

    def state_bytes(self, sums: LayerSums):
        """Weights, gradients and optimizer state, of its own parameters and of the tied weights'
        copies it holds (a stage with a later user of a tied weight, not its first, keeps a copy
        that it updates itself, its gradient summed with the first's: pipeplan run's tied sync,
        Megatron's embedding group)."""
        own = self.static_bytes_per_param_byte * (sums.param_bytes + sums.tied_copy_param_bytes)
        expert = self.expert_static_bytes_per_param_byte
        if expert is None:
            return own
        # The routed experts' share, at its own sharding (expert-data-parallel group).
        return own + (expert - self.static_bytes_per_param_byte) * sums.expert_param_bytes

    def kept_bytes(self, sums: LayerSums, in_bytes, mode: str):
        """The recompute rule, memory: what a stage keeps per micro-batch in flight (for full
        recomputation, every layer's input; ``in_bytes`` is read only by plans that lack them)."""
        if mode == "full":
            return sums.input_bytes
        if mode == "selective":
            return sums.selective_activation_bytes
        if mode == "block":  # the first N blocks keep their inputs, the rest everything
            return sums.activation_bytes - sums.block_activation_bytes + sums.block_input_bytes
        return sums.activation_bytes

    def recompute_bytes(self, sums: LayerSums, mode: str):
        """The recompute rule, working memory: one layer's activations for one micro-batch,
        rebuilt from its kept input just before its backward and freed after it (Megatron's full
        recomputation and torch's per-layer checkpointing recompute one layer at a time): the
        stage's largest layer's. For selective: the model's largest layer's attention core."""
        if mode == "full":
            return sums.largest_activation_bytes
        if mode == "block":  # the largest of the recomputed blocks
            return sums.block_largest_activation_bytes
        if mode == "selective":
            return self.selective_working_bytes
        return 0.0

    def working_bytes(self, sums: LayerSums):
        """The working rule: the stage's largest layer's ``working_bytes``, once (its layers run
        one at a time, each freeing its working memory before the next allocates)."""
        return sums.largest_working_bytes

    def stage_memory_bytes(self, sums: LayerSums, in_bytes, in_flight, mode: str):
        """The stage's peak memory."""
        return (self.state_bytes(sums) + in_flight * self.kept_bytes(sums, in_bytes, mode)
                + self.recompute_bytes(sums, mode) + self.working_bytes(sums))

    # -- one stage, in parts -----------------------------------------------------------------

    def breakdown(self, sums: LayerSums, *, index: int, layers, in_bytes: float, out_bytes: float,
                  in_flight: int, mode: str, last: bool) -> StageBreakdown:
        """Every term of one stage (float sums), with totals from the same definitions."""
        time = StageTime(
            forward_ms=sums.forward_ms,
            backward_ms=sums.backward_ms,
            backward_input_ms=sums.backward_input_ms,
            backward_weight_ms=sums.backward_weight_ms,
            compute_ms=sums.compute_ms,
            recompute_ms=self.recompute_ms(sums, mode),
            transfer_ms=self.transfer_ms(in_bytes, out_bytes),
            send_ms=self.send_ms(out_bytes),
            action_overhead_ms=self.action_overhead_ms,
            total_ms=self.stage_time_ms(sums, in_bytes, out_bytes, mode),
        )
        memory = StageMemory(
            state_bytes=self.state_bytes(sums),
            kept_bytes=self.kept_bytes(sums, in_bytes, mode),
            in_flight=int(in_flight),
            recompute_bytes=self.recompute_bytes(sums, mode),
            peak_bytes=self.stage_memory_bytes(sums, in_bytes, in_flight, mode),
            tied_copy_param_bytes=sums.tied_copy_param_bytes,
            working_bytes=self.working_bytes(sums),
        )
        return StageBreakdown(index=index, layers=tuple(layers), in_bytes=in_bytes, out_bytes=out_bytes,
                              recompute=mode, time=time, memory=memory, last=last)

    def stage_cost_from_plan(self, stage, in_bytes: float, last: bool):
        """The simulator's :class:`pipeplan.plan.simulate.StageCost` of a plan file's stage.

        The inverse of :meth:`breakdown` on the numbers a plan keeps: the recompute time comes
        out of the backward, the kept bytes follow the recompute rule (``in_bytes``, the
        previous stage's ``send_bytes``, for a recomputing stage), and the static bytes are
        the peak less the in-flight ones. Plans without ``backward_input_ms`` get half the
        (recompute-free) backward as B.
        """
        mode = ("selective" if stage.recompute_granularity == "selective" else "full") if stage.recompute else "none"
        # A plan keeps a selective stage's kept bytes, not its recompute time (B includes it).
        # Full recomputation keeps each layer's input (checkpoint_bytes); plans from before it was
        # recorded kept the stage's input alone, the previous stage's send_bytes.
        checkpoint = getattr(stage, "checkpoint_bytes", None)
        sums = LayerSums.of(forward_ms=stage.forward_ms, activation_bytes=stage.activation_bytes,
                            selective_activation_bytes=stage.selective_activation_bytes or 0,
                            selective_recompute_ms=0.0, input_bytes=in_bytes if checkpoint is None else checkpoint)
        recompute = self.recompute_ms(sums, mode)
        if stage.backward_input_ms is not None:
            b_input = stage.backward_input_ms
        else:
            b_input = recompute + (stage.backward_ms - recompute) / 2
        if stage.backward_weight_ms is not None:
            b_weight = stage.backward_weight_ms
        else:
            b_weight = max(0.0, stage.backward_ms - b_input)
        kept = int(self.kept_bytes(sums, in_bytes, mode))
        return StageCost(
            forward_ms=stage.forward_ms,
            backward_input_ms=b_input,
            backward_weight_ms=b_weight,
            full_backward_ms=stage.backward_ms,
            send_ms=0.0 if last else self.send_ms(stage.send_bytes),
            static_memory_bytes=max(0, stage.peak_memory_bytes - stage.in_flight * kept),
            activation_bytes=kept,
            action_overhead_ms=self.action_overhead_ms,
        )

"""What doctor reads from a launcher config, and the layout the launcher would build from it.

Each launcher's reader (``pipeplan.launchers.<name>.reader``) turns the user's file
into a :class:`LauncherConfig` (the settings, in pipeplan's words, each tied to the launcher
setting it came from) and a :class:`Layout` (which of the launcher's units sit on which rank and
virtual stage, after the launcher's own rounding). ``pipeplan.doctor.evaluate`` costs the layout
with the planner's model; ``pipeplan.doctor.findings`` says what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LauncherConfig", "LayoutStage", "Layout", "Problem", "LAUNCHERS"]

from pipeplan.errors import BadInputError
from pipeplan.formats.limits import MAX_MICROBATCHES, MAX_PARALLEL_DEGREE
from pipeplan.launchers.registry import LAUNCHER_SCHEDULES

#: Launchers doctor reads, and the pipeplan schedules each can run.
LAUNCHERS = LAUNCHER_SCHEDULES


@dataclass(frozen=True)
class LauncherConfig:
    """A launcher's pipeline-relevant settings, in pipeplan's terms."""

    launcher: str
    """``megatron``, ``torchtitan`` or ``deepspeed``."""
    path: str
    """The file they were read from (named in every message)."""
    pipeline_degree: int
    """Pipeline ranks ``p``."""
    virtual_stages: int
    """Stages per rank ``v`` (1 without interleaving)."""
    schedule: str
    """The pipeplan schedule the launcher runs (``1f1b``, ``interleaved``, ...)."""
    microbatch_size: int
    """Samples per micro-batch."""
    num_microbatches: int | None
    """Micro-batches per iteration on one pipeline (one data-parallel replica); None if unknown."""
    tensor_degree: int = 1
    """Tensor-parallel size ``t`` (costed on a cluster: ``doctor --cluster``)."""
    data_degree: int | None = None
    """Data-parallel size ``d``, where the file (or ``--world-size``) gives it."""
    context_degree: int = 1
    """Context-parallel size (Megatron ``--context-parallel-size``)."""
    expert_degree: int = 1
    """Expert-parallel size ``E`` (Megatron's ``--expert-model-parallel-size``, torchtitan's
    ``parallelism.expert_parallel_degree``, DeepSpeed-MoE's ``MoE(ep_size=...)``; 1: every GPU
    holds every expert of a mixture-of-experts model)."""
    num_layers: int | None = None
    """Transformer blocks the config declares (Megatron ``--num-layers``, torchtitan's model)."""
    recompute: str = "none"
    """``none``, ``full`` or ``selective``: what the launcher recomputes."""
    sharded_optimizer: bool = False
    """ZeRO / distributed optimizer (``--use-distributed-optimizer``, ``zero_optimization.stage``)."""
    zero_stage: int = 0
    """The ZeRO stage the launcher runs: Megatron's distributed optimizer is 1, DeepSpeed's
    ``zero_optimization.stage`` as given, torchtitan's FSDP (``data_parallel_shard_degree`` above 1) 3."""
    sequence_parallel: bool = False
    precision: str | None = None
    """The GEMMs' recipe the launcher trains with (``fp8``, ``mxfp8``, ``nvfp4``:
    :mod:`pipeplan.facts.precision`); None: the training dtype (bf16)."""
    quantized_params: bool = False
    """The weights kept quantized (Megatron's ``--fp8-param-gather`` / ``--fp4-param-gather``)."""
    gradient_reduce_dtype: str | None = None
    """``bf16`` where the launcher reduces gradients in bf16 (Megatron's ``--grad-reduce-in-bf16``);
    None: its default."""
    """Megatron's sequence parallelism (``--sequence-parallel``; torchtitan's tensor parallelism
    always shards the norms' activations this way)."""
    overlap: tuple[str, ...] | None = None
    """The communication the launcher overlaps with compute (names of
    :data:`pipeplan.cluster.overlap.OVERLAPS`, from its flags); None: the launcher's defaults."""
    ddp_bucket_size: int | None = None
    """Parameters per gradient bucket (Megatron's ``--ddp-bucket-size``); None: the launcher's."""
    settings: dict[str, str] = field(default_factory=dict)
    """Launcher setting name to the value as written, for the ones doctor read."""
    recompute_modules: tuple[str, ...] | None = None
    """Selective recomputation's modules (Megatron's ``--recompute-modules``); None: the default,
    the attention core."""

    def __post_init__(self):
        # Every degree and count is bounded here, where all three launchers' readers meet, so that
        # a layout of 1e9 stages or an iteration of 1e12 micro-batches is refused, never built.
        degrees = (("pipeline stages p", self.pipeline_degree), ("virtual stages per rank v", self.virtual_stages),
                   ("tensor-parallel size t", self.tensor_degree), ("data-parallel size d", self.data_degree),
                   ("context-parallel size", self.context_degree), ("expert-parallel size", self.expert_degree),
                   ("micro-batch size", self.microbatch_size),
                   ("layers", self.num_layers))
        for what, value in degrees:
            if value is not None and not 1 <= value <= MAX_PARALLEL_DEGREE:
                raise BadInputError(f"{self.path}: {what} = {value} must be between 1 and {MAX_PARALLEL_DEGREE:,} "
                                    f"(the most pipeplan plans){self._named(value)}")
        if self.pipeline_degree * self.virtual_stages > MAX_PARALLEL_DEGREE:
            raise BadInputError(f"{self.path}: p x v = {self.pipeline_degree * self.virtual_stages} stages; pipeplan "
                                f"plans at most {MAX_PARALLEL_DEGREE:,}")
        if self.num_microbatches is not None and not 1 <= self.num_microbatches <= MAX_MICROBATCHES:
            raise BadInputError(f"{self.path}: {self.num_microbatches} micro-batches per pipeline (one data-parallel "
                                f"replica); pipeplan plans 1 to {MAX_MICROBATCHES} per iteration: give a smaller "
                                f"global batch or a larger micro-batch size")

    def _named(self, value: int) -> str:
        """`` (from SETTING VALUE)`` for the settings written with ``value``, or nothing."""
        read = [self.setting(name) for name, text in self.settings.items() if str(text).strip() == str(value)]
        return f" (from {', '.join(read[:3])})" if read else ""

    @property
    def samples_per_replica(self) -> int | None:
        """Samples one pipeline runs per iteration (micro-batch size x micro-batches)."""
        if self.num_microbatches is None:
            return None
        return self.microbatch_size * self.num_microbatches

    def setting(self, name: str) -> str:
        """``name`` with its value as written, e.g. ``--micro-batch-size 1``."""
        value = self.settings.get(name)
        return name if value is None else f"{name} {value}" if name.startswith("-") else f"{name} = {value}"


@dataclass(frozen=True)
class LayoutStage:
    """One (virtual) stage as the launcher builds it."""

    index: int
    """Pipeline order (virtual-stage-major: ``vstage * p + rank`` for the loop placement)."""
    rank: int
    vstage: int
    units: tuple[str, ...]
    """The launcher's own unit names, in order (``decoder.3``, ``layers.3``, layer index ``3``)."""


@dataclass(frozen=True)
class Problem:
    """Something the launcher itself refuses or silently gets wrong (a finding before costing)."""

    code: str
    """``layers-lost``, ``layers-duplicated``, ``unknown-unit``, ``empty-stage``, ``refused``."""
    severity: str
    """``error``, ``warning`` or ``info``."""
    setting: str
    """The launcher setting at fault, as written."""
    message: str
    fix: str


@dataclass(frozen=True)
class Layout:
    """The stages a launcher builds from a config, and what it drops, repeats or refuses."""

    stages: tuple[LayoutStage, ...]
    """Every (virtual) stage in pipeline order; empty when the launcher refuses the config."""
    all_units: tuple[str, ...]
    """Every unit the model has, in model order (the ones the layout should cover once each)."""
    problems: tuple[Problem, ...] = ()

    @property
    def built_units(self) -> list[str]:
        return [u for s in self.stages for u in s.units]

    @property
    def units_per_stage(self) -> list[int]:
        return [len(s.units) for s in self.stages]

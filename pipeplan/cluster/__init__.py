"""The cluster model: presets, rank placement, collectives, ZeRO memory, data-parallel sync.

Pure cost terms, one job per module, that the one cost model combines (docs/cluster-model.md):

- :mod:`~pipeplan.cluster.presets`: named clusters and resolving ``--cluster NAME|FILE``;
- :mod:`~pipeplan.cluster.placement`: which GPUs form each stage and group, and which link each uses;
- :mod:`~pipeplan.cluster.collectives`: ring / tree / hierarchical collective times;
- :mod:`~pipeplan.facts.training_state`: bytes per parameter of each ``--optimizer``, the step's time;
- :mod:`~pipeplan.cluster.memory`: training state per GPU under ZeRO 0-3, the per-GPU reserve;
- :mod:`~pipeplan.cluster.dataparallel`: gradient sync and ZeRO 3's gathers per iteration;
- :mod:`~pipeplan.cluster.space`: the (d, t, p, b) candidates of a search.

The spec's file format is :mod:`pipeplan.formats.cluster`.
"""

from pipeplan.cluster.presets import PRESETS, resolve_cluster

__all__ = ["PRESETS", "resolve_cluster"]

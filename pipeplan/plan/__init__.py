"""Planning: profile in, plan out. Pure Python; no torch.

The data flow, one module per step (docs/architecture.md)::

    graph -> costmodel -> problem -> chain / ideals / ilp / orders -> solve
          -> actions + memory -> simulate -> search (+ candidates, explain, bound, ranks)
          -> assemble -> Plan

The schedules' facts (names, torch classes, the rules on stages per rank) are
:mod:`pipeplan.facts.schedules`'. The names below are the stable surface other packages
import. The simulator's function is ``pipeplan.plan.simulate.simulate``
(``pipeplan.plan.simulate`` is its module).
"""

from __future__ import annotations

from pipeplan.plan.graph import LayerGraph, build_layer_graph
from pipeplan.plan.costmodel import (CostModel, LayerSums, RECOMPUTE_MODES, StageBreakdown, StageMemory, StageTime, layer_sums)
from pipeplan.plan.problem import (Partition, PartitionProblem, build_problem, evaluate_split, split_fits, stage_breakdowns, stage_costs)
from pipeplan.plan.chain import partition_chain
from pipeplan.plan.ideals import partition_ideals
from pipeplan.plan.ilp import partition_ilp
from pipeplan.plan.orders import partition_along_orders
from pipeplan.plan.solve import solve_partition
from pipeplan.plan.actions import Action, rank_actions
from pipeplan.plan.memory import rank_peak_bytes, stage_in_flight
from pipeplan.plan.simulate import Simulation, StageCost
from pipeplan.plan.bound import Incumbent, PrunedError
from pipeplan.plan.search import candidate_microbatch_sizes, make_plan, with_profile_defaults
from pipeplan.plan.assemble import plan_from_partition, plan_given_split, plan_simulation, plan_stage_costs

__all__ = [
    "Action",
    "CostModel",
    "Incumbent",
    "LayerGraph",
    "LayerSums",
    "Partition",
    "PartitionProblem",
    "PrunedError",
    "RECOMPUTE_MODES",
    "Simulation",
    "StageBreakdown",
    "StageCost",
    "StageMemory",
    "StageTime",
    "build_layer_graph",
    "build_problem",
    "candidate_microbatch_sizes",
    "evaluate_split",
    "layer_sums",
    "make_plan",
    "partition_along_orders",
    "partition_chain",
    "partition_ideals",
    "partition_ilp",
    "plan_from_partition",
    "plan_given_split",
    "plan_simulation",
    "plan_stage_costs",
    "rank_actions",
    "rank_peak_bytes",
    "solve_partition",
    "split_fits",
    "stage_breakdowns",
    "stage_costs",
    "stage_in_flight",
    "with_profile_defaults",
]

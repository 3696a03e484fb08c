"""Planning: profile in, plan out. Pure Python; no torch.

The data flow, one module per step (docs/architecture.md)::

    graph -> costmodel -> problem -> chain / ideals / ilp / orders -> solve
          -> schedules + actions + memory -> simulate -> search (+ candidates, explain, bound)
          -> assemble -> Plan

The names below are the stable surface other packages import (lazily: importing
``pipeplan.plan`` loads nothing until a name is used). The simulator's function is
``pipeplan.plan.simulate.simulate`` (``pipeplan.plan.simulate`` is its module).
"""

from __future__ import annotations

import importlib

#: Public name -> the module that defines it.
_EXPORTS = {
    # the search and plan files
    "make_plan": "search",
    "with_profile_defaults": "search",
    "candidate_microbatch_sizes": "search",
    "plan_from_partition": "assemble",
    "plan_given_split": "assemble",
    "plan_simulation": "assemble",
    "plan_stage_costs": "assemble",
    "Incumbent": "bound",
    "PrunedError": "bound",
    # the cost model
    "CostModel": "costmodel",
    "LayerSums": "costmodel",
    "StageBreakdown": "costmodel",
    "StageTime": "costmodel",
    "StageMemory": "costmodel",
    "RECOMPUTE_MODES": "costmodel",
    "layer_sums": "costmodel",
    "static_bytes_per_param_byte": "costmodel",
    # problems and solvers
    "PartitionProblem": "problem",
    "Partition": "problem",
    "build_problem": "problem",
    "evaluate_split": "problem",
    "split_fits": "problem",
    "stage_breakdowns": "problem",
    "stage_costs": "problem",
    "solve_partition": "solve",
    "partition_chain": "chain",
    "partition_ideals": "ideals",
    "partition_ilp": "ilp",
    "partition_along_orders": "orders",
    # schedules, memory and the simulator
    "SCHEDULES": "schedules",
    "SCHEDULE_INFO": "schedules",
    "ScheduleInfo": "schedules",
    "schedule_info": "schedules",
    "check_schedule": "schedules",
    "stage_ranks": "schedules",
    "valid_virtual_stages": "schedules",
    "Action": "actions",
    "rank_actions": "actions",
    "stage_in_flight": "memory",
    "rank_peak_bytes": "memory",
    "StageCost": "simulate",
    "Simulation": "simulate",
    # the LayerGraph
    "LayerGraph": "graph",
    "build_layer_graph": "graph",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeplan.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pipeplan.plan.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__

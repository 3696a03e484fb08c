"""``rank_actions`` against torch's own schedule classes, for many (ranks, micro-batches, v).

The schedule objects are built with stand-in stages (no process group is
needed to build them). For the runtime classes (interleaved, zb, zbv,
dualpipev) the compute actions of ``pipeline_order_with_comms`` are exactly
what ``_step_microbatches`` runs, one after another (``OVERLAP_F_B`` runs its
sub-actions in order). ``ScheduleGPipe`` and ``Schedule1F1B`` run their own
loops; here those loops are *executed* with a recording stand-in stage and
no-op communication, and the recorded order is compared. In torch 2.13,
``Schedule1F1B.pipeline_order`` is off by one on the last rank (it lists
``F1 .. Fm`` instead of ``F0 .. F(m-1)``); a test pins that, so a torch that
fixes it shows up here.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
S = pytest.importorskip("torch.distributed.pipelining.schedules")

from pipeplan.errors import BadInputError  # noqa: E402
from pipeplan.plan.actions import Action, rank_actions  # noqa: E402
from pipeplan.facts.schedules import (  # noqa: E402
    SCHEDULES,
    TORCH_SCHEDULE_CLASS,
    allows_virtual_stages,
    check_schedule,
    stage_ranks,
)

pytestmark = pytest.mark.torch


class _Stage:
    """Stand-in for a PipelineStage: the attributes the schedule classes read, and a call log."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = torch.nn.Identity()
        self.log: list[str] = []
        self.output_chunks: list = []

    # Single-stage loops call these.
    def clear_runtime_states(self):
        pass

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, **kwargs):
        self.log.append(f"{self.stage_index}B{mb}")

    def perform_reduce_grad(self, scale):
        pass


def _torch_class(schedule: str):
    return getattr(S, TORCH_SCHEDULE_CLASS[schedule])


def _build(schedule: str, p: int, m: int, v: int, rank: int = 0):
    cls = _torch_class(schedule)
    if schedule in ("gpipe", "1f1b"):
        return cls(_Stage(rank, p, p, rank), m)
    owned = [s for s, r in enumerate(stage_ranks(schedule, p, v)) if r == rank]
    return cls([_Stage(s, p * v, p, rank) for s in owned], m)


def _executed_single(schedule: str, p: int, m: int) -> list[list[str]]:
    """Run the single-stage class's own loop on each rank, recording compute calls."""
    out = []
    originals = (S._batch_p2p, S._sorted_batch_p2p, S._wait_batch_p2p)
    S._batch_p2p = lambda ops, desc=None: []
    S._sorted_batch_p2p = lambda ops, desc=None: {}
    S._wait_batch_p2p = lambda work: None
    try:
        for rank in range(p):
            sched = _build(schedule, p, m, 1, rank)
            sched._check_inputs = lambda a, k, t, l: (a, k)
            sched._initialize_stage = lambda *a, **k: None
            sched._step_microbatches([()] * m, [{}] * m, None, None, return_outputs=False)
            out.append(sched._stage.log)
    finally:
        S._batch_p2p, S._sorted_batch_p2p, S._wait_batch_p2p = originals
    return out


def _runtime_order(schedule: str, p: int, m: int, v: int) -> list[list[str]]:
    """The compute actions each rank's runtime runs, in order, in torch's spelling."""
    sched = _build(schedule, p, m, v)
    out = []
    for rank in range(p):
        row = []
        for action in sched.pipeline_order_with_comms[rank]:
            parts = action.sub_actions if action.sub_actions is not None else (action,)
            row.extend(str(a) for a in parts if a.is_compute_op)
        out.append(row)
    return out


def _ours(schedule: str, p: int, m: int, v: int) -> list[list[str]]:
    return [[str(a) for a in actions] for actions in rank_actions(schedule, p, m, v)]


def _accepted(schedule: str, p: int, m: int, v: int) -> bool:
    try:
        check_schedule(schedule, p, m, v)
    except BadInputError:
        return False
    return True


def _torch_accepts(schedule: str, p: int, m: int, v: int) -> bool:
    try:
        _build(schedule, p, m, v)
    except (ValueError, AssertionError):
        return False
    return True


RANKS = (1, 2, 3, 4, 5, 8)
MICROBATCHES = tuple(range(1, 17)) + (24, 32)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_classes_match_what_they_execute(schedule):
    for p, m in itertools.product(RANKS, MICROBATCHES):
        if _accepted(schedule, p, m, 1):
            assert _ours(schedule, p, m, 1) == _executed_single(schedule, p, m), (p, m)


def test_gpipe_listing_matches_execution():
    for p, m in itertools.product(RANKS, (1, 3, 8)):
        listed = [
            [str(a) for a in row if a.computation_type in (S.F, S.B)]
            for row in (_build("gpipe", p, m, 1).pipeline_order[r] for r in range(p))
        ]
        assert listed == _ours("gpipe", p, m, 1)


def test_1f1b_listing_is_off_by_one_on_last_rank_in_torch_2_13():
    """torch 2.13's Schedule1F1B.pipeline_order: right on ranks < p-1, shifted forwards on the last.

    The last rank's listing starts its forwards at micro-batch 1 and ends at m
    (out of range); its loop runs F0 .. F(m-1). pipeplan follows the loop.
    """
    for p, m in ((2, 2), (2, 5), (4, 4), (4, 9), (8, 8)):
        listing = _build("1f1b", p, m, 1).pipeline_order
        ours = _ours("1f1b", p, m, 1)
        for rank in range(p - 1):
            assert [str(a) for a in listing[rank] if a.computation_type in (S.F, S.B)] == ours[rank]
        last = [a for a in listing[p - 1] if a.computation_type in (S.F, S.B)]
        listed_forwards = [a.microbatch_index for a in last if a.computation_type == S.F]
        ours_forwards = [a.microbatch for a in rank_actions("1f1b", p, m, 1)[p - 1] if a.kind == "F"]
        assert ours_forwards == list(range(m))
        assert listed_forwards == [i + 1 for i in ours_forwards]


@pytest.mark.parametrize("schedule", ["interleaved", "zb"])
def test_interleaved_classes_match_pipeline_order(schedule):
    for p, v, m in itertools.product(RANKS, (1, 2, 3, 4), MICROBATCHES):
        if not _accepted(schedule, p, m, v):
            continue
        assert _ours(schedule, p, m, v) == _runtime_order(schedule, p, m, v), (p, m, v)


@pytest.mark.parametrize("schedule", ["interleaved", "zb"])
def test_interleaved_classes_match_pipeline_order_at_many_stages_per_rank(schedule):
    """Megatron's recipes run VP 5, 8 (and more); torch's classes build any v: the orders agree."""
    for p, v, m in itertools.product((1, 2, 3, 4, 8), (5, 8), (1, 2, 3, 4, 5, 8, 9, 12, 16, 24, 32)):
        if _accepted(schedule, p, m, v):
            assert _ours(schedule, p, m, v) == _runtime_order(schedule, p, m, v), (p, m, v)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_classes_match_pipeline_order(schedule):
    for p, m in itertools.product(RANKS, MICROBATCHES):
        if not _accepted(schedule, p, m, 2):
            continue
        assert _ours(schedule, p, m, 2) == _runtime_order(schedule, p, m, 2), (p, m)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_check_schedule_agrees_with_torch_constructors(schedule):
    """Where pipeplan accepts (p, m, v), torch builds the class; where torch refuses m, pipeplan refuses."""
    for p, m, v in itertools.product(RANKS, MICROBATCHES, (1, 2, 3, 4, 5, 8)):
        if v > 4 and (p > 4 or m not in (1, 3, 4, 5, 8, 16)):
            continue  # the large v: fewer cases, the same rules
        ours = _accepted(schedule, p, m, v)
        if ours:
            assert _torch_accepts(schedule, p, m, v), (schedule, p, m, v)
        elif allows_virtual_stages(schedule, v):
            # pipeplan refused the micro-batch count: torch must refuse it too.
            assert not _torch_accepts(schedule, p, m, v), (schedule, p, m, v)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_classes_refuse_other_than_two_stages_per_rank(schedule):
    """The V classes' own rule (``n_local_stages != 2`` raises), kept as a fact."""
    for v in (1, 3, 4):
        assert not allows_virtual_stages(schedule, v)
        cls = _torch_class(schedule)
        with pytest.raises(ValueError, match="exactly 2 stages per rank"):
            cls([_Stage(s, 2 * v, 2, 0) for s in range(v)], 8)


def test_torch_parses_our_action_strings():
    for text in ("0F0", "1B0", "2I1", "2W1"):
        ours = Action.from_str(text)
        theirs = S._Action.from_str(text)
        assert str(ours) == str(theirs) == text


def test_orders_reload_through_torch_csv_runtime(tmp_path):
    """A CSV of ``rank_actions`` (as torchtitan's CSV schedules use) loads into
    ``_PipelineScheduleRuntime`` and runs in the same order, for every schedule."""
    import csv

    path = tmp_path / "schedule.csv"
    count = 0
    for schedule in SCHEDULES:
        for p, m, v in itertools.product((1, 2, 3, 4), (1, 2, 4, 6, 8), (1, 2, 3)):
            if not _accepted(schedule, p, m, v):
                continue
            rows = [[str(a) for a in actions] for actions in rank_actions(schedule, p, m, v)]
            with open(path, "w", newline="") as handle:
                csv.writer(handle).writerows(rows)
            owned = [s for s, r in enumerate(stage_ranks(schedule, p, v)) if r == 0]
            runtime = S._PipelineScheduleRuntime([_Stage(s, p * v, p, 0) for s in owned], m)
            runtime._load_csv(str(path), format="compute_only")
            loaded = [
                [str(a) for a in runtime.pipeline_order_with_comms[r] if a.is_compute_op] for r in range(p)
            ]
            assert loaded == rows, (schedule, p, m, v)
            count += 1
    assert count > 100

"""Launcher exports, each checked by its consumer's own parser or loader where it is installed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeplan.errors import BadInputError
from pipeplan.export import export_plan, run_export
from pipeplan.launchers.common import TORCH_SCHEDULE_NAME
from pipeplan.launchers.megatron.writer import expand_layout, megatron_layout
from pipeplan.launchers.torchtitan.writer import TORCHTITAN_NAME, schedule_csv
from pipeplan.formats.io import dump_model, write_text_atomic

from test_export_fixtures import (
    SCHEDULE_CASES, even_split, hand_plan, llama_like_profile, profile_bytes, profile_sha, torchtitan_config_manager,
)

tomllib = pytest.importorskip("tomllib")


def _case_plan(schedule, p, v, m, blocks=None):
    stages = p * v
    profile = llama_like_profile(blocks or 3 * stages)
    return profile, hand_plan(profile, even_split(len(profile.layers), stages), schedule, p, v, 2, m)


# --------------------------------------------------------------------------- torchtitan


@pytest.mark.parametrize("schedule,p,v,m", SCHEDULE_CASES)
def test_torchtitan_toml_keys(schedule, p, v, m):
    _, plan = _case_plan(schedule, p, v, m)
    files = export_plan(plan, None, "torchtitan", stem="out/x")
    assert list(files) == [".toml"]
    config = tomllib.loads(files[".toml"])
    par = config["parallelism"]
    assert par["pipeline_parallel_degree"] == p
    assert par["module_fqns_per_model_part"] == [s.layers for s in plan.stages]
    assert par["pipeline_parallel_microbatch_size"] == 2
    assert config["training"]["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == m
    assert "pipeline_parallel_schedule_csv" not in par


def _fake_stage(p, num_stages, rank, index):
    torch = pytest.importorskip("torch")
    return SimpleNamespace(num_stages=num_stages, group_size=p, group_rank=rank, stage_index=index,
                           stage_index_to_group_rank=None, submod=torch.nn.Identity())


def _torchtitan_stage_indices(schedule_class, pp_rank, pp_degree, num_stages):
    # torchtitan 0.2 pipeline_module_split._get_stage_indices, restated.
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    stages_per_rank = num_stages // pp_degree
    if schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        pairs = list(zip(range(pp_degree), range(num_stages - 1, pp_degree - 1, -1)))
        return pairs[pp_rank]
    return tuple(pp_rank + s * pp_degree for s in range(stages_per_rank))


@pytest.mark.parametrize("schedule,p,v,m", SCHEDULE_CASES)
def test_torchtitan_accepted_by_torchtitan_and_torch(tmp_path, schedule, p, v, m):
    """torchtitan parses the TOML; torch runs the named class and loads the CSV without deadlock."""
    pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as S

    _, plan = _case_plan(schedule, p, v, m)
    stem = str(tmp_path / "tt")
    files = export_plan(plan, None, "torchtitan", stem=stem, with_schedule_csv=True)
    assert list(files) == [".toml", ".schedule.csv"]
    for suffix, text in files.items():
        write_text_atomic(stem + suffix, text)
    ConfigManager = torchtitan_config_manager()
    config = ConfigManager().parse_args(["--job.config_file", stem + ".toml"])
    par = config.parallelism
    assert par.module_fqns_per_model_part == [s.layers for s in plan.stages]
    assert par.pipeline_parallel_schedule_csv == stem + ".schedule.csv"
    # What torchtitan's build_pipeline_schedule does with these values:
    n_microbatches = config.training.local_batch_size // par.pipeline_parallel_microbatch_size
    assert n_microbatches == m
    schedule_class = S.get_schedule_class(par.pipeline_parallel_schedule)
    num_stages = len(par.module_fqns_per_model_part)
    for rank in range(p):
        indices = _torchtitan_stage_indices(schedule_class, rank, par.pipeline_parallel_degree, num_stages)
        assert [plan.stages[i].rank for i in indices] == [rank] * v
    rank0 = [_fake_stage(p, num_stages, 0, i)
             for i in _torchtitan_stage_indices(schedule_class, 0, p, num_stages)]
    if issubclass(schedule_class, S.PipelineScheduleSingle):
        schedule_class(rank0[0], n_microbatches=n_microbatches)
    else:
        schedule_class(rank0, n_microbatches=n_microbatches)
    runtime = S._PipelineScheduleRuntime(rank0, n_microbatches=n_microbatches)
    runtime._load_csv(par.pipeline_parallel_schedule_csv, format="compute_only")
    assert runtime.stage_index_to_group_rank == {s.index: s.rank for s in plan.stages}
    lowered = {
        rank: [a for a in actions if a is not None
               and a.computation_type.value not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
        for rank, actions in runtime.pipeline_order_with_comms.items()
    }
    S._simulate_comms_compute(lowered, lambda s: runtime.stage_index_to_group_rank[s], num_stages)


def test_torchtitan_csv_rows_are_rank_actions():
    from pipeplan.plan.actions import rank_actions

    _, plan = _case_plan("zb", 2, 2, 4)
    csv = export_plan(plan, None, "torchtitan", with_schedule_csv=True)[".schedule.csv"]
    rows = [line.split(",") for line in csv.splitlines()]
    assert rows == [[str(a) for a in row] for row in rank_actions("zb", 2, 4, 2)]
    assert any(cell.endswith("W0") for cell in rows[0]) and any("I" in cell for cell in rows[0])


# --------------------------------------------------------------------------- Megatron-LM


def _megatron_flags(text: str) -> dict[str, str]:
    body = text.split("PIPEPLAN_MEGATRON_ARGS=(")[1].split(")\n")[0]
    words = shlex.split(body)
    return dict(zip(words[::2], words[1::2]))


def _megatron_layout_class():
    pytest.importorskip("torch")
    try:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError:
        pytest.skip("megatron-core not installed")
    return PipelineParallelLayerLayout, LayerType


@pytest.mark.parametrize("schedule,p,v,m", [c for c in SCHEDULE_CASES if c[0] not in ("zbv", "dualpipev")])
def test_megatron_layout_accepted_by_megatron(schedule, p, v, m):
    profile, plan = _case_plan(schedule, p, v, m, blocks=3 * p * v + 1)
    flags = _megatron_flags(export_plan(plan, profile, "megatron", profile_sha256=profile_sha(profile))[".sh"])
    assert "--num-virtual-stages-per-pipeline-rank" not in flags  # Megatron refuses it beside a layout
    assert int(flags["--pipeline-model-parallel-size"]) == p
    assert int(flags["--global-batch-size"]) == int(flags["--micro-batch-size"]) * m
    Layout, LayerType = _megatron_layout_class()
    layout = Layout(flags["--pipeline-model-parallel-layout"], p)
    assert (layout.virtual_pipeline_model_parallel_size or 1) == v
    layout.validate_layer_layout(int(flags["--num-layers"]), None)
    kinds = {layer.name: layer.kind for layer in profile.layers}
    for stage in plan.stages:
        built = layout.layout[stage.index % p][stage.index // p]
        assert built.count(LayerType.decoder) == sum(kinds[n] == "block" for n in stage.layers)
    assert LayerType.embedding in layout.layout[0][0] and LayerType.loss in layout.layout[p - 1][v - 1]


def test_megatron_uneven_split_and_norm_moves_with_loss():
    profile = llama_like_profile(6)  # 9 layers: E, t*6, norm, output
    plan = hand_plan(profile, [3, 4, 1, 1], "1f1b", 4, 1, 1, 8)  # norm alone on stage 2
    layout, num_layers, notes = megatron_layout(plan, profile)
    assert expand_layout(layout) == ["Ett", "tttt", "", "L"]
    assert num_layers == 6
    assert any("norm moved to stage 3" in note for note in notes)
    text = export_plan(plan, profile, "megatron")[".sh"]
    assert "# note: norm moved to stage 3" in text
    try:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError:
        return
    real = PipelineParallelLayerLayout(layout, 4)  # Megatron-LM accepts the empty stage
    real.validate_layer_layout(num_layers, None)
    assert [len(real.layout[r][0]) for r in range(4)] == [3, 4, 0, 1]


def test_megatron_layout_compression_round_trips():
    profile = llama_like_profile(29)  # 32 layers on 8 stages: E+3t | 4t x6 | 2t+norm+output
    plan = hand_plan(profile, [4, 4, 4, 4, 4, 4, 4, 4], "1f1b", 8, 1, 1, 8)
    layout, _, _ = megatron_layout(plan, profile)
    assert layout == "Et*3|(t*4|)*6,t*2L"
    assert expand_layout(layout) == ["Ettt"] + ["tttt"] * 6 + ["ttL"]


def test_megatron_refuses_v_schedules_and_missing_roles():
    profile, plan = _case_plan("zbv", 2, 2, 4)
    with pytest.raises(BadInputError, match="V"):
        export_plan(plan, profile, "megatron")
    profile, plan = _case_plan("1f1b", 2, 1, 4)
    with pytest.raises(BadInputError, match="needs the profile"):
        export_plan(plan, None, "megatron")
    data = profile.model_dump()
    data["layers"][3]["kind"] = None
    from pipeplan.formats.profile import Profile

    bare = Profile.model_validate(data)
    with pytest.raises(BadInputError, match="no 'kind'"):
        export_plan(plan, bare, "megatron")
    data["layers"][3]["kind"] = "embedding"
    with pytest.raises(BadInputError, match="embedding\\s+first|roles"):
        export_plan(plan, Profile.model_validate(data), "megatron")


def test_run_export_profile_checks(tmp_path):
    profile, plan = _case_plan("1f1b", 2, 1, 4)
    plan_path, profile_path = tmp_path / "plan.json", tmp_path / "profile.json"
    plan_path.write_text(dump_model(plan))
    profile_path.write_bytes(profile_bytes(profile))
    with pytest.raises(BadInputError, match="--profile PATH"):
        run_export(plan_path, "megatron")
    text, written = run_export(plan_path, "megatron", profile_path=profile_path, output=tmp_path / "m.sh")
    assert written == [tmp_path / "m.sh"] and (tmp_path / "m.sh").read_text() == text
    profile_path.write_bytes(profile_bytes(profile) + b"\n")
    with pytest.raises(BadInputError, match="sha256"):
        run_export(plan_path, "megatron", profile_path=profile_path)
    with pytest.raises(BadInputError, match="-o FILE"):
        run_export(plan_path, "torchtitan", with_schedule_csv=True)
    text, written = run_export(plan_path, "torchtitan", with_schedule_csv=True, output=tmp_path / "t.toml")
    assert written == [tmp_path / "t.toml", tmp_path / "t.schedule.csv"]
    assert f'pipeline_parallel_schedule_csv = "{tmp_path / "t.schedule.csv"}"' in text


# --------------------------------------------------------------------------- DeepSpeed


def test_deepspeed_parts_and_batch_keys():
    profile, plan = _case_plan("1f1b", 4, 1, 8)
    data = json.loads(export_plan(plan, None, "deepspeed")[".json"])
    parts, layers = data["parts"], data["layers"]
    assert len(parts) == data["num_stages"] + 1 == 5 and parts[0] == 0 and parts[-1] == len(layers)
    # What the documented PipelineModule subclass builds on each stage: layers[parts[s]:parts[s+1]].
    for s, stage in enumerate(plan.stages):
        assert layers[parts[s]:parts[s + 1]] == stage.layers
    ds = data["ds_config"]
    # DeepSpeed's batch assertion, with one data-parallel replica.
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 1
    assert ds["gradient_accumulation_steps"] == plan.num_microbatches


def test_deepspeed_refuses_virtual_stages():
    _, plan = _case_plan("interleaved", 2, 2, 4)
    with pytest.raises(BadInputError, match="one\\s+stage per rank"):
        export_plan(plan, None, "deepspeed")


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize("schedule,p,v,m", [("1f1b", 4, 1, 8), ("zbv", 2, 2, 4)])
def test_torch_split_spec_accepted_by_pipeline(schedule, p, v, m):
    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.pipelining.schedules import get_schedule_class

    profile, plan = _case_plan(schedule, p, v, m, blocks=2 * p * v)
    data = json.loads(export_plan(plan, None, "torch")[".json"])
    blocks = sum(layer.kind == "block" for layer in profile.layers)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Linear(4, 4)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(blocks))
            self.norm = torch.nn.LayerNorm(4)
            self.output = torch.nn.Linear(4, 4)

        def forward(self, x):
            x = self.tok_embeddings(x)
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x))

    split_spec = {fqn: getattr(SplitPoint, where) for fqn, where in data["split_spec"].items()}
    pipe = pipeline(Tiny(), mb_args=(torch.randn(data["microbatch_size"], 4),), split_spec=split_spec)
    assert pipe.num_stages == data["num_stages"] == len(plan.stages)
    for index, stage in enumerate(plan.stages):
        owned = {name.rsplit(".", 1)[0] for name, _ in pipe.get_stage_module(index).named_parameters()}
        assert owned == set(stage.layers)
    cls = get_schedule_class(data["schedule"])
    assert cls.__name__ == data["schedule_class"]
    assert data["stage_to_rank"] == [s.rank for s in plan.stages]
    assert data["n_microbatches"] == m


# --------------------------------------------------------------------------- all


@pytest.mark.parametrize("format", ["torchtitan", "megatron", "deepspeed", "torch"])
def test_exports_are_deterministic_and_reject_bad_format(format):
    profile, plan = _case_plan("1f1b", 2, 1, 4)
    first = export_plan(plan, profile, format)
    assert first == export_plan(plan, profile, format)
    with pytest.raises(BadInputError, match="--format"):
        export_plan(plan, profile, "fairscale")


def test_inconsistent_placement_is_refused():
    _, plan = _case_plan("interleaved", 2, 2, 4)
    data = plan.model_dump()
    data["stages"][1]["rank"], data["stages"][2]["rank"] = 0, 1
    from pipeplan.formats.plan import Plan

    with pytest.raises(BadInputError, match="placement"):
        export_plan(Plan.model_validate(data), None, "torch")


# --------------------------------------------------------------------------- shipped baselines

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "profiles" / "baselines").glob("*.json")) if (REPO / "profiles" / "baselines").is_dir() else []


@pytest.mark.skipif(not SHIPPED, reason="no baselines shipped in profiles/baselines/")
@pytest.mark.parametrize("baseline", SHIPPED, ids=lambda p: p.name)
def test_shipped_baselines_export_to_every_launcher(baseline, tmp_path):
    """Each shipped plan through each consumer that can run it (Megatron needs layer roles)."""
    from pipeplan.check.regress import find_profile
    from pipeplan.formats.io import file_sha256, load_plan, load_profile

    plan = load_plan(baseline)
    profile_path = find_profile(baseline, plan, REPO / "profiles")
    profile = load_profile(profile_path)
    sha = file_sha256(profile_path)
    from pipeplan.launchers.torchtitan.writer import torchtitan_module_names

    try:
        names = torchtitan_module_names(profile)
    except BadInputError:  # not a decoder torchtitan has (convnet): the export must refuse it
        with pytest.raises(BadInputError, match="torchtitan"):
            export_plan(plan, profile, "torchtitan", profile_sha256=sha)
        names = None
    if names is not None:
        files = export_plan(plan, profile, "torchtitan", profile_sha256=sha, stem=str(tmp_path / "t"),
                            with_schedule_csv=True)
        toml = tomllib.loads(files[".toml"])
        # torchtitan's module names (tok_embeddings, layers.N, norm, output), never the profile's own
        assert toml["parallelism"]["module_fqns_per_model_part"] == [
            [names[n] for n in s.layers if names[n]] for s in sorted(plan.stages, key=lambda s: s.index)]
        assert all(TORCHTITAN_NAME.fullmatch(n) for part in toml["parallelism"]["module_fqns_per_model_part"]
                   for n in part)
    else:
        files = export_plan(plan, None, "torch", profile_sha256=sha)
        toml = {"parallelism": {"pipeline_parallel_schedule": TORCH_SCHEDULE_NAME[plan.schedule]}}
        files[".schedule.csv"] = schedule_csv(plan)
    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as S

    csv_path = tmp_path / "t.schedule.csv"
    csv_path.write_text(files[".schedule.csv"])
    p = plan.settings.stages
    mine = [s.index for s in plan.stages if s.rank == 0]
    runtime = S._PipelineScheduleRuntime([_fake_stage(p, len(plan.stages), 0, i) for i in mine],
                                         n_microbatches=plan.num_microbatches)
    runtime._load_csv(str(csv_path), format="compute_only")
    assert runtime.stage_index_to_group_rank == {s.index: s.rank for s in plan.stages}
    S.get_schedule_class(toml["parallelism"]["pipeline_parallel_schedule"])
    data = json.loads(export_plan(plan, profile, "torch", profile_sha256=sha)[".json"])
    assert len(data["split_spec"]) == len(plan.stages) - 1
    if plan.virtual_stages == 1:
        parts = json.loads(export_plan(plan, profile, "deepspeed")[".json"])["parts"]
        assert len(parts) == p + 1
    kinds = {layer.kind for layer in profile.layers}
    if None not in kinds and "embedding" in kinds and kinds & {"norm", "head"} and not plan.schedule.startswith(("zbv", "dualpipev")):
        flags = _megatron_flags(export_plan(plan, profile, "megatron", profile_sha256=sha)[".sh"])
        try:
            Layout, _ = _megatron_layout_class()
        except pytest.skip.Exception:
            return
        layout = Layout(flags["--pipeline-model-parallel-layout"], p)
        layout.validate_layer_layout(int(flags["--num-layers"]), None)


# --------------------------------------------------------------------------- the documented snippets


def test_documented_torch_snippet_builds_every_schedule_with_one_stage_per_rank():
    """docs/launchers.md's schedule line: multi-stage classes get a list even at one stage per rank."""
    import re

    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as S

    text = (Path(__file__).resolve().parents[1] / "docs" / "launchers.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "get_schedule_class" in b)
    line = block[block.index("schedule_class = get_schedule_class"):]
    for schedule, p, v, m in [("zb", 2, 1, 4), ("1f1b", 2, 1, 4), ("gpipe", 2, 1, 3), ("interleaved", 2, 2, 4)]:
        _, plan = _case_plan(schedule, p, v, m)
        exported = json.loads(export_plan(plan, None, "torch")[".json"])
        stages = [_fake_stage(p, p * v, 0, s) for s, r in enumerate(exported["stage_to_rank"]) if r == 0]
        namespace = {"exported": exported, "stages": stages, "loss_fn": torch.nn.MSELoss(),
                     "get_schedule_class": S.get_schedule_class, "PipelineScheduleMulti": S.PipelineScheduleMulti}
        exec(line, namespace)
        assert type(namespace["schedule"]).__name__ == exported["schedule_class"]


def test_torchtitan_export_maps_profile_names_or_refuses(tmp_path):
    from pipeplan.formats.profile import Profile

    profile = llama_like_profile(4)
    data = profile.model_dump()
    rename = {"tok_embeddings": "embed", "output": "head"}
    for layer in data["layers"]:
        layer["name"] = rename.get(layer["name"], layer["name"].replace("layers.", "blocks."))
    ours = Profile.model_validate(data)
    plan = hand_plan(ours, [3, 4], "1f1b", 2, 1, 1, 4)
    with pytest.raises(BadInputError, match="not torchtitan module names"):
        export_plan(plan, None, "torchtitan")
    toml = tomllib.loads(export_plan(plan, ours, "torchtitan")[".toml"])
    assert toml["parallelism"]["module_fqns_per_model_part"] == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    for layer in data["layers"]:
        layer["kind"] = "other" if layer["kind"] == "embedding" else layer["kind"]
    with pytest.raises(BadInputError, match="cannot name these layers for torchtitan"):
        export_plan(plan, Profile.model_validate(data), "torchtitan")


@pytest.mark.parametrize("m,refused", [(2, True), (4, False), (6, True), (8, False)])
def test_megatron_export_refuses_interleaved_counts_megatron_refuses(m, refused):
    profile, plan = _case_plan("interleaved", 4, 2, m, blocks=3 * 8 + 1)
    if refused:
        with pytest.raises(BadInputError, match="interleaved schedule refuses"):
            export_plan(plan, profile, "megatron")
    else:
        assert "--pipeline-model-parallel-layout" in export_plan(plan, profile, "megatron")[".sh"]

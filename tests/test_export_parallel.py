"""Exports of plans with data, tensor and pipeline degrees and ZeRO, each checked by its launcher's own code.

At d = 2 and 4 the micro-batch count each launcher derives from the export equals the plan's:
megatron-core's ``ConstantNumMicroBatchesCalculator``, DeepSpeed's ``DeepSpeedConfig`` batch checks
(with the data-parallel world size DeepSpeed reads from its grid), torchtitan's ``ConfigManager`` and
``ParallelDims`` with its trainer's accumulation rule. megatron-core's ``TransformerConfig`` (its
argument and layout validation) and torchtitan's config manager accept the output.
"""

from __future__ import annotations

import inspect
import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeplan.errors import BadInputError
from pipeplan.export import export_plan, run_export
from pipeplan.formats.io import dump_model, write_text_atomic
from pipeplan.formats.plan import Parallelism, Plan

from test_export_fixtures import even_split, hand_plan, llama_like_profile, profile_bytes, torchtitan_config_manager

tomllib = pytest.importorskip("tomllib")
GIB = 2**30

#: (d, t, p, v, schedule, b, m, ZeRO, sequence parallel, recompute) that every launcher here can run.
CASES = [
    (2, 1, 2, 1, "1f1b", 1, 4, 1, False, "none"),
    (2, 2, 4, 1, "1f1b", 2, 8, 0, True, "full"),
    (4, 2, 2, 1, "1f1b", 1, 6, 1, True, "selective"),
    (4, 1, 4, 1, "1f1b", 2, 8, 0, False, "none"),
]
#: Interleaved cases (Megatron and torchtitan; DeepSpeed runs one stage per rank).
INTERLEAVED = [
    (2, 2, 2, 2, "interleaved", 1, 4, 1, True, "none"),
    (4, 1, 4, 2, "interleaved", 1, 8, 1, False, "full"),
]


def degree_plan(d, t, p, v, schedule, b, m, zero=1, sp=False, recompute="none", *, blocks=None,
                cap_bytes=80 * GIB, weight_mib=32):
    """A hand-made cluster plan: the llama-like chain split evenly, with ``parallelism`` set."""
    profile = llama_like_profile(blocks or 3 * p * v + 1)
    plan = hand_plan(profile, even_split(len(profile.layers), p * v), schedule, p, v, b, m)
    mib = 2**20
    stages = []
    for stage in plan.stages:
        params = weight_mib * mib * len(stage.layers)
        update = {"param_bytes": params,
                  "weight_bytes": params // d if zero >= 3 else params,
                  "gradient_bytes": params // d if zero >= 2 else params,
                  "optimizer_bytes": 6 * params // (d if zero >= 1 else 1)}
        if recompute == "full":
            update["recompute"] = True
        elif recompute == "selective":
            update.update(recompute=True, recompute_granularity="selective")
        stages.append(stage.model_copy(update=update))
    settings = plan.settings.model_copy(update={
        "global_batch": b * m * d, "num_gpus": d * t * p, "data_parallel": d, "tensor_parallel": t,
        "zero_stage": zero, "memory_cap_bytes": cap_bytes})
    par = Parallelism(num_gpus=d * t * p, data=d, tensor=t, pipeline=p, virtual_stages=v, zero_stage=zero,
                      sequence_parallel=sp, gpus_per_node=8)
    data = plan.model_copy(update={"schema_version": 2, "settings": settings, "stages": stages,
                                   "parallelism": par}).model_dump()
    return profile, Plan.model_validate(data)


# --------------------------------------------------------------------------- Megatron-LM


def megatron_flags(text: str) -> dict[str, str | None]:
    words = shlex.split(text.split("PIPEPLAN_MEGATRON_ARGS=(")[1].split(")\n")[0])
    flags, i = {}, 0
    while i < len(words):
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            flags[words[i]] = words[i + 1]
            i += 2
        else:
            flags[words[i]] = None
            i += 1
    return flags


def _megatron_core():
    pytest.importorskip("torch")
    try:
        from megatron.core import num_microbatches_calculator, parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        pytest.skip("megatron-core not installed")
    return SimpleNamespace(calc=num_microbatches_calculator, ps=parallel_state, DDP=DistributedDataParallelConfig,
                           Opt=OptimizerConfig, TC=TransformerConfig)


def megatron_accepts(flags: dict, plan: Plan) -> int:
    """Build what Megatron-LM builds from these flags (megatron-core's own checks); return its micro-batch count."""
    import torch

    core = _megatron_core()
    par = plan.parallelism
    config = core.TC(
        num_layers=int(flags["--num-layers"]), hidden_size=64, num_attention_heads=8,
        tensor_model_parallel_size=int(flags["--tensor-model-parallel-size"]),
        pipeline_model_parallel_size=int(flags["--pipeline-model-parallel-size"]),
        pipeline_model_parallel_layout=flags.get("--pipeline-model-parallel-layout"),
        sequence_parallel="--sequence-parallel" in flags, pipeline_dtype=torch.bfloat16,
        recompute_granularity=flags.get("--recompute-granularity"), recompute_method=flags.get("--recompute-method"),
        recompute_num_layers=int(flags["--recompute-num-layers"]) if "--recompute-num-layers" in flags else None)
    assert (config.virtual_pipeline_model_parallel_size or 1) == (par.virtual_stages if par.pipeline > 1 else 1)
    distributed = "--use-distributed-optimizer" in flags
    core.DDP(use_distributed_optimizer=distributed)
    core.Opt(use_distributed_optimizer=distributed)
    # Megatron-LM's data-parallel size is the world over t x p; ranks in its order (tensor, data, pipeline).
    world = par.num_gpus
    d = world // (config.tensor_model_parallel_size * config.pipeline_model_parallel_size)
    gen = core.ps.RankGenerator(tp=config.tensor_model_parallel_size, ep=1, dp=d,
                                pp=config.pipeline_model_parallel_size, cp=1, order="tp-cp-ep-dp-pp")
    assert sorted(r for group in gen.get_ranks("dp") for r in group) == list(range(world))
    calculator = core.calc.ConstantNumMicroBatchesCalculator(
        int(flags["--global-batch-size"]), int(flags["--micro-batch-size"]), d, False, 0)
    return calculator.get()


@pytest.mark.parametrize("case", CASES + INTERLEAVED, ids=str)
def test_megatron_microbatches_and_config_are_megatrons(case):
    d, t, p, v, schedule, b, m, zero, sp, recompute = case
    profile, plan = degree_plan(*case)
    text = export_plan(plan, profile, "megatron")[".sh"]
    flags = megatron_flags(text)
    assert flags["--tensor-model-parallel-size"] == str(t) and flags["--pipeline-model-parallel-size"] == str(p)
    assert flags["--global-batch-size"] == str(b * m * d) and flags["--micro-batch-size"] == str(b)
    assert ("--sequence-parallel" in flags) == sp
    assert ("--use-distributed-optimizer" in flags) == (zero >= 1)
    assert flags.get("--recompute-granularity") == {"none": None, "full": "full", "selective": "selective"}[recompute]
    assert megatron_accepts(flags, plan) == m == plan.num_microbatches


def test_megatron_zero3_refused_and_zero2_counts_the_whole_gradients():
    profile, plan = degree_plan(2, 2, 2, 1, "1f1b", 1, 4, zero=3)
    with pytest.raises(BadInputError, match="ZeRO 3.*--zero 1"):
        export_plan(plan, profile, "megatron")
    profile, plan = degree_plan(4, 1, 2, 1, "1f1b", 1, 4, zero=2)
    text = export_plan(plan, profile, "megatron")[".sh"]
    assert "--use-distributed-optimizer" in megatron_flags(text) and "whole gradient buffer" in text
    # 5 layers of 32 MiB per stage: Megatron holds the whole gradients, (d - 1) shards more than planned
    extra = max(s.gradient_bytes for s in plan.stages) * 3
    assert extra == 120 * 2**20 and f"about {extra / GIB:.2f} GiB more per GPU" in text
    profile, tight = degree_plan(4, 1, 2, 1, "1f1b", 1, 4, zero=2, cap_bytes=200 * 2**20)  # peak 100 MiB + 120
    with pytest.raises(BadInputError, match="over the 0.20 GiB cap.*--zero 1"):
        export_plan(tight, profile, "megatron")


def test_megatron_one_pipeline_rank_has_no_layout():
    profile, plan = degree_plan(4, 2, 1, 1, "1f1b", 1, 4, zero=1, sp=True)
    flags = megatron_flags(export_plan(plan, profile, "megatron")[".sh"])
    assert "--pipeline-model-parallel-layout" not in flags
    assert megatron_accepts(flags, plan) == 4


# --------------------------------------------------------------------------- torchtitan


def torchtitan_accepts(tmp_path, text: str, world: int):
    """torchtitan's ConfigManager and ParallelDims on the TOML; its trainer's micro-batch count per replica."""
    ConfigManager = torchtitan_config_manager()
    path = tmp_path / "job.toml"
    path.write_text(text)
    config = ConfigManager().parse_args(["--job.config_file", str(path)])
    from torchtitan.distributed.parallel_dims import ParallelDims

    par = config.parallelism
    dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                        pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                        etp=par.expert_tensor_parallel_degree, world_size=world)
    # torchtitan.train.Trainer: batch degree = dp_replicate x dp_shard; accumulation steps from the global batch
    batch_degree = dims.dp_replicate * dims.dp_shard
    local, global_ = config.training.local_batch_size, config.training.global_batch_size
    assert global_ % (local * batch_degree) == 0
    accumulation = global_ // (local * batch_degree)
    # torchtitan.distributed.pipeline_parallel.build_pipeline_schedule: n_microbatches = local / microbatch
    per_step = local // par.pipeline_parallel_microbatch_size if dims.pp_enabled else 1
    return config, dims, per_step * accumulation


@pytest.mark.parametrize("case", CASES + INTERLEAVED, ids=str)
def test_torchtitan_microbatches_and_degrees_are_torchtitans(tmp_path, case):
    pytest.importorskip("torch")
    d, t, p, v, schedule, b, m, zero, sp, recompute = case
    _, plan = degree_plan(*case)
    text = export_plan(plan, None, "torchtitan")[".toml"]
    config, dims, microbatches = torchtitan_accepts(tmp_path, text, d * t * p)
    assert microbatches == m == plan.num_microbatches
    assert (dims.tp, dims.pp, dims.dp_replicate * dims.dp_shard) == (t, p, d)
    assert config.training.global_batch_size == b * m * d
    # ZeRO 0 alone is DDP; everything else shards over d (FSDP), resharding after forward only for ZeRO 3
    assert dims.fsdp_enabled == (zero >= 1 or t > 1 or p > 1)
    if dims.fsdp_enabled:
        assert config.parallelism.fsdp_reshard_after_forward == ("always" if zero == 3 else "never")
    assert config.activation_checkpoint.mode == recompute


def test_torchtitan_without_pipeline_accumulates_and_zero0_alone_is_ddp(tmp_path):
    pytest.importorskip("torch")
    _, plan = degree_plan(2, 1, 1, 1, "1f1b", 2, 6, zero=0)
    config, dims, microbatches = torchtitan_accepts(tmp_path, export_plan(plan, None, "torchtitan")[".toml"], 2)
    assert (dims.dp_replicate, dims.dp_shard, microbatches) == (2, 1, 6)
    assert config.training.local_batch_size == 2
    _, plan = degree_plan(4, 2, 1, 1, "1f1b", 1, 4, zero=3, sp=True)
    config, dims, microbatches = torchtitan_accepts(tmp_path, export_plan(plan, None, "torchtitan")[".toml"], 8)
    assert (dims.dp_shard, config.parallelism.fsdp_reshard_after_forward, microbatches) == (4, "always", 4)


def test_torchtitan_sharded_state_under_pipelining_is_checked_against_the_cap():
    _, plan = degree_plan(4, 1, 2, 1, "1f1b", 1, 4, zero=3)
    text = export_plan(plan, None, "torchtitan")[".toml"]
    assert "whole weights and gradients until the step ends" in text and "within the 80.00 GiB cap" in text
    _, tight = degree_plan(4, 1, 2, 1, "1f1b", 1, 4, zero=3, cap_bytes=300 * 2**20)  # 100 + 2 x 120 MiB
    with pytest.raises(BadInputError, match="over the 0.29 GiB cap"):
        export_plan(tight, None, "torchtitan")


def test_torchtitan_pipeline_only_plan_disables_its_default_recomputation(tmp_path):
    pytest.importorskip("torch")
    profile = llama_like_profile(6)
    plan = hand_plan(profile, [3, 6], "1f1b", 2, 1, 1, 4)
    config, dims, microbatches = torchtitan_accepts(tmp_path, export_plan(plan, None, "torchtitan")[".toml"], 2)
    assert config.activation_checkpoint.mode == "none"  # torchtitan's own default is "selective"
    assert (dims.dp_shard, dims.dp_replicate, microbatches) == (1, 1, 4)


# --------------------------------------------------------------------------- DeepSpeed


def _deepspeed():
    pytest.importorskip("torch")
    try:
        from deepspeed.runtime import config as ds_config_module
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    except Exception as exc:  # noqa: BLE001 - not installed, or no accelerator it can use
        pytest.skip(f"deepspeed does not import here: {exc}")
    return ds_config_module, PipeModelDataParallelTopology


def deepspeed_accepts(monkeypatch, exported: dict, *, derive_accumulation: bool = False):
    """DeepSpeed's own DeepSpeedConfig on the ds_config, its data-parallel size from the topology's grid."""
    ds_config_module, Topology = _deepspeed()
    topology = Topology(**exported["topology"])

    class Grid:  # what PipelineParallelGrid answers DeepSpeedConfig
        def get_data_parallel_world_size(self):
            return topology.get_dim("data")

    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda *a, **k: 0)
    config = dict(exported["ds_config"])
    if derive_accumulation:
        del config["gradient_accumulation_steps"]
    return ds_config_module.DeepSpeedConfig(config, mpu=Grid()), topology


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("derive", [False, True], ids=["given", "derived"])
def test_deepspeed_batch_checks_and_topology_are_deepspeeds(monkeypatch, case, derive):
    d, t, p, v, schedule, b, m, zero, sp, recompute = case
    _, plan = degree_plan(*case)
    exported = json.loads(export_plan(plan, None, "deepspeed")[".json"])
    config, topology = deepspeed_accepts(monkeypatch, exported, derive_accumulation=derive)
    assert config.world_size == d
    assert config.gradient_accumulation_steps == m == plan.num_microbatches
    assert config.train_batch_size == b * m * d and config.train_micro_batch_size_per_gpu == b
    assert config.zero_optimization_stage == zero
    assert topology.world_size() == d * t * p and topology.get_dim("pipe") == p
    # DeepSpeed's ranks (pipe, data, model) are Megatron's order, which the plan's layout uses
    for pipe in range(p):
        for data in range(d):
            for model in range(t):
                assert topology.get_rank(pipe=pipe, data=data, model=model) == (pipe * d + data) * t + model
    interval = exported["pipeline_module"]["activation_checkpoint_interval"]
    assert interval == (1 if recompute == "full" else 0)


@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_refuses_what_its_pipeline_engine_asserts(zero):
    from pipeplan.launchers.deepspeed.writer import DEEPSPEED_PIPELINE_ZERO_RULE

    _, plan = degree_plan(2, 1, 2, 1, "1f1b", 1, 4, zero=zero)
    with pytest.raises(BadInputError, match="PipelineEngine asserts zero_optimization.stage < 2"):
        export_plan(plan, None, "deepspeed")
    _, single = degree_plan(2, 1, 1, 1, "1f1b", 1, 4, zero=zero)
    exported = json.loads(export_plan(single, None, "deepspeed")[".json"])
    assert exported["ds_config"]["zero_optimization"] == {"stage": zero}
    assert any("not a PipelineModule" in note for note in exported["pipeplan"]["notes"])
    pytest.importorskip("torch")
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"deepspeed does not import here: {exc}")
    source = inspect.getsource(PipelineEngine.__init__)
    assert DEEPSPEED_PIPELINE_ZERO_RULE in source and "< ZeroStageEnum.gradients" in source


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_export_names_what_to_wrap_the_stages_in(case):
    d, t, p, v, schedule, b, m, zero, sp, recompute = case
    _, plan = degree_plan(*case)
    data = json.loads(export_plan(plan, None, "torch")[".json"])
    assert data["parallelism"] == {"data": d, "tensor": t, "zero_stage": zero, "sequence_parallel": sp,
                                   "global_batch": b * m * d}
    assert data["n_microbatches"] * data["microbatch_size"] * data["parallelism"]["data"] == plan.settings.global_batch


# --------------------------------------------------------------------------- real cluster plans, through the CLI

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def analytic_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("analytic") / "llama3-8b.json"
    from typer.testing import CliRunner

    from pipeplan.cli import app

    result = CliRunner().invoke(app, ["profile", "llama3-8b", "--analytic", "--gpu", "h100-sxm", "--seq-len", "2048",
                                      "--microbatch-sizes", "1,2", "--tensor-parallel", "1,2", "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.mark.parametrize("d", [2, 4])
def test_cluster_plan_exports_to_every_launcher(tmp_path, monkeypatch, analytic_profile, d):
    """`pipeplan plan --gpus` then `pipeplan export` (a subprocess); each launcher derives the plan's count."""
    plan_path = tmp_path / "plan.json"
    env_python = [sys.executable, "-m", "pipeplan"]
    subprocess.run([*env_python, "plan", str(analytic_profile), "--gpus", str(d * 2 * 2), "--cluster", "dgx-h100",
                    "--data-parallel", str(d), "--tensor-parallel", "2", "--stages", "2", "--schedule", "1f1b",
                    "--zero", "1", "--global-batch", "32", "-q", "-o", str(plan_path)], check=True, cwd=REPO)
    plan = Plan.model_validate_json(plan_path.read_text())
    assert plan.parallelism.data == d and plan.num_microbatches * plan.microbatch_size * d == 32
    m = plan.num_microbatches
    out = subprocess.run([*env_python, "export", str(plan_path), "--format", "megatron", "--profile",
                          str(analytic_profile)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert megatron_accepts(megatron_flags(out.stdout), plan) == m
    text, _ = run_export(plan_path, "torchtitan", profile_path=analytic_profile)
    _, _, microbatches = torchtitan_accepts(tmp_path, text, d * 4)
    assert microbatches == m
    text, _ = run_export(plan_path, "deepspeed")
    config, _ = deepspeed_accepts(monkeypatch, json.loads(text))
    assert config.gradient_accumulation_steps == m and config.world_size == d


def test_cluster_zero3_megatron_export_exits_2_with_one_line(tmp_path):
    profile, plan = degree_plan(2, 1, 2, 1, "1f1b", 1, 4, zero=3)
    plan_path, profile_path = tmp_path / "plan.json", tmp_path / "profile.json"
    write_text_atomic(plan_path, dump_model(plan))
    profile_path.write_bytes(profile_bytes(profile))
    out = subprocess.run([sys.executable, "-m", "pipeplan", "export", str(plan_path), "--format", "megatron",
                          "--profile", str(profile_path)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "ZeRO 3" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_deepspeed_engine_runs_a_data_parallel_export(request, tmp_path):
    """d = 2, p = 2 on 4 CPU ranks: DeepSpeed's own pipeline engine takes the export's topology and batch keys."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("DeepSpeed's engine on torchrun aborts now and then on a loaded CPU runner: "
                    "pytest -m slow tests/test_export_parallel.py")
    _deepspeed()
    _, plan = degree_plan(2, 1, 2, 1, "1f1b", 1, 4, zero=1, blocks=5)
    export = tmp_path / "plan.deepspeed.json"
    export.write_text(export_plan(plan, None, "deepspeed")[".json"])
    worker = Path(__file__).parent / "deepspeed_pipeline_worker.py"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", "29563",
         str(worker), str(export), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    parts = json.loads(export.read_text())["parts"]
    assert all(r["parts"] == parts for r in ranks)
    # ranks (pipe, data): 0, 1 are stage 0's two replicas, 2, 3 stage 1's
    assert [r["stage"] for r in ranks] == [0, 0, 1, 1]
    assert all(r["micro_batches"] == plan.num_microbatches == 4 for r in ranks)


def test_exports_carry_the_profiles_sequence_length(tmp_path):
    # Without it torchtitan trained at its default 2048 and Megatron-LM at whatever the script said,
    # not at the sequence the plan's times and memory were profiled at.
    profile, plan = degree_plan(2, 2, 2, 1, "1f1b", 1, 4)
    profile = profile.model_copy(update={"sequence_length": 4096})
    flags = megatron_flags(export_plan(plan, profile, "megatron")[".sh"])
    assert flags["--seq-length"] == "4096"
    text = export_plan(plan, profile, "torchtitan")[".toml"]
    assert "seq_len = 4096" in text
    pytest.importorskip("torch")
    config, _, _ = torchtitan_accepts(tmp_path, text, 8)
    assert config.training.seq_len == 4096
    # A profile without one (or no profile) writes none.
    bare = profile.model_copy(update={"sequence_length": None})
    assert "--seq-length" not in megatron_flags(export_plan(plan, bare, "megatron")[".sh"])
    assert "seq_len" not in export_plan(plan, None, "torchtitan")[".toml"]


def test_llama_405b_shape_at_eight_stages_per_rank_exports_to_megatron_and_torchtitan(tmp_path):
    """Llama 3.1 405B's published layout, TP 8 PP 8 VP 8: 126 blocks (129 units) on 64 stages, not all
    alike; Megatron's layout and torchtitan's TOML say 8 stages per rank, each with the plan's layers."""
    pytest.importorskip("torch")
    profile, plan = degree_plan(16, 8, 8, 8, "interleaved", 1, 96, 1, True, "none", blocks=126)
    assert len({len(s.layers) for s in plan.stages}) == 2
    flags = megatron_flags(export_plan(plan, profile, "megatron")[".sh"])
    assert megatron_accepts(flags, plan) == 96
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    layout = PipelineParallelLayerLayout(flags["--pipeline-model-parallel-layout"], 8)
    assert layout.virtual_pipeline_model_parallel_size == 8
    layout.validate_layer_layout(126, None)
    kinds = {layer.name: layer.kind for layer in profile.layers}
    for stage in plan.stages:
        built = layout.layout[stage.index % 8][stage.index // 8]
        assert built.count(LayerType.decoder) == sum(kinds[n] == "block" for n in stage.layers)
    config, dims, microbatches = torchtitan_accepts(tmp_path, export_plan(plan, None, "torchtitan")[".toml"], 1024)
    assert (microbatches, dims.pp, config.parallelism.pipeline_parallel_schedule) == (96, 8, "Interleaved1F1B")
    assert config.parallelism.module_fqns_per_model_part == [s.layers for s in plan.stages]


# --------------------------------------------------------------------------- overlap flags, export -> doctor


def _overlap_plan(d, t, p, zero, overlap, launcher=None, sp=False, bucket=None):
    profile, plan = degree_plan(d, t, p, 1, "1f1b", 1, 4, zero=zero, sp=sp)
    settings = plan.settings.model_copy(update={"overlap": overlap, "launcher": launcher, "ddp_bucket_size": bucket})
    return profile, plan.model_copy(update={"settings": settings})


@pytest.mark.parametrize("overlap", [["grad-reduce", "param-gather", "tp-comm"], ["grad-reduce"], []], ids=str)
def test_megatron_overlap_flags_round_trip_and_megatron_core_takes_them(overlap):
    from pipeplan.launchers.megatron.reader import parse_megatron

    profile, plan = _overlap_plan(4, 2, 2, 1, overlap, launcher="megatron", sp=True, bucket=134217728)
    text = export_plan(plan, profile, "megatron")[".sh"]
    flags = megatron_flags(text)
    assert ("--overlap-grad-reduce" in flags) == ("grad-reduce" in overlap)
    assert ("--overlap-param-gather" in flags) == ("param-gather" in overlap)
    assert ("--tp-comm-overlap" in flags) == ("tp-comm" in overlap)
    assert flags.get("--ddp-bucket-size") == ("134217728" if overlap else None)
    core = _megatron_core()
    # megatron-core's own configs take what the flags set (training/arguments.py copies them over)
    ddp = core.DDP(use_distributed_optimizer=True, overlap_grad_reduce="--overlap-grad-reduce" in flags,
                   overlap_param_gather="--overlap-param-gather" in flags,
                   bucket_size=int(flags["--ddp-bucket-size"]) if "--ddp-bucket-size" in flags else None)
    assert ddp.overlap_grad_reduce == ("grad-reduce" in overlap)
    import torch

    core.TC(num_layers=int(flags["--num-layers"]), hidden_size=64, num_attention_heads=8,
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, pipeline_dtype=torch.bfloat16,
            sequence_parallel=True, tp_comm_overlap="--tp-comm-overlap" in flags)
    config = parse_megatron("exported.sh", text, world_size=16)
    assert config.overlap == tuple(overlap)
    assert config.ddp_bucket_size == (134217728 if overlap else None)


def test_megatron_overlap_without_its_prerequisites_is_left_out_with_a_note():
    profile, plan = _overlap_plan(4, 2, 2, 1, ["param-gather", "tp-comm"], launcher="megatron", sp=False)
    text = export_plan(plan, profile, "megatron")[".sh"]
    flags = megatron_flags(text)
    assert "--overlap-param-gather" not in flags and "--tp-comm-overlap" not in flags
    assert "--overlap-grad-reduce" in text and "--sequence-parallel: --tp-comm-overlap left out" in text


def test_torchtitan_async_tp_round_trips_through_its_config_manager(tmp_path):
    pytest.importorskip("torch")
    from pipeplan.launchers.torchtitan.reader import parse_torchtitan

    _, plan = _overlap_plan(2, 2, 2, 1, ["grad-reduce", "param-gather", "tp-comm"], launcher="torchtitan", sp=True)
    text = export_plan(plan, None, "torchtitan")[".toml"]
    assert "enable_async_tensor_parallel = true" in text and "[compile] enable = true" in text
    config, _, _ = torchtitan_accepts(tmp_path, text, 8)
    assert config.parallelism.enable_async_tensor_parallel is True
    read = parse_torchtitan("job.toml", text, validate_with_torchtitan=False, world_size=8)
    assert "tp-comm" in read.overlap and "grad-reduce" in read.overlap
    _, plain = _overlap_plan(2, 2, 2, 1, None, launcher="torchtitan", sp=True)
    text = export_plan(plain, None, "torchtitan")[".toml"]
    assert "enable_async_tensor_parallel" not in text
    assert parse_torchtitan("job.toml", text, validate_with_torchtitan=False, world_size=8).overlap is None


@pytest.mark.parametrize("zero,overlap,keys,read", [
    (3, ["grad-reduce"], {"stage3_prefetch_bucket_size": 0}, ("grad-reduce",)),
    (3, None, {}, ("grad-reduce", "param-gather")),          # DeepSpeed's stage-3 defaults
    (2, ["grad-reduce"], {"overlap_comm": True}, ("grad-reduce",)),
    (3, [], {"overlap_comm": False, "stage3_prefetch_bucket_size": 0}, ()),
], ids=str)
def test_deepspeed_overlap_keys_round_trip_through_deepspeed_config(monkeypatch, zero, overlap, keys, read):
    from pipeplan.launchers.deepspeed.reader import parse_deepspeed

    _, plan = _overlap_plan(4, 1, 1, zero, overlap, launcher="deepspeed")
    exported = json.loads(export_plan(plan, None, "deepspeed")[".json"])
    assert exported["ds_config"]["zero_optimization"] == {"stage": zero, **keys}
    config, _ = deepspeed_accepts(monkeypatch, exported)
    assert config.zero_config.overlap_comm == ("grad-reduce" in read)
    assert (config.zero_config.prefetch_bucket_size > 0) == ("param-gather" in read or zero < 3)
    parsed = parse_deepspeed("ds.json", json.dumps(exported["ds_config"]), num_stages=1, world_size=4)
    assert parsed.overlap == read

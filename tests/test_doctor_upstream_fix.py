"""``doctor --fix`` on every real file of the upstream corpus (tests/data/doctor/upstream/, origin and
licence in its ORIGIN.md): the fixed file is accepted by the launcher's own config code, and the
fields that code builds differ from the original's in exactly what the finding states.

What checks each launcher's file:

- torchtitan v0.2.2 TOML: torchtitan's own ``ConfigManager`` (its ``JobConfig``, every field).
- Megatron core_v0.16.1 scripts: megatron-core 0.16.1 ships no ``megatron.training`` (no
  ``arguments.py`` to parse with), so the script is read with pipeplan's shell reader (never run)
  and its flags build megatron-core's own ``TransformerConfig`` and ``DistributedDataParallelConfig``
  as ``core_transformer_config_from_args`` does (a flag whose name is a field sets that field; the
  renames below); every other flag is compared as written.
- DeepSpeed: the corpus holds no DeepSpeed file (nothing from DeepSpeedExamples is stored here), so
  the repo's own pipeline example (tests/data/doctor/deepspeed_pipeline_ds_config.json) stands in,
  through DeepSpeed 0.19.8's ``DeepSpeedConfig``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import sys
import types

import pytest
from typer.testing import CliRunner

from conftest import REPO
from pipeplan.analytic.api import analytic_profile
from pipeplan.cli import app
from pipeplan.doctor import DoctorOptions, doctor_file
from pipeplan.facts.gpus import get_gpu
from pipeplan.formats.io import dump_model
from pipeplan.formats.plan import PlanSettings
from pipeplan.launchers.megatron.reader import _launch_command
from pipeplan.launchers.megatron.shell import read_script

from doctor_profiles import llama3_8b, write_profile

UPSTREAM = REPO / "tests" / "data" / "doctor" / "upstream"

pytestmark = pytest.mark.slow

#: (file, launcher, profile: (model, GPU, sequence, micro-batch sizes, tensor-parallel sizes,
#: precision), doctor's options). The world sizes are the jobs' own: torchtitan's files name their
#: GPU counts in their descriptions; the Mixtral script's 8 GPUs per node cannot hold its
#: p 4 x E 8 (Megatron refuses it), so its 8 nodes; the 175B script as written (a refusal, an error).
CASES = [
    ("torchtitan_v0.2.2_llama3_8b.toml", "torchtitan", ("llama3-8b", "a100-80gb", 8192, (1, 2), (1, 8), "bf16"),
     ["--cluster", "dgx-a100", "--world-size", "8"]),
    ("torchtitan_v0.2.2_llama3_70b.toml", "torchtitan", ("llama3-70b", "a100-80gb", 8192, (1, 8), (1, 8), "bf16"),
     ["--cluster", "dgx-a100", "--world-size", "64"]),
    ("torchtitan_v0.2.2_llama3_405b.toml", "torchtitan", ("llama3-405b", "a100-80gb", 8192, (1, 2), (1, 8), "bf16"),
     ["--cluster", "dgx-a100", "--world-size", "128"]),
    ("megatron_core_v0.16.1_train_gpt3_175b_distributed.sh", "megatron",
     ("gpt3-175b", "a100-80gb", 2048, (1,), (8,), "bf16"), ["--cluster", "dgx-a100"]),
    ("megatron_core_v0.16.1_train_llama3_8b_h100_fp8.sh", "megatron",
     ("llama3-8b", "h100-sxm", 8192, (1,), (1,), "fp8"), ["--cluster", "dgx-h100"]),
    ("megatron_core_v0.16.1_train_mixtral_8x7b_distributed.sh", "megatron",
     ("mixtral-8x7b", "h100-sxm", 4096, (1,), (1,), "bf16"), ["--cluster", "dgx-h100", "--world-size", "64"]),
]


def test_every_file_of_the_corpus_is_checked():
    assert {name for name, *_ in CASES} == {p.name for p in UPSTREAM.iterdir() if p.name != "ORIGIN.md"}


def _stated(launcher: str, output: str) -> dict:
    """The fields the gap-to-best finding says change, and to what (empty: no change stated)."""
    line = next(w for w in output.splitlines() if "[gap-to-best]" in w)
    if "as fast as pipeplan's best plan" in line:
        return {}
    recipe = line.split("): ", 1)[1]
    stated = {}
    for step in recipe.split(", "):
        if step == "drop recomputation":
            stated.update({"activation_checkpoint.mode": "none"} if launcher == "torchtitan" else
                          {"recompute_granularity": None})
        elif (m := re.fullmatch(r"micro-batch size (\d+) \((\d+) micro-batches\)", step)) and launcher == "torchtitan":
            # Without a pipeline: local_batch_size is the micro-batch, the global batch kept by
            # gradient accumulation (training.global_batch_size; its value checked by the caller).
            stated.update({"training.local_batch_size": int(m.group(1)),
                           "training.global_batch_size": ("kept", int(m.group(1)) * int(m.group(2)))})
        elif m := re.fullmatch(r"use interleaved with v = (\d+)", step):
            assert launcher == "megatron", step
            # Megatron's interleaving is the layout's virtual stages (TransformerConfig derives v).
            stated.update({"virtual_pipeline_model_parallel_size": int(m.group(1)),
                           "pipeline_model_parallel_layout": "a layout"})
        else:
            pytest.fail(f"a step this test does not know how to check: {step!r}")
    return stated


# ----------------------------------------------------------------------------------- torchtitan

def _torchtitan_fields(path) -> dict:
    """Every leaf of the JobConfig torchtitan's own ConfigManager builds from the file."""
    pytest.importorskip("torch")
    if "torchtitan" not in sys.modules:
        # torchtitan/__init__ pulls its model registry (triton); the config needs none of it
        # (pipeplan.launchers.torchtitan.reader loads it the same way).
        import importlib.util

        spec = importlib.util.find_spec("torchtitan")
        if spec is None:
            pytest.skip("torchtitan not installed")
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    from torchtitan.config import ConfigManager

    with contextlib.redirect_stdout(io.StringIO()):
        job = ConfigManager().parse_args(["--job.config_file", str(path)])
    out = {}
    job.job.config_file = None  # the file's own path, not a setting
    for table, values in dataclasses.asdict(job).items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            out[f"{table}.{key}"] = value
    return out


# ------------------------------------------------------------------------------------- Megatron

#: Flags whose TransformerConfig field has another name or sense (megatron/training/arguments.py,
#: core_transformer_config_from_args and its argparse definitions, core_v0.16.1).
_MEGATRON_RENAMES = {
    "--num-experts": ("num_moe_experts", None),
    "--swiglu": ("gated_linear_unit", True),
    "--disable-bias-linear": ("add_bias_linear", False),
    "--no-masked-softmax-fusion": ("masked_softmax_fusion", False),
    "--fp8-format": ("fp8", None),
    "--fp8-param-gather": ("fp8_param", True),
}


def _value(words: list[str]):
    def one(word):
        for kind in (int, float):
            with contextlib.suppress(ValueError):
                return kind(word)
        return word
    return True if not words else one(words[0]) if len(words) == 1 else [one(w) for w in words]


def _megatron_flags(path) -> dict:
    """Flag to its words in the command that trains (the last occurrence wins, as in argparse)."""
    _, args = _launch_command(read_script(str(path), path.read_text()))
    flags, i = {}, 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        words, i = ([inline], i + 1) if eq else ([], i + 1)
        while not eq and i < len(args) and not args[i].startswith("--"):
            words.append(args[i])
            i += 1
        flags[name] = words
    return flags


def _megatron_fields(path) -> dict:
    """megatron-core's TransformerConfig and DistributedDataParallelConfig built from the flags
    (their own checks run: a layout it refuses raises), every other flag as written."""
    pytest.importorskip("torch")
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    configs = {TransformerConfig: {}, DistributedDataParallelConfig: {}}
    names = {kind: {f.name for f in dataclasses.fields(kind)} for kind in configs}
    raw = {}
    for flag, words in _megatron_flags(path).items():
        field, value = _MEGATRON_RENAMES.get(flag, (flag[2:].replace("-", "_"), None))
        value = _value(words) if value is None else value
        homes = [kind for kind in configs if field in names[kind]]
        for kind in homes:
            configs[kind][field] = value
        if not homes:
            raw[flag] = words
    core = configs[TransformerConfig]
    # validate_args (arguments.py) turns sequence parallelism off at tensor-parallel 1, with a warning.
    if core.get("tensor_model_parallel_size", 1) == 1:
        core["sequence_parallel"] = False
    # arguments.py: pipeline_dtype = params_dtype (--bf16 / --fp16).
    core["pipeline_dtype"] = torch.bfloat16 if core.get("bf16") else torch.float16 if core.get("fp16") else torch.float32
    with contextlib.redirect_stdout(io.StringIO()):
        built = [kind(**kwargs) for kind, kwargs in configs.items()]
    out = dict(raw)
    for config in built:
        for f in dataclasses.fields(config):
            out[f.name] = _comparable(getattr(config, f.name))
    return out


def _comparable(value):
    """A field's value as something ``==`` compares by content (a layout's stages, an init method's
    function and arguments: megatron-core builds a new ``functools.partial`` per config)."""
    import functools

    if hasattr(value, "layout"):
        return value.layout
    if isinstance(value, functools.partial):
        return (_comparable(value.func), value.args, tuple(sorted(value.keywords.items())))
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return value


# ---------------------------------------------------------------------------------- the check

@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("upstream_fix"), {}
    for _, _, (model, gpu, seq, sizes, tp, precision), _ in CASES:
        key = (model, gpu, precision)
        if key not in out:
            out[key] = root / f"{model}-{gpu}-{precision}.json"
            out[key].write_text(dump_model(analytic_profile(model, get_gpu(gpu), seq_len=seq, microbatch_sizes=sizes,
                                                            tensor_parallel=tp, precision=precision)))
    return out


@pytest.mark.parametrize("name, launcher, profile, extra", CASES, ids=[c[0] for c in CASES])
def test_fix_is_accepted_and_changes_exactly_what_its_finding_states(profiles, tmp_path, name, launcher, profile,
                                                                      extra):
    path, fixed = UPSTREAM / name, tmp_path / name
    model, gpu, _, _, _, precision = profile
    result = CliRunner().invoke(app, ["doctor", launcher, str(path), "--profile", str(profiles[(model, gpu, precision)]),
                                      "--same-layout", *extra, "--fix", "-o", str(fixed)])
    assert result.exit_code in (0, 1), result.output
    fields = _torchtitan_fields if launcher == "torchtitan" else _megatron_fields
    before, after = fields(path), fields(fixed)  # the launcher's config code accepts both
    changed = {key: after.get(key) for key in set(before) | set(after) if before.get(key) != after.get(key)}
    stated = _stated(launcher, result.output)
    assert set(changed) == set(stated), (changed, result.output)
    for key, value in stated.items():
        if key == "training.global_batch_size":  # M micro-batches of N in place of one batch of M x N
            assert before["training.local_batch_size"] == value[1], (before["training.local_batch_size"], value)
            assert changed[key] % value[1] == 0 and changed[key] > 0, changed[key]
        elif key != "pipeline_model_parallel_layout":
            assert changed[key] == value, (key, changed[key])
    if stated:  # the finding names the launcher settings that change
        lines = result.output.splitlines()
        setting = lines[next(i for i, w in enumerate(lines) if "[gap-to-best]" in w) + 1]
        named = {"activation_checkpoint.mode": "activation_checkpoint.mode",
                 "virtual_pipeline_model_parallel_size": "--pipeline-model-parallel-layout"}
        for key in set(stated) & set(named):
            assert named[key] in setting, setting


def test_the_corpus_findings_are_the_ones_a_careful_engineer_draws(profiles, tmp_path):
    """What the check above checks, pinned: 8B TOML drops recomputation; 70B TOML drops it too, at
    micro-batch 1 with gradient accumulation 8 (the FSDP gathers per micro-batch hidden by FSDP2's
    prefetch since the overlap terms); 405B TOML and the 8B FP8 script are already the best
    (nothing to change); the 175B and Mixtral scripts interleave."""
    expected = {"torchtitan_v0.2.2_llama3_8b.toml": {"activation_checkpoint.mode"},
                "torchtitan_v0.2.2_llama3_70b.toml": {"activation_checkpoint.mode", "training.local_batch_size",
                                                      "training.global_batch_size"},
                "megatron_core_v0.16.1_train_gpt3_175b_distributed.sh": {"virtual_pipeline_model_parallel_size",
                                                                         "pipeline_model_parallel_layout"},
                "megatron_core_v0.16.1_train_mixtral_8x7b_distributed.sh": {"virtual_pipeline_model_parallel_size",
                                                                            "pipeline_model_parallel_layout"}}
    for name, launcher, (model, gpu, _, _, _, precision), extra in CASES:
        result = CliRunner().invoke(app, ["doctor", launcher, str(UPSTREAM / name), "--profile",
                                          str(profiles[(model, gpu, precision)]), "--same-layout", *extra])
        assert set(_stated(launcher, result.output)) == expected.get(name, set()), (name, result.output)


# ------------------------------------------------------------------------------------ DeepSpeed

def test_deepspeed_fix_is_accepted_by_deepspeedconfig_and_changes_what_its_finding_states(monkeypatch, tmp_path):
    """No DeepSpeed file in the corpus: the repo's pipeline example, through DeepSpeedConfig."""
    pytest.importorskip("torch")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from deepspeed.runtime import config as ds_config_module
    except Exception as exc:  # noqa: BLE001 - not installed, or no accelerator it can use
        pytest.skip(f"deepspeed does not import here: {exc}")
    world = 8

    class Grid:  # what PipelineParallelGrid answers DeepSpeedConfig: d = world / p
        def get_data_parallel_world_size(self):
            return world // 4

    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda *a, **k: 0)
    source = REPO / "tests" / "data" / "doctor" / "deepspeed_pipeline_ds_config.json"
    out = tmp_path / "fixed.json"
    profile = write_profile(llama3_8b(), tmp_path / "profile.json")
    settings = PlanSettings(stages=1, global_batch=1, memory_cap_bytes=80 * 2**30, bandwidth_bytes_per_s=25e9)
    result, text, _ = doctor_file("deepspeed", source, profile, settings, fix_output=out,
                                  options=DoctorOptions(num_stages=4, world_size=world, partition_method="uniform"))

    def fields(path):
        config = ds_config_module.DeepSpeedConfig(json.loads(path.read_text()), mpu=Grid())
        return {k: v for k, v in vars(config).items() if isinstance(v, (bool, int, float, str, type(None)))}

    before, after = fields(source), fields(out)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    gap = next(f for f in result.findings if f.code == "gap-to-best")
    best = result.best
    stated = set()
    if f"micro-batch size {best.microbatch_size} ({best.num_microbatches} micro-batches)" in gap.message:
        stated = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    assert changed == stated, (changed, text)
    assert (after["train_micro_batch_size_per_gpu"], after["gradient_accumulation_steps"]) == \
        (best.microbatch_size, best.num_microbatches)
    assert after["train_batch_size"] == before["train_batch_size"]

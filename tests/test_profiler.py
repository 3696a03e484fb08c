"""Tests of the profiler: built-in models, units and edges, measured bytes, user models, errors."""

from __future__ import annotations

import platform
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from pipeplan.errors import BadInputError  # noqa: E402
from pipeplan.formats.io import dump_model, load_profile, write_json_atomic  # noqa: E402
from pipeplan.profile import profile_model  # noqa: E402
from pipeplan.profile.loading import load_bundle, make_microbatch  # noqa: E402
from pipeplan.profile.models import build_model, loss_fn  # noqa: E402
from pipeplan.profile.units import build_stage, default_units, select_units, trace_units  # noqa: E402
from pipeplan.profile.measure import measure_unit  # noqa: E402
from pipeplan.profile.memory import parameter_storages, saved_activation_bytes  # noqa: E402

pytestmark = pytest.mark.torch

CPU = torch.device("cpu")
FAST = dict(repeats=1, warmup=0, threads=1)
TINY_GPT = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64}


# --------------------------------------------------------------------------- hand-computed bytes
class ExplicitAttention(nn.Module):
    """Single-head attention from primitive ops, so every saved tensor is known."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        p = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.wo(p @ v)


def _measure(module, *inputs):
    return measure_unit(module, (tuple(inputs), {}), device=CPU, repeats=1, warmup=0,
                        exclude=parameter_storages(module))


def test_linear_bytes_match_hand_count():
    batch, d_in, d_out = 4, 8, 3
    m = _measure(nn.Linear(d_in, d_out), torch.randn(batch, d_in))
    # Linear keeps only its input for the weight gradient (the weight itself is a parameter).
    assert m.activation_bytes == batch * d_in * 4
    assert m.output_bytes == batch * d_out * 4
    # B and W are timed as torch splits them; on a unit this small torch's bookkeeping alone
    # can make B longer than a whole backward, so no bound against backward_ms holds.
    assert m.backward_input_ms is not None and m.backward_input_ms >= 0
    assert m.backward_weight_ms is not None and m.backward_weight_ms >= 0


def test_attention_bytes_match_hand_count():
    b, s, d = 2, 5, 8
    m = _measure(ExplicitAttention(d), torch.randn(b, s, d))
    # x (shared by the three projections), q, k, v, p@v: b*s*d each; softmax output p: b*s*s.
    assert m.activation_bytes == 4 * (5 * b * s * d + b * s * s)
    assert m.output_bytes == 4 * b * s * d


def test_saved_bytes_exclude_parameters_and_count_storages_once():
    lin = nn.Linear(6, 6, bias=False)
    x = torch.randn(3, 6, requires_grad=True)
    with saved_activation_bytes(exclude=parameter_storages(lin)) as saved:
        y = lin(x)
        z = lin(y) + lin(x)  # x saved twice, counted once
    assert saved.bytes == 2 * 3 * 6 * 4
    z.sum().backward()


def test_gpt2_block_bytes_in_bf16_are_half_of_fp32():
    fp32 = profile_model("gpt2-tiny", microbatch_sizes=[2], seq_len=8, options=TINY_GPT,
                         whole_model_check=False, **FAST)
    bf16 = profile_model("gpt2-tiny", microbatch_sizes=[2], seq_len=8, options=TINY_GPT, dtype="bf16",
                         whole_model_check=False, **FAST)
    block32, block16 = fp32.layers[1], bf16.layers[1]
    assert block16.param_bytes * 2 == block32.param_bytes
    assert block16.costs[0].output_bytes * 2 == block32.costs[0].output_bytes == 2 * 8 * 32 * 4


# --------------------------------------------------------------------------- profile_model
def test_profile_gpt2_tiny_is_a_valid_measured_profile(tmp_path):
    prof = profile_model("gpt2-tiny", microbatch_sizes="2,1", seq_len=16, options=TINY_GPT, **FAST)
    assert [layer.name for layer in prof.layers] == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    assert [layer.kind for layer in prof.layers] == ["embedding", "block", "block", "norm", "head"]
    assert prof.source == "measured" and prof.sequence_length == 16 and prof.edges is None
    assert prof.microbatch_sizes == [1, 2]
    assert "measured with the loss" in prof.layers[-1].description
    for layer in prof.layers:
        for cost in layer.costs:
            # Timed as torch's split passes: both present; splitting may cost more than B alone.
            assert cost.backward_input_ms >= 0 and cost.backward_weight_ms >= 0
            assert cost.forward_spread is not None and cost.backward_spread is not None
    # Token ids need no gradient: the embedding's backward is all weight gradient.
    assert prof.layers[0].costs[0].backward_input_ms == 0
    assert prof.layers[0].costs[0].backward_weight_ms == prof.layers[0].costs[0].backward_ms
    assert "stage_backward_input" in prof.measurement["backward_split"]
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert prof.measurement["allocator"].startswith("glibc keeps freed memory")
    # Output of a block: micro-batch * seq * hidden fp32 values.
    assert prof.layers[1].cost_at(2).output_bytes == 2 * 16 * 32 * 4
    assert prof.layers[1].cost_at(2).activation_bytes > prof.layers[1].cost_at(1).activation_bytes
    check = prof.measurement["whole_model_check"]
    assert [c["microbatch_size"] for c in check] == [1, 2]
    assert all(c["ratio"] > 0 for c in check)
    for key in ("torch_version", "threads", "repeats", "warmup", "load_average_before", "dtype"):
        assert key in prof.measurement
    path = tmp_path / "p.json"
    write_json_atomic(path, prof)
    assert dump_model(load_profile(path)) == path.read_text()


def test_activation_bytes_of_units_add_up_to_the_whole_model():
    prof = profile_model("gpt2-tiny", microbatch_sizes=[2], seq_len=8, options=TINY_GPT,
                         whole_model_check=False, **FAST)
    bundle = load_bundle("gpt2-tiny", **TINY_GPT)
    (ids,), target = make_microbatch(bundle, 2, 8, seed=2)
    with saved_activation_bytes(exclude=parameter_storages(bundle.model)) as saved:
        loss = loss_fn(bundle.model(ids), target)
    loss.backward()
    assert sum(layer.costs[0].activation_bytes for layer in prof.layers) == saved.bytes


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_other_transformer_families_profile(name):
    prof = profile_model(name, microbatch_sizes=[1], seq_len=8, options={"layers": 1, "hidden": 32, "vocab": 64},
                         whole_model_check=False, **FAST)
    assert prof.layers[0].kind == "embedding" and prof.layers[-1].kind == "head"
    assert prof.layers[1].name == "blocks.0"


def test_convnet_records_the_skip_edge():
    prof = profile_model("convnet-tiny", microbatch_sizes=[1], options={"layers": 2, "hidden": 4,
                         "image_size": 8}, whole_model_check=False, **FAST)
    assert [layer.name for layer in prof.layers] == ["stem", "blocks.0", "blocks.1", "fuse", "head"]
    assert ("stem", "fuse") in prof.edges and ("blocks.1", "fuse") in prof.edges
    assert prof.sequence_length is None


# --------------------------------------------------------------------------- units and edges
def test_select_units_refines_only_where_asked():
    model = build_model("gpt2-tiny", **TINY_GPT)
    assert default_units(model) == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    assert select_units(model, ["blocks.0.*"])[:6] == [
        "embed", "blocks.0.ln_1", "blocks.0.attn", "blocks.0.ln_2", "blocks.0.mlp", "blocks.1"]
    with pytest.raises(BadInputError, match="matches no module"):
        select_units(model, ["encoder.layer.*"])


def test_fx_edges_see_through_ops_between_units():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            return self.c(torch.relu(self.b(h)) + h)

    graph = trace_units(Skip(), ["a", "b", "c"])
    assert graph.edges == [("a", "b"), ("a", "c"), ("b", "c")]
    assert graph.args["c"] is None  # an op sits between units: no stage from units alone


def test_capture_fallback_finds_the_same_edges_when_fx_fails():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            if h.sum() > 1e9:  # data-dependent control flow defeats torch.fx
                h = h * 2
            return self.c(torch.relu(self.b(h)) + h)

    from pipeplan.profile.capture import capture

    with pytest.raises(Exception):
        trace_units(Untraceable(), ["a", "b", "c"])
    seen = capture(Untraceable(), ["a", "b", "c"], (torch.randn(2, 4),))
    assert seen.graph.edges == [("a", "b"), ("a", "c"), ("b", "c")]


class _SharedDropout(nn.Module):
    """T5Stack's shape: one dropout module called before and after the blocks."""

    def __init__(self, shared_weights: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.drop = nn.Linear(4, 4) if shared_weights else nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.b(self.a(self.drop(x))))


def test_a_unit_without_parameters_called_twice_is_code_between_units():
    from pipeplan.profile.capture import capture

    graph = trace_units(_SharedDropout(), ["drop", "a", "b"])
    assert (graph.units, graph.repeated, graph.edges) == (["a", "b"], ["drop"], [("a", "b")])
    seen = capture(_SharedDropout(), ["drop", "a", "b"], (torch.randn(2, 4),))
    assert (seen.order, seen.graph.repeated, seen.graph.edges) == (["a", "b"], ["drop"], [("a", "b")])
    assert sorted(seen.calls) == ["a", "b"]


def test_a_unit_with_parameters_called_twice_is_refused_by_name():
    from pipeplan.profile.capture import capture

    for find in (lambda m, u: trace_units(m, u), lambda m, u: capture(m, u, (torch.randn(2, 4),))):
        with pytest.raises(BadInputError, match=r"unit 'drop' ran more than once in one forward and holds "
                                                r"parameters .*choose units that contain every call"):
            find(_SharedDropout(shared_weights=True), ["drop", "a", "b"])


# --------------------------------------------------------------------------- stages
def test_stages_built_alone_equal_the_full_model():
    full = build_model("gpt2-tiny", seed=3, **TINY_GPT)
    first = build_stage("gpt2-tiny", ["embed", "blocks.0"], seed=3, **TINY_GPT)
    second = build_stage("gpt2-tiny", ["blocks.1", "norm", "head"], seed=3, **TINY_GPT)
    full_params = dict(full.named_parameters())
    for stage in (first, second):
        for name, param in stage.named_parameters():
            assert torch.equal(param, full_params[name]), name
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(second(first(ids)), full(ids))


def test_convnet_stage_passes_the_skip_through():
    opts = {"layers": 2, "hidden": 4, "image_size": 8}
    full = build_model("convnet-tiny", **opts).eval()
    s1 = build_stage("convnet-tiny", ["stem", "blocks.0"], **opts).eval()
    s2 = build_stage("convnet-tiny", ["blocks.1", "fuse", "head"], **opts).eval()
    assert s1.outputs == [("unit", "stem"), ("unit", "blocks.0")] == s2.inputs
    images = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(s2(*s1(images)), full(images))
    with pytest.raises(BadInputError, match="not consecutive"):
        build_stage("convnet-tiny", ["stem", "blocks.1"], **opts)


# --------------------------------------------------------------------------- user models
USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from pipeplan.profile import InputSpec, ModelBundle

    class Net(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.inp = nn.Linear(6, width)
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
            self.out = nn.Linear(width, 3)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.out(x)

    def build(hidden=8):
        def make_batch(microbatch_size):
            return torch.randn(microbatch_size, 6), torch.randint(0, 3, (microbatch_size,))
        return Net(hidden), make_batch, torch.nn.functional.cross_entropy

    def build_spec():
        return Net(8), [InputSpec(shape=(6,))]

    def build_bundle():
        return ModelBundle(model=Net(8), input_spec=[InputSpec(shape=(6,))], units=["inp", "layers.*", "out"],
                           kinds={"out": "head"})

    def build_raising():
        def make_batch(microbatch_size):
            raise ValueError("no data here")
        return Net(8), make_batch

    def build_misfit():
        return Net(8), [InputSpec(shape=(7,))]

    def build_model_only():
        return Net(8)
    """
)


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "pp_user_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pp_user_models"
    sys.modules.pop("pp_user_models", None)


def test_user_model_with_factory_and_loss(user_module):
    prof = profile_model(f"{user_module}:build", microbatch_sizes=[1, 2], options={"hidden": 16}, **FAST)
    assert [layer.name for layer in prof.layers] == ["inp", "layers.0", "layers.1", "out"]
    assert prof.layers[1].param_bytes == (16 * 16 + 16) * 4  # --hidden reached the callable
    assert prof.layers[1].cost_at(2).output_bytes == 2 * 16 * 4
    assert "measured with the loss" in prof.layers[-1].description


def test_user_model_with_input_spec_and_bundle(user_module):
    prof = profile_model(f"{user_module}:build_spec", microbatch_sizes=[1], **FAST)
    assert prof.layers[0].costs[0].activation_bytes == 6 * 4  # the Linear keeps its input
    prof = profile_model(f"{user_module}:build_bundle", microbatch_sizes=[1], **FAST)
    assert prof.layers[-1].kind == "head"


@pytest.mark.parametrize(
    "callable_name, pattern",
    [
        ("build_raising", "factory raised ValueError"),
        ("build_misfit", "failed at micro-batch size 1"),
        ("build_model_only", "returned only a model"),
        ("no_such_function", "has no attribute"),
    ],
)
def test_user_model_errors_say_what_to_change(user_module, callable_name, pattern):
    with pytest.raises(BadInputError, match=pattern):
        profile_model(f"{user_module}:{callable_name}", microbatch_sizes=[1], **FAST)


def test_unknown_module_is_bad_input():
    with pytest.raises(BadInputError, match="cannot import module"):
        profile_model("no_such_pkg_xyz:build", microbatch_sizes=[1], **FAST)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(model="gpt9"), "not a built-in model"),
        (dict(model="gpt2-tiny", units=["encoder.layer.*"]), "matches no module"),
        (dict(model="gpt2-tiny", seq_len=4096), "longer than the model's 512 positions"),
        (dict(model="gpt2-tiny", microbatch_sizes="1,x"), "not an integer"),
        (dict(model="gpt2-tiny", dtype="fp8"), "fp32, bf16 or fp16"),
        (dict(model="gpt2-tiny", options={"image_size": 3}), "does not apply"),
        (dict(model="gpt2-tiny", options={"hidden": 30, "heads": 4}), "not divisible"),
        (dict(model="gpt2-tiny", device="tpu"), "not known"),
    ],
)
def test_bad_input_names_the_fix(kwargs, pattern):
    kwargs.setdefault("microbatch_sizes", [1])
    with pytest.raises(BadInputError, match=pattern):
        profile_model(**{**FAST, **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_bad_input():
    with pytest.raises(BadInputError, match="no CUDA"):
        profile_model("gpt2-tiny", microbatch_sizes=[1], device="cuda", **FAST)


def test_stage_from_a_profile_rebuilds_the_profiled_model():
    from pipeplan.profile.units import build_stage_from_profile

    prof = profile_model("gpt2-tiny", microbatch_sizes=[1], seq_len=8, options=TINY_GPT,
                         whole_model_check=False, **FAST)
    stage = build_stage_from_profile(prof, [layer.name for layer in prof.layers[-2:]])
    assert stage.unit_names == ["norm", "head"]
    assert stage.get_submodule("head").proj.weight.shape == (64, 32)  # --vocab and --hidden kept


def test_keep_freed_memory_applies_once_on_glibc():
    from pipeplan.profile.allocator import keep_freed_memory

    first = keep_freed_memory()
    assert keep_freed_memory() is first
    assert first is (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")

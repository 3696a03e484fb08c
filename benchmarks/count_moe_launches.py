"""Count the kernels Megatron-core's MoE layer launches per layer, forward and backward.

Runs megatron-core's ``MoELayer`` (the version in the environment: 0.16.1 here) on CPU tensors
with the all-to-all token dispatcher at expert-parallel degree 1, the unfused router (softmax
top-k, the ``aux_loss`` load-balancing loss) and permutation (``moe_router_fusion`` and
``moe_permute_fusion`` off, their defaults), and the local ``SequentialMLP`` (one loop step per
expert), and counts the aten ops that launch a kernel on a GPU (torch's profiler; views,
allocations and host-side ops left out). Two expert counts give the per-expert loop's share and
the rest; the router alone gives its own. The CUDA-only calls the dispatcher makes on a GPU
(its side stream for the device-to-host copies of the token counts) are stubbed, which removes
no kernel. pipeplan's analytic MoE parts carry these counts as their launches
(``pipeplan/analytic/flops.py``, docs/analytic.md, "Host overhead").

Usage: .venv/bin/python benchmarks/count_moe_launches.py
Measured 2026-12-02 with megatron-core 0.16.1, torch 2.13 (CPU): router forward 26, backward 19;
the dispatcher's permute, sort and unpermute forward 19, backward 12; each local expert of the
SequentialMLP forward 7, backward 13.
"""

from __future__ import annotations

import contextlib
import os

#: Ops that launch no kernel (views, allocations, host-side queries).
NOT_KERNELS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::as_strided", "aten::view", "aten::t", "aten::transpose",
    "aten::expand", "aten::reshape", "aten::_reshape_alias", "aten::split", "aten::narrow", "aten::slice",
    "aten::detach", "aten::alias", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::resize_",
    "aten::chunk", "aten::select", "aten::lift_fresh", "aten::result_type", "aten::_unsafe_view",
    "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg", "aten::is_nonzero", "aten::item",
    "aten::_local_scalar_dense", "aten::size", "aten::stride", "aten::contiguous", "aten::to", "aten::_to_copy",
    "aten::lift", "aten::squeeze_", "aten::split_with_sizes", "aten::numpy_T",
    "aten::_has_compatible_shallow_copy_type", "aten::set_", "aten::unsqueeze_", "aten::view_as", "aten::numel",
    "aten::sym_size"})


def kernels(fn) -> int:
    """Kernel-launching aten ops ``fn`` runs (an op none of whose children launches one)."""
    import torch

    with torch.profiler.profile() as prof:
        fn()

    def launches(event):
        return event.name.startswith("aten::") and event.name not in NOT_KERNELS

    return sum(1 for e in prof.events() if launches(e) and not any(launches(c) for c in e.cpu_children))


def _stub_cuda(torch) -> None:
    class _Event:
        def synchronize(self):
            pass

    class _Stream:
        def wait_stream(self, other):
            pass

        def record_event(self, event=None):
            return _Event()

        def __eq__(self, other):
            return True

        def __hash__(self):
            return 0

    stream = _Stream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"


def layer_counts(experts: int) -> dict:
    """``{"forward", "backward", "router_forward", "router_backward"}`` kernels of one MoE layer."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = None  # megatron-core names it without Transformer Engine installed
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=32, moe_ffn_hidden_size=32,
        num_moe_experts=experts, moe_router_topk=4, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3, gated_linear_unit=True,
        add_bias_linear=False, bf16=False, params_dtype=torch.float32, moe_grouped_gemm=False,
        use_cpu_initialization=True)
    layer = MoELayer(config, get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False).submodules.mlp.submodules)
    x = torch.randn(32, 2, 64, requires_grad=True)

    def forward():
        return layer(x)[0]

    def both():
        forward().sum().backward()

    def router_both():
        layer.router(x)[0].sum().backward()

    both()
    f, fb = kernels(forward), kernels(both)
    rf, rfb = kernels(lambda: layer.router(x)), kernels(router_both)
    return {"forward": f, "backward": fb - f, "router_forward": rf, "router_backward": rfb - rf}


def main() -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    _stub_cuda(torch)
    few, many = layer_counts(8), layer_counts(16)
    per_expert = {k: (many[k] - few[k]) / 8 for k in ("forward", "backward")}
    rest = {k: few[k] - 8 * per_expert[k] for k in ("forward", "backward")}
    print(f"router: forward {few['router_forward']}, backward {few['router_backward']}")
    print(f"dispatcher (permute, sort, unpermute): forward {rest['forward'] - few['router_forward']:.0f}, "
          f"backward {rest['backward'] - few['router_backward']:.0f}")
    print(f"each local expert (SequentialMLP): forward {per_expert['forward']:.0f}, backward {per_expert['backward']:.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

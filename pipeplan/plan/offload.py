"""CPU activation offload as Megatron-core runs it: ``--cpu-offloading --cpu-offloading-num-layers N``.

Megatron-core (``TransformerConfig.cpu_offloading``, ``cpu_offloading_num_layers``,
``cpu_offloading_activations`` True by default, ``cpu_offloading_weights`` False,
``cpu_offloading_double_buffering`` False) hands its transformer block a CPU-offload context
(``transformer_block.py``: ``get_cpu_offload_context``, Transformer Engine's
``transformer_engine/pytorch/cpu_offload_v1.py``): the saved activations of the first N layers are copied
to host memory on a side stream (D2H) while later layers run their forward, and copied back (H2D)
one group ahead of the backward that needs them (``AsyncDoubleBufferGroupOffloadHandler``: group
``i`` is synchronised at layer ``(L // N) (i + 1) - 1``, so each copy has ``L // N`` layers of
compute to hide behind). Its checks (``transformer_config.py``, megatron-core 0.16.1): N below the
model's layer count, no pipeline parallelism, no activation recomputation, no CUDA graphs.

Costed here:

- **memory**: each offloaded layer's saved activations leave the GPU, except one layer's worth,
  the group in flight (offloading in the forward, prefetched in the backward: the handler's
  double buffer), so the GPU keeps ``sum over kept layers + max over offloaded layers`` of the
  activations (:func:`with_cpu_offload`). With ``cpu_offloading_double_buffering`` (off by
  default, and not exported) TE keeps two reload buffers of a group for the whole step: not costed;
- **time**, per micro-batch and offloaded layer ``i`` with saved bytes ``A_i``, forward ``F_i``
  and backward ``B_i`` on the host link's one-direction bandwidth ``bw``
  (:data:`pipeplan.facts.gpus.HOST_LINK_BYTES_PER_S`) and window ``w = L // N``::

      exposed_i = max(0, A_i / bw - w F_i) + max(0, A_i / bw - w B_i)

  and the iteration adds ``m x sum_i exposed_i`` (one pipeline rank: its micro-batches run one
  after the other), the plan's ``cpu_offload_ms``: each layout of the cluster search is costed
  with it (:func:`offload_view`).

docs/cost-model.md, "CPU activation offload".
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.errors import BadInputError
from pipeplan.facts.gpus import HOST_LINK_BYTES_PER_S

__all__ = ["check_cpu_offload", "offloaded_layers", "with_cpu_offload", "offload_exposed_ms", "offload_view",
           "with_offload_note", "host_link_bytes_per_s"]


def _blocks(profile) -> list:
    """The transformer layers (kind ``block``; every layer where the profile names no kinds)."""
    named = any(layer.kind for layer in profile.layers)
    return [layer for layer in profile.layers if not named or layer.kind == "block"]


def offloaded_layers(profile, n: int) -> list[str]:
    """The names of the first ``n`` transformer layers (Megatron offloads from the first)."""
    return [layer.name for layer in _blocks(profile)[:n]]


def check_cpu_offload(settings, profile):
    """The settings Megatron runs offload under, or a one-line :class:`BadInputError`.

    ``--stages`` defaults to 1 and ``--recompute auto`` to none (Megatron-core refuses pipeline
    parallelism and recomputation with ``cpu_offloading``); anything else is refused, as is N at or
    above the profile's transformer layers.
    """
    n = settings.cpu_offload_layers
    if n is None:
        return settings
    where = f"--cpu-offload-layers {n}"
    if settings.launcher != "megatron":
        raise BadInputError(f"{where}: Megatron-core's --cpu-offloading; give --launcher megatron")
    blocks = len(_blocks(profile))
    if n >= blocks:
        raise BadInputError(f"{where}: must be below the profile's {blocks} transformer layers "
                            f"(Megatron-core: cpu_offloading_num_layers < num_layers)")
    if settings.stages not in (None, 1) or settings.virtual_stages not in (None, 1):
        raise BadInputError(f"{where}: Megatron-core has no pipeline parallelism with CPU offloading; "
                            f"give --stages 1 (or leave it out)")
    if settings.recompute not in ("auto", "none") or settings.recompute_method or settings.recompute_modules:
        raise BadInputError(f"{where}: Megatron-core refuses CPU offloading with activation recomputation; "
                            f"give --recompute none (or leave it out)")
    if settings.num_gpus is None:
        raise BadInputError(f"{where}: a cluster plan's option (the host link is the cluster GPU's); give "
                            f"--gpus and --cluster")
    host_link_bytes_per_s(settings.cluster.gpu)
    return settings.model_copy(update={"stages": 1, "recompute": "none"})


def host_link_bytes_per_s(gpu: str) -> float:
    """The GPU's host link, one direction (:data:`HOST_LINK_BYTES_PER_S`), or BadInputError."""
    if gpu not in HOST_LINK_BYTES_PER_S:
        raise BadInputError(f"--cpu-offload-layers: no host link bandwidth is known for GPU {gpu!r} (known: "
                            f"{', '.join(HOST_LINK_BYTES_PER_S)})")
    return HOST_LINK_BYTES_PER_S[gpu]


def with_cpu_offload(profile, n: int):
    """``profile`` with the first ``n`` transformer layers' activations off the GPU, less the
    double buffer: every entry of an offloaded layer keeps 0 bytes but the last offloaded layer's,
    which keeps the largest offloaded layer's at its (micro-batch size, degree) (module docstring)."""
    names = offloaded_layers(profile, n)
    chosen = set(names)
    largest = {}
    for layer in profile.layers:
        if layer.name in chosen:
            for c in layer.costs:
                key = (c.microbatch_size, c.degree)
                largest[key] = max(largest.get(key, 0), c.activation_bytes)
    layers = []
    for layer in profile.layers:
        if layer.name in chosen:
            keep = layer.name == names[-1]
            layer = layer.model_copy(update={"costs": [
                c.model_copy(update={"activation_bytes": largest[(c.microbatch_size, c.degree)] if keep else 0})
                for c in layer.costs]})
        layers.append(layer)
    return profile.model_copy(update={"layers": layers})


def offload_exposed_ms(profile, n: int, microbatch_size: int, tensor: int, host_bytes_per_s: float) -> dict:
    """Per micro-batch: ``d2h_ms`` and ``h2d_ms`` (the copies) and ``exposed_ms`` (what the
    forward and backward of the next ``L // n`` layers do not cover), from the original profile's
    entries at (``microbatch_size``, ``tensor``).

    Examples
    --------
    >>> from types import SimpleNamespace as N
    >>> cost = N(microbatch_size=1, degree=1, activation_bytes=2e9, forward_ms=1.0, backward_ms=2.0)
    >>> layer = lambda i: N(name=f"l{i}", kind="block", cost_at=lambda b, t: cost)
    >>> out = offload_exposed_ms(N(layers=[layer(i) for i in range(4)]), 2, 1, 1, 500e9)   # 4 ms per copy, w = 2
    >>> out["d2h_ms"], out["exposed_ms"]          # 2 x (4 - 2) forward + 2 x (4 - 4) backward
    (8.0, 4.0)
    """
    blocks = _blocks(profile)
    window = len(blocks) // n
    d2h = exposed = 0.0
    for layer in blocks[:n]:
        cost = layer.cost_at(microbatch_size, tensor)
        copy_ms = cost.activation_bytes / host_bytes_per_s * 1e3
        d2h += copy_ms
        exposed += max(0.0, copy_ms - window * cost.forward_ms) + max(0.0, copy_ms - window * cost.backward_ms)
    return {"d2h_ms": d2h, "h2d_ms": d2h, "exposed_ms": exposed}


def offload_view(view, n, gpu: str):
    """A cluster search's view (:class:`pipeplan.cluster.profile_view.DegreeView`, degree-1
    entries at its t) with the first ``n`` layers offloaded (:func:`with_cpu_offload`) and, per
    micro-batch size, the copies' exposed ms (:func:`offload_exposed_ms` on the view's own
    entries, its tensor-parallel collectives in the time that covers them); ``view`` itself when
    ``n`` is None."""
    if n is None:
        return view
    bw = host_link_bytes_per_s(gpu)
    exposed = {b: offload_exposed_ms(view.profile, n, b, 1, bw)["exposed_ms"] for b in view.profile.microbatch_sizes}
    return replace(view, profile=with_cpu_offload(view.profile, n), offload_ms=exposed)


def with_offload_note(plan, profile, settings):
    """The cluster plan with a note on its offload (``profile``: the original, at the plan's t)."""
    n = settings.cpu_offload_layers
    tensor = plan.parallelism.tensor if plan.parallelism is not None else 1
    bw = host_link_bytes_per_s(settings.cluster.gpu)
    per = offload_exposed_ms(profile, n, plan.microbatch_size, tensor, bw)
    note = (f"CPU activation offload (Megatron's --cpu-offloading --cpu-offloading-num-layers {n}): the first {n} "
            f"transformer layers' activations go to host memory over {bw / 1e9:g} GB/s per direction, "
            f"{per['d2h_ms']:.1f} ms each way per micro-batch; {plan.predicted.cpu_offload_ms or 0:.2f} ms per "
            f"iteration not covered by the next {len(_blocks(profile)) // n} layers' compute; one offloaded "
            f"layer's activations stay (the double buffer)")
    return plan.model_copy(update={"notes": [*plan.notes, note]})

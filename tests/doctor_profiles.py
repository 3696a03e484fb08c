"""Analytic decoder profiles for the doctor tests (no tests here).

Times from FLOPs at a fixed throughput, activation bytes from Korthikanti et al. (2022,
"Reducing Activation Recomputation in Large Transformer Models": 34*s*b*h bytes per layer in
16-bit at tensor-parallel 1, with the 5*a*s^2*b attention term gone because flash attention keeps
no score matrix), transfers of s*b*h 16-bit values. The
layers carry torchtitan's names and their ``kind``, so every launcher's units map onto them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeplan.formats.io import dump_model
from pipeplan.formats.profile import Profile


def decoder_profile(num_layers: int, hidden: int, heads: int, seq: int, vocab: int, *, ffn: int | None = None,
                    sizes=(1, 2, 4), tflops: float = 400.0, model: str | None = None,
                    memory_bytes: int = 80 * 2**30) -> Profile:
    """A Llama/GPT-shaped chain: tok_embeddings, layers.0..N-1, norm, output (untied), bf16."""
    ffn = ffn or 4 * hidden
    block_params = 4 * hidden * hidden + 2 * hidden * ffn + 2 * hidden
    flops_per_ms = tflops * 1e12 / 1e3

    def cost(b, forward_flops, activation_bytes, output_bytes):
        f = forward_flops * b / flops_per_ms
        return {"microbatch_size": b, "forward_ms": round(f, 6), "backward_ms": round(2 * f, 6),
                "activation_bytes": int(activation_bytes * b), "output_bytes": int(output_bytes * b)}

    tokens = seq
    act_block = 34 * seq * hidden
    out = 2 * seq * hidden
    layers = [{"name": "tok_embeddings", "kind": "embedding", "param_bytes": 2 * vocab * hidden,
               "costs": [cost(b, 2 * tokens * hidden, out, out) for b in sizes]}]
    for i in range(num_layers):
        flops = 2 * tokens * block_params + 4 * tokens * seq * hidden
        layers.append({"name": f"layers.{i}", "kind": "block", "param_bytes": 2 * block_params,
                       "costs": [cost(b, flops, act_block, out) for b in sizes]})
    layers.append({"name": "norm", "kind": "norm", "param_bytes": 2 * hidden,
                   "costs": [cost(b, 4 * tokens * hidden, 2 * seq * hidden, out) for b in sizes]})
    # The head keeps its input and the fp32 logits for the loss.
    layers.append({"name": "output", "kind": "head", "param_bytes": 2 * vocab * hidden,
                   "costs": [cost(b, 2 * tokens * hidden * vocab, 2 * seq * hidden + 4 * seq * vocab, 0)
                             for b in sizes]})
    return Profile.model_validate({
        "schema_version": 1, "model": model or f"decoder-{num_layers}x{hidden}", "source": "analytic",
        "device": {"name": f"analytic {tflops:g} TFLOP/s bf16", "memory_bytes": memory_bytes},
        "dtype": "bf16", "sequence_length": seq, "layers": layers,
    })


def write_profile(profile: Profile, path: Path) -> Path:
    path.write_text(dump_model(profile))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def llama3_8b(**kw) -> Profile:
    return decoder_profile(32, 4096, 32, 8192, 128256, ffn=14336 * 3 // 2, model="llama3-8b-analytic", **kw)


def llama3_70b(**kw) -> Profile:
    return decoder_profile(80, 8192, 64, 8192, 128256, ffn=28672 * 3 // 2, model="llama3-70b-analytic", **kw)


def gpt3_175b(**kw) -> Profile:
    return decoder_profile(96, 12288, 96, 2048, 50257, model="gpt3-175b-analytic", **kw)

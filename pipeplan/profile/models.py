"""Built-in models, built from a configuration only (no weights), with torch alone.

Every built-in is a top-level module whose children are the pipeline units, each taking the
previous unit's output, so that a pipeline rank can build only its own units by their dotted
names (:func:`pipeplan.profile.units.build_stage`):

========== ============================================== ==========================
family     units (in order)                               kinds
========== ============================================== ==========================
gpt2       ``embed``, ``blocks.0`` .. ``blocks.N-1``,     embedding, block..., norm,
           ``norm``, ``head``                             head
llama      same as gpt2 (RMSNorm, rotary, SwiGLU)         same
bert       ``embed``, ``blocks.*``, ``head`` (MLM head)   embedding, block..., head
convnet    ``stem``, ``blocks.*``, ``fuse``, ``head``     other, block..., other, head
========== ============================================== ==========================

The convnet's ``fuse`` adds the ``stem`` output back (a long skip connection), so its profile
has a real DAG edge ``stem -> fuse``. No weights are tied (the LM head is its own matrix):
torch.distributed.pipelining copies tied weights into both stages without syncing their
gradients. Llama's rotary tables are buffers inside each block (recomputed per stage instead
of sent between stages).

Weights are initialised per unit from ``seed`` and the unit's name, so a rank that builds only
``blocks.3`` gets the same weights as the full model built with the same seed.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.errors import BadInputError
from pipeplan.profile.registry import ModelBundle, resolve_builtin

__all__ = [
    "torch_dtype_of",
    "GPT2",
    "Llama",
    "Bert",
    "ConvNet",
    "build_model",
    "builtin_bundle",
    "builtin_units",
    "builtin_kinds",
    "example_batch",
    "loss_fn",
    "init_unit",
    "DTYPES",
]

#: ``--dtype`` names to torch dtypes.
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


# --------------------------------------------------------------------------- GPT-2
class GPT2Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, hidden: int, max_positions: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_positions, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.wte(input_ids) + self.wpe(positions)


class CausalSelfAttention(nn.Module):
    """GPT-2 attention: fused qkv projection, causal SDPA, output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.c_attn(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, h))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = GPT2MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Module):
    """Untied output projection to the vocabulary."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Decoder(nn.Module):
    """A chain of units: embed -> blocks -> norm -> head."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class GPT2(_Decoder):
    """GPT-2 style decoder LM (learned positions, LayerNorm, GELU MLP), untied head."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.embed = GPT2Embedding(vocab, hidden, max_positions)
        self.blocks = nn.ModuleList(GPT2Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = LMHead(hidden, vocab)


# --------------------------------------------------------------------------- Llama
class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position tables (non-persistent buffers, rebuilt by ``reset_parameters``)."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.base = head_dim, max_positions, base
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device
        if device.type == "meta":
            return
        inv = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_positions, device=device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        with torch.no_grad():
            self.cos.copy_(emb.cos())
            self.sin.copy_(emb.sin())

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = q.shape[-2]
        cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, max_positions: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.rotary = Rotary(self.head_dim, max_positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k)
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads, kv_heads, max_positions)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(input_ids)


class Llama(_Decoder):
    """Llama style decoder LM: RMSNorm, rotary positions, SwiGLU MLP, grouped KV heads."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                 max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.embed = TokenEmbedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            LlamaBlock(hidden, heads, kv_heads, ffn, max_positions) for _ in range(layers)
        )
        self.norm = RMSNorm(hidden)
        self.head = LMHead(hidden, vocab)


# --------------------------------------------------------------------------- BERT
class BertEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, max_positions: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.norm(self.word(input_ids) + self.position(positions))


class BertBlock(nn.Module):
    """Post-norm encoder layer with bidirectional attention."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = self.norm1(x + self.out(attn.transpose(1, 2).reshape(b, s, h)))
        return self.norm2(x + self.fc2(F.gelu(self.fc1(x))))


class MLMHead(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x))))


class Bert(nn.Module):
    """BERT style encoder with a masked-LM head (every position predicted)."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.embed = BertEmbedding(vocab, hidden, max_positions)
        self.blocks = nn.ModuleList(BertBlock(hidden, heads, ffn) for _ in range(layers))
        self.head = MLMHead(hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# --------------------------------------------------------------------------- ConvNet
class Stem(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(images)))


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convolutions and an identity shortcut)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class Fuse(nn.Module):
    """Adds the stem's output back in: a long skip connection across the blocks."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.mix = nn.Conv2d(channels, channels, 1, bias=False)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return F.relu(self.mix(x) + skip)


class ClassifierHead(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class ConvNet(nn.Module):
    """A small ResNet-like image classifier with a long skip ``stem -> fuse``."""

    def __init__(self, layers: int, hidden: int, image_size: int, classes: int) -> None:
        super().__init__()
        self.image_size = image_size
        self.stem = Stem(hidden)
        self.blocks = nn.ModuleList(BasicBlock(hidden) for _ in range(layers))
        self.fuse = Fuse(hidden)
        self.head = ClassifierHead(hidden, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        skip = self.stem(images)
        x = skip
        for block in self.blocks:
            x = block(x)
        return self.head(self.fuse(x, skip))


# --------------------------------------------------------------------------- building
_CLASSES = {"gpt2": GPT2, "llama": Llama, "bert": Bert, "convnet": ConvNet}


def builtin_units(config: dict[str, Any]) -> list[str]:
    """The units of a built-in model, in execution order."""
    blocks = [f"blocks.{i}" for i in range(config["layers"])]
    family = config["family"]
    if family in ("gpt2", "llama"):
        return ["embed", *blocks, "norm", "head"]
    if family == "bert":
        return ["embed", *blocks, "head"]
    return ["stem", *blocks, "fuse", "head"]


def builtin_kinds(config: dict[str, Any]) -> dict[str, str]:
    """Role of each unit of a built-in model."""
    kinds = {}
    for name in builtin_units(config):
        if name.startswith("blocks."):
            kinds[name] = "block"
        else:
            kinds[name] = {"embed": "embedding", "norm": "norm", "head": "head"}.get(name, "other")
    return kinds


def _unit_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def _reset(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def init_unit(module: nn.Module, name: str, seed: int = 0) -> None:
    """Initialise one unit's parameters and buffers from ``seed`` and its dotted ``name``.

    The global random state is left untouched, and the result does not depend on which other
    units exist, so a stage built alone equals the same units of the full model.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_unit_seed(seed, name))
        for sub in module.modules():
            _reset(sub)


def _materialise(model: nn.Module, units: list[str], device: torch.device, dtype: torch.dtype,
                 seed: int) -> None:
    for name in units:
        unit = model.get_submodule(name)
        unit.to_empty(device=device)
        init_unit(unit, name, seed)
        unit.to(dtype=dtype)


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cpu")
    return torch.device(device)


def build_model(name: str, *, seed: int = 0, device: Any = "cpu", dtype: Any = "fp32",
                units: Optional[list[str]] = None, **options: Any) -> nn.Module:
    """Build a built-in model from its configuration.

    Parameters
    ----------
    name : str
        A preset name (``gpt2-tiny``, ``gpt2``, ``llama-tiny``, ``bert-tiny``, ``convnet-tiny``, ...).
    seed : int
        Weights are drawn per unit from this seed and the unit's name.
    device, dtype
        Where and in which floating dtype (``fp32``, ``bf16``, ``fp16`` or a torch dtype).
    units : list of str, optional
        Materialise only these units; the others stay on the ``meta`` device (no memory).
        :func:`pipeplan.profile.units.build_stage` wraps such a model into a stage module.
    **options
        Configuration overrides: ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn``,
        ``vocab``, ``max_positions``, ``image_size``, ``classes``.

    Returns
    -------
    torch.nn.Module
        In training mode.

    Raises
    ------
    BadInputError
        Unknown name or option, or a unit name the model does not have.

    Examples
    --------
    >>> model = build_model("gpt2-tiny", layers=2)
    >>> [n for n, _ in model.named_children()]
    ['embed', 'blocks', 'norm', 'head']
    """
    config = resolve_builtin(name, **options)
    torch_dtype = torch_dtype_of(dtype)
    all_units = builtin_units(config)
    wanted = list(all_units if units is None else units)
    unknown = [u for u in wanted if u not in all_units]
    if unknown:
        raise BadInputError(
            f"unit {unknown[0]!r} is not in {name!r}; its units are {', '.join(all_units)}"
        )
    kwargs = {k: v for k, v in config.items() if k != "family"}
    with torch.device("meta"):
        model = _CLASSES[config["family"]](**kwargs)
    _materialise(model, wanted, _resolve_device(device), torch_dtype, seed)
    return model.train()


def torch_dtype_of(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise BadInputError(f"--dtype: {dtype!r} is not known; use fp32, bf16 or fp16")
    return DTYPES[dtype]


def example_batch(config: dict[str, Any], microbatch_size: int, seq_len: Optional[int] = None, *,
                  seed: int = 0, device: Any = "cpu", dtype: Any = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic micro-batch ``(inputs, target)`` for a built-in model's configuration.

    LMs get random token ids of shape ``(microbatch_size, seq_len)``; causal LMs' targets are the
    inputs shifted by one token. The convnet gets images of ``image_size`` and class labels.
    The same ``seed`` gives the same batch.

    Raises
    ------
    BadInputError
        If ``seq_len`` exceeds the model's ``max_positions``.
    """
    generator = torch.Generator().manual_seed(int(seed))
    family = config["family"]
    if microbatch_size <= 0:
        raise BadInputError(f"micro-batch size {microbatch_size} must be positive")
    if family == "convnet":
        size = config["image_size"]
        images = torch.randn(microbatch_size, 3, size, size, generator=generator)
        labels = torch.randint(0, config["classes"], (microbatch_size,), generator=generator)
        return images.to(device=device, dtype=torch_dtype_of(dtype)), labels.to(device)
    seq_len = int(seq_len or 128)
    if seq_len > config["max_positions"]:
        raise BadInputError(
            f"--seq-len {seq_len} is longer than the model's {config['max_positions']} positions; "
            f"lower --seq-len"
        )
    tokens = torch.randint(0, config["vocab"], (microbatch_size, seq_len + 1), generator=generator)
    if family == "bert":
        targets = torch.randint(0, config["vocab"], (microbatch_size, seq_len), generator=generator)
        return tokens[:, :-1].contiguous().to(device), targets.to(device)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits ``(..., classes)`` against integer targets ``(...)``, in fp32.

    The loss every built-in trains with; pass it to the pipeline schedule as its ``loss_fn``.
    """
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))


def builtin_bundle(name: str, *, seed: int = 0, device: Any = "cpu", dtype: Any = "fp32",
                   units: Optional[list[str]] = None, **options: Any) -> ModelBundle:
    """A built-in model with its batch factory, loss and unit roles."""
    config = resolve_builtin(name, **options)
    model = build_model(name, seed=seed, device=device, dtype=dtype, units=units, **options)

    def make_batch(microbatch_size: int, seq_len: Optional[int] = None, seed: int = 0):
        return example_batch(config, microbatch_size, seq_len, seed=seed, device=device, dtype=dtype)

    return ModelBundle(
        model=model,
        make_batch=make_batch,
        loss_fn=loss_fn,
        units=builtin_units(config),
        kinds=builtin_kinds(config),
        config=config,
    )

"""Small user models for the ``module:callable`` contract that once failed to profile or run.

Each is built as a user would write it (no weights, few channels), and runs with ``--verify`` in
the 2-rank job of ``tests/test_run_hf.py`` (the ranks import this module: the job's PYTHONPATH
holds ``tests/``). No tests here.

``unet``
    A U-Net whose blocks pass a tuple on (``(features, *skips)``), with no loss; its skips are
    crops of larger maps (U-Net's "copy and crop"), views that are not contiguous. A stage
    received the tuple as several inputs where its first unit takes one (``stage expects 1
    inputs``), and a cropped skip sent as it was failed on the receiving rank (``input tensor
    has to be contiguous``).
``t5ish``
    A T5-style encoder-decoder fed a dict batch: each stack computes a relative position bias
    once (a unit, ``encoder_bias``) and every block of the stack reuses it, so the bias (and
    ``decoder_input_ids``, integers) cross stage boundaries. The units stage builder took no
    keyword batch (``UnitChain.forward() got an unexpected keyword argument 'input_ids'``) and,
    with a tuple batch, inferred the later stage's shapes on garbage token ids (``index out of
    range``). ``t5ish_dropout`` is the same with T5's default dropout of 0.1: a pipeline and
    one process draw different masks, and ``--verify`` found gradients 100%+ off, worst on
    ``relative_attention_bias``; it is now refused before running, with the reason.
``inplace``
    A torchvision-style ResNet with ``nn.ReLU(inplace=True)`` after every batch norm, each its
    own unit of an ``nn.Sequential``: the profiler fed a unit fresh leaf inputs, which the
    in-place ReLU may not change, and blamed the inputs (``the whole model failed ...; check
    that the inputs fit the model (--seq-len ...)``); a stage starting with that ReLU failed on
    its received input the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeplan.profile.registry import InputSpec


class _Down(nn.Module):
    """Takes the tuple of the block before (features, then the skips so far) and adds a skip."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=2)

    def forward(self, state: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, *skips = state if isinstance(state, tuple) else (state,)
        # U-Net's "copy and crop": the skip is the centre of a larger map, a view that is not contiguous.
        skip = torch.relu(self.conv(x))[:, :, 1:-1, 1:-1]
        return (nn.functional.max_pool2d(skip, 2), *skips, skip)


class _Mid(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, *skips = state
        return (torch.relu(self.conv(x)), *skips)


class _Up(nn.Module):
    """Takes the tuple, upsamples the features and joins the last skip."""

    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin + cskip, cout, 3, padding=1)

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, *skips, skip = state
        x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        return (torch.relu(self.conv(torch.cat([x, skip], dim=1))), *skips)


class _Out(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 2, 1)

    def forward(self, state: tuple[torch.Tensor]) -> torch.Tensor:
        return self.conv(state[0])


class UNet(nn.Module):
    """Two down blocks, a bottleneck, two up blocks and a 1 x 1 head, on 8 x 8 images; each block
    takes the tuple the block before returns (a chain of units)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        c = channels
        self.down1 = _Down(3, c)
        self.down2 = _Down(c, c)
        self.mid = _Mid(c)
        self.up2 = _Up(c, c, c)
        self.up1 = _Up(c, c, c)
        self.out = _Out(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.up1(self.up2(self.mid(self.down2(self.down1(x))))))


def unet(hidden: int = 4) -> tuple[nn.Module, list[InputSpec]]:
    """:class:`UNet` with ``hidden`` channels on 3 x 8 x 8 images; no loss (the default trains it)."""
    return UNet(hidden), [InputSpec(shape=(3, 8, 8))]


class RelativeBias(nn.Module):
    """T5's relative position bias: a table of one bias per head and distance bucket."""

    def __init__(self, buckets: int, heads: int) -> None:
        super().__init__()
        self.buckets = buckets
        self.relative_attention_bias = nn.Embedding(buckets, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        half = self.buckets // 2
        distance = (positions[None, :] - positions[:, None]).clamp(-half, half - 1) + half
        return self.relative_attention_bias(distance).permute(2, 0, 1)[None]  # 1 x heads x s x s


class _Block(nn.Module):
    """Attention with the stack's position bias (and cross-attention in the decoder), then a
    feed-forward layer; each with an optional dropout."""

    def __init__(self, hidden: int, heads: int, cross: bool, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.cross = nn.Linear(hidden, hidden, bias=False) if cross else None
        self.ff = nn.Linear(hidden, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor, memory: torch.Tensor | None = None):
        b, s, h = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) + position_bias
        x = x + self.dropout(self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)))
        if self.cross is not None:
            x = x + self.cross(memory).mean(dim=1, keepdim=True)
        return x + self.dropout(torch.relu(self.ff(x)))


class T5ish(nn.Module):
    """Embeddings, an encoder and a decoder stack whose blocks all reuse their stack's position
    bias (computed once per stack), and a head; fed ``input_ids`` and ``decoder_input_ids``."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, dropout: float = 0.0,
                 buckets: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder_bias = RelativeBias(buckets, heads)
        self.encoder = nn.ModuleList(_Block(hidden, heads, False, dropout) for _ in range(layers))
        self.decoder_embed = nn.Embedding(vocab, hidden)  # a unit runs once per forward: its own table
        self.decoder_bias = RelativeBias(buckets, heads)
        self.decoder = nn.ModuleList(_Block(hidden, heads, True, dropout) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        bias = self.encoder_bias(x)
        for block in self.encoder:
            x = block(x, bias)
        y = self.decoder_embed(decoder_input_ids)
        bias = self.decoder_bias(y)
        for block in self.decoder:
            y = block(y, bias, x)
        return self.head(y)


def t5ish(layers: int = 2, hidden: int = 16, heads: int = 2, vocab: int = 32, dropout: float = 0.0):
    """:class:`T5ish` fed a dict batch (``input_ids``, ``decoder_input_ids``), with a loss."""
    model = T5ish(vocab, hidden, heads, layers, dropout)

    def make_batch(microbatch_size: int, seq_len: int):
        seq_len = seq_len or 8
        ids = torch.randint(0, vocab, (microbatch_size, seq_len))
        dec = torch.randint(0, vocab, (microbatch_size, seq_len))
        return {"input_ids": ids, "decoder_input_ids": dec}, torch.randint(0, vocab, (microbatch_size, seq_len))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    return model, make_batch, loss_fn


def t5ish_dropout(layers: int = 2, hidden: int = 16, heads: int = 2, vocab: int = 32):
    """The same with T5's default dropout (0.1), as a user's T5 built from a config has it."""
    return t5ish(layers, hidden, heads, vocab, dropout=0.1)


class _Basic(nn.Module):
    """torchvision's BasicBlock, small: conv-bn-relu(inplace)-conv-bn, + identity, relu(inplace)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def inplace(hidden: int = 4, layers: int = 2) -> tuple[nn.Module, list[InputSpec]]:
    """A torchvision-style ResNet (``nn.ReLU(inplace=True)``) on 3 x 8 x 8 images, 10 classes; no loss."""
    model = nn.Sequential(
        nn.Conv2d(3, hidden, 3, padding=1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU(inplace=True),
        *[_Basic(hidden) for _ in range(layers)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(hidden, 10))
    return model, [InputSpec(shape=(3, 8, 8))]

"""Example models for kiln specs: plain torch, no downloads.

``tiny_gpt`` and ``tiny_mlp`` are small enough to bake on a laptop CPU in seconds; ``llm`` and
``convnet`` are the GPU reference models (realistic structure, random weights).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding over the last dim of (batch, heads, seq, head_dim)."""
    seq, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.hd, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = rotary(q), rotary(k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.n1, self.n2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class DecoderLM(nn.Module):
    """Decoder-only transformer: RMSNorm, rotary, GQA attention through SDPA, SwiGLU."""

    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        # Last-position logits, as a serving prefill returns.
        return self.head(self.norm(x[:, -1]))


def tiny_gpt(vocab: int = 512, dim: int = 64, layers: int = 2, heads: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return DecoderLM(vocab, dim, layers, heads, max(1, heads // 2), 4 * dim)


def llm(
    vocab: int = 32000, dim: int = 1024, layers: int = 8, heads: int = 16, kv_heads: int = 4
) -> nn.Module:
    """The GPU reference LLM: ~8 layers, hidden 1024, GQA 16/4, SwiGLU 2816."""
    torch.manual_seed(0)
    return DecoderLM(vocab, dim, layers, heads, kv_heads, int(math.ceil(2.75 * dim / 64) * 64))


class TinyMLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * scale


def tiny_mlp(dim: int = 16, hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return TinyMLP(dim, hidden)


class ConvNet(nn.Module):
    """A small ResNet-style vision model (conv-bn-relu stages with residuals)."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages = []
        c = width
        for i in range(4):
            out = width * 2**i
            stages.append(_ResBlock(c, out, stride=1 if i == 0 else 2))
            stages.append(_ResBlock(out, out, stride=1))
            c = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(pixels))
        return self.head(x.mean((2, 3)))


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.skip(x))


def convnet(width: int = 64, classes: int = 1000) -> nn.Module:
    torch.manual_seed(0)
    return ConvNet(width, classes)


def _record_activation_stats(x: torch.Tensor) -> None:
    """A host-side hook between layers (activation monitoring, a tracing span). The encoder
    wraps it in ``torch.compiler.disable``, so Dynamo splits the model in two graphs there, as
    real models often are. Wrapped when an encoder is built, not at import: the decorator
    imports Dynamo, which an eager server of this file's other models would never load."""


class TokenEncoder(nn.Module):
    """An encoder (BERT-like: bidirectional attention, mean-pooled output) with one plain graph
    break after layer ``break_after``: the reference for models that cannot be ``fullgraph``."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, break_after: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.break_after = break_after
        self.record = torch.compiler.disable(_record_activation_stats)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        # Two loops, the hook between them: a break inside a loop makes Dynamo give up on the
        # whole frame (eager), which is a different problem than the one this model shows.
        for layer in self.layers[: self.break_after + 1]:
            x = layer(x)
        self.record(x)
        for layer in self.layers[self.break_after + 1 :]:
            x = layer(x)
        return self.norm(x).mean(dim=1)


def encoder(
    vocab: int = 30522, dim: int = 768, layers: int = 6, heads: int = 12, break_after: int = 2
) -> nn.Module:
    """The GPU reference encoder with a graph break (BERT-base width, 6 layers)."""
    torch.manual_seed(0)
    return TokenEncoder(vocab, dim, layers, heads, break_after)


class MaskedEncoder(nn.Module):
    """A bidirectional encoder that takes an attention mask (1: a token, 0: padding), so padded
    positions change nothing the real ones compute: the reference model for serving a grid by
    padding (docs/padding.md). Returns every token's hidden state and their masked mean."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(512, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.n1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.n2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        b, s = input_ids.shape
        x = self.embed(input_ids) + self.pos(torch.arange(s, device=input_ids.device))
        keep = attention_mask.to(x.dtype)
        # Additive mask over keys: a large negative, not -inf, so a row that is all padding
        # (a padded batch row) stays finite instead of turning into NaN.
        bias = ((1.0 - keep) * torch.finfo(x.dtype).min)[:, None, None, :]
        for i in range(len(self.qkv)):
            q, k, v = (
                self.qkv[i](self.n1[i](x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            )
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = x + self.out[i](y.transpose(1, 2).reshape(b, s, -1))
            x = x + self.mlp[i](self.n2[i](x))
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1.0)
        return {"hidden": x, "pooled": pooled}


def masked_encoder(vocab: int = 1000, dim: int = 64, layers: int = 2, heads: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return MaskedEncoder(vocab, dim, layers, heads)


class TensorParallelMLP(nn.Module):
    """Rank ``rank``'s shard of a Megatron-style MLP: a column-parallel linear (this rank's
    ``hidden / world_size`` output features), then a row-parallel linear (the matching input
    features), whose partial sums are added across ranks with ``all_reduce`` in forward. Every
    rank builds the full weights from one seed and keeps its slice, so the ranks together
    compute exactly the unsharded MLP."""

    def __init__(self, dim: int, hidden: int, rank: int, world_size: int) -> None:
        super().__init__()
        if hidden % world_size:
            raise ValueError(f"hidden={hidden} does not split over {world_size} ranks")
        torch.manual_seed(0)
        up, down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        part = hidden // world_size
        rows = slice(rank * part, (rank + 1) * part)
        self.up = nn.Linear(dim, part)
        self.down = nn.Linear(part, dim, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(up.weight[rows])
            self.up.bias.copy_(up.bias[rows])
            self.down.weight.copy_(down.weight[:, rows])
        self.down_bias = nn.Parameter(down.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        partial = self.down(F.gelu(self.up(x)))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(partial)
        return partial + self.down_bias


def tp_mlp(dim: int = 64, hidden: int = 256, *, rank: int, world_size: int) -> nn.Module:
    """A distributed spec's factory: kiln passes ``rank=`` and ``world_size=``."""
    return TensorParallelMLP(dim, hidden, rank, world_size)

"""A tiny decoder-only transformer for character- or token-level language modelling (``TinyGPT``).

Written with plain matmuls (no fused attention kernel), so it trains under the stacked client runner
(``torch.func.vmap``) as well as sequentially.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.heads)
        att = F.softmax(att.masked_fill(mask[:T, :T], float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token embedding + learned positions, ``layers`` pre-norm causal self-attention blocks, a linear head.

    Input: int64 token ids ``[B, T]`` (``T <= max_len``); output: logits ``[B, T, vocab_size]``.

    Args:
        vocab_size: Number of tokens.
        dim: Width (divisible by ``heads``).
        layers: Transformer blocks.
        heads: Attention heads.
        max_len: Longest sequence.
    """

    def __init__(self, vocab_size: int = 16, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 128):
        super().__init__()
        if dim % heads:
            raise ValueError(f"`model.dim` ({dim}) must be divisible by `model.heads` ({heads})")
        self.tok, self.pos = nn.Embedding(vocab_size, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size)
        self.register_buffer("mask", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        T = ids.shape[-1]
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x))

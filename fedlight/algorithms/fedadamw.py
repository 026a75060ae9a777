"""FedAdamW (Liu et al., AAAI 2026, arXiv:2510.27486, "FedAdamW: A Communication-Efficient Optimizer with
Convergence and Generalization Guarantees for Federated Large Models"), Algorithm 2.

State (server): global step counter ``t`` (steps taken before this round, ``r·K``), global direction
``Δ_G`` (zeros) and block means ``v̄`` (zeros, B scalars).
  broadcast   x_r, Δ_G, v̄ (B scalars) and t (one scalar)                                    (line 21)
  client      AdamW with m_0 = 0, v_0 = v̄ expanded to each block's elements; local step k = 1..K, global
              step t = r·K + k (the same for every client of the round):                      (lines 4–6)
                g ← clip(g)                                              (loop's max_grad_norm, before moments)
                m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²           (lines 8–9)
                m̂ = m/(1 − β1^k);  v̂ = v/(1 − β2^t);  ϑ = 1/(√v̂ + ε)    (lines 11–13: local k, global t)
                y ← y − η·(m̂ ⊙ ϑ + α·Δ_G + λ·y)                         (line 14, decoupled decay)
  upload      Δ_i and v̄_i = block means of the final v (B scalars)                           (line 16)
  server      x ← x + η_g·Δ̄;  v̄ ← mean_S v̄_i;  Δ_G ← −Δ̄/(K·η);  t ← t + K                  (lines 18–20)
Every server mean is the plain mean over S (``weighting = "uniform"``). η is the loop's ``η_r``, optionally
scheduled over the local steps by the loop (``loop.local_lr_schedule: cosine``: η_k = ½η_r(1 + cos(πk/K))); K
and η on the server are the round's mean K and η_r (line 18 divides by K·η_r even when the η_k vary). The step
itself is :class:`AmendedAdam` (shared with FedLADA) with ``b = α·Δ_G``.

Blocks (Appendix D), how ``v̄`` is shared:
  * ``tensor``: one block per parameter tensor.
  * ``hessian``: Adam-mini-style blocks from timm parameter names: ``attn.qkv.weight`` split into q and k per
    head (``head_dim`` rows each) and v per output row; ``attn.proj``, ``mlp.fc1``, ``mlp.fc2`` weights per output
    row; ``pos_embed`` per token; ``head.weight`` per class; everything else one block per tensor. Hugging Face
    BERT/RoBERTa names likewise (Appendix D's Algorithm 3): ``attention.self.query`` / ``key`` weights per head,
    ``value``, ``attention.output.dense``, ``intermediate.dense``, ``output.dense`` and the ``classifier`` per output
    row, ``word_embeddings`` / ``position_embeddings`` per token; with LoRA the ``lora_B`` factor of query / key per
    head and of value per row (its rows are the projection's outputs), ``lora_A`` one block. Appendix D.3's
    RoBERTa-Base example — the coarser partition the paper's GLUE runs use — is one block per weight matrix:
    ``blocks: tensor``. At most
    ``C = min(max_blocks, ⌊d/min_block_size⌋)`` blocks: consecutive units of one segment are merged with a common
    threshold s (⌈s/u⌉ units of u elements per block), s the smallest that brings the count to ≤ C; blocks never
    straddle tensors or q/k/v, and C below the number of tensors gives one block per tensor.
  * ``none``: element-wise ``v`` (Table 7's Agg-v; 3 models down, 2 up).

"As released" settings (``paper`` by default, ``released`` for the authors' code):
  bias_correction  m̂ = m/(1 − β1^t) with the global t (the released vision code and the July-2025 original)
  step_scale       the Adam step and the decoupled decay scaled by (1 − α), i.e. lr η(1 − α) for both, the
                   amendment α·Δ_G unscaled (the July-2025 ``new_adamw.py``)
The current released vision code sends the full element-wise v (``blocks: none``); the July-2025 original shares
one v̄ per tensor (``blocks: tensor``, the default). Their amendment ``γη·m̃/K`` is exactly ``α·Δ_G`` at
α = γ = 0.5, so ``bias_correction: released, blocks: none`` is the current released vision code and
``bias_correction: released, step_scale: released`` the July-2025 original.

``variant=3`` is Algorithm 3: β1 = 0, λ = 0, ``y ← y − η·(α·g ⊙ ϑ + (1 − α)·Δ_G)``, server ``x ← x − γ·Δ_G`` with
the new Δ_G and γ = η_g·K·η_r (η_g = 1: x_{r+1} = mean y_{i,K}). Ablations (Table 4), the decay sign the paper
prints, the released code and the set-up differences: ``docs/algorithms.md`` (FedAdamW).
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fedlight.algorithms.compose import released, values
from fedlight.algorithms.fedlada import AmendedAdam
from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, Broadcast, ClientResult, LocalUpdateRule, RoundInfo, ServerRule
from fedlight.core.scale import Scale
from fedlight.errors import ConfigError, check

Runs = list[tuple[int, int]]
"""A tensor's blocks in flattened (row-major) order: ``(count, size)`` = ``count`` consecutive blocks of
``size`` elements each. ``None`` instead of a list means element-wise (no blocks)."""

_QKV = re.compile(r"(^|\.)attn\.qkv\.weight$")
_ROWS = re.compile(r"(^|\.)(attn\.proj|mlp\.fc1|mlp\.fc2|head|head\.fc)\.weight$")
_TOKENS = re.compile(r"(^|\.)pos_embed$")
# Hugging Face BERT/RoBERTa names (Appendix D, Algorithm 3 on RoBERTa), with peft's LoRA factors of q/k/v
_HF_HEADS = re.compile(r"(^|\.)attention\.self\.(query|key)(\.lora_B\.[^.]+)?\.weight$")
_HF_ROWS = re.compile(r"(^|\.)(attention\.self\.value(\.lora_B\.[^.]+)?|attention\.output\.dense|intermediate\.dense|"
                      r"output\.dense|classifier\.dense|classifier\.out_proj|classifier)\.weight$")
_HF_TOKENS = re.compile(r"(^|\.)(word_embeddings|position_embeddings)\.weight$")


def _segments(name: str, shape: tuple[int, ...], head_dim: int) -> list[tuple[int, int]]:
    """The natural Hessian units of one tensor as segments ``(n_units, unit_size)``."""
    numel = math.prod(shape)
    if _QKV.search(name) and len(shape) == 2:
        rows, cols = shape
        if rows % 3 or (rows // 3) % head_dim:
            raise ConfigError(f"`algorithm.head_dim` ({head_dim}) does not divide the attention width "
                              f"{rows // 3 if rows % 3 == 0 else rows / 3} of {name} {tuple(shape)}; set "
                              "`algorithm.head_dim` to the model's embed_dim / num_heads")
        width, heads = rows // 3, rows // 3 // head_dim
        return [(heads, head_dim * cols), (heads, head_dim * cols), (width, cols)]  # q, k per head; v per row
    if _HF_HEADS.search(name) and len(shape) == 2:
        if shape[0] % head_dim:
            raise ConfigError(f"`algorithm.head_dim` ({head_dim}) does not divide the {shape[0]} rows of {name}; set "
                              "`algorithm.head_dim` to the model's hidden_size / num_attention_heads")
        return [(shape[0] // head_dim, head_dim * shape[1])]  # query / key (or their LoRA B): per head
    if (_ROWS.search(name) or _HF_ROWS.search(name)) and len(shape) >= 2:
        return [(shape[0], numel // shape[0])]  # per output neuron / class
    if (_TOKENS.search(name) or _HF_TOKENS.search(name)) and len(shape) >= 2:
        return [(numel // shape[-1], shape[-1])]  # per token
    return [(1, numel)]


def _blocks_at(n: int, u: int, s: int) -> int:
    g = max(1, -(-s // u))  # units per block: ⌈s/u⌉
    return -(-n // g)


def _runs(n: int, u: int, s: int) -> Runs:
    g = max(1, -(-s // u))
    if g >= n:
        return [(1, n * u)]
    full, rem = divmod(n, g)
    return [(full, g * u)] + ([(1, rem * u)] if rem else [])


def hessian_partition(shapes: dict[str, tuple[int, ...]], head_dim: int = 64, min_block_size: int = 512,
                      max_blocks: int | None = None) -> dict[str, Runs]:
    """Adam-mini-style blocks from timm names, capped at ``min(max_blocks, ⌊d/min_block_size⌋)`` blocks."""
    segs = {k: _segments(k, s, head_dim) for k, s in shapes.items()}
    d = sum(math.prod(s) for s in shapes.values())
    cap = d // min_block_size
    if max_blocks is not None:
        cap = min(cap, max_blocks)
    cap = max(cap, len(shapes))
    flat = [(n, u) for ss in segs.values() for n, u in ss]
    total = lambda s: sum(_blocks_at(n, u, s) for n, u in flat)  # noqa: E731  (non-increasing in s)
    if total(1) <= cap:
        s = 1
    else:
        hi = max(n * u for n, u in flat)
        if total(hi) > cap:  # one block per segment is still too many: fall back to one per tensor
            return {k: [(1, math.prod(s))] for k, s in shapes.items()}
        lo = 1
        while lo < hi:  # smallest s with total(s) ≤ cap
            mid = (lo + hi) // 2
            if total(mid) <= cap:
                hi = mid
            else:
                lo = mid + 1
        s = lo
    return {k: [r for n, u in ss for r in _runs(n, u, s)] for k, ss in segs.items()}


def make_partition(shapes: dict[str, tuple[int, ...]], blocks: str, head_dim: int = 64, min_block_size: int = 512,
                   max_blocks: int | None = None) -> dict[str, Runs | None]:
    """Blocks of every tensor for ``blocks`` = "tensor" | "hessian" | "none" (None: element-wise)."""
    if blocks == "none":
        return {k: None for k in shapes}
    if blocks == "tensor":
        return {k: [(1, math.prod(s))] for k, s in shapes.items()}
    return hessian_partition(shapes, head_dim, min_block_size, max_blocks)


def num_blocks(part: dict[str, Runs | None], shapes: dict[str, tuple[int, ...]]) -> int:
    """B: the number of shared v̄ scalars."""
    return sum(math.prod(shapes[k]) if r is None else sum(c for c, _ in r) for k, r in part.items())


def block_means(v: Tensor, runs: Runs | None) -> Tensor:
    """Mean of ``v`` over each block (``[B_p]``); ``v`` itself (a copy) when element-wise."""
    if runs is None:
        return v.detach().clone()
    flat, out, o = v.detach().reshape(-1), [], 0
    for c, s in runs:
        out.append(flat[o:o + c * s].view(c, s).mean(1))
        o += c * s
    return torch.cat(out)


def expand_blocks(vb: Tensor, runs: Runs | None, like: Tensor) -> Tensor:
    """Each block's value repeated over its elements, shaped like ``like``."""
    if runs is None:
        return vb.to(like.dtype).clone()
    out, i = [], 0
    for c, s in runs:
        out.append(vb[i:i + c].to(like.dtype).repeat_interleave(s))
        i += c
    return torch.cat(out).view_as(like)


def _shapes(p: Params) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in p.items()}


class _Blocks:
    """The partition shared by both halves (computed once from parameter names and shapes)."""

    def __init__(self, blocks: str, head_dim: int, min_block_size: int, max_blocks: int | None) -> None:
        self.blocks, self.head_dim, self.min_block_size, self.max_blocks = blocks, head_dim, min_block_size, max_blocks
        self._key: Any = None
        self.part: dict[str, Runs | None] = {}
        self.count = 0

    def __call__(self, params: Params) -> dict[str, Runs | None]:
        shapes = _shapes(params)
        key = tuple(shapes.items())
        if key != self._key:
            self.part = make_partition(shapes, self.blocks, self.head_dim, self.min_block_size, self.max_blocks)
            self.count = num_blocks(self.part, shapes)
            self._key = key
        return self.part

    def check_model(self, model: nn.Module) -> None:
        """``head_dim`` must match the model's attention modules (timm ``Attention.head_dim``)."""
        if self.blocks != "hessian":
            return
        for name, mod in model.named_modules():
            hd = getattr(mod, "head_dim", None) if hasattr(mod, "qkv") else getattr(mod, "attention_head_size", None)
            if isinstance(hd, int) and (hasattr(mod, "qkv") or hasattr(mod, "query")) and hd != self.head_dim:
                raise ConfigError(f"`algorithm.head_dim` is {self.head_dim} but {name or 'the model'} has "
                                  f"head_dim {hd}; set `algorithm.head_dim: {hd}`")


class FedAdamWClient(LocalUpdateRule):
    """AdamW with m_0 = 0, v_0 = v̄ (expanded), local-k / global-t bias corrections and ``b = α·Δ_G``."""

    def __init__(self, blocks: _Blocks, alpha: float, lam: float, beta1: float, beta2: float, eps: float,
                 decoupled: bool, aggregate_v: bool, variant: int, global_bias1: bool = False,
                 step_scale: float = 1.0) -> None:
        self.blocks, self.alpha, self.lam = blocks, alpha, lam
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.decoupled, self.aggregate_v, self.variant = decoupled, aggregate_v, variant
        self.global_bias1, self.step_scale = global_bias1, step_scale
        self._checked = False

    def make_optimizer(self, params, lr, default):
        scale = self.alpha if self.variant == 3 else self.step_scale  # Alg. 3: α·g ⊙ ϑ; July 2025: (1 − α)
        return AmendedAdam(params, lr, self.beta1, self.beta2, self.eps, weight_decay=self.lam * self.step_scale,
                           decoupled=self.decoupled, adam_scale=scale, bias1="global" if self.global_bias1 else "local",
                           bias2="global" if self.aggregate_v else "local")

    def start(self, model, ctx):
        super().start(model, ctx)
        if not self._checked:
            self.blocks.check_model(model)
            self._checked = True
        bc = ctx.broadcast
        part = self.blocks(ctx.params)
        v0 = None
        if self.aggregate_v:
            v_bar = bc.extras["v_bar"]
            v0 = [expand_blocks(v_bar[k], part[k], p) for k, p in ctx.params.items()]  # v_0 = v̄ per block
        w = (1 - self.alpha) if self.variant == 3 else self.alpha
        b = torch._foreach_mul(values(bc.extras["delta_G"], ctx.params), w) if w != 0 else None  # α·Δ_G
        ctx.optimizer.begin_round(v0=v0, extra=b, t0=int(bc.scalars["t"]))  # m_0 = 0; t = t0 + k
        ctx.metrics["num_blocks"] = float(self.blocks.count)

    def finish(self, model, ctx):
        result = super().finish(model, ctx)
        if self.aggregate_v:
            part = self.blocks(ctx.params)
            result.extras["v_bar"] = {k: block_means(v, part[k])
                                      for k, v in zip(ctx.params, ctx.optimizer.v)}  # v̄_i
        return result


class FedAdamWServer(ServerRule):
    """``x ← x + η_g·Δ̄`` (Alg. 3: ``x ← x − γ·Δ_G``); ``v̄ ← mean v̄_i``; ``Δ_G ← −Δ̄/(Kη)``; ``t ← t + K``."""

    state_keys = ("delta_G", "v_bar", "t")
    weighting = "uniform"  # Algorithm 2, lines 18–20: Δ_G, x and v̄ are plain means over the S clients

    def __init__(self, blocks: _Blocks, lr: float = 1.0, aggregate_v: bool = True, variant: int = 2) -> None:
        super().__init__(lr)
        self.blocks, self.aggregate_v, self.variant = blocks, aggregate_v, variant
        self.t = 0

    def setup(self, params: Params) -> None:
        part = self.blocks(params)
        self.delta_G = P.zeros_like(params)
        self.v_bar = {k: (torch.zeros_like(p) if part[k] is None
                          else p.new_zeros(sum(c for c, _ in part[k]))) for k, p in params.items()}
        self.t = 0

    def broadcast(self, params: Params, info: RoundInfo, client_id: int) -> Broadcast:
        extras = {"delta_G": self.delta_G}
        if self.aggregate_v:
            extras["v_bar"] = self.v_bar
        return Broadcast(params, extras=extras, scalars={"t": float(self.t)})

    def update(self, params: Params, agg: ClientResult, info: RoundInfo) -> Params:
        K, eta = info.num_steps, info.lr
        self.delta_G = P.scale(agg.delta, -1.0 / (K * eta))  # Δ_G ← −Δ̄/(K·η)
        if self.aggregate_v:
            self.v_bar = {k: v.clone() for k, v in agg.extras["v_bar"].items()}  # v̄ ← mean_S v̄_i
        self.t += int(round(K))  # t ← t + K
        if self.variant == 3:
            return P.add(params, self.delta_G, -self.lr * K * eta)  # x ← x − γ·Δ_G, γ = η_g·K·η
        return P.add(params, agg.delta, self.lr)  # x ← x + η_g·Δ̄

    def diagnostics(self) -> dict[str, float]:
        n = max(P.numel(self.v_bar), 1)
        return {"num_blocks": float(self.blocks.count), "delta_G_norm": float(P.norm(self.delta_G)),
                "v_bar_mean": float(sum(v.double().sum() for v in self.v_bar.values()) / n),
                "global_step": float(self.t)}


@register("fedadamw", paper="Liu et al., AAAI 2026 (arXiv:2510.27486)", backprops=1, comm=(2, 1))
class FedAdamW(Algorithm):
    """FedAdamW (Algorithm 2; ``variant: 3`` is the analysed Algorithm 3).

    The local learning rate η is ``loop.lr`` (the paper: 3e-4); ``loop.optimizer`` and ``loop.weight_decay``
    are ignored. Communication per client and round: 2 models + B + 1 scalars down (x, Δ_G, v̄, t), 1 model + B
    scalars up (B = rule/num_blocks; ``blocks: none`` sends model-sized v̄ both ways: 3 down / 2 up).

    Args:
        alpha: α, weight of the global direction Δ_G in the local step (≥ 0; in [0, 1] for variant 3; 0 drops
            the alignment).
        lam: λ, weight decay (decoupled unless ``decoupled`` is False). None: 0.01 (variant 2) or 0
            (variant 3).
        beta1: β1, first-moment decay in [0, 1). None: 0.9 (variant 2) or 0 (variant 3).
        beta2: β2, second-moment decay in [0, 1).
        eps: ε (> 0).
        server_lr: η_g, the global learning rate (variant 3: γ = η_g·K·η).
        blocks: how v̄ is shared: "tensor" (one scalar per tensor; Appendix D.3's RoBERTa partition), "hessian"
            (Adam-mini blocks for timm transformers and Hugging Face BERT/RoBERTa, LoRA included) or "none"
            (element-wise v, Table 7's Agg-v).
        head_dim: rows per attention head of ``attn.qkv`` / ``query`` (``blocks: hessian``); timm ViT/DeiT and
            RoBERTa-Base use 64, Swin 32.
        min_block_size: hessian cap: at most ⌊d/min_block_size⌋ blocks.
        max_blocks: hessian cap: at most this many blocks (None: no extra cap).
        aggregate_v: start local v from the aggregated v̄ (False: v_0 = 0, nothing about v is sent).
        decoupled: decoupled weight decay (AdamW); False is coupled L2.
        variant: 2 (Algorithm 2) or 3 (Algorithm 3).
        local_schedule: removed: the in-round lr schedule is the loop's, for every rule
            (``loop.local_lr_schedule: cosine``, η_k = ½η_r(1 + cos(πk/K)) at ``loop.local_lr_eta_min: 0``); any
            value here is refused with that fix. Δ_G still divides by K·η_r (line 18), not by Σ_k η_k.
        bias_correction: "paper" (m̂ with the local k, line 11) or "released" (with the global t, as the
            released code).
        step_scale: "paper" (Adam step and decay at η) or "released" (both at η(1 − α), the July-2025 original;
            variant 2 only).
    """

    scales = (Scale("loop.lr", paper=3e-4, low=1e-6, high=1e-2),)  # Adam-scale lr: fedlight.config.advice

    def __init__(self, alpha: float = 0.5, lam: float | None = None, beta1: float | None = None,
                 beta2: float = 0.999, eps: float = 1e-8, server_lr: float = 1.0,
                 blocks: Literal["tensor", "hessian", "none"] = "tensor", head_dim: int = 64,
                 min_block_size: int = 512, max_blocks: int | None = None, aggregate_v: bool = True,
                 decoupled: bool = True, variant: Literal[2, 3] = 2,
                 local_schedule: str | None = None,
                 bias_correction: Literal["paper", "released"] = "paper",
                 step_scale: Literal["paper", "released"] = "paper") -> None:
        check(variant in (2, 3), f"`algorithm.variant` must be 2 or 3, got {variant!r}")
        lam = (0.01 if variant == 2 else 0.0) if lam is None else lam
        beta1 = (0.9 if variant == 2 else 0.0) if beta1 is None else beta1
        check(alpha >= 0, f"`algorithm.alpha` must be >= 0, got {alpha}")
        check(variant == 2 or alpha <= 1, f"`algorithm.alpha` must be in [0, 1] for variant 3, got {alpha}")
        check(lam >= 0, f"`algorithm.lam` must be >= 0, got {lam}")
        check(0 <= beta1 < 1, f"`algorithm.beta1` must be in [0, 1), got {beta1}")
        check(0 <= beta2 < 1, f"`algorithm.beta2` must be in [0, 1), got {beta2}")
        check(eps > 0, f"`algorithm.eps` must be > 0, got {eps}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        check(blocks in ("tensor", "hessian", "none"),
              f"`algorithm.blocks` must be one of 'tensor', 'hessian', 'none', got {blocks!r}")
        check(isinstance(head_dim, int) and head_dim >= 1,
              f"`algorithm.head_dim` must be an integer >= 1, got {head_dim!r}")
        check(isinstance(min_block_size, int) and min_block_size >= 1,
              f"`algorithm.min_block_size` must be an integer >= 1, got {min_block_size!r}")
        check(max_blocks is None or (isinstance(max_blocks, int) and max_blocks >= 1),
              f"`algorithm.max_blocks` must be null or an integer >= 1, got {max_blocks!r}")
        check(local_schedule is None, f"`algorithm.local_schedule` ({local_schedule!r}) moved to the loop, which "
              "applies it to every rule: set `loop.local_lr_schedule: cosine` (or `constant`) and remove "
              "`algorithm.local_schedule`")
        global_bias1 = released("bias_correction", bias_correction)
        scaled = released("step_scale", step_scale)
        check(variant == 2 or not scaled, "`algorithm.step_scale: released` is the July-2025 form of Algorithm 2; "
              "use `variant: 2` with it (or `step_scale: paper`)")
        check(not scaled or alpha <= 1, f"`algorithm.alpha` must be in [0, 1] with `step_scale: released` (the "
              f"Adam step is scaled by 1 − α), got {alpha}")
        part = _Blocks(blocks, head_dim, min_block_size, max_blocks)
        client = FedAdamWClient(part, alpha, lam, beta1, beta2, eps, decoupled, aggregate_v, variant, global_bias1,
                                (1.0 - alpha) if scaled else 1.0)  # loop.local_lr_schedule sets η_k per step
        super().__init__(client, FedAdamWServer(part, server_lr, aggregate_v, variant))

"""A small DeiT-Tiny-style Vision Transformer for 32×32 (or 64×64) images."""

from __future__ import annotations

from functools import partial

from timm.models.vision_transformer import VisionTransformer
from torch import nn

from fedlight.errors import check


class ViTTiny(VisionTransformer):
    """DeiT-Tiny variant for small images, as in the FedAdamW paper's code: patch 4, width 192, depth 6, 3 heads.

    A timm ``VisionTransformer`` (so its state_dict uses timm's key names) with qkv bias, LayerNorm(eps=1e-6),
    cls-token pooling and timm's default init (truncated normal std 0.02 for Linear weights, zero biases).
    ``drop_rate`` is dropout after the position embedding and inside every block (attention projection and MLP),
    which is what ``drop_rate`` meant in timm before 0.9; there is no dropout before the head. Use
    ``img_size=64`` for Tiny-ImageNet.

    Args:
        num_classes: Number of output logits.
        img_size: Side of the square input image; must be a multiple of ``patch_size``.
        patch_size: Side of a square patch.
        embed_dim: Token width; must be a multiple of ``num_heads``.
        depth: Number of transformer blocks.
        num_heads: Attention heads per block.
        mlp_ratio: MLP hidden width as a multiple of ``embed_dim``.
        drop_rate: Dropout probability (position embedding, attention projection, MLP).
    """

    def __init__(
        self,
        num_classes: int = 100,
        img_size: int = 32,
        patch_size: int = 4,
        embed_dim: int = 192,
        depth: int = 6,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        drop_rate: float = 0.1,
    ) -> None:
        for name, value in [
            ("num_classes", num_classes),
            ("img_size", img_size),
            ("patch_size", patch_size),
            ("embed_dim", embed_dim),
            ("depth", depth),
            ("num_heads", num_heads),
        ]:
            check(isinstance(value, int) and value >= 1, f"`model.{name}` must be a positive integer, got {value!r}")
        check(
            img_size % patch_size == 0,
            f"`model.img_size` ({img_size}) must be a multiple of `model.patch_size` ({patch_size})",
        )
        check(
            embed_dim % num_heads == 0,
            f"`model.embed_dim` ({embed_dim}) must be a multiple of `model.num_heads` ({num_heads})",
        )
        check(mlp_ratio > 0, f"`model.mlp_ratio` must be positive, got {mlp_ratio!r}")
        check(0.0 <= drop_rate < 1.0, f"`model.drop_rate` must be in [0, 1), got {drop_rate!r}")
        super().__init__(
            img_size=img_size,
            patch_size=patch_size,
            num_classes=num_classes,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=True,
            norm_layer=partial(nn.LayerNorm, eps=1e-6),
            global_pool="token",
            pos_drop_rate=drop_rate,
            proj_drop_rate=drop_rate,
            drop_rate=0.0,
        )

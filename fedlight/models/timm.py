"""Any timm model (ViT-B, Swin, DeiT, ...): random init, timm's Hub weights or a local checkpoint; optional LoRA."""

from __future__ import annotations

import difflib
import importlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
from torch import Tensor, nn

from fedlight.errors import ConfigError, check


@dataclass
class LoRA:
    """LoRA adapters (applied with the ``peft`` library; ``pip install peft``).

    After they are added, only the adapter weights and the classifier head are trainable. The seed papers use
    rank 16, alpha 2·rank, dropout 0.05 on the attention ``qkv`` and ``proj`` layers.

    Args:
        rank: Rank r of each low-rank update.
        alpha: Scaling numerator; the update is scaled by alpha / rank.
        dropout: Dropout on the adapter input.
        target_modules: Module names (or name suffixes) that get adapters.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["attn.qkv", "attn.proj"])

    def __post_init__(self) -> None:
        check(isinstance(self.rank, int) and self.rank >= 1, f"`model.lora.rank` must be >= 1, got {self.rank!r}")
        check(self.alpha > 0, f"`model.lora.alpha` must be positive, got {self.alpha!r}")
        check(0.0 <= self.dropout < 1.0, f"`model.lora.dropout` must be in [0, 1), got {self.dropout!r}")
        check(len(self.target_modules) > 0, "`model.lora.target_modules` must name at least one module")


class Timm(nn.Module):
    """A model from timm: random init, pretrained weights from the Hugging Face Hub (via timm), or a local file.

    ``pretrained: true`` loads timm's Hub weights for ``name``; a name may carry timm's weight tag, e.g.
    ``swin_tiny_patch4_window7_224.ms_in22k`` (ImageNet-22K, as the FedAdamW paper) or
    ``vit_base_patch16_224.orig_in21k`` (the original ViT-B/16 ImageNet-21K weights); without a tag timm's default
    tag is used. Once downloaded they are cached by ``huggingface_hub`` and found offline. When the Hub cannot be
    reached and they are not cached (``HF_HUB_OFFLINE=1``, no network), construction fails with a
    :class:`~fedlight.errors.ConfigError` naming the fix: a local ``checkpoint``. A ``checkpoint`` always wins over
    ``pretrained`` (nothing is fetched).

    The timm model is ``self.model``; this wrapper only adds loading and LoRA. Examples of ``name``:
    ``vit_base_patch16_224``, ``swin_tiny_patch4_window7_224``, ``swin_small_patch4_window7_224``,
    ``swin_base_patch4_window7_224``, ``deit_tiny_patch16_224``.

    The checkpoint may be a state_dict or a dict holding one under "model" or "state_dict" (keys with a common
    "module." or "model." prefix are accepted). It goes through the model family's timm ``checkpoint_filter_fn``
    when there is one, which converts original (e.g. Microsoft Swin) layouts and resizes position embeddings to
    ``img_size``. A classifier head whose shape does not match ``num_classes`` is dropped with a warning and
    stays freshly initialized; any other missing weight is an error.

    Args:
        name: A timm model name (see ``timm.list_models()``).
        num_classes: Number of output logits (size of the new classifier head).
        checkpoint: Path to a local weights file (``.safetensors``, or anything ``torch.load(weights_only=True)``
            reads); None for random init or Hub weights.
        pretrained: Load timm's pretrained weights for ``name`` from the Hugging Face Hub (or its local cache)
            when no ``checkpoint`` is given; the classifier head is replaced to fit ``num_classes``.
        img_size: Input image size, for models that take one (ViT, Swin); None keeps the model's default.
        lora: Add LoRA adapters and freeze everything else except the classifier head; None for full training.
        kwargs: Further keyword arguments for ``timm.create_model`` (e.g. ``{"depth": 2, "patch_size": 4}``).
    """

    def __init__(
        self,
        name: str,
        num_classes: int = 100,
        checkpoint: str | None = None,
        pretrained: bool = False,
        img_size: int | None = None,
        lora: LoRA | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not timm.is_model(name):
            close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.5)
            stem = name.split("_")[0]
            close += [m for m in timm.list_models(f"*{stem}*")[:5] if m not in close]
            hint = f"; close matches: {', '.join(close[:8])}" if close else ""
            raise ConfigError(f"`model.name` {name!r} is not a timm model{hint}")
        check(
            isinstance(num_classes, int) and num_classes >= 1, f"`model.num_classes` must be >= 1, got {num_classes!r}"
        )
        if checkpoint is not None and not os.path.isfile(checkpoint):
            raise ConfigError(f"`model.checkpoint` file not found: {checkpoint!r}")
        extra = dict(kwargs or {})
        if img_size is not None:
            extra["img_size"] = img_size
        hub = bool(pretrained) and checkpoint is None
        try:
            self.model = hub_model(name, num_classes, extra) if hub else timm.create_model(
                name, pretrained=False, num_classes=num_classes, **extra)
        except TypeError as e:
            raise ConfigError(f"`model.kwargs`/`model.img_size` not accepted by timm model {name!r}: {e}") from e
        if checkpoint is not None:
            load_checkpoint(self.model, checkpoint)
        if lora is not None:
            apply_lora(self.model, lora)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def hub_model(name: str, num_classes: int, extra: dict[str, Any]) -> nn.Module:
    """``timm.create_model(name, pretrained=True, ...)``; a :class:`ConfigError` naming the fix when timm has no
    weights for ``name`` or the Hub cannot be reached and the weights are not cached."""
    try:
        cfg = timm.models.get_pretrained_cfg(name)
    except RuntimeError:  # an unknown weight tag
        cfg = None
    source = getattr(cfg, "hf_hub_id", None) or getattr(cfg, "url", None)
    if not source:
        tags = timm.list_pretrained(name.split(".")[0] + ".*")
        hint = f"; weights timm has: {', '.join(tags[:8])}" if tags else ""
        raise ConfigError(f"`model.pretrained`: timm has no pretrained weights for {name!r}{hint}; name one of those "
                          "(or set `model.pretrained: false`, or give a local `model.checkpoint`)")
    try:
        return timm.create_model(name, pretrained=True, num_classes=num_classes, **extra)
    except OSError as e:  # huggingface_hub's offline / not-cached / HTTP errors and network errors are OSErrors
        offline = " (HF_HUB_OFFLINE is set)" if _hub_offline() else ""
        raise ConfigError(
            f"`model.pretrained: true` needs the weights {source} from the Hugging Face Hub, which cannot be reached"
            f"{offline} and has no cached copy ({type(e).__name__}). Fix: on a machine with a network run "
            f"`huggingface-cli download {source}` (or run once online so they are cached) and set "
            "`model.init_args.checkpoint` to the local weights file (model.safetensors or a .pth/.bin)"
        ) from None


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    names = model.pretrained_cfg.get("classifier", "head") if hasattr(model, "pretrained_cfg") else "head"
    names = (names,) if isinstance(names, str) else tuple(names)
    return tuple(n + "." for n in names)


def load_checkpoint(model: nn.Module, path: str) -> None:
    """Load weights from the local file ``path`` into the timm ``model`` (see :class:`Timm` for the rules)."""
    try:
        state = _read_weights(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a configuration problem
        raise ConfigError(f"`model.checkpoint` {path!r} could not be read as weights: {e}") from e
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    check(isinstance(state, dict) and len(state) > 0, f"`model.checkpoint` {path!r} holds no state_dict")
    for prefix in ("module.", "model."):
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    filter_fn = getattr(importlib.import_module(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        state = filter_fn(state, model)

    own = model.state_dict()
    head = _classifier_prefixes(model)
    dropped = [k for k, v in state.items() if k.startswith(head) and k in own and v.shape != own[k].shape]
    if dropped:
        warnings.warn(
            f"`model.checkpoint`: dropping the classifier head {dropped} (shape differs from num_classes="
            f"{own[dropped[0]].shape[0]}); it stays randomly initialized",
            stacklevel=3,
        )
        state = {k: v for k, v in state.items() if k not in dropped}
    bad_shape = [
        f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    check(not bad_shape, f"`model.checkpoint` {path!r} does not fit the model: {bad_shape[:5]}")
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith(head)]
    check(not missing, f"`model.checkpoint` {path!r} lacks {len(missing)} weights of the model, e.g. {missing[:5]}")
    if result.unexpected_keys:
        warnings.warn(
            f"`model.checkpoint`: ignoring {len(result.unexpected_keys)} keys the model does not have, "
            f"e.g. {result.unexpected_keys[:5]}",
            stacklevel=3,
        )


def _read_weights(path: str) -> Any:
    """A ``.safetensors`` file (as the Hub serves timm weights), else ``torch.load(weights_only=True)``."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def apply_lora(model: nn.Module, lora: LoRA) -> None:
    """Add LoRA adapters to ``model`` in place; freeze all but the adapters and the classifier head."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ConfigError("`model.lora` needs the peft library: pip install peft (or fedlight[lora])") from e
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:
        raise ConfigError(f"`model.lora.target_modules` {lora.target_modules} match no layer of the model: {e}") from e
    head = _classifier_prefixes(model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith(head))

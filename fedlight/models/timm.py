"""Any timm model (ViT-B, Swin, DeiT, ...): random init, timm's Hub weights or a local checkpoint; optional LoRA."""

from __future__ import annotations

import difflib
import importlib
import os
import warnings
from typing import Any, Literal

import timm
import torch
from torch import Tensor, nn

from fedlight.errors import ConfigError, check
from fedlight.models import hub
from fedlight.models.adapters import LoRA, apply_lora

TIMM_TARGETS = ["attn.qkv", "attn.proj"]
"""Default LoRA targets of timm transformers: the attention's qkv and output projections (the seed papers' choice)."""


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
        preprocessing: how the data module normalises and resizes inputs for pretrained weights (``pretrained`` or a
            ``checkpoint``): ``checkpoint`` (default) uses timm's resolved data config of the weights
            (``pretrained_cfg``: mean/std and interpolation, e.g. ImageNet's for Swin in22k, 0.5/0.5 for ViT
            orig_in21k); ``dataset`` keeps the data module's own statistics and bilinear resizing. A randomly
            initialised model always keeps the data module's.
        interpolation: the resize interpolation (``bilinear`` / ``bicubic``), overriding the one ``preprocessing``
            gives; None: the checkpoint's (``preprocessing: checkpoint``) or bilinear.
        kwargs: Further keyword arguments for ``timm.create_model`` (e.g. ``{"depth": 2, "patch_size": 4}``).
    """

    def __init__(
        self,
        name: str,
        num_classes: int = 100,
        checkpoint: str | None = None,
        pretrained: bool = False,
        img_size: int | None = None,
        preprocessing: Literal["checkpoint", "dataset"] = "checkpoint",
        interpolation: Literal["bilinear", "bicubic"] | None = None,
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
            apply_lora(self.model, lora, TIMM_TARGETS, keep=_classifier_prefixes(self.model))
        check(preprocessing in ("checkpoint", "dataset"), "`model.init_args.preprocessing` must be 'checkpoint' or "
              f"'dataset', got {preprocessing!r}")
        check(interpolation in (None, "bilinear", "bicubic"), "`model.init_args.interpolation` must be bilinear, "
              f"bicubic or null, got {interpolation!r}")
        weights = bool(pretrained) or checkpoint is not None
        self.preprocessing_config = checkpoint_preprocessing(self.model, name) if (
            weights and preprocessing == "checkpoint") else {}
        """What the data module adopts (``fedlight.data.augment.adopt_preprocessing``): mean, std, interpolation."""
        if interpolation is not None:
            self.preprocessing_config = {**self.preprocessing_config, "interpolation": interpolation,
                                         "source": self.preprocessing_config.get("source", "the data module")
                                         + f", interpolation {interpolation} (model.init_args.interpolation)"}

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def checkpoint_preprocessing(model: nn.Module, name: str) -> dict[str, Any]:
    """Mean, std and interpolation of the weights' ``pretrained_cfg`` (timm's resolved data config)."""
    from timm.data import resolve_data_config

    cfg = resolve_data_config({}, model=model)
    return {"mean": tuple(cfg["mean"]), "std": tuple(cfg["std"]), "interpolation": cfg["interpolation"],
            "source": f"{name}'s pretrained_cfg (model.init_args.preprocessing: checkpoint)"}


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
    overlay = {}
    if not hub.available():
        cached = _cached_weights(cfg)
        if cached is None:
            raise ConfigError(
                f"`model.pretrained: true` needs the weights {source} from the Hugging Face Hub, which cannot be used "
                f"({hub.why_not()}), and they are not in the local cache. Fix: where the Hub is reachable run "
                f"`{_fetch(cfg, source)}` (or run once online so they are cached) and set "
                "`model.init_args.checkpoint` to the local weights file (model.safetensors or a .pth/.bin)")
        overlay = {"pretrained_cfg_overlay": {"file": cached}}  # the cached file: nothing is fetched
    try:
        return timm.create_model(name, pretrained=True, num_classes=num_classes, **overlay, **extra)
    except OSError as e:  # huggingface_hub's HTTP errors and network errors are OSErrors
        raise ConfigError(f"`model.pretrained: true`: the weights {source} could not be fetched ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}). Fix: `{_fetch(cfg, source)}` and set "
                          "`model.init_args.checkpoint` to the downloaded file") from None


def _cached_weights(cfg: Any) -> str | None:
    """The locally cached weights file of a timm pretrained config (Hugging Face cache or torch hub), or None."""
    repo = getattr(cfg, "hf_hub_id", None)
    if repo:
        from huggingface_hub import try_to_load_from_cache

        names = [getattr(cfg, "hf_hub_filename", None), "model.safetensors", "pytorch_model.bin"]
        for f in filter(None, names):
            path = try_to_load_from_cache(repo, f)
            if isinstance(path, str):
                return path
        return None
    url = getattr(cfg, "url", None)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url or ""))
    return path if url and os.path.isfile(path) else None


def _fetch(cfg: Any, source: str) -> str:
    repo = getattr(cfg, "hf_hub_id", None)
    return hub.download_command(repo, "model.safetensors", "--local-dir", "DIR") if repo else f"curl -LO {source}"


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

"""Hugging Face ``transformers`` models (``pip install fedlight[nlp]``), optionally with LoRA adapters (``peft``).

Where the weights come from (``name``): a local directory saved with ``save_pretrained`` (offline), a Hub name such
as ``roberta-base`` (downloaded when online, else read from the local Hugging Face cache), or nothing — then
``config`` (a dict with ``model_type``) builds a randomly initialised model (tests, GPT-2 from scratch).

Only parameters with ``requires_grad`` are federated (``fedlight.core.params.trainable``): with LoRA the backbone is
frozen, so broadcasts, uploads, per-client state and the byte counts are the adapters plus the task head.

On the ``meta`` device (shape-only instantiation: the recipe tests) nothing is downloaded or read: a Hub name that is
not available locally resolves to its architecture from :data:`ARCHITECTURES`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.core.params import in_stacked
from fedlight.errors import ConfigError, check
from fedlight.models import hub
from fedlight.models.adapters import LoRA, apply_lora

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "roberta-base": {"model_type": "roberta", "vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12,
                     "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 514,
                     "type_vocab_size": 1, "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0,
                     "eos_token_id": 2},
    "gpt2": {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12},
}
"""Architectures of the Hub names fedlight's recipes use (only read on the ``meta`` device, where no weights load)."""

HEADS = ("classifier", "score")
"""Prefixes of the task heads that stay trainable next to the LoRA adapters."""


HFLoRA = LoRA
"""The LoRA configuration of :mod:`fedlight.models.adapters` (one for every model family); the old name still works."""
HF_TARGETS = ["query", "value"]
"""Default LoRA targets: BERT/RoBERTa's query and value projections (the FedAdamW paper's Table 9)."""


def _imports():
    try:
        import transformers
    except ImportError as e:
        raise ConfigError("Hugging Face models need the nlp extra: pip install 'fedlight[nlp]' (transformers, peft, "
                          "tokenizers, datasets)") from e
    return transformers


def _on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def _offline_error(name: str, what: str) -> ConfigError:
    return ConfigError(f"`{what}` {name!r} is a Hugging Face Hub name, but the Hub cannot be used ({hub.why_not()}) "
                       "and it is not in the local cache. Fix: give a local directory instead (one saved with "
                       "`save_pretrained`, holding config.json and the weights), e.g. fetched where the Hub is "
                       f"reachable with `{hub.download_command(name, '--local-dir', 'DIR')}`")


def _config(name: str | None, config: dict[str, Any] | None, what: str, **overrides: Any):
    """The ``transformers`` config of ``name`` (local dir, cache or Hub) or of the ``config`` dict."""
    tf = _imports()
    check((name is None) != (config is None), f"`{what}` and `model.init_args.config`: give exactly one (a Hub "
          "name or local directory for weights, or a config dict with `model_type` for a random model)")
    if config is not None:
        cfg = dict(config)
        check("model_type" in cfg, f"`model.init_args.config` needs `model_type` (e.g. roberta, gpt2), got "
              f"{sorted(cfg)}")
        try:
            return tf.AutoConfig.for_model(cfg.pop("model_type"), **cfg, **overrides)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"`model.init_args.config`: {e}") from None
    local = os.path.isdir(name)
    try:  # on the meta device only the local cache is read (then the table): nothing is ever downloaded there
        offline = local or _on_meta() or not hub.available()
        return tf.AutoConfig.from_pretrained(name, local_files_only=offline, **overrides)
    except OSError:
        if local:
            raise ConfigError(f"`{what}` {name!r} is a directory without a transformers config.json; save the "
                              "model there with `save_pretrained`") from None
        if _on_meta() and name in ARCHITECTURES:
            return _config(None, ARCHITECTURES[name], what, **overrides)
        raise _offline_error(name, what) from None


def build(auto_class: str, name: str | None, config: dict[str, Any] | None, what: str, **overrides: Any) -> nn.Module:
    """A ``transformers`` model: pretrained weights from ``name`` (a local directory, the cache or the Hub), or a
    random one from ``config``. Never downloads while offline."""
    tf = _imports()
    cls = getattr(tf, auto_class)
    cfg = _config(name, config, what, **overrides)
    if name is None or _on_meta():
        return cls.from_config(cfg)
    try:
        return cls.from_pretrained(name, config=cfg, local_files_only=os.path.isdir(name) or not hub.available(),
                                   ignore_mismatched_sizes=True)  # a head of another label count starts afresh
    except OSError as e:
        if os.path.isdir(name):
            raise ConfigError(f"`{what}` {name!r}: no weights could be read ({str(e).splitlines()[0]}); save the "
                              "model there with `save_pretrained`") from None
        raise _offline_error(name, what) from None


def _sdpa(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == "sdpa" and not model.config.is_decoder


class HFModel(nn.Module):
    """Base of the wrappers: ``self.model`` is the ``transformers`` model; ``forward`` returns the logits tensor."""

    auto_class = "AutoModel"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        if attention_mask is not None and attention_mask.dim() == 2 and in_stacked() and _sdpa(self.model):
            # under vmap: a ready [B, 1, 1, T] boolean mask, which transformers passes on as is (building one from
            # the 2-D padding mask branches on its values, which vmap cannot do)
            attention_mask = attention_mask[:, None, None, :].bool()
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding (the largest token id + 1 the model accepts)."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def pad_token_id(self) -> int | None:
        return getattr(self.model.config, "pad_token_id", None)

    @property
    def head_dim(self) -> int:
        c = self.model.config
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
        width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
        return int(width // heads)


class HFSequenceClassifier(HFModel):
    """A ``transformers`` ``...ForSequenceClassification`` model (RoBERTa, BERT, ...), optionally with LoRA.

    Called with the batch's ``input_ids`` / ``attention_mask``; returns logits ``[B, num_labels]``.

    Args:
        name: weights: a local directory (``save_pretrained``) or a Hub name (``roberta-base``; needs a network or
            the local Hugging Face cache). Exclusive with ``config``.
        config: a random model instead: a config dict with ``model_type`` (e.g. ``{model_type: roberta,
            hidden_size: 32, num_hidden_layers: 2, ...}``).
        num_labels: classes of the task (GLUE: 2; MNLI: 3).
        lora: LoRA adapters (backbone frozen; adapters and classifier trained); None trains every weight.
        dropout: hidden and attention dropout of the backbone (None: the checkpoint's; RoBERTa: 0.1).
    """

    auto_class = "AutoModelForSequenceClassification"

    def __init__(self, name: str | None = None, config: dict[str, Any] | None = None, num_labels: int = 2,
                 lora: LoRA | None = None, dropout: float | None = None) -> None:
        super().__init__()
        check(isinstance(num_labels, int) and num_labels >= 2, f"`model.init_args.num_labels` must be >= 2, got "
              f"{num_labels!r}")
        extra = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        self.model = build(self.auto_class, name, config, "model.init_args.name", num_labels=num_labels, **extra)
        if lora is not None:
            apply_lora(self.model, lora, HF_TARGETS, keep=tuple(h + "." for h in HEADS))


class HFCausalLM(HFModel):
    """A ``transformers`` causal language model (GPT-2, ...): called with token ids ``[B, T]``, returns logits
    ``[B, T, vocab]`` (for :class:`fedlight.tasks.LanguageModeling`).

    Args:
        name: weights: a local directory or a Hub name (``gpt2``). Exclusive with ``config``.
        config: a random model: a config dict with ``model_type`` (e.g. ``{model_type: gpt2, vocab_size: 80,
            n_positions: 128, n_embd: 768, n_layer: 12, n_head: 12}``).
        lora: LoRA adapters (e.g. ``target_modules: [c_attn]`` for GPT-2); None trains every weight.
        dropout: residual, embedding and attention dropout (None: the config's; GPT-2: 0.1).
    """

    auto_class = "AutoModelForCausalLM"

    def __init__(self, name: str | None = None, config: dict[str, Any] | None = None, lora: LoRA | None = None,
                 dropout: float | None = None) -> None:
        super().__init__()
        extra = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
        self.model = build(self.auto_class, name, config, "model.init_args.name", **extra)
        if lora is not None:
            apply_lora(self.model, lora, HF_TARGETS)

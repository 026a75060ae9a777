"""Hugging Face ``transformers`` models (``pip install fedlight[nlp]``), optionally with LoRA adapters (``peft``).

Where the weights come from (``name``): a local directory saved with ``save_pretrained`` (offline), a Hub name such
as ``roberta-base`` (downloaded when online, else read from the local Hugging Face cache), or nothing — then
``config`` (a dict with ``model_type``) builds a randomly initialised model (tests, GPT-2 from scratch).

Only parameters with ``requires_grad`` are federated (``fedlight.params.trainable``): with LoRA the backbone is
frozen, so broadcasts, uploads, per-client state and the byte counts are the adapters plus the task head.

On the ``meta`` device (shape-only instantiation: the recipe tests) nothing is downloaded or read: a Hub name that is
not available locally resolves to its architecture from :data:`ARCHITECTURES`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.errors import ConfigError, check
from fedlight.params import in_stacked

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


@dataclass
class HFLoRA:
    """LoRA adapters on a ``transformers`` model (through ``peft``): the backbone is frozen, adapters and the task
    head are trained. Defaults: the FedAdamW paper's RoBERTa set-up (Table 9: r = 16, α = 32 on query and value).

    Args:
        rank: r, the rank of each low-rank update.
        alpha: α; the update is scaled by α / r.
        dropout: dropout on the adapter input.
        target_modules: module names (or dotted name suffixes) that get adapters, e.g. ``query``, ``value``
            (BERT/RoBERTa) or ``c_attn`` (GPT-2).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.1
    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])

    def __post_init__(self) -> None:
        check(isinstance(self.rank, int) and self.rank >= 1, f"`model.init_args.lora.rank` must be >= 1, got "
              f"{self.rank!r}")
        check(self.alpha > 0, f"`model.init_args.lora.alpha` must be positive, got {self.alpha!r}")
        check(0.0 <= self.dropout < 1.0, f"`model.init_args.lora.dropout` must be in [0, 1), got {self.dropout!r}")
        check(len(self.target_modules) > 0, "`model.init_args.lora.target_modules` must name at least one module")


def _imports():
    try:
        import transformers
    except ImportError as e:
        raise ConfigError("Hugging Face models need the nlp extra: pip install 'fedlight[nlp]' (transformers, peft, "
                          "tokenizers, datasets)") from e
    return transformers


def hub_offline() -> bool:
    """Whether the Hugging Face Hub must not be contacted (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def _offline_error(name: str, what: str) -> ConfigError:
    return ConfigError(f"`{what}` {name!r} is a Hugging Face Hub name, but the Hub cannot be reached (offline: "
                       "HF_HUB_OFFLINE is set or there is no network) and it is not in the local cache; give a local "
                       "directory instead (one saved with `save_pretrained`, holding config.json and the weights)")


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
        return tf.AutoConfig.from_pretrained(name, local_files_only=local or hub_offline() or _on_meta(), **overrides)
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
        return cls.from_pretrained(name, config=cfg, local_files_only=os.path.isdir(name) or hub_offline(),
                                   ignore_mismatched_sizes=True)  # a head of another label count starts afresh
    except OSError as e:
        if os.path.isdir(name):
            raise ConfigError(f"`{what}` {name!r}: no weights could be read ({str(e).splitlines()[0]}); save the "
                              "model there with `save_pretrained`") from None
        raise _offline_error(name, what) from None


def apply_lora(model: nn.Module, lora: HFLoRA, heads: tuple[str, ...] = HEADS) -> None:
    """Add LoRA adapters to ``model`` in place; only adapters and the task head (``heads``) stay trainable."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ConfigError("`model.init_args.lora` needs peft: pip install 'fedlight[nlp]'") from e
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, (nn.Linear, nn.Conv1d)) or type(m).__name__ == "Conv1D"})
    names = [n for n, _ in model.named_modules()]
    absent = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if absent:
        raise ConfigError(f"`model.init_args.lora.target_modules`: {absent} match no module of the model; its "
                          f"linear modules are named {', '.join(linear)}")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules))
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # e.g. a target that is not a linear layer
        raise ConfigError(f"`model.init_args.lora.target_modules` {lora.target_modules}: {str(e).splitlines()[0]}; "
                          f"LoRA goes on linear modules, here named {', '.join(linear)}") from None
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n or n.split(".", 1)[0] in heads)


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
                 lora: HFLoRA | None = None, dropout: float | None = None) -> None:
        super().__init__()
        check(isinstance(num_labels, int) and num_labels >= 2, f"`model.init_args.num_labels` must be >= 2, got "
              f"{num_labels!r}")
        extra = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        self.model = build(self.auto_class, name, config, "model.init_args.name", num_labels=num_labels, **extra)
        if lora is not None:
            apply_lora(self.model, lora)


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

    def __init__(self, name: str | None = None, config: dict[str, Any] | None = None, lora: HFLoRA | None = None,
                 dropout: float | None = None) -> None:
        super().__init__()
        extra = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
        self.model = build(self.auto_class, name, config, "model.init_args.name", **extra)
        if lora is not None:
            apply_lora(self.model, lora, heads=())

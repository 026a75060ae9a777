"""LoRA adapters for every model family (timm and ``transformers``), through ``peft``: one configuration, one
validation, one rule for what stays trainable."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedlight.errors import ConfigError, check


@dataclass
class LoRA:
    """LoRA adapters (``peft``; ``pip install 'fedlight[lora]'``). After they are added only the adapters and the
    model's task head stay trainable (the backbone is frozen), so only those are federated.

    Args:
        rank: r, the rank of each low-rank update.
        alpha: α; the update is scaled by α / r.
        dropout: dropout on the adapter input (0.1: the FedAdamW paper's RoBERTa set-up, Table 9).
        target_modules: module names (or dotted name suffixes) that get adapters; None: the model family's
            attention projections (timm: ``attn.qkv``, ``attn.proj``; ``transformers``: ``query``, ``value``).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.1
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        check(isinstance(self.rank, int) and self.rank >= 1, f"`model.init_args.lora.rank` must be >= 1, got "
              f"{self.rank!r}")
        check(self.alpha > 0, f"`model.init_args.lora.alpha` must be positive, got {self.alpha!r}")
        check(0.0 <= self.dropout < 1.0, f"`model.init_args.lora.dropout` must be in [0, 1), got {self.dropout!r}")
        check(self.target_modules is None or len(self.target_modules) > 0,
              "`model.init_args.lora.target_modules` must name at least one module (or be null for the default)")


def apply_lora(model: nn.Module, lora: LoRA, default_targets: list[str], keep: tuple[str, ...] = ()) -> None:
    """Add ``lora``'s adapters to ``model`` in place (``default_targets`` when it names none); only the adapters and
    the parameters whose names start with a prefix in ``keep`` (the task head, e.g. ``"head."``) stay trainable."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ConfigError("`model.init_args.lora` needs peft: pip install 'fedlight[lora]'") from e
    targets = list(lora.target_modules or default_targets)
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, (nn.Linear, nn.Conv1d)) or type(m).__name__ == "Conv1D"})
    names = [n for n, _ in model.named_modules()]
    absent = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if absent:
        raise ConfigError(f"`model.init_args.lora.target_modules`: {absent} match no module of the model; its "
                          f"linear modules are named {', '.join(linear)}")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # e.g. a target that is not a linear layer
        raise ConfigError(f"`model.init_args.lora.target_modules` {targets}: {str(e).splitlines()[0]}; LoRA goes on "
                          f"linear modules, here named {', '.join(linear)}") from None
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n or n.startswith(keep))

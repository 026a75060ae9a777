"""Loop settings. Field docstrings become ``fedlight fit --help`` text; defaults live here only."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from fedlight.core.scale import scales_of
from fedlight.errors import check

SGD_LR = 0.1
"""``loop.lr`` left unset, for a rule that declares no learning-rate scale of its own (SGD-type rules)."""

AUTO_CLIP = 10.0
"""``loop.max_grad_norm: auto`` for fedlight's own models (a LightningModule: no clip)."""


@dataclass
class LRSchedule:
    """Round learning-rate schedule ``η_r`` (r = 0-based round)."""

    kind: Literal["constant", "exponential", "cosine"] = "constant"
    """constant: η_r = η_0; exponential: η_r = η_0·decay^r; cosine: η_r = ½η_0(1 + cos(π r / R))."""
    decay: float = 0.998
    """Per-round factor of the exponential schedule (the seed papers use 0.998)."""

    def __post_init__(self) -> None:
        check(0 < self.decay <= 1, f"`loop.lr_schedule.decay` must be in (0, 1], got {self.decay}")

    def lr(self, lr0: float, r: int, rounds: int) -> float:
        if self.kind == "exponential":
            return lr0 * self.decay**r
        if self.kind == "cosine":
            return 0.5 * lr0 * (1 + math.cos(math.pi * r / rounds))
        return lr0


def _optimizer_class(path: str) -> type | None:
    """The ``torch.optim.Optimizer`` subclass at ``path``, or None."""
    import torch

    try:
        cls = _load(path)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _load(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _init_params(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch.compile`` modes ``loop.compile`` accepts (any other string must be a backend name)."""


def _check_compile(value) -> None:
    """``loop.compile``: null, a bool, a mode, or a registered ``torch.compile`` backend."""
    if value is None or isinstance(value, bool) or value in COMPILE_MODES:
        return
    backends: list[str] = []
    if isinstance(value, str):
        from torch._dynamo import list_backends

        if value in list_backends(exclude_tags=()):
            return
        backends = [*sorted(list_backends()), "aot_eager", "eager"]
    check(False, f"`loop.compile` must be true, false, null, a mode ({', '.join(COMPILE_MODES)}) or a "
          f"torch.compile backend ({', '.join(backends) or 'see torch._dynamo.list_backends()'}), got {value!r}")


MAX_LR = 1e30
"""Largest accepted ``loop.lr``: any float a float32 update can hold after scaling, with margin."""


@dataclass
class LoopConfig:
    """How the federated simulation runs (everything that is engineering, not an algorithm's math)."""

    rounds: int = 100
    """Communication rounds R."""
    clients_per_round: int = 10
    """Clients sampled each round (S), seeded by (seed, round); under ``sampling: poisson`` the expected number."""
    sampling: Literal["fixed", "poisson"] = "fixed"
    """fixed: S of N without replacement; poisson: each client with probability S/N (any number, none included)."""
    local_epochs: int | None = None
    """Local epochs E: K = E·⌈n_i/B⌉ steps. Exactly one of local_epochs / local_steps is set (default E = 1)."""
    local_steps: int | None = None
    """Local steps K per round (fixed, independent of client size)."""
    lr: float | None = None
    """Local lr η_0; unset: the rule's own (FedAdamW 3e-4, else 0.1)."""
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    """Round schedule of the local learning rate."""
    local_lr_schedule: Literal["constant", "cosine"] = "constant"
    """lr of local step k = 0..K−1, every rule: constant η_r; cosine η_min + ½(η_r − η_min)(1 + cos(πk/K))."""
    local_lr_eta_min: float = 0.0
    """η_min of the local cosine (0 <= η_min < loop.lr)."""
    optimizer: str = "torch.optim.SGD"
    """Local optimizer: the class path of a ``torch.optim.Optimizer`` subclass, built per client as
    ``cls(params, lr=η_r, weight_decay=loop.weight_decay, [momentum=loop.momentum,] **loop.optimizer_args)``
    (rules with their own optimizer, e.g. FedAdamW, ignore it)."""
    momentum: float = 0.0
    """Local momentum, for optimizers that take one (SGD; 0 in the seed papers)."""
    weight_decay: float = 1.0e-3
    """Local weight decay (coupled for SGD, added after clipping)."""
    optimizer_args: dict = field(default_factory=dict)
    """The optimizer's other init arguments (checked against its signature), e.g. {betas: [0.9, 0.99]}."""
    max_grad_norm: float | str | None = "auto"  # str, not Literal["auto"]: a wrong value gets the check's message
    """Joint L2 clip of the local step; null: none; auto: 10, none for a LightningModule."""
    weighting: Literal["samples", "uniform"] = "samples"
    """Aggregation weights: w_i ∝ n_i or 1/S."""
    aggregate_buffers: bool = True
    """Average floating-point buffers (BatchNorm running statistics) over clients."""
    eval_every: int = 1
    """Evaluate the global model on the test set every this many rounds (and after the last)."""
    save_every: int = 1
    """Write checkpoints/last.ckpt every this many rounds (and after the last)."""
    targets: list[float] = field(default_factory=list)
    """Values of the headline test metric for rounds-to-target in summary.json, e.g. [0.55] (accuracy: reached at
    or above; a lower-is-better metric such as MSE or perplexity: reached at or below)."""
    state_device: Literal["cpu", "device"] = "cpu"
    """Where per-client state lives between rounds."""
    state_budget_mb: float | None = None
    """Keep at most this many MiB of per-client state in memory; the least recently stored states spill to files in
    ``<out_dir>/client_state/rank<r>/``, which checkpoints reference instead of copying. null: all in memory."""
    on_nonfinite: Literal["stop", "skip_client"] = "stop"
    """A non-finite client loss/update: stop (keep the last good checkpoint, record diverged_at_round) or
    skip_client (drop that client's update for the round, count it, go on)."""
    client_dropout: float = 0.0
    """Probability that a sampled client fails to report (seeded by (seed, round, client)); its state is untouched."""
    client_parallelism: Literal["auto", "sequential", "vmap", "streams", "graphs"] = "auto"
    """How each process runs its clients (docs/speed.md; the log says which ran and why). auto: the fastest exact
    route measured on the device (CUDA: vmap with CUDA graphs) that the rule and model allow, else sequential.
    sequential: one after another. vmap: stacked along a client dimension (torch.func; memory grows with the
    chunk). streams: a model copy per client, steps interleaved on CUDA streams with CUDA graphs (exact). graphs: vmap
    with each whole step (forward, backward, update) replayed from a CUDA graph (FedAvg, FedSAM, FedNSAM, SCAFFOLD;
    not yet measured on a GPU, so auto does not take it)."""
    vmap_chunk: int | str | None = None  # str, not Literal["auto"]: a wrong value gets the check's message
    """Stacked runner only: at most this many clients trained together (bounds memory); null: all of a group; auto:
    as many as fit in the free memory by the model's measured per-client footprint. A chunk that runs out of memory
    is halved and redone (same numbers)."""
    channels_last: bool = False
    """Keep convolution weights and 4-D input batches in channels-last memory format (faster tensor-core
    convolutions on GPU; no effect on the math). The stacked runner then also keeps its grouped convolutions
    channels-last end to end."""
    matmul_convs: int = 0
    """Stacked runner: convolutions of at most this many input channels (3: RGB) as one batched matmul, not a
    grouped convolution (fedlight/runners/matmul_conv.py); 0: none."""
    compile: bool | str | None = None
    """torch.compile the client computation. true: inductor; a mode ("reduce-overhead": CUDA graphs) or a backend
    ("aot_eager"); false: never; null: as auto's route runs. Failures fall back, each saying why (docs/speed.md)."""
    progress: bool = True
    """Show a progress bar (only when stderr is a terminal)."""

    def local_lr(self, lr: float, k: int, K: int) -> float:
        """η_k, the lr of local step k (0-based) of K in a round at η_r = ``lr`` (``loop.local_lr_schedule``).

        cosine: ``η_k = η_min + ½(η_r − η_min)(1 + cos(πk/K))``, from η_r at the first step down towards η_min,
        restarted every round (the FedAdamW paper's "cosine decay ... over the 50 local steps per round", Appendix
        C). The loop applies it to every rule (:func:`fedlight.engine.local_schedule.local_schedule`); a rule that
        divides by the lr keeps its paper's divisor (SCAFFOLD: ``Σ_k η_k``; FedAdamW's Δ_G: ``K·η_r``)."""
        if self.local_lr_schedule == "cosine":
            return self.local_lr_eta_min + 0.5 * (lr - self.local_lr_eta_min) * (1.0 + math.cos(math.pi * k / K))
        return lr

    def round_lrs(self, info) -> tuple[float, float]:
        """The lr of round ``info``'s first and last local step (``loop.local_lr_schedule`` from ``η_r``)."""
        K = max(1, round(info.num_steps))
        return self.local_lr(info.lr, 0, K), self.local_lr(info.lr, K - 1, K)

    @property
    def clip_norm(self) -> float | None:
        """The clip in force for fedlight's own models: ``max_grad_norm`` with ``auto`` read as 10."""
        return AUTO_CLIP if self.max_grad_norm == "auto" else self.max_grad_norm

    def optimizer_factory(self):
        """``factory(params, lr=η)`` → the local optimizer with this config's class, weight decay and arguments."""
        import functools

        cls = _load(self.optimizer)
        extra = {"momentum": self.momentum} if "momentum" in _init_params(cls) else {}
        return functools.partial(cls, weight_decay=self.weight_decay, **extra, **self.optimizer_args)

    def for_rule(self, algorithm: Any) -> LoopConfig:
        """This config with an unset ``lr`` given ``algorithm``'s own: its declared paper value, else
        :data:`SGD_LR`."""
        if self.lr is not None:
            return self
        return dataclasses.replace(self, lr=next((s.paper for s in scales_of(algorithm) if s.key == "loop.lr"),
                                                 SGD_LR))

    def __post_init__(self) -> None:
        for name in ("rounds", "clients_per_round", "eval_every", "save_every"):
            v = getattr(self, name)
            check(isinstance(v, int) and v > 0, f"`loop.{name}` must be a positive integer, got {v!r}")
        check(self.local_epochs is None or self.local_steps is None,
              "set only one of `loop.local_epochs` and `loop.local_steps`")
        for name in ("local_epochs", "local_steps"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and v > 0), f"`loop.{name}` must be a positive integer, got {v!r}")
        opt = _optimizer_class(self.optimizer)
        check(opt is not None, f"`loop.optimizer` {self.optimizer!r} is not an importable torch.optim.Optimizer "
              "subclass (e.g. torch.optim.SGD, torch.optim.AdamW)")
        given = set(self.optimizer_args)
        unknown = sorted(given - _init_params(opt) | given & {"params", "lr", "weight_decay"})
        check(not unknown, f"`loop.optimizer_args` {unknown} are not arguments {self.optimizer} takes from there "
              "(lr comes from `loop.lr`, weight decay from `loop.weight_decay`)")
        check(self.lr is None or 0 < self.lr <= MAX_LR, f"`loop.lr` must be positive and at most {MAX_LR:g} "
              f"(float32 parameters overflow beyond ~3.4e38), got {self.lr}")
        check(self.local_lr_schedule in ("constant", "cosine"),
              f"`loop.local_lr_schedule` must be 'constant' or 'cosine', got {self.local_lr_schedule!r}")
        check(0 <= self.local_lr_eta_min < (math.inf if self.lr is None else self.lr),
              f"`loop.local_lr_eta_min` must be in [0, loop.lr = {self.lr}), got {self.local_lr_eta_min}")
        check(0 <= self.momentum < 1, f"`loop.momentum` must be in [0, 1), got {self.momentum}")
        check(self.momentum == 0 or "momentum" in _init_params(opt),
              f"`loop.momentum` ({self.momentum}) is not an argument of `loop.optimizer` {self.optimizer}; "
              "set it to 0 or pass the optimizer's own arguments in `loop.optimizer_args`")
        check(0 <= self.weight_decay < math.inf, f"`loop.weight_decay` must be >= 0, got {self.weight_decay}")
        check(self.max_grad_norm in (None, "auto") or (isinstance(self.max_grad_norm, (int, float))
                                                        and not isinstance(self.max_grad_norm, bool)
                                                        and self.max_grad_norm > 0),
              f"`loop.max_grad_norm` must be positive, auto or null, got {self.max_grad_norm!r}")
        check(self.state_budget_mb is None or self.state_budget_mb >= 0,
              f"`loop.state_budget_mb` must be >= 0 or null, got {self.state_budget_mb}")
        check(type(self.matmul_convs) is int and self.matmul_convs >= 0,
              f"`loop.matmul_convs` is a number of input channels (0: none; 3: an RGB first layer), got "
              f"{self.matmul_convs!r}")
        check(self.vmap_chunk in (None, "auto") or (type(self.vmap_chunk) is int and self.vmap_chunk > 0),
              f"`loop.vmap_chunk` must be a positive integer, auto or null, got {self.vmap_chunk!r}")
        _check_compile(self.compile)
        check(self.sampling in ("fixed", "poisson"), f"`loop.sampling` must be fixed or poisson, got {self.sampling!r}")
        check(0 <= self.client_dropout < 1, f"`loop.client_dropout` must be in [0, 1), got {self.client_dropout}")
        check(all(isinstance(t, (int, float)) and math.isfinite(t) for t in self.targets),
              f"`loop.targets` must be numbers (values of the headline test metric), got {self.targets}")

"""The task seam: what a batch is, what a client minimises, how the global model is evaluated.

A :class:`Task` is the third replaceable part of a run, next to the data module and the rule pair. Rules never see
it: the loop hands its objective to every client as ``ctx.objective``, so a rule keeps calling
``ctx.loss(model, batch)`` whatever the task. Evaluation (the test metrics of a round, and which of them is the
run's *headline*, with its direction) belongs to the task too.

Metrics are written to ``metrics.jsonl`` as ``test_<name>`` (``test_acc``, ``test_loss``, ``test_mse`` ...); the
headline metric ``test_<headline>`` is the one the console line, ``summary.json`` (final / best / rounds to target),
``fedlight report`` and table specs use by default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.core import precision as precisions
from fedlight.errors import ConfigError


@dataclass(frozen=True)
class LocalOptimization:
    """How clients optimise locally, as a task decides it (:meth:`Task.local_optimization`)."""

    loop: Any
    """The loop settings the run uses (a LightningModule's lr, weight decay and clip in place of the loop's)."""
    algorithm: Any
    """The rule pair (a LightningModule with manual optimisation: FedAvg's client stepping the module's code)."""
    optimizer: Callable[..., Any] | None = None
    """``factory(params, lr=η)`` for the local optimizer; ``None``: ``loop.optimizer``."""
    effective: str | None = None
    """The line saying what trains, when it is not the loop's settings (``summary.json``'s ``local_optimization``)."""
    hint: str | None = None
    """What a diverging loss should blame (the module's optimizer and lr), else ``None``."""


class Task:
    """Base class. Subclasses implement :meth:`objective`, :meth:`metrics` and :meth:`update`.

    Attributes:
        headline: the name of the run's headline metric (without ``test_``), e.g. ``"acc"``.
        higher_is_better: the headline's direction (accuracy: higher; loss, MSE, perplexity: lower).
    """

    headline: str = "loss"
    higher_is_better: bool = False
    reports: tuple[str, ...] = ("loss",)
    """The names :meth:`metrics` reports (without ``test_``), known before any data is seen."""
    higher: tuple[str, ...] = ()
    """The reported names besides the headline whose higher values are better (accuracy, F1, R², ...)."""
    effective: str | None = None
    """The local optimization actually used, when the task brings its own (a LightningModule's): recorded in
    ``summary.json`` (``local_optimization``) and as a comment in ``config.yaml``."""
    stacked_note: str | None = None
    """Why ``loop.client_parallelism: auto`` should train this task's clients one after another even on CUDA
    (forcing ``vmap`` still works); ``None``: no reason."""

    def setup(self, data: Any) -> None:
        """Learn what the task needs from the data module after its ``setup`` (e.g. the number of classes)."""

    def local_optimization(self, fabric: Any, model: nn.Module, algorithm: Any, loop: Any,
                           data: Any = None) -> LocalOptimization:
        """The local optimisation this task's model brings. Default: the loop's settings, unchanged."""
        return LocalOptimization(loop=loop, algorithm=algorithm)

    def round_lrs(self, info: Any) -> tuple[float, float] | None:
        """The lr of round ``info.round``'s first and last local step when the task sets it (a LightningModule's
        schedule); ``None``: the loop's."""
        return None

    def begin_round(self, info: Any) -> None:
        """Round ``info.round`` is about to train (a task that tracks the round, e.g. a LightningModule's epoch)."""

    def final_files(self, model: nn.Module) -> dict[str, Any]:
        """Files to write (``torch.save``, sealed, on global rank 0) beside ``final_model.pt`` before :meth:`end`, by
        name: a LightningModule's ``final_model.ckpt``."""
        return {}

    def end(self, model: nn.Module) -> None:
        """The run finished (after ``final_model.pt`` is written)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """What the task keeps in every checkpoint (a LightningModule's own checkpoint extras); ``{}``: nothing."""
        return {}

    def load_checkpoint_state(self, state: dict[str, Any], model: nn.Module | None) -> None:
        """Given back on ``--resume`` (what :meth:`checkpoint_state` kept)."""

    # ----------------------------------------------------------------------------------------- training
    def objective(self, model: nn.Module, batch: Any) -> Tensor:
        """The client's mean training loss on ``batch`` (a 0-dim tensor)."""
        raise NotImplementedError

    def client_objective(self, ctx: Any) -> Callable[[nn.Module, Any], Tensor]:
        """The ``ctx.objective`` of one client's round. Default: :meth:`objective` itself (one object for the
        whole run, so compiled stacked code is reused); a task that needs the step index or per-client logs
        (a LightningModule's ``training_step``) returns a closure over ``ctx``."""
        fn = self.__dict__.get("_objective")
        if fn is None:
            fn = self.__dict__["_objective"] = self.objective
        return fn

    # ----------------------------------------------------------------------------------------- evaluation
    def metrics(self) -> dict[str, Any]:
        """Fresh ``torchmetrics`` objects, one per reported name (without ``test_``); must include the headline."""
        raise NotImplementedError

    def update(self, metrics: dict[str, Any], model: nn.Module, batch: Any, forward: Callable) -> None:
        """Add one test batch to ``metrics``; ``forward(model, *args, **kwargs)`` runs the model under the
        precision plugin."""
        raise NotImplementedError

    def metric_names(self) -> tuple[str, ...]:
        """The ``test_*`` keys this task reports."""
        return tuple(f"test_{k}" for k in self.reports)

    @property
    def headline_key(self) -> str:
        return f"test_{self.headline}"

    def directions(self) -> dict[str, bool]:
        """``test_<name>`` → whether higher is better, for every metric this task reports (the headline's is
        :attr:`higher_is_better`); the only source of a metric's direction (``summary.json`` records it)."""
        return {**{f"test_{k}": k in self.higher for k in self.reports}, self.headline_key: self.higher_is_better}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any], fabric: Any = None) -> dict[str, float]:
        """The test metrics of ``model`` over ``batches`` (torchmetrics reduce across processes in ``compute``)."""
        device = next(iter(model.parameters())).device
        metrics = {k: m.to(device) for k, m in self.metrics().items()}
        forward = precision_forward(fabric)
        was_training = model.training
        model.eval()
        try:
            for batch in batches:
                self.update(metrics, model, batch, forward)
        finally:
            model.train(was_training)
        return {f"test_{k}": float(m.compute()) for k, m in metrics.items()}

    # ----------------------------------------------------------------------------------------- checks
    def check(self, model: nn.Module, data: Any) -> None:
        """Refuse, before any training, a model/data pair this task cannot work with (e.g. too few outputs)."""

    def probe(self, model: nn.Module, train_batch: Any, test_batch: Any, data: Any, fabric: Any = None) -> None:
        """Run one training and one test batch through model + task (eval mode, no grad: nothing changes) and
        raise :class:`ConfigError` naming the fix when they do not fit together."""
        self.check(model, data)
        forward = precision_forward(fabric)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                loss = guard("the training objective", lambda: self._probe_loss(model, train_batch, fabric),
                             train_batch)
                if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
                    raise ConfigError(f"{type(self).__name__}: the training objective must be a scalar loss tensor, "
                                      f"got {_describe(loss)}; return the batch mean")
                metrics = {k: m.to(loss.device) for k, m in self.metrics().items()}
                guard("evaluation", lambda: self.update(metrics, model, test_batch, forward))
        finally:
            model.train(was_training)
        if self.headline not in metrics:
            raise ConfigError(f"{type(self).__name__}: the headline metric {self.headline!r} is not among the "
                              f"metrics the task reports ({', '.join(metrics) or 'none'})")


    def _probe_loss(self, model: nn.Module, batch: Any, fabric: Any) -> Any:
        return precisions.forward(fabric, self.objective, model, batch)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def precision_forward(fabric: Any) -> Callable:
    """``forward(model, *args, **kwargs)``: the model under the precision plugin (inputs converted)."""
    return functools.partial(precisions.forward, fabric, _call)


def _call(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return model(*args, **kwargs)


def eval_outputs(model: nn.Module, fabric: Any, *args: Any, **kwargs: Any) -> Tensor:
    """The model's predictions in eval mode without gradients (nothing changes): for the probes' shape checks."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return outputs(precision_forward(fabric)(model, *args, **kwargs))
    finally:
        model.train(was)


def check_class_count(logits: Tensor, num_classes: int, argument: str = "num_classes") -> None:
    """Refuse a model whose output is not ``[batch, num_classes]`` scores, naming the model argument to set."""
    if logits.dim() != 2 or logits.shape[-1] != num_classes:
        raise ConfigError(f"the model outputs {logits.shape[-1] if logits.dim() else 1} scores per sample but the "
                          f"data has {num_classes} classes; set `--model.init_args.{argument} {num_classes}` (or the "
                          "model's equivalent argument)")


def guard(what: str, fn: Callable, batch: Any = None) -> Any:
    """Run ``fn``; a shape, dtype or index error becomes a :class:`ConfigError` naming ``what`` failed (string
    labels in ``batch``, when given, are named as the cause)."""
    try:
        return fn()
    except ConfigError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError, KeyError, AttributeError) as e:
        strings = _strings(batch)
        if strings:
            raise ConfigError(f"the data's labels are strings ({', '.join(map(repr, strings[:3]))}, ...): {what} "
                              "needs integer class indices. Map them in your dataset, as torchvision's ImageFolder "
                              "does (`class_to_idx = {name: i for i, name in enumerate(sorted(names))}`, then return "
                              "`class_to_idx[label]`), or pass the data module `label_fn` (sample -> label): fedlight "
                              "then maps the names to class indices") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model, data and task do not fit together: {what} failed on the first batch "
                          f"({type(e).__name__}: {first}). Check the model's input/output size against the data "
                          "(e.g. `--model.init_args.num_classes`) and the task (`--task`)") from None


def _strings(batch: Any) -> list[str]:
    """The string labels of a collated ``(x, labels)`` batch (a list or tuple of str), else ``[]``."""
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and isinstance(batch[-1], (list, tuple)):
        if batch[-1] and all(isinstance(v, str) for v in batch[-1]):
            return sorted(set(batch[-1]))
    return []


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def check_vocab(model: nn.Module, data: Any) -> None:
    """Refuse a tokenizer that does not fit the model: ids beyond the model's embedding, or another padding id.

    Reads ``data.vocab_size`` / ``data.pad_token_id`` and ``model.vocab_size`` / ``model.pad_token_id`` where they
    exist (fedlight's GLUE and Shakespeare data, its Hugging Face model wrappers); anything else is not checked."""
    have, takes = getattr(data, "vocab_size", None), getattr(model, "vocab_size", None)
    if isinstance(have, int) and isinstance(takes, int) and have > takes:
        raise ConfigError(f"the tokenizer's vocabulary ({have} tokens) is larger than the model's embedding ({takes} "
                          "rows): the data was tokenized for another model. Use the model's own tokenizer "
                          "(`data.init_args.tokenizer` = the model's directory or Hub name)")
    pad, model_pad = getattr(data, "pad_token_id", None), getattr(model, "pad_token_id", None)
    if isinstance(pad, int) and isinstance(model_pad, int) and pad != model_pad:
        raise ConfigError(f"the tokenizer pads with id {pad} but the model's padding id is {model_pad}: the data was "
                          "tokenized for another model. Use the model's own tokenizer (`data.init_args.tokenizer` = "
                          "the model's directory or Hub name)")


def outputs(out: Any) -> Tensor:
    """The prediction tensor of a model's output: the tensor itself, ``out.logits`` (Hugging Face) or
    ``out["logits"]``."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    if logits is None:
        raise TypeError(f"cannot find the predictions in a model output of type {type(out).__name__}; return a "
                        "tensor or an object with `.logits`")
    return logits


HIGHER = ("acc", "accuracy", "f1", "mcc", "r2", "auroc", "auc", "precision", "recall", "iou", "dice", "bleu")
"""Metric names (or parts of them) whose higher values are better; every other metric (loss, MSE, perplexity) is
better lower."""


def higher_is_better(name: str) -> bool:
    """A default direction for a metric a task reports only by name (a LightningModule's ``self.log``)."""
    name = name.lower().removeprefix("test_")
    return any(h in name for h in HIGHER)

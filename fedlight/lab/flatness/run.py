"""The flatness tools on a run directory: ``fedlight landscape`` and ``fedlight sharpness``.

:func:`load_run` rebuilds a run's model, data and task from ``RUN_DIR/config.yaml`` (the loss is the run's task
objective: cross-entropy, MSE, next-token cross-entropy ...) and loads ``final_model.pt`` (or a checkpoint);
:func:`data_batches` serves its data to the measurements of :mod:`fedlight.lab.flatness.landscape`.
:func:`run_landscape` and :func:`run_sharpness` write plots, raw grids and JSON under ``RUN_DIR/landscape/``, and
images/scalars to ``RUN_DIR/tb``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedlight.core import params as P
from fedlight.errors import ConfigError, check
from fedlight.lab.flatness.landscape import (
    landscape_1d,
    landscape_2d,
    loss,
    random_direction,
    sam_sharpness,
    samples_in,
    top_eigenvalue,
)
from fedlight.tasks import Task, resolve_task


# ------------------------------------------------------------------------------------------------ batches
def _take(batch: Any, k: int) -> Any:
    """The first ``k`` samples of a batch (every tensor sliced along its leading dimension)."""
    if isinstance(batch, Tensor):
        return batch[:k]
    if isinstance(batch, dict):
        return {key: _take(v, k) for key, v in batch.items()}
    return type(batch)(_take(v, k) for v in batch) if isinstance(batch, (tuple, list)) else batch


def _cat(batches: list[Any]) -> Any:
    """Batches of one structure joined along the sample dimension."""
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.cat(batches)
    if isinstance(first, dict):
        return {key: _cat([b[key] for b in batches]) for key in first}
    return type(first)(_cat(list(parts)) for parts in zip(*batches)) if isinstance(first, (tuple, list)) else first


# ------------------------------------------------------------------------------------------------ plots
def plot_1d(alphas: np.ndarray, losses: np.ndarray, title: str = ""):
    """The 1-D curve as a matplotlib ``Figure`` (Agg canvas, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(alphas, losses, marker=".", lw=1.5)
    ax.set_xlabel("α (filter-normalized direction)")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_2d(alphas: np.ndarray, betas: np.ndarray, losses: np.ndarray, title: str = ""):
    """The 2-D contour plot (``losses[i, j]`` at ``(alphas[i], betas[j])``) as a matplotlib ``Figure``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    z = losses.T  # rows: β, columns: α
    lo, hi = float(np.nanmin(z)), float(np.nanmax(z))
    levels = np.linspace(lo, hi, 25) if hi > lo else None
    cs = ax.contourf(alphas, betas, z, levels=levels, cmap="viridis")
    ax.contour(alphas, betas, z, levels=levels, colors="k", linewidths=0.3)
    fig.colorbar(cs, ax=ax, label="loss")
    ax.plot([0], [0], "r*", ms=8)
    ax.set_xlabel("α (direction 1)")
    ax.set_ylabel("β (direction 2)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig

# ------------------------------------------------------------------------------------------------ run directories
@dataclass
class LoadedRun:
    """A run's global model (weights loaded, on ``device``) and data (set up with the run's seed)."""

    run_dir: Path
    model: nn.Module
    data: Any
    seed: int
    round: int
    """Rounds completed by the loaded weights."""
    weights: Path
    task: Task
    """The run's task: its objective is the loss every tool here measures."""
    algorithm: str = "FedAvg"
    """The run's algorithm (class name), for titles."""

    @property
    def label(self) -> str:
        """``FedSAM (run dir name), round 20, MLP``: what a plot of this model is of."""
        return f"{self.algorithm} ({self.run_dir.name}), round {self.round}, {type(self.model).__name__}"


def load_weights(model: nn.Module, path: Path) -> int | None:
    """Load ``final_model.pt`` (a state_dict) or a fedlight checkpoint into ``model``; returns the checkpoint's round
    (``None`` for a plain state_dict)."""
    path = Path(path)
    check(path.is_file(), f"model weights not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise ConfigError(f"{path} is not a readable model file ({type(e).__name__})") from None
    rnd = None
    if isinstance(obj, dict) and "params" in obj and "format" in obj:  # checkpoints/last.ckpt
        rnd = int(obj.get("round", 0))
        obj = {**obj["params"], **obj.get("buffers", {}), **obj.get("int_buffers", {})}
    check(isinstance(obj, dict), f"{path} holds no state_dict")
    hint = ("; a config.yaml without the model's init_args (a run started with fedlight.fit() from Python) cannot "
            "rebuild the model")
    try:
        res = model.load_state_dict(obj, strict=False)
    except RuntimeError as e:
        raise ConfigError(f"{path} does not fit the model rebuilt from config.yaml "
                          f"({str(e).splitlines()[-1].strip()}){hint}") from None
    missing = [k for k in res.missing_keys if k in P.trainable(model)]
    check(not res.unexpected_keys and not missing,
          f"{path} does not fit the model rebuilt from config.yaml (unexpected keys {res.unexpected_keys[:3]}, "
          f"missing {missing[:3]}){hint}")
    return rnd


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, device: str | None = None) -> LoadedRun:
    """Rebuild a run's model and data from ``RUN_DIR/config.yaml`` and load its final (or a checkpointed) model.

    Args:
        run_dir: a fedlight run directory.
        checkpoint: weights to load instead of ``final_model.pt``: a path, or ``last`` for ``checkpoints/last.ckpt``.
        device: where to evaluate; default ``cuda`` when available, else ``cpu``.
    """
    from fedlight.config.cli import _parse

    run_dir = Path(run_dir)
    cfg = run_dir / "config.yaml"
    check(cfg.is_file(), f"{run_dir} is not a fedlight run directory (no config.yaml)")
    kwargs, _ = _parse("fedlight fit", ["--config", str(cfg)])
    from fedlight.config.plan import data_or_own
    from fedlight.data import as_federated

    model, seed = kwargs["model"], int(kwargs.get("seed", 0))
    data = as_federated(data_or_own(kwargs["data"], model))  # a LightningDataModule, or the module's own hooks
    if checkpoint in (None, "final"):
        weights = run_dir / "final_model.pt"
        check(weights.is_file(), f"{run_dir} has no final_model.pt (unfinished run?); pass `--checkpoint last` to use "
                                 "checkpoints/last.ckpt")
    elif checkpoint == "last":
        weights = run_dir / "checkpoints" / "last.ckpt"
    else:
        weights = Path(checkpoint)
    rnd = load_weights(model, weights)
    if rnd is None:
        summary = run_dir / "summary.json"
        rnd = int(json.loads(summary.read_text()).get("rounds_completed", 0)) if summary.is_file() else 0
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device=dev, dtype=torch.float32)
    data.setup(dev, seed)
    task = resolve_task(kwargs.get("task"), model, data)
    task.setup(data)
    algorithm = type(kwargs["algorithm"]).__name__ if kwargs.get("algorithm") is not None else "FedAvg"
    return LoadedRun(run_dir, model, data, seed, rnd, weights, task, algorithm)


def data_batches(data: Any, split: str = "train", max_samples: int | None = None, seed: int = 0,
                 batch_size: int | None = None) -> Callable[[], Iterator[Any]]:
    """A re-iterable source of a federated data module's batches, for :func:`~fedlight.lab.flatness.landscape.loss` and
    friends.

    ``train``: every client's samples once, without augmentation (so ``L`` is the sample-weighted federated
    objective ``Σ_i n_i·L_i / Σ_i n_i``), merged into batches of about ``batch_size`` (default
    ``data.eval_batch_size``). ``test``: the global test set. ``max_samples`` keeps a fixed, seeded sample of that
    size (each train client contributes in proportion to its size).
    """
    check(split in ("train", "test"), f"`--data` must be 'train' or 'test', got {split!r}")
    check(max_samples is None or max_samples > 0, f"`--samples` must be positive, got {max_samples}")
    size = batch_size or getattr(data, "eval_batch_size", 1000)

    def merged(chunks: Iterable[Any]) -> Iterator[Any]:
        parts, n = [], 0
        for b in chunks:
            parts.append(b)
            n += samples_in(b)
            if n >= size:
                yield _cat(parts)
                parts, n = [], 0
        if parts:
            yield _cat(parts)

    def train_chunks() -> Iterator[Any]:
        total = sum(data.num_samples(c) for c in range(data.num_clients))
        frac = 1.0 if max_samples is None else min(1.0, max_samples / total)
        saved, data.augment = data.augment, False
        try:
            for c in range(data.num_clients):
                n = data.num_samples(c)
                keep = n if frac >= 1.0 else max(1, round(n * frac))
                gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + c)
                got = 0
                for b in data.client_batches(c, data.steps_per_epoch(c), gen):
                    take = min(samples_in(b), keep - got)
                    if take <= 0:
                        break
                    yield _take(b, take)
                    got += take
        finally:
            data.augment = saved

    def test_chunks() -> Iterator[Any]:
        left = max_samples
        for b in data.test_batches():
            if left is not None:
                if left <= 0:
                    break
                b = _take(b, left)
                left -= samples_in(b)
            yield b

    def batches() -> Iterator[Any]:
        return merged(train_chunks() if split == "train" else test_chunks())

    return batches


def _out_dir(run: LoadedRun, out: str | Path | None) -> Path:
    d = Path(out) if out is not None else run.run_dir / "landscape"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _tb_images(run_dir: Path, images: dict[str, Any], step: int, text: dict[str, str] | None = None,
               scalars: dict[str, float] | None = None) -> None:
    from fedlight.run.tensorboard import RunLogger

    logger = RunLogger(run_dir)
    try:
        for name, fig in images.items():
            logger.log_figure(name, fig, step)
        for name, value in (scalars or {}).items():
            logger.writer.add_scalar(name, value, step)
        for name, value in (text or {}).items():
            logger.writer.add_text(name, value, step)
    finally:
        logger.close()


def run_landscape(run_dir: str | Path, split: str = "train", dims: int = 1, points: int = 21, span: float = 1.0,
                  checkpoint: str | None = None, max_samples: int | None = None, seed: int = 0,
                  device: str | None = None, out: str | Path | None = None, tensorboard: bool = True
                  ) -> dict[str, Any]:
    """``fedlight landscape``: the loss along filter-normalized random directions around a run's model.

    Writes ``<out>/r<round>_<split>_1d.{png,csv,npz}`` (and ``..._2d.{png,npz}`` for ``dims=2``, whose β = 0 row
    is the 1-D curve along the first direction when ``points`` is odd) and the figures to ``RUN_DIR/tb``.
    Returns the grid(s) and the written paths.
    """
    check(dims in (1, 2), f"`--dims` must be 1 or 2, got {dims!r}")
    run = load_run(run_dir, checkpoint, device)
    batches, objective = data_batches(run.data, split, max_samples, seed), run.task.objective
    d1 = random_direction(run.model, seed=seed)
    out_dir = _out_dir(run, out)
    stem = f"r{run.round}_{split}"
    what = f"{split} loss: {run.label}"
    result: dict[str, Any] = {"round": run.round, "split": split, "base_loss": loss(run.model, batches, objective),
                              "titles": []}
    images: dict[str, Any] = {}
    paths: list[Path] = []
    curve = None
    if dims == 2:
        d2 = random_direction(run.model, seed=seed + 1)
        g2 = landscape_2d(run.model, batches, d1, d2, objective, points=points, span=span)
        result["grid_2d"] = g2
        np.savez(out_dir / f"{stem}_2d.npz", **g2)
        fig = plot_2d(g2["alphas"], g2["betas"], g2["losses"], f"{what}\n2-D, filter-normalized directions")
        result["titles"].append(fig.axes[0].get_title())
        fig.savefig(out_dir / f"{stem}_2d.png")
        images[f"landscape/{split}_2d"] = fig
        paths += [out_dir / f"{stem}_2d.png", out_dir / f"{stem}_2d.npz"]
        zero = np.flatnonzero(g2["betas"] == 0.0)
        if len(zero):
            curve = {"alphas": g2["alphas"], "losses": g2["losses"][:, zero[0]].copy()}
    if curve is None:
        curve = landscape_1d(run.model, batches, d1, objective, points=points, span=span)
    result["curve_1d"] = curve
    np.savez(out_dir / f"{stem}_1d.npz", **curve)
    np.savetxt(out_dir / f"{stem}_1d.csv", np.stack([curve["alphas"], curve["losses"]], 1), delimiter=",",
               header="alpha,loss", comments="")
    fig = plot_1d(curve["alphas"], curve["losses"], f"{what}\n1-D, filter-normalized direction")
    result["titles"].append(fig.axes[0].get_title())
    fig.savefig(out_dir / f"{stem}_1d.png")
    images[f"landscape/{split}_1d"] = fig
    paths += [out_dir / f"{stem}_1d.png", out_dir / f"{stem}_1d.csv", out_dir / f"{stem}_1d.npz"]
    if tensorboard:
        _tb_images(run.run_dir, images, run.round)
    result["paths"] = paths
    return result


def run_sharpness(run_dir: str | Path, split: str = "train", iters: int = 20, tol: float = 1e-3,
                  rho: float = 0.05, steps: int = 5, checkpoint: str | None = None, max_samples: int | None = None,
                  seed: int = 0, device: str | None = None, out: str | Path | None = None,
                  tensorboard: bool = True) -> dict[str, Any]:
    """``fedlight sharpness``: top Hessian eigenvalue and SAM sharpness of a run's model.

    Writes ``<out>/r<round>_<split>_sharpness.json`` and ``sharpness/<split>/*`` scalars (at the model's round) to
    ``RUN_DIR/tb``.
    """
    run = load_run(run_dir, checkpoint, device)
    batches = data_batches(run.data, split, max_samples, seed)
    eig = top_eigenvalue(run.model, batches, run.task.objective, iters=iters, tol=tol, seed=seed)
    sam = sam_sharpness(run.model, batches, run.task.objective, rho=rho, steps=steps, seed=seed)
    result = {"round": run.round, "split": split, "weights": str(run.weights), "loss": sam["loss"],
              "top_eigenvalue": eig["eigenvalue"], "power_iterations": eig["iterations"],
              "eigenvalue_history": eig["history"], "rho": rho, "ascent_steps": steps,
              "sam_sharpness": sam["sharpness"], "sam_one_step": sam["sam_step"],
              "sam_history": sam["history"], "samples": max_samples}
    path = _out_dir(run, out) / f"r{run.round}_{split}_sharpness.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    result["path"] = path
    if tensorboard:
        scalars = {f"sharpness/{split}/top_eigenvalue": eig["eigenvalue"],
                   f"sharpness/{split}/sam_rho{rho:g}": sam["sharpness"]}
        _tb_images(run.run_dir, {}, run.round, scalars={k: v for k, v in scalars.items() if math.isfinite(v)})
    return result

"""``fedlight landscape`` and ``fedlight sharpness``: flatness tools on a finished (or checkpointed) run.

Resolved lazily by :mod:`fedlight.config.cli`; the work is done in :mod:`fedlight.lab.flatness.run`.
"""

from __future__ import annotations

import argparse


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a fedlight run directory (holds config.yaml)")
    p.add_argument("--data", choices=("train", "test"), default="train",
                   help="the loss on every client's training samples (the federated objective) or on the test set")
    p.add_argument("--checkpoint", default=None,
                   help="weights to use: final (default: final_model.pt), last (checkpoints/last.ckpt) or a path")
    p.add_argument("--samples", type=int, default=None,
                   help="evaluate on a fixed, seeded sample of this many examples (default: the whole split)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random directions and the sample")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/landscape)")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                   help="do not add the results to RUN_DIR/tb")


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description)


def cmd_landscape(argv: list[str]) -> int:
    from fedlight.lab.flatness.run import run_landscape

    p = _parser("fedlight landscape", "Loss of the global model along filter-normalized random directions "
                "(Li et al. 2018): a 1-D curve or a 2-D contour, as PNG, CSV/NPZ and TensorBoard images.")
    _common(p)
    p.add_argument("--dims", type=int, choices=(1, 2), default=1, help="1: a curve; 2: a contour plot (and the curve)")
    p.add_argument("--points", type=int, default=21, help="grid points per axis (odd includes the model itself)")
    p.add_argument("--span", type=float, default=1.0, help="the grid covers [-span, span] along each direction")
    a = p.parse_args(argv)
    res = run_landscape(a.run_dir, split=a.data, dims=a.dims, points=a.points, span=a.span, checkpoint=a.checkpoint,
                        max_samples=a.samples, seed=a.seed, device=a.device, out=a.out, tensorboard=a.tensorboard)
    curve = res["curve_1d"]
    print(f"round {res['round']}, {a.data} loss {res['base_loss']:.4f}; along direction 1 on [-{a.span:g}, "
          f"{a.span:g}]: min {curve['losses'].min():.4f}, max {curve['losses'].max():.4f}")
    if "grid_2d" in res:
        g = res["grid_2d"]["losses"]
        print(f"2-D grid {g.shape[0]}x{g.shape[1]}: min {g.min():.4f}, max {g.max():.4f}")
    print("wrote " + ", ".join(str(q) for q in res["paths"]))
    return 0


def cmd_sharpness(argv: list[str]) -> int:
    from fedlight.lab.flatness.run import run_sharpness

    p = _parser("fedlight sharpness", "Top Hessian eigenvalue (power iteration on Hessian-vector products) and "
                "SAM sharpness max_{|e|<=rho} L(x+e) - L(x) (projected ascent) of the global model.")
    _common(p)
    p.add_argument("--iters", type=int, default=20, help="power iterations at most")
    p.add_argument("--tol", type=float, default=1e-3, help="stop when the eigenvalue estimate changes less (relative)")
    p.add_argument("--rho", type=float, default=0.05, help="SAM radius")
    p.add_argument("--steps", type=int, default=5, help="ascent steps for the SAM sharpness (1 = SAM's own step)")
    a = p.parse_args(argv)
    res = run_sharpness(a.run_dir, split=a.data, iters=a.iters, tol=a.tol, rho=a.rho, steps=a.steps,
                        checkpoint=a.checkpoint, max_samples=a.samples, seed=a.seed, device=a.device, out=a.out,
                        tensorboard=a.tensorboard)
    print(f"round {res['round']}, {a.data} loss {res['loss']:.4f}")
    print(f"top Hessian eigenvalue  {res['top_eigenvalue']:.4f}  ({res['power_iterations']} power iterations)")
    print(f"SAM sharpness (rho={a.rho:g})  {res['sam_sharpness']:.6f}  (one SAM step: {res['sam_one_step']:.6f})")
    print(f"wrote {res['path']}")
    return 0



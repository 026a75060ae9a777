"""Landscape and sharpness tools on a quadratic whose answers are known in closed form, and on a real run directory.

The quadratic: least squares ``L(W) = 1/(2n)·‖X Wᵀ − Y‖²_F`` with ``W ∈ R^{o×d}`` (an ``nn.Linear`` without bias,
float64). Its Hessian is ``I_o ⊗ A`` with ``A = XᵀX/n``, so the top eigenvalue is ``λ_max(A)``, the loss along any
direction ``D`` is exactly ``L(W) + α⟨G, D⟩ + (α²/2)·⟨D, D A⟩``, and at the minimum the SAM sharpness is ``½·λ_max·ρ²``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedlight.lab.flatness import landscape as LS
from fedlight.lab.flatness import run as LR

D_IN, D_OUT, N = 6, 2, 40
EIGS = np.array([9.0, 3.0, 2.0, 1.0, 0.5, 0.25])  # spectrum of A = XᵀX/n


def mse(model, batch):
    x, y = batch
    return 0.5 * ((model(x) - y) ** 2).sum(1).mean()


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((D_IN, D_IN)))
    z = rng.standard_normal((N, D_IN))
    z = (z - z.mean(0)) @ np.linalg.inv(np.linalg.cholesky(np.cov(z.T, bias=True)).T)  # whitened: zᵀz/n = I
    x = z @ np.diag(np.sqrt(EIGS)) @ q.T  # xᵀx/n = Q diag(EIGS) Qᵀ
    y = rng.standard_normal((N, D_OUT))
    w = rng.standard_normal((D_OUT, D_IN))
    model = nn.Linear(D_IN, D_OUT, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor(w))
    xt, yt = torch.tensor(x), torch.tensor(y)
    batches = [(xt[i:i + 15], yt[i:i + 15]) for i in range(0, N, 15)]  # unequal batches: 15, 15, 10
    return {"x": x, "y": y, "w": w, "A": x.T @ x / N, "model": model, "batches": batches}


def np_loss(p, w):
    r = p["x"] @ w.T - p["y"]
    return 0.5 * float((r**2).sum(1).mean())


def np_grad(p, w):
    return (p["x"] @ w.T - p["y"]).T @ p["x"] / N


def test_spectrum_is_as_built(problem):
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(problem["A"]))[::-1], EIGS, rtol=1e-10)


def test_loss_grad_and_hvp_are_exact(problem):
    m, b, w = problem["model"], problem["batches"], problem["w"]
    assert LS.loss(m, b, mse) == pytest.approx(np_loss(problem, w), rel=1e-12)
    val, g = LS.loss_and_grad(m, b, mse)
    assert val == pytest.approx(np_loss(problem, w), rel=1e-12)
    np.testing.assert_allclose(g["weight"].numpy(), np_grad(problem, w), atol=1e-12)
    v = np.random.default_rng(1).standard_normal((D_OUT, D_IN))
    hv = LS.hvp(m, b, {"weight": torch.tensor(v)}, mse)
    np.testing.assert_allclose(hv["weight"].numpy(), v @ problem["A"], atol=1e-12)
    m.weight.grad = None


def test_top_eigenvalue_is_exact(problem):
    res = LS.top_eigenvalue(problem["model"], problem["batches"], mse, iters=100, tol=0.0)
    assert res["eigenvalue"] == pytest.approx(EIGS[0], rel=1e-10)
    early = LS.top_eigenvalue(problem["model"], problem["batches"], mse, iters=100, tol=1e-6)
    assert early["iterations"] < 100 and early["eigenvalue"] == pytest.approx(EIGS[0], rel=1e-5)
    np.testing.assert_allclose(problem["model"].weight.detach().numpy(), problem["w"])  # parameters untouched


def test_filter_normalized_direction():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    d = LS.random_direction(net, seed=3)
    assert set(d) == {n for n, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        if p.dim() == 1:  # biases and BatchNorm weights: no move (Li et al.'s "ignore biasbn")
            assert torch.count_nonzero(d[name]) == 0, name
        else:
            torch.testing.assert_close(d[name].flatten(1).norm(dim=1), p.detach().flatten(1).norm(dim=1))
    again = LS.random_direction(net, seed=3)
    assert all(torch.equal(d[k], again[k]) for k in d)
    layer = LS.random_direction(net, seed=3, norm="layer", ignore_1d=False)
    torch.testing.assert_close(layer["3.weight"].norm(), net[3].weight.detach().norm())
    torch.testing.assert_close(layer["3.bias"], net[3].bias.detach())


def test_1d_curve_is_exact(problem):
    m, b, w = problem["model"], problem["batches"], problem["w"]
    d = LS.random_direction(m, seed=0)
    dn = d["weight"].numpy()
    np.testing.assert_allclose(np.linalg.norm(dn, axis=1), np.linalg.norm(w, axis=1), rtol=1e-12)
    res = LS.landscape_1d(m, b, d, mse, points=9, span=2.0)
    np.testing.assert_allclose(res["alphas"], np.linspace(-2, 2, 9))
    g = np_grad(problem, w)
    want = [np_loss(problem, w) + a * np.sum(g * dn) + 0.5 * a * a * np.sum(dn * (dn @ problem["A"]))
            for a in res["alphas"]]
    np.testing.assert_allclose(res["losses"], want, rtol=1e-12)
    np.testing.assert_allclose(res["losses"], [np_loss(problem, w + a * dn) for a in res["alphas"]], rtol=1e-12)
    np.testing.assert_allclose(m.weight.detach().numpy(), w)  # restored


def test_2d_grid_is_exact(problem):
    m, b, w = problem["model"], problem["batches"], problem["w"]
    d1, d2 = LS.random_direction(m, seed=0), LS.random_direction(m, seed=1)
    res = LS.landscape_2d(m, b, d1, d2, mse, points=5, span=1.0)
    a1, a2 = d1["weight"].numpy(), d2["weight"].numpy()
    want = np.array([[np_loss(problem, w + a * a1 + c * a2) for c in res["betas"]] for a in res["alphas"]])
    np.testing.assert_allclose(res["losses"], want, rtol=1e-12)
    np.testing.assert_allclose(res["losses"][:, 2], LS.landscape_1d(m, b, d1, mse, points=5)["losses"], rtol=1e-12)


def test_sam_sharpness_at_the_minimum_is_half_lambda_rho_squared(problem):
    w_star = np.linalg.solve(problem["A"], problem["x"].T @ problem["y"] / N).T
    m = nn.Linear(D_IN, D_OUT, bias=False).double()
    with torch.no_grad():
        m.weight.copy_(torch.tensor(w_star))
    rho = 0.1
    res = LS.sam_sharpness(m, problem["batches"], mse, rho=rho, steps=60)
    assert res["sharpness"] == pytest.approx(0.5 * EIGS[0] * rho**2, rel=1e-8)
    assert res["loss"] == pytest.approx(np_loss(problem, w_star), rel=1e-12)
    assert all(b >= a - 1e-15 for a, b in zip(res["history"], res["history"][1:]))  # ascent never loses ground here


def test_sam_sharpness_away_from_the_minimum(problem):
    m, b, w = problem["model"], problem["batches"], problem["w"]
    rho = 0.05
    res = LS.sam_sharpness(m, b, mse, rho=rho, steps=10)
    g = np_grad(problem, w)
    e = rho * g / np.linalg.norm(g)
    assert res["sam_step"] == pytest.approx(np_loss(problem, w + e) - np_loss(problem, w), rel=1e-10)
    upper = rho * np.linalg.norm(g) + 0.5 * EIGS[0] * rho**2  # g·e + ½ eᵀHe ≤ ρ‖g‖ + ½λρ²
    assert res["sam_step"] <= res["sharpness"] <= upper
    np.testing.assert_allclose(m.weight.detach().numpy(), w)


def test_bad_arguments(problem):
    from fedlight.errors import ConfigError

    with pytest.raises(ConfigError, match="points"):
        LS.landscape_1d(problem["model"], problem["batches"], LS.random_direction(problem["model"]), mse, points=1)
    with pytest.raises(ConfigError, match="rho"):
        LS.sam_sharpness(problem["model"], problem["batches"], mse, rho=0.0)
    with pytest.raises(ConfigError, match="norm"):
        LS.random_direction(problem["model"], norm="unit")


# ------------------------------------------------------------------------------------------------ run directories
TINY = """\
seed: 0
model:
  class_path: fedlight.models.MLP
  init_args: {in_features: 20, hidden: [8], num_classes: 4}
data:
  class_path: fedlight.data.Synthetic
  init_args: {num_clients: 5, dim: 20, num_classes: 4, samples_per_client: 30, batch_size: 10}
algorithm:
  class_path: fedlight.algorithms.FedAvg
loop: {rounds: 2, clients_per_round: 3, local_steps: 2, lr: 0.05, progress: false}
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from fedlight.config.cli import main

    tmp = tmp_path_factory.mktemp("landscape_run")
    (tmp / "tiny.yaml").write_text(TINY)
    assert main(["fit", "--config", str(tmp / "tiny.yaml"), "--out_dir", str(tmp / "run"), "--accelerator",
                 "cpu"]) == 0
    return tmp / "run"


def test_load_run_rebuilds_the_final_model(run_dir):
    run = LR.load_run(run_dir, device="cpu")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.round == 2
    test_loss = LS.loss(run.model, LR.data_batches(run.data, "test"), run.task.objective)
    assert test_loss == pytest.approx(summary["final_test_loss"], rel=1e-5)
    train = LS.loss(run.model, LR.data_batches(run.data, "train", batch_size=7), run.task.objective)
    assert train == pytest.approx(LS.loss(run.model, LR.data_batches(run.data, "train"), run.task.objective), rel=1e-6)
    last = LR.load_run(run_dir, checkpoint="last", device="cpu")
    assert last.round == 2
    assert all(torch.equal(a, b) for a, b in zip(run.model.state_dict().values(), last.model.state_dict().values()))
    sub = list(LR.data_batches(run.data, "train", max_samples=40)())
    assert 35 <= sum(len(y) for _, y in sub) <= 45


def test_landscape_and_sharpness_commands(run_dir, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedlight.config.cli import main

    assert main(["landscape", str(run_dir), "--dims", "2", "--points", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "2-D grid 5x5" in out
    files = {p.name for p in (run_dir / "landscape").iterdir()}
    assert {"r2_train_1d.png", "r2_train_1d.csv", "r2_train_1d.npz", "r2_train_2d.png", "r2_train_2d.npz"} <= files
    grid = np.load(run_dir / "landscape" / "r2_train_2d.npz")
    curve = np.loadtxt(run_dir / "landscape" / "r2_train_1d.csv", delimiter=",", skiprows=1)
    assert grid["losses"].shape == (5, 5)
    np.testing.assert_allclose(curve[:, 1], grid["losses"][:, 2])  # the β = 0 row is the 1-D curve
    run = LR.load_run(run_dir, device="cpu")
    train = LS.loss(run.model, LR.data_batches(run.data, "train"), run.task.objective)
    assert grid["losses"][2, 2] == pytest.approx(train, rel=1e-6)

    assert main(["sharpness", str(run_dir), "--data", "test", "--iters", "5", "--steps", "2", "--device", "cpu"]) == 0
    res = json.loads((run_dir / "landscape" / "r2_test_sharpness.json").read_text())
    assert res["top_eigenvalue"] > 0 and res["sam_sharpness"] >= res["sam_one_step"] and res["round"] == 2
    assert "top Hessian eigenvalue" in capsys.readouterr().out

    ea = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "scalars": 0})
    ea.Reload()
    assert {"landscape/train_1d", "landscape/train_2d"} <= set(ea.Tags()["images"])
    (eig,) = ea.Scalars("sharpness/test/top_eigenvalue")
    assert eig.step == 2 and eig.value == pytest.approx(res["top_eigenvalue"], rel=1e-6)


def test_command_errors(tmp_path, capsys):
    from fedlight.config.cli import main

    assert main(["landscape", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["landscape", str(tmp_path), "--dims", "3"])
    assert e.value.code == 2


REGRESSION = """
seed: 0
model:
  class_path: fedlight.models.MLP
  init_args: {in_features: 5, hidden: [8], num_classes: 1}
data:
  class_path: fedlight.data.SyntheticRegression
  init_args: {num_clients: 4, dim: 5, samples_per_client: 20, batch_size: 10}
algorithm:
  class_path: fedlight.algorithms.FedAvg
loop: {rounds: 2, clients_per_round: 2, local_steps: 2, lr: 0.05, weight_decay: 0.0, progress: false}
"""


def test_landscape_and_sharpness_use_the_runs_task(tmp_path, capsys):
    """A regression run (the data's default task: MSE on float targets): the landscape's centre on the test split is
    the run's own final test MSE, and sharpness measures the same loss (cross-entropy could not even be evaluated)."""
    from fedlight.config.cli import main
    from fedlight.tasks import Regression

    (tmp_path / "reg.yaml").write_text(REGRESSION)
    assert main(["fit", "--config", str(tmp_path / "reg.yaml"), "--out_dir", str(tmp_path / "run"),
                 "--accelerator", "cpu"]) == 0
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["headline"]["metric"] == "test_mse"
    run = LR.load_run(run_dir, device="cpu")
    assert isinstance(run.task, Regression)
    assert main(["landscape", str(run_dir), "--data", "test", "--points", "3", "--device", "cpu"]) == 0
    curve = np.loadtxt(run_dir / "landscape" / "r2_test_1d.csv", delimiter=",", skiprows=1)
    assert curve[1, 0] == 0.0 and curve[1, 1] == pytest.approx(summary["final_test_mse"], rel=1e-5)
    assert main(["sharpness", str(run_dir), "--data", "test", "--iters", "5", "--steps", "2", "--device", "cpu"]) == 0
    res = json.loads((run_dir / "landscape" / "r2_test_sharpness.json").read_text())
    assert res["loss"] == pytest.approx(summary["final_test_mse"], rel=1e-5) and res["top_eigenvalue"] > 0
    capsys.readouterr()

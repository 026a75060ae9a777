"""Golden tests for FedNSAM (+ -S, -D, ablation options) and FedSWA/FedMoSWA: two rounds on the 3-client softmax
regression (full batch, 64-true, no wd, no clip) equal an independent numpy derivation of ALGORITHMS.md to 1e-10,
including server momentum, control variates and per-client state. The derivations are the code below."""

import fedtest
import numpy as np
import pytest
import torch
from fedtest import assert_params_close, grad, lin, linear_model, make_loop, mean, norm, problem, run_rounds, sub, zeros

import fedlight
from fedlight.core.registry import get_algorithm
from fedlight.core.sampling import sample_clients
from fedlight.errors import ConfigError

K, LR, R = 2, 0.1, 2
SEED = 1  # partial participation (2 of 3): S_0 = {0, 1}, S_1 = {0, 2}, so client 1 sits out round 1


def sqdist(a, b):
    return norm(sub(a, b)) ** 2


def np_params(p):
    return {k: v.detach().cpu().double().numpy() for k, v in p.items()}


def run(name, local_steps=K, clients_per_round=None, seed=0, **kw):
    clients, theta = problem()
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=local_steps, lr=LR,
                     clients_per_round=clients_per_round, seed=seed)
    return run_rounds(loop, R), clients, theta, loop


def nsam_offset(m, lam, rho, extrapolate=True):
    """e = λm + δ with δ = −ρ·m/‖m‖ (0 when m = 0): m points downhill, so −m/‖m‖ is the ascent direction."""
    nm = norm(m)
    delta = lin((-rho / nm, m)) if nm > 0 else zeros(m)
    return lin((1, delta), (lam, m)) if extrapolate else delta


def sam_direction(y, xi, yi, rho):
    g = grad(y, xi, yi)
    return grad(lin((1, y), (rho / (norm(g) + 1e-12), g)), xi, yi)


# ------------------------------------------------------------------------------------------------ FedNSAM
def nsam_reference(clients, theta, lam, rho, extrapolate=True):
    """Returns x_R, m_R and the flatness distance D_r = (1/S)Σ‖y_{i,K} − x_{r+1}‖² of every round."""
    x, m, D = theta, zeros(theta), []
    for _ in range(R):
        e = nsam_offset(m, lam, rho, extrapolate)
        ys = []
        for xi, yi in clients:
            y = dict(x)
            for _ in range(K):
                y = lin((1, y), (-LR, grad(lin((1, y), (1, e)), xi, yi)))  # y ← y − η∇ℓ(y + λm + δ)
            ys.append(y)
        m = lin((lam, m), (1, mean([sub(y, x) for y in ys])))  # m ← λm + Δ̄
        x = lin((1, x), (1, m))  # x ← x + m
        D.append(np.mean([sqdist(y, x) for y in ys]))
    return x, m, D


@pytest.mark.parametrize("extrapolate", [True, False])
def test_fednsam(extrapolate):
    lam, rho = 0.85, 0.2
    got, clients, theta, loop = run("fednsam", lam=lam, rho=rho, extrapolate=extrapolate)
    x, m, D = nsam_reference(clients, theta, lam, rho, extrapolate)
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.m), m)  # server momentum after 2 rounds
    # flatness distance (FedNSAM Def. 1), logged by the loop for every rule
    np.testing.assert_allclose([row["flatness_distance"] for row in loop.rows], D, rtol=1e-10, atol=1e-12)
    assert loop.rows[1]["rule/perturbation_norm"] == pytest.approx(rho)  # ‖δ‖ = ρ once m ≠ 0
    assert loop.rows[0]["rule/perturbation_norm"] == 0.0  # round 0: m = 0, δ = 0 (no NaN)


def test_fednsam_perturbation_is_an_ascent_along_minus_m():
    """δ = −ρm/‖m‖ raises the loss to first order where m is a descent direction (m accumulates Δ̄)."""
    clients, theta = problem()
    xi, yi = clients[0]
    m = lin((-1, grad(theta, xi, yi)))  # a descent direction, like Δ̄
    e = nsam_offset(m, 0.0, 1e-3)
    g = grad(theta, xi, yi)
    assert sum(np.sum(e[k] * g[k]) for k in g) > 0  # ⟨δ, ∇ℓ⟩ > 0: uphill


@pytest.mark.parametrize("extrapolate", [True, False])
def test_fednsam_local_sam(extrapolate):
    """The released client: start once from x_r + λm, local-gradient SAM (ρ_s), Δ_i = y_{i,K} − y_0."""
    lam, sam_rho = 0.85, 0.2
    got, clients, theta, loop = run("fednsam", lam=lam, perturbation="local_sam", sam_rho=sam_rho,
                                    extrapolate=extrapolate)
    x, m, D = theta, zeros(theta), []
    for _ in range(R):
        y0 = lin((1, x), (lam, m)) if extrapolate else dict(x)  # y_0 = x_r + λm
        ys = []
        for xi, yi in clients:
            y = dict(y0)
            for _ in range(K):
                y = lin((1, y), (-LR, sam_direction(y, xi, yi, sam_rho)))
            ys.append(y)
        m = lin((lam, m), (1, mean([sub(y, y0) for y in ys])))  # m ← λm + Δ̄ (Δ relative to y_0)
        x = lin((1, x), (1, m))
        D.append(np.mean([sqdist(y, x) for y in ys]))
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.m), m)
    np.testing.assert_allclose([row["flatness_distance"] for row in loop.rows], D, rtol=1e-10, atol=1e-12)
    if extrapolate:
        assert_params_close(got, mean(ys))  # with the look-ahead start, x_{r+1} = mean y_{i,K}


def test_fednsam_s_partial_participation():
    lam, rho, S = 0.85, 0.2, 2
    got, clients, theta, loop = run("fednsam_s", lam=lam, rho=rho, clients_per_round=S, seed=SEED)
    N = len(clients)
    x, m, c, ci = theta, zeros(theta), zeros(theta), [zeros(theta) for _ in clients]
    sampled = [sample_clients(N, S, SEED, r) for r in range(R)]
    assert set(sampled[0]) - set(sampled[1])  # someone sits out round 2 and keeps c_i
    for r in range(R):
        e = nsam_offset(m, lam, rho)
        deltas, dcs = [], []
        for i in sampled[r]:
            xi, yi = clients[i]
            y = dict(x)
            for _ in range(K):
                y = lin((1, y), (-LR, lin((1, grad(lin((1, y), (1, e)), xi, yi)), (1, c), (-1, ci[i]))))
            delta = sub(y, x)
            ci_new = lin((1, ci[i]), (-1, c), (-1 / (K * LR), delta))  # c_i⁺ = c_i − c + (x − y)/(Kη)
            dcs.append(sub(ci_new, ci[i]))
            ci[i] = ci_new
            deltas.append(delta)
        m = lin((lam, m), (1, mean(deltas)))  # m ← λm + Δ̄
        x = lin((1, x), (1, m))  # x ← x + m
        c = lin((1, c), *[(1 / N, dc) for dc in dcs])  # c ← c + (1/N)ΣΔc_i
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.inner.m), m)
    assert_params_close(np_params(loop.server.c), c)
    for i in set(sampled[0]) | set(sampled[1]):  # includes a client absent in one round: its c_i persisted
        assert_params_close(np_params(loop.store.get(i, "cpu")["c_i"]), ci[i])


def test_fednsam_d():
    lam, rho, a = 0.85, 0.2, 0.1
    got, clients, theta, loop = run("fednsam_d", lam=lam, rho=rho, alpha=a)
    N = len(clients)
    x, m, h, gL = theta, zeros(theta), zeros(theta), [zeros(theta) for _ in clients]
    for _ in range(R):
        e = nsam_offset(m, lam, rho)
        ys = []
        for i, (xi, yi) in enumerate(clients):
            y = dict(x)
            for _ in range(K):
                d = lin((1, grad(lin((1, y), (1, e)), xi, yi)), (-1, gL[i]), (a, y), (-a, x))  # ∇ℓ(ỹ+δ) − ∇L_i + α(y−x)
                y = lin((1, y), (-LR, d))
            gL[i] = lin((1, gL[i]), (-a, y), (a, x))  # ∇L_i ← ∇L_i − α(y − x)
            ys.append(y)
        deltas = [sub(y, x) for y in ys]
        h = lin((1, h), *[(-a / N, dl) for dl in deltas])  # h ← h − (α/N)Σ(y − x)
        m = lin((lam, m), (1, mean(deltas)))  # m ← λm + Δ̄
        x = lin((1, x), (1, m), (-1 / a, h))  # x ← x + m − h/α
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.inner.m), m)
    assert_params_close(np_params(loop.server.h), h)
    for i in range(N):
        assert_params_close(np_params(loop.store.get(i, "cpu")["grad_L"]), gL[i])


# ------------------------------------------------------------------------------------------------ FedSWA
def swa_lrs(rho, steps):
    return [LR * (1 - k / steps) + (k / steps) * rho * LR for k in range(steps)]  # η_k, k = 0..K−1


def test_fedswa():
    rho, alpha, Ks = 0.3, 0.7, 3
    got, clients, theta, loop = run("fedswa", rho=rho, alpha=alpha, local_steps=Ks)
    etas = swa_lrs(rho, Ks)
    x = theta
    for _ in range(R):
        ys = []
        for xi, yi in clients:
            y = dict(x)
            for eta in etas:
                y = lin((1, y), (-eta, grad(y, xi, yi)))
            ys.append(y)
        x = lin((1, x), (alpha, sub(mean(ys), x)))  # x ← x + α(v − x)
    assert_params_close(got, x)


def test_fedmoswa_partial_participation():
    rho, alpha, gamma, Ks, S = 0.3, 0.8, 0.5, 3, 2
    got, clients, theta, loop = run("fedmoswa", rho=rho, alpha=alpha, gamma=gamma, local_steps=Ks,
                                    clients_per_round=S, seed=SEED)
    N = len(clients)
    etas = swa_lrs(rho, Ks)
    x, m, ci = theta, zeros(theta), [zeros(theta) for _ in clients]
    sampled = [sample_clients(N, S, SEED, r) for r in range(R)]
    assert set(sampled[0]) - set(sampled[1])
    for r in range(R):
        ys, dcs = [], []
        for i in sampled[r]:
            xi, yi = clients[i]
            y = dict(x)
            for eta in etas:
                y = lin((1, y), (-eta, lin((1, grad(y, xi, yi)), (-1, ci[i]), (1, m))))  # d = g − c_i + m
            ci_new = lin((1, ci[i]), (-1, m), (1 / sum(etas), sub(x, y)))  # c_i⁺ = c_i − m + (x − y)/Ση_k
            dcs.append(sub(ci_new, m))  # Δc_i = c_i⁺ − m
            ci[i] = ci_new
            ys.append(y)
        x = lin((1, x), (alpha, sub(mean(ys), x)))  # x ← x + α(v − x)
        m = lin((1, m), (gamma, mean(dcs)))  # m ← m + γ·mean(Δc_i)
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.m), m)
    for i in set(sampled[0]) | set(sampled[1]):
        assert_params_close(np_params(loop.store.get(i, "cpu")["c_i"]), ci[i])


def test_fedmoswa_correction_vanishes_for_identical_clients():
    """c_i estimates the local gradient and m the global one (d = g − c_i + m is SCAFFOLD's g + c − c_i): with one
    shared dataset, full participation, ρ = 1 (constant lr) and γ = 1, m = c_i after round 1, so the correction
    vanishes and FedMoSWA ≡ FedAvg (to rounding)."""
    clients, theta = problem(num_clients=1)
    same = clients * 3
    base = run_rounds(make_loop(fedlight.create("fedavg"), same, linear_model(theta), local_steps=K, lr=LR), R)
    mo = make_loop(fedlight.create("fedmoswa", rho=1.0, gamma=1.0), same, linear_model(theta), local_steps=K, lr=LR)
    got = run_rounds(mo, R)
    assert_params_close(got, base, tol=1e-12)


# ------------------------------------------------------------------------------------------------ equivalences
def _fedavg_bitwise(name, kw, base="fedavg", base_kw=None):
    clients, theta = problem()
    opts = dict(local_steps=K, lr=LR, precision="32-true", batch_size=2)
    ref = run_rounds(make_loop(fedlight.create(base, **(base_kw or {})), clients, linear_model(theta), **opts), R)
    other = run_rounds(make_loop(fedlight.create(name, **kw), clients, linear_model(theta), **opts), R)
    for k in ref:
        np.testing.assert_array_equal(other[k], ref[k], err_msg=f"{name} {kw} != {base} at {k}")


@pytest.mark.parametrize("name,kw,base,base_kw", [
    ("fednsam", {"lam": 0.0, "rho": 0.0}, "fedavg", None),
    ("fedswa", {"rho": 1.0, "alpha": 1.0}, "fedavg", None),
    ("fednsam_s", {"lam": 0.0, "rho": 0.0}, "scaffold", None),
    ("fednsam_d", {"lam": 0.0, "rho": 0.0, "alpha": 0.1}, "feddyn", {"alpha": 0.1}),
])
def test_reduces_bitwise(name, kw, base, base_kw):
    _fedavg_bitwise(name, kw, base, base_kw)


def test_fedavg_plus_nesterov_two_ways():
    """"FedAvg + Nesterov" = extrapolation without perturbation (rho=0). With weight decay 0 the per-step look-ahead
    y + λm equals starting once from x_r + λm (the released client with sam_rho=0): same Δ_i, same x_{r+1}."""
    clients, theta = problem()
    a = run_rounds(make_loop(fedlight.create("fednsam", rho=0.0), clients, linear_model(theta), local_steps=K,
                             lr=LR), R)
    b = run_rounds(make_loop(fedlight.create("fednsam", perturbation="local_sam", sam_rho=0.0), clients,
                             linear_model(theta), local_steps=K, lr=LR), R)
    assert_params_close(a, b, tol=1e-12)


# ------------------------------------------------------------------------------------------------ contract bits
@pytest.mark.parametrize("name,kw,comm", [
    ("fednsam", {}, None), ("fednsam_s", {}, None), ("fednsam_d", {}, None), ("fedswa", {}, None),
    ("fedmoswa", {}, None), ("fednsam", {"perturbation": "local_sam"}, (1, 1)),
    ("fednsam", {"perturbation": "local_sam", "extrapolate": False}, (1, 1)),
])
def test_communication(name, kw, comm):
    clients, theta = problem()
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=1, lr=LR)
    row = loop.run_round(0)
    down, up = comm or get_algorithm(name).comm
    model_bytes = sum(v.numel() * v.element_size() for v in loop.x.values())
    assert row["bytes_down"] == down * model_bytes * len(clients)
    assert row["bytes_up"] == up * model_bytes * len(clients)


def test_precision_flags():
    assert not fedlight.create("fednsam").local.needs_true_grad_norm  # ‖m‖ is not a gradient norm
    assert fedlight.create("fednsam", perturbation="local_sam").local.needs_true_grad_norm  # SAM: ‖g‖


@pytest.mark.parametrize("name,kw", [("fednsam_s", {"lam": 0.5, "rho": 0.1}), ("fedmoswa", {"rho": 0.3})])
def test_resume_is_bitwise(name, kw, tmp_path):
    clients, theta = problem()
    opts = dict(local_steps=K, lr=LR, clients_per_round=2)
    a = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), out_dir=tmp_path / "a", **opts)
    a.run_round(0)
    fedtest.save_checkpoint(a, a.out_dir)
    a.run_round(1)
    b = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), out_dir=tmp_path / "b", **opts)
    fedtest.resume(b, tmp_path / "a" / "checkpoints" / "last.ckpt")
    b.run_round(1)
    for k in a.x:
        assert torch.equal(a.x[k], b.x[k])
    _assert_same_state(a.server.state_dict(), b.server.state_dict())
    for i in a.store.ids():
        _assert_same_state(a.store.get(i, "cpu"), b.store.get(i, "cpu"))


def _assert_same_state(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("name,kw,arg", [
    ("fednsam", {"lam": 1.0}, "lam"), ("fednsam", {"lam": -0.1}, "lam"), ("fednsam", {"rho": -0.1}, "rho"),
    ("fednsam", {"perturbation": "global"}, "perturbation"), ("fednsam", {"sam_rho": -1.0}, "sam_rho"),
    ("fednsam_s", {"lam": 1.5}, "lam"), ("fednsam_s", {"rho": -1.0}, "rho"),
    ("fednsam_d", {"alpha": 0.0}, "alpha"), ("fednsam_d", {"lam": 1.0}, "lam"),
    ("fedswa", {"rho": 1.5}, "rho"), ("fedswa", {"rho": -0.1}, "rho"), ("fedswa", {"alpha": 0.0}, "alpha"),
    ("fedswa", {"alpha": 1.5}, "alpha"), ("fedmoswa", {"gamma": 1.5}, "gamma"), ("fedmoswa", {"gamma": -0.1}, "gamma"),
    ("fedmoswa", {"rho": 2.0}, "rho"),
])
def test_validation(name, kw, arg):
    with pytest.raises(ConfigError, match=f"`algorithm.{arg}` must be"):
        fedlight.create(name, **kw)

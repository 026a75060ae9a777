"""Golden tests: two rounds on a 3-client softmax regression (full batch, 64-true, no wd, no clip)
equal an independent numpy derivation of ALGORITHMS.md to 1e-10. The derivation is the code below."""

import numpy as np
import pytest
from fedtest import assert_params_close, grad, lin, linear_model, make_loop, mean, problem, run_rounds

import fedlight

K, LR, R = 2, 0.1, 2


def reference(clients, theta, client_step, server, rounds=R):
    """Generic FL driver in numpy: client_step(i, y, x, r) -> d; server(x, deltas, r) -> x."""
    x = theta
    for r in range(rounds):
        deltas = []
        for i, _ in enumerate(clients):
            y = dict(x)
            for _k in range(K):
                y = lin((1, y), (-LR, client_step(i, y, x, r)))
            deltas.append(lin((1, y), (-1, x)))
        x = server(x, deltas, r)
    return x


def run(name, **kw):
    clients, theta = problem()
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=K, lr=LR)
    return run_rounds(loop, R), clients, theta, loop


def test_fedavg():
    got, clients, theta, _ = run("fedavg")
    want = reference(clients, theta, lambda i, y, x, r: grad(y, *clients[i]),
                     lambda x, ds, r: lin((1, x), (1, mean(ds))))
    assert_params_close(got, want)


def test_fedavgm():
    got, clients, theta, loop = run("fedavgm", beta=0.9)
    m = {k: np.zeros_like(v) for k, v in theta.items()}

    def server(x, ds, r):
        nonlocal m
        m = lin((0.9, m), (1, mean(ds)))  # m ← β·m + Δ̄
        return lin((1, x), (1, m))  # x ← x + m

    want = reference(clients, theta, lambda i, y, x, r: grad(y, *clients[i]), server)
    assert_params_close(got, want)
    assert_params_close({k: v.numpy() for k, v in loop.server.m.items()}, m)


def test_fedprox():
    mu = 0.3
    got, clients, theta, _ = run("fedprox", mu=mu)
    want = reference(clients, theta, lambda i, y, x, r: lin((1, grad(y, *clients[i])), (mu, y), (-mu, x)),
                     lambda x, ds, r: lin((1, x), (1, mean(ds))))
    assert_params_close(got, want)


def test_scaffold():
    got, clients, theta, loop = run("scaffold")
    N = len(clients)
    zeros = {k: np.zeros_like(v) for k, v in theta.items()}
    c, ci = dict(zeros), [dict(zeros) for _ in clients]
    x = theta
    for r in range(R):
        deltas, dcs = [], []
        for i, (xi, yi) in enumerate(clients):
            y = dict(x)
            for _ in range(K):
                y = lin((1, y), (-LR, lin((1, grad(y, xi, yi)), (1, c), (-1, ci[i]))))  # d = g + c − c_i
            delta = lin((1, y), (-1, x))
            ci_new = lin((1, ci[i]), (-1, c), (-1 / (K * LR), delta))  # c_i⁺ = c_i − c + (x − y)/(Kη)
            dcs.append(lin((1, ci_new), (-1, ci[i])))
            ci[i] = ci_new
            deltas.append(delta)
        x = lin((1, x), (1, mean(deltas)))
        c = lin((1, c), *[(1 / N, dc) for dc in dcs])  # c ← c + (1/N) Σ Δc_i
    assert_params_close(got, x)
    assert_params_close({k: v.numpy() for k, v in loop.server.c.items()}, c)
    for i in range(N):
        assert_params_close({k: v.numpy() for k, v in loop.store.get(i, "cpu")["c_i"].items()}, ci[i])


def test_feddyn():
    a = 0.1
    got, clients, theta, loop = run("feddyn", alpha=a)
    N = len(clients)
    zeros = {k: np.zeros_like(v) for k, v in theta.items()}
    h, gL = dict(zeros), [dict(zeros) for _ in clients]
    x = theta
    for r in range(R):
        ys = []
        for i, (xi, yi) in enumerate(clients):
            y = dict(x)
            for _ in range(K):
                y = lin((1, y), (-LR, lin((1, grad(y, xi, yi)), (-1, gL[i]), (a, y), (-a, x))))  # g − ∇L_i + α(y − x)
            gL[i] = lin((1, gL[i]), (-a, y), (a, x))  # ∇L_i ← ∇L_i − α(y − x)
            ys.append(y)
        h = lin((1, h), *[(-a / N, lin((1, y), (-1, x))) for y in ys])  # h ← h − α/N Σ (y − x)
        x = lin((1, mean(ys)), (-1 / a, h))  # x ← mean y − h/α
    assert_params_close(got, x)
    assert_params_close({k: v.numpy() for k, v in loop.server.h.items()}, h)


def sam_direction(y, xi, yi, rho):
    g = grad(y, xi, yi)
    e = lin((rho / (np.sqrt(sum(np.sum(v * v) for v in g.values())) + 1e-12), g))
    return grad(lin((1, y), (1, e)), xi, yi)


def test_fedsam():
    rho = 0.2
    got, clients, theta, _ = run("fedsam", rho=rho)
    want = reference(clients, theta, lambda i, y, x, r: sam_direction(y, *clients[i], rho),
                     lambda x, ds, r: lin((1, x), (1, mean(ds))))
    assert_params_close(got, want)


def test_fedasam():
    rho, eta = 0.5, 0.01
    got, clients, theta, _ = run("fedasam", rho=rho, eta=eta)

    def step(i, y, x, r):
        xi, yi = clients[i]
        g = grad(y, xi, yi)
        T = {k: np.abs(v) + eta for k, v in y.items()}
        Tg_norm = np.sqrt(sum(np.sum((T[k] * g[k]) ** 2) for k in g))
        e = {k: rho * T[k] ** 2 * g[k] / Tg_norm for k in g}  # e = ρ T²g/‖Tg‖
        return grad(lin((1, y), (1, e)), xi, yi)

    want = reference(clients, theta, step, lambda x, ds, r: lin((1, x), (1, mean(ds))))
    assert_params_close(got, want)


@pytest.mark.parametrize("name,kw", [("fedprox", {"mu": 0.0}), ("fedsam", {"rho": 0.0}), ("fedavgm", {"beta": 0.0})])
def test_reduces_to_fedavg(name, kw):
    clients, theta = problem()
    base = run_rounds(make_loop(fedlight.create("fedavg"), clients, linear_model(theta), local_steps=K, lr=LR,
                                precision="32-true", batch_size=2), R)
    other = run_rounds(make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=K, lr=LR,
                                 precision="32-true", batch_size=2), R)
    for k in base:
        np.testing.assert_array_equal(other[k], base[k], err_msg=f"{name} {kw} != fedavg at {k}")


def test_scaffold_identical_clients_full_participation_is_fedavg():
    clients, theta = problem(num_clients=1)
    same = clients * 3
    base = run_rounds(make_loop(fedlight.create("fedavg"), same, linear_model(theta), local_steps=K, lr=LR), R)
    scaf = run_rounds(make_loop(fedlight.create("scaffold"), same, linear_model(theta), local_steps=K, lr=LR), R)
    assert_params_close(scaf, base, tol=1e-12)

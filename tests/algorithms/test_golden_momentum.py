"""Golden tests for the client/server-momentum family (FedCM, MoFedSAM, FedACG, FedWMSAM): two or three rounds on
the 3-client softmax regression (full batch, 64-true, no wd, no clip) equal an independent numpy derivation of
ALGORITHMS.md to 1e-10; the §3 equivalences hold bitwise in 32-true with minibatches; declared communication
matches what is sent; argument ranges are validated."""

import fedtest
import numpy as np
import pytest
from fedtest import assert_params_close, grad, lin, linear_model, make_loop, mean, norm, problem, run_rounds

import fedlight
from fedlight.core.registry import get_algorithm
from fedlight.core.sampling import sample_clients
from fedlight.errors import ConfigError

K, LR, R = 2, 0.1, 2


def np_params(p):
    return {k: v.detach().cpu().double().numpy() for k, v in p.items()}


def zeros_like(theta):
    return {k: np.zeros_like(v) for k, v in theta.items()}


def cos(a, b):
    na, nb = norm(a), norm(b)
    if na == 0 or nb == 0:
        return 0.0
    return sum(float(np.sum(a[k] * b[k])) for k in a) / (na * nb)


def sam_direction(y, xi, yi, rho):
    g = grad(y, xi, yi)
    e = lin((rho / (norm(g) + 1e-12), g))
    return grad(lin((1, y), (1, e)), xi, yi)


def run(name, clients=None, theta=None, rounds=R, local_steps=K, **kw):
    if clients is None:
        clients, theta = problem()
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=local_steps, lr=LR,
                     rounds=rounds)
    return run_rounds(loop, rounds), clients, theta, loop


def assert_comm(loop, name, scalars_down=0, scalars_up=0):
    """bytes per client per round = declared comm × model bytes (+ 4 bytes per scalar)."""
    down, up = get_algorithm(name).comm
    model_bytes = sum(v.numel() * v.element_size() for v in loop.x.values())
    for r, row in enumerate(loop.rows):
        S = len(sample_clients(loop.data.num_clients, loop.cfg.clients_per_round, loop.seed, r))
        assert row["bytes_down"] == S * (down * model_bytes + 4 * scalars_down), (name, "down", row)
        assert row["bytes_up"] == S * (up * model_bytes + 4 * scalars_up), (name, "up", row)


# ------------------------------------------------------------------------------------------------ FedCM
def fedcm_reference(clients, theta, alpha, direction=None):
    direction = direction or (lambda y, xi, yi: grad(y, xi, yi))
    x, G = theta, zeros_like(theta)
    for _r in range(R):
        deltas = []
        for xi, yi in clients:
            y = dict(x)
            for _ in range(K):
                y = lin((1, y), (-LR, lin((alpha, direction(y, xi, yi)), (1 - alpha, G))))  # d = αg + (1 − α)G
            deltas.append(lin((1, y), (-1, x)))
        D = mean(deltas)
        x = lin((1, x), (1, D))  # x ← x + Δ̄
        G = lin((-1 / (K * LR), D))  # G ← −Δ̄/(Kη)
    return x, G


def test_fedcm():
    alpha = 0.3
    got, clients, theta, loop = run("fedcm", alpha=alpha)
    x, G = fedcm_reference(clients, theta, alpha)
    assert norm(G) > 0
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.G), G)
    assert loop.rows[-1]["server/G_norm"] == pytest.approx(norm(G), abs=1e-12)
    assert_comm(loop, "fedcm")


def test_mofedsam():
    alpha, rho = 0.3, 0.2
    got, clients, theta, loop = run("mofedsam", alpha=alpha, rho=rho)
    x, G = fedcm_reference(clients, theta, alpha, lambda y, xi, yi: sam_direction(y, xi, yi, rho))
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.G), G)
    assert_comm(loop, "mofedsam")


# ------------------------------------------------------------------------------------------------ FedACG
def test_fedacg():
    lam, beta = 0.85, 0.3
    got, clients, theta, loop = run("fedacg", lam=lam, beta=beta)
    x, m = theta, zeros_like(theta)
    for _r in range(R):
        y0 = lin((1, x), (lam, m))  # y_0 = x + λm
        ys = []
        for xi, yi in clients:
            y = dict(y0)
            for _ in range(K):
                y = lin((1, y), (-LR, lin((1, grad(y, xi, yi)), (beta, y), (-beta, y0))))  # d = g + β(y − y_0)
            ys.append(y)
        D = mean([lin((1, y), (-1, y0)) for y in ys])  # Δ relative to y_0
        m = lin((lam, m), (1, D))  # m ← λm + Δ̄
        x = lin((1, x), (1, m))  # x ← x + m
        assert_params_close(x, mean(ys), tol=1e-12)  # x_{r+1} = mean y_{i,K}
    assert norm(m) > 0
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.m), m)
    assert_comm(loop, "fedacg")


# ------------------------------------------------------------------------------------------------ FedWMSAM
def wmsam_reference(clients, theta, rounds, alpha, rho, gamma, personalized=True, sam=True, adaptive=True,
                    similarity="momentum", perturbation="paper", per_round=None, seed=0):
    N = len(clients)
    z = zeros_like(theta)
    x, M, c, ci, a = theta, dict(z), dict(z), [dict(z) for _ in clients], alpha
    perturbed = 0
    for r in range(rounds):
        S = sample_clients(N, per_round or N, seed, r)
        deltas, dcs, sims = [], [], []
        for i in S:
            xi, yi = clients[i]
            u = lin((1, M), (a / (1 - a), c), (-a / (1 - a), ci[i])) if personalized else M  # eq. 1
            y = dict(x)
            for b in range(K3):
                e = dict(z)
                if sam and b > 0:
                    delta = lin((1, x), (b, u), (-1, y))  # δ_b = (x_r + b·u_i) − y_b  (Algorithm 1, lines 14–15)
                    if perturbation == "released":
                        delta = lin((-1, delta))  # the released code's sign: y_b − (x_r + b·u_i)
                    if norm(delta) > 0:
                        e = lin((rho / norm(delta), delta))
                        perturbed += 1
                d = lin((a, grad(lin((1, y), (1, e)), xi, yi)), (1 - a, u))  # eq. 2
                y = lin((1, y), (-LR, d))
            D_i = lin((1, y), (-1, x))
            if personalized:
                ci_new = lin((1, ci[i]), (-1, c), (-1 / (K3 * LR), D_i))  # SCAFFOLD option II
                dcs.append(lin((1, ci_new), (-1, ci[i])))
                ci[i] = ci_new
            if similarity == "momentum":
                sims.append(cos(M, u))
            else:
                sims.append(1 + cos(D_i, M) if norm(D_i) > 0 and norm(M) > 0 else 0.0)
            deltas.append(D_i)
        D = mean(deltas)
        a_hat = float(np.mean(sims))
        if adaptive:
            a = (1 - gamma) * a + gamma * min(max(a_hat, 0.1), 0.9)  # eq. 4
        if personalized:
            c = lin((1, c), *[(1 / N, dc) for dc in dcs])
        M = lin((-1 / (K3 * LR), D))
        x = lin((1, x), (1, D))
    return dict(x=x, M=M, c=c, ci=ci, alpha=a, alpha_hat=a_hat, perturbed=perturbed)


K3 = 3  # b = 1, 2 perturb

WMSAM_CASES = {
    "paper": dict(kw={}, rounds=2, per_round=None),
    "partial_released_update": dict(kw=dict(similarity="update", perturbation="released"), rounds=3, per_round=2),
    "released_no_personalization": dict(kw=dict(perturbation="released", personalized=False), rounds=2,
                                        per_round=None),
    "no_sam_fixed_alpha": dict(kw=dict(sam=False, adaptive=False), rounds=2, per_round=None),
}


@pytest.mark.parametrize("case", list(WMSAM_CASES))
def test_fedwmsam(case):
    spec = WMSAM_CASES[case]
    kw = dict(alpha=0.5, rho=0.1, gamma=0.5, **spec["kw"])  # α_0 = 0.5, γ = 0.5: α moves already after round 0
    n = 4 if spec["per_round"] else 3
    clients, theta = problem(num_clients=n)
    loop = make_loop(fedlight.create("fedwmsam", **kw), clients, linear_model(theta), local_steps=K3, lr=LR,
                     rounds=spec["rounds"], clients_per_round=spec["per_round"])
    got = run_rounds(loop, spec["rounds"])
    want = wmsam_reference(clients, theta, spec["rounds"], per_round=spec["per_round"], **kw)
    assert_params_close(got, want["x"])
    srv = loop.server  # AdaptiveWeightServer(PseudoGradientServer(ScaffoldServer(FedAvg)))
    assert_params_close(np_params(srv.inner.M), want["M"])
    assert srv.alpha == pytest.approx(want["alpha"], abs=1e-12)
    assert srv.alpha_hat == pytest.approx(want["alpha_hat"], abs=1e-12)
    assert norm(want["M"]) > 0
    if kw.get("adaptive", True):
        assert srv.alpha != 0.5
    if kw.get("personalized", True):
        assert_params_close(np_params(srv.inner.inner.c), want["c"])
        assert norm(want["c"]) > 0
        for i in range(n):
            if i in loop.store:
                assert_params_close(np_params(loop.store.get(i, "cpu")["c_i"]), want["ci"][i])
            else:
                assert norm(want["ci"][i]) == 0
        assert_comm(loop, "fedwmsam", scalars_down=1, scalars_up=int(kw.get("adaptive", True)))
    if kw.get("sam", True):
        assert want["perturbed"] > 0
        assert loop.rows[-1]["rule/perturbation_norm"] == pytest.approx(0.1, abs=1e-12)  # last step's ‖e‖ = ρ
    row = loop.rows[-1]
    assert row["server/alpha"] == pytest.approx(want["alpha"], abs=1e-12)
    assert row["server/alpha_hat"] == pytest.approx(want["alpha_hat"], abs=1e-12)
    assert row["server/M_norm"] == pytest.approx(norm(want["M"]), abs=1e-12)


def test_fedwmsam_round0_zero_momentum():
    """Round 0: M = 0, so every cos(M, u_i) counts as 0: α̂ = 0 and α_1 = (1 − γ)α_0 + γ·0.1 (no NaN)."""
    loop = make_loop(fedlight.create("fedwmsam", alpha=0.5, gamma=0.5), *_small(), local_steps=K3, lr=LR)
    loop.run_round(0)
    assert loop.server.alpha_hat == 0.0
    assert loop.server.alpha == pytest.approx(0.5 * 0.5 + 0.5 * 0.1)


def _recorded_offsets(perturbation, rounds=3):
    """Run FedWMSAM on the 3-client problem and record every non-zero offset with the point it perturbs."""
    from fedlight.algorithms.fedwmsam import WMSAMPerturbation

    seen, call = [], WMSAMPerturbation.__call__

    def record(self, model, batch, ctx):
        e, loss = call(self, model, batch, ctx)
        if e is not None:
            seen.append((ctx.round, np_params(ctx.params), np_params(e)))
        return e, loss

    clients, theta = problem()
    loop = make_loop(fedlight.create("fedwmsam", alpha=0.5, gamma=0.5, rho=0.1, perturbation=perturbation), clients,
                     linear_model(theta), local_steps=K3, lr=LR, rounds=rounds)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WMSAMPerturbation, "__call__", record)
        run_rounds(loop, rounds)
    return clients, seen


def test_fedwmsam_paper_offset_ascends_the_global_loss():
    """The paper's e_b (Algorithm 1, line 15) points uphill on the global loss: ⟨e_b, ∇f(y_b)⟩ > 0 at every
    perturbed step of rounds 1–2 (M ≠ 0), f the mean of the clients' losses; the released form is its exact
    negative (a descent offset)."""
    clients, paper = _recorded_offsets("paper")
    _, released = _recorded_offsets("released")
    assert len(paper) == len(released) == 3 * 3 * (K3 - 1)  # rounds × clients × (b = 1, 2)
    for (r, y, e), (_, y_rel, e_rel) in zip(paper, released):
        if r == 0:
            continue  # M = 0: x̃_b − y_b is the client's own accumulated step
        assert cos(e, mean([grad(y, xi, yi) for xi, yi in clients])) > 0.1  # uphill
        assert cos(e_rel, mean([grad(y_rel, xi, yi) for xi, yi in clients])) < -0.1  # downhill
        assert norm(e) == pytest.approx(0.1, abs=1e-12) and norm(e_rel) == pytest.approx(0.1, abs=1e-12)
    r0 = [(y, e) for r, y, e in paper if r == 0]
    assert r0 and all(norm(e) == pytest.approx(0.1, abs=1e-12) for _, e in r0)
    # Same first offset in both runs (the trajectories part after it): released = −paper exactly.
    assert_params_close(released[0][2], lin((-1, paper[0][2])), tol=1e-15)


def test_fedwmsam_refuses_fp16(tmp_path):
    from fedtest import image_clients

    from fedlight.core.loop_config import LoopConfig
    from fedlight.data import TensorClients
    from fedlight.models import MLP

    assert fedlight.create("fedwmsam").local.needs_true_grad_norm
    assert not fedlight.create("fedwmsam", sam=False).local.needs_true_grad_norm  # no offset, no refusal
    with pytest.raises(ConfigError, match="16-mixed.*FedWMSAM|FedWMSAM.*16-mixed"):
        fedlight.fit(MLP(), TensorClients(image_clients(), batch_size=4), fedlight.create("fedwmsam"),
                     LoopConfig(clients_per_round=2), precision="16-mixed", out_dir=str(tmp_path))


def _small():
    clients, theta = problem()
    return clients, linear_model(theta)


# ------------------------------------------------------------------------------------------------ equivalences
def _run32(name, **kw):
    clients, theta = problem()
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=K, lr=LR,
                     precision="32-true", batch_size=2, weight_decay=1e-3, max_grad_norm=0.5, rounds=R)
    return run_rounds(loop, R)


@pytest.mark.parametrize("name,kw,base,base_kw", [
    ("fedcm", {"alpha": 1.0}, "fedavg", {}),  # ALGORITHMS.md §3
    ("fedacg", {"lam": 0.0, "beta": 0.0}, "fedavg", {}),  # ALGORITHMS.md §3
    ("mofedsam", {"alpha": 1.0, "rho": 0.1}, "fedsam", {"rho": 0.1}),
    ("mofedsam", {"alpha": 0.3, "rho": 0.0}, "fedcm", {"alpha": 0.3}),
    ("fedwmsam", {"alpha": 0.3, "personalized": False, "sam": False, "adaptive": False}, "fedcm", {"alpha": 0.3}),
])
def test_reductions(name, kw, base, base_kw):
    want, got = _run32(base, **base_kw), _run32(name, **kw)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} {kw} != {base} {base_kw} at {k}")


def test_fedwmsam_checkpoint_resume_is_bitwise(tmp_path):
    kw = dict(alpha=0.5, gamma=0.5, rho=0.1)
    clients, theta = problem(num_clients=4)
    mk = lambda out: make_loop(fedlight.create("fedwmsam", **kw), clients, linear_model(theta),  # noqa: E731
                               local_steps=K3, lr=LR, rounds=3, clients_per_round=2, out_dir=out)
    full = mk(tmp_path / "a")
    want = run_rounds(full, 3)
    first = mk(tmp_path / "b")
    first.run_round(0)
    fedtest.save_checkpoint(first, first.out_dir)
    resumed = mk(tmp_path / "c")
    fedtest.resume(resumed, tmp_path / "b" / "checkpoints" / "last.ckpt")
    for r in (1, 2):
        resumed.run_round(r)
    got = np_params(resumed.x)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert resumed.server.alpha == full.server.alpha


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("name,kw,arg", [
    ("fedcm", {"alpha": 0.0}, "alpha"), ("fedcm", {"alpha": 1.5}, "alpha"), ("fedcm", {"server_lr": 0}, "server_lr"),
    ("mofedsam", {"alpha": -0.1}, "alpha"), ("mofedsam", {"rho": -1}, "rho"),
    ("fedacg", {"lam": 1.0}, "lam"), ("fedacg", {"lam": -0.1}, "lam"), ("fedacg", {"beta": -1}, "beta"),
    ("fedwmsam", {"alpha": 1.0}, "alpha"), ("fedwmsam", {"alpha": 0.0}, "alpha"), ("fedwmsam", {"rho": -1}, "rho"),
    ("fedwmsam", {"gamma": 1.5}, "gamma"), ("fedwmsam", {"similarity": "cosine"}, "similarity"),
    ("fedwmsam", {"perturbation": "sam"}, "perturbation"), ("fedwmsam", {"server_lr": -1}, "server_lr"),
    ("fedwmsam", {"perturbation": "deviation"}, "perturbation"),  # the old default is gone
])
def test_validation(name, kw, arg):
    with pytest.raises(ConfigError, match=f"`algorithm.{arg}`"):
        fedlight.create(name, **kw)

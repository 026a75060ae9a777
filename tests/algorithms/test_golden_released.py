"""Golden tests for the "as released" settings (``<setting>: released``): each released-code behaviour listed in
``../shared/reference/released_code_check.md`` is re-derived here in float64 numpy from that description (never from
the authors' code) and compared with the rule over two or three rounds of the 3-client softmax regression (full
batch, 64-true). The clip-order cases run with an active clip (the only place the order matters). Every setting also
runs stacked (vmap) exactly as sequentially, and a bad value names the setting and its choices."""

import numpy as np
import pytest
from fedtest import (
    Clip,
    as_np,
    assert_params_close,
    emap,
    grad,
    lin,
    linear_model,
    make_loop,
    mean,
    norm,
    problem,
    run_rounds,
    sub,
    zeros,
)

import fedlight
from fedlight.errors import ConfigError

K, LR = 2, 0.1
CLIP = 0.2  # the problem's gradient norms are 0.3–1.3: the clip is active on most steps


def run(name, rounds, local_steps=K, lr=LR, max_grad_norm=None, weight_decay=0.0, **kw):
    clients, theta = problem()
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), rounds=rounds, local_steps=local_steps,
                     lr=lr, max_grad_norm=max_grad_norm, weight_decay=weight_decay)
    return run_rounds(loop, rounds), clients, theta, loop


# ------------------------------------------------------------------------------------------------ FedCM, clip order
def fedcm_ref(clients, theta, alpha, rounds, clip, gradient_first):
    """paper: d = clip(α·g + (1 − α)·G); released: d = α·clip(g) + (1 − α)·G. Server x ← x + Δ̄, G ← −Δ̄/(Kη)."""
    x, G = theta, zeros(theta)
    for _ in range(rounds):
        deltas = []
        for xi, yi in clients:
            y = dict(x)
            for _ in range(K):
                g = grad(y, xi, yi)
                d = lin((alpha, clip(g)), (1 - alpha, G)) if gradient_first else clip(lin((alpha, g), (1 - alpha, G)))
                y = lin((1, y), (-LR, d))
            deltas.append(sub(y, x))
        D = mean(deltas)
        x, G = lin((1, x), (1, D)), lin((-1 / (K * LR), D))
    return x, G


@pytest.mark.parametrize("clip_order", ["paper", "released"])
def test_fedcm_clip_order(clip_order):
    alpha, R = 0.3, 3
    clip = Clip(CLIP)
    got, clients, theta, loop = run("fedcm", R, max_grad_norm=CLIP, alpha=alpha, clip_order=clip_order)
    x, G = fedcm_ref(clients, theta, alpha, R, clip, clip_order == "released")
    assert clip.active > 0
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.G), G)
    other = fedcm_ref(clients, theta, alpha, R, Clip(CLIP), clip_order != "released")[0]
    assert norm(sub(x, other)) > 1e-4  # the two orders really differ here


# ------------------------------------------------------------------------------------------------ FedMoSWA
def moswa_ref(clients, theta, rounds, Ks, rho, gamma, clip, first_round, divisor, gradient_first):
    """Algorithm 1 with the released settings switched on as the reference file words them:
    first_round: m ← m + 1·mean(c_i⁺ − m) in round 0 (= mean c_i⁺, since m = 0);
    divisor: c_i⁺ = c_i − m + (x − y)/(K·(η_l + ρη_l)/2) instead of /Σ_k η_k;
    gradient_first: d = clip(g) − c_i + m instead of clip(g − c_i + m)."""
    etas = [LR * (1 - k / Ks) + (k / Ks) * rho * LR for k in range(Ks)]  # η_k, k = 0..K−1
    x, m, ci = theta, zeros(theta), [zeros(theta) for _ in clients]
    for r in range(rounds):
        ys, dcs = [], []
        for i, (xi, yi) in enumerate(clients):
            y = dict(x)
            for eta in etas:
                g = grad(y, xi, yi)
                d = lin((1, clip(g)), (-1, ci[i]), (1, m)) if gradient_first else clip(lin((1, g), (-1, ci[i]), (1, m)))
                y = lin((1, y), (-eta, d))
            div = Ks * (LR + rho * LR) / 2 if divisor else sum(etas)
            new = lin((1, ci[i]), (-1, m), (1 / div, sub(x, y)))
            dcs.append(sub(new, m))
            ci[i] = new
            ys.append(y)
        x = mean(ys)  # α = 1
        m = lin((1, m), (1.0 if (first_round and r == 0) else gamma, mean(dcs)))
    return x, m, ci


MOSWA_CASES = {
    # the runnable released "MoFedSWA": constant lr (ρ = 1), γ = 1 in round 0, clip before the correction
    "runnable-released": (dict(rho=1.0, first_round="released", clip_order="released"),
                          dict(rho=1.0, first_round=True, divisor=False, gradient_first=True), CLIP, 2),
    "first-round": (dict(rho=0.3, first_round="released"),
                    dict(rho=0.3, first_round=True, divisor=False, gradient_first=False), None, 3),
    # the unreachable released update_FedMoSWA: cyclic lr with ρ = 0, divisor K·η̄ = Kη/2 (paper: (K + 1)η/2)
    "control-divisor": (dict(rho=0.0, first_round="released", control_divisor="released"),
                        dict(rho=0.0, first_round=True, divisor=True, gradient_first=False), None, 3),
    "clip-order": (dict(rho=0.3, clip_order="released"),
                   dict(rho=0.3, first_round=False, divisor=False, gradient_first=True), CLIP, 3),
}


@pytest.mark.parametrize("case", list(MOSWA_CASES))
def test_fedmoswa_released(case):
    kw, ref_kw, max_norm, Ks = MOSWA_CASES[case]
    gamma, R = 0.4, 3
    clip = Clip(max_norm)
    got, clients, theta, loop = run("fedmoswa", R, local_steps=Ks, max_grad_norm=max_norm, gamma=gamma, **kw)
    x, m, ci = moswa_ref(clients, theta, R, Ks, gamma=gamma, clip=clip, **ref_kw)
    assert (clip.active > 0) == (max_norm is not None)
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.m), m)
    for i in range(len(clients)):
        assert_params_close(as_np(loop.store.get(i, "cpu")["c_i"]), ci[i])
    paper = moswa_ref(clients, theta, R, Ks, ref_kw["rho"], gamma, Clip(max_norm), False, False, False)[0]
    assert norm(sub(x, paper)) > 1e-5  # each setting changes the result


def test_fedmoswa_control_divisor_is_exact_at_constant_lr():
    """At ρ = 1 both divisors are K·η: the setting changes nothing (bitwise)."""
    a = run("fedmoswa", 2, rho=1.0)[0]
    b = run("fedmoswa", 2, rho=1.0, control_divisor="released")[0]
    for k in a:
        assert np.array_equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------------ FedAdamW
def adamw_ref(clients, theta, rounds, alpha, lam, global_m, scale, clip, b1=0.9, b2=0.999, eps=1e-8):
    """Element-wise v (blocks: none). Per step k (global t = r·K + k): m̂ = m/(1 − β1^(t if global_m else k)),
    v̂ = v/(1 − β2^t); y ← y − η·(s·m̂/(√v̂ + ε) + α·Δ_G + s·λ·y), s = 1 − α for the July-2025 step scale, else 1.
    Server: x ← x + Δ̄; v̄ ← mean v_i; Δ_G ← −Δ̄/(Kη); t ← t + K."""
    x, dG, vbar, t = theta, zeros(theta), zeros(theta), 0
    for _ in range(rounds):
        deltas, vs = [], []
        for xi, yi in clients:
            y, m, v = dict(x), zeros(x), dict(vbar)
            for k in range(1, K + 1):
                g = clip(grad(y, xi, yi))
                m = emap(lambda m, g: b1 * m + (1 - b1) * g, m, g)
                v = emap(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
                c1 = 1 - b1 ** ((t + k) if global_m else k)
                c2 = 1 - b2 ** (t + k)
                adam = emap(lambda m, v: (m / c1) / (np.sqrt(v / c2) + eps), m, v)
                y = lin((1, y), (-LR, lin((scale, adam), (alpha, dG), (scale * lam, y))))
            deltas.append(sub(y, x))
            vs.append(v)
        D = mean(deltas)
        x, vbar, dG, t = lin((1, x), (1, D)), mean(vs), lin((-1 / (K * LR), D)), t + K
    return x, dG, vbar


@pytest.mark.parametrize("step_scale", ["paper", "released"])
def test_fedadamw_released(step_scale):
    """bias_correction: released + blocks: none is the current released vision code; step_scale: released is the
    July-2025 original's step (that version shares v̄ per tensor; the step math is checked here with element-wise v),
    both at α = their γ = 0.5 and λ = their alpha = 0.01."""
    alpha, lam, R = 0.5, 0.01, 3
    clip = Clip(0.3)
    got, clients, theta, loop = run("fedadamw", R, lr=LR, max_grad_norm=0.3, alpha=alpha, lam=lam, blocks="none",
                                    bias_correction="released", step_scale=step_scale)
    scale = 1 - alpha if step_scale == "released" else 1.0
    x, dG, vbar = adamw_ref(clients, theta, R, alpha, lam, True, scale, clip)
    assert clip.active > 0
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.delta_G), dG, tol=1e-9)
    assert_params_close({k: v.reshape(-1) for k, v in as_np(loop.server.v_bar).items()},
                        {k: v.reshape(-1) for k, v in vbar.items()}, tol=1e-12)
    local = adamw_ref(clients, theta, R, alpha, lam, False, scale, Clip(0.3))[0]
    assert norm(sub(x, local)) > 1e-5  # the global-t correction of m is not the paper's local k


# ------------------------------------------------------------------------------------------------ FedLADA
def lada_ref(clients, theta, rounds, gamma, wd, clip, fresh_first, b1=0.9, b2=0.999, eps=1e-8):
    """Paper: every round Adam at lr (1 − γ)η from m = 0, v = v̄, no bias correction, then y ← y + γη·m̃/K.
    Released first round: the same but a bias-corrected Adam (÷(1 − β^k) for m and v, local k) in round 0."""
    x, mt, vbar = theta, zeros(theta), zeros(theta)
    for r in range(rounds):
        deltas, vs = [], []
        for xi, yi in clients:
            y, m, v = dict(x), zeros(x), dict(vbar)
            for k in range(1, K + 1):
                g = lin((1, clip(grad(y, xi, yi))), (wd, y))
                m = emap(lambda m, g: b1 * m + (1 - b1) * g, m, g)
                v = emap(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
                c1, c2 = (1 - b1**k, 1 - b2**k) if (fresh_first and r == 0) else (1.0, 1.0)
                y = emap(lambda y, m, v: y - (1 - gamma) * LR * (m / c1) / (np.sqrt(v / c2) + eps), y, m, v)
                y = lin((1, y), (gamma * LR / K, mt))
            deltas.append(sub(y, x))
            vs.append(v)
        D = mean(deltas)
        x, vbar, mt = lin((1, x), (1, D)), mean(vs), lin((1 / LR, D))
    return x, mt, vbar


@pytest.mark.parametrize("first_round", ["paper", "released"])
def test_fedlada_first_round(first_round):
    gamma, wd, R = 0.9, 0.01, 3
    clip = Clip(0.3)
    got, clients, theta, loop = run("fedlada", R, max_grad_norm=0.3, weight_decay=wd, gamma=gamma,
                                    first_round=first_round)
    x, mt, vbar = lada_ref(clients, theta, R, gamma, wd, clip, first_round == "released")
    assert clip.active > 0
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.m_tilde), mt, tol=1e-9)
    assert_params_close(as_np(loop.server.v_bar), vbar, tol=1e-12)


def test_fedlada_round0_step_ratio():
    """The size of the round-0 difference: from v̄ = 0 without bias correction, step k is (1 − β1^k)/√(1 − β2^k)
    times a bias-corrected Adam step for a gradient of constant sign; one step: 0.1/√0.001 = 3.16."""
    clients, theta = problem(num_clients=1)
    moves = {}
    for fr in ("paper", "released"):
        loop = make_loop(fedlight.create("fedlada", first_round=fr), clients, linear_model(theta), rounds=1,
                         local_steps=1, lr=LR)
        moves[fr] = norm(sub(run_rounds(loop, 1), theta))
    assert moves["paper"] / moves["released"] == pytest.approx(0.1 / np.sqrt(0.001), rel=1e-3)


# ------------------------------------------------------------------------------------------------ FedNSAM
def test_fednsam_released_client():
    """The released update_NSAM: y_0 = x_r + λm, local-gradient SAM with ρ_s = 0.05 at every step (also in round 0,
    m = 0), Δ_i = y_K − y_0; server m ← λm + Δ̄, x ← x + m (the correct copy of the server)."""
    lam, R = 0.85, 3
    got, clients, theta, loop = run("fednsam", R, lam=lam, perturbation="released")
    x, m = theta, zeros(theta)
    for _ in range(R):
        y0 = lin((1, x), (lam, m))
        ds = []
        for xi, yi in clients:
            y = dict(y0)
            for _ in range(K):
                g = grad(y, xi, yi)
                y = lin((1, y), (-LR, grad(lin((1, y), (0.05 / (norm(g) + 1e-12), g)), xi, yi)))
            ds.append(sub(y, y0))
        m = lin((lam, m), (1, mean(ds)))
        x = lin((1, x), (1, m))
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.m), m)
    same = run("fednsam", R, lam=lam, perturbation="local_sam")[0]
    for k in got:
        assert np.array_equal(got[k], same[k]), k


# ------------------------------------------------------------------------------------------------ all settings
SETTINGS = [
    ("fedcm", {"clip_order": "released"}),
    ("fedmoswa", {"rho": 1.0, "first_round": "released", "clip_order": "released"}),
    ("fedmoswa", {"rho": 0.0, "first_round": "released", "control_divisor": "released"}),
    ("fedadamw", {"blocks": "none", "bias_correction": "released", "step_scale": "released"}),
    ("fedlada", {"first_round": "released"}),
    ("fednsam", {"perturbation": "released"}),
]


@pytest.mark.parametrize("name,kw", SETTINGS)
def test_released_settings_run_stacked_as_sequential(name, kw):
    clients, theta = problem(num_clients=4, n=6)
    xs = {}
    for mode in ("sequential", "vmap"):
        loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), rounds=3, local_steps=3, lr=LR,
                         clients_per_round=3, batch_size=3, max_grad_norm=CLIP, weight_decay=1e-3,
                         client_parallelism=mode)
        xs[mode] = run_rounds(loop, 3)
    assert_params_close(xs["vmap"], xs["sequential"], tol=1e-12)


@pytest.mark.parametrize("name,setting", [("fedcm", "clip_order"), ("fedmoswa", "first_round"),
                                          ("fedmoswa", "control_divisor"), ("fedmoswa", "clip_order"),
                                          ("fedadamw", "bias_correction"), ("fedadamw", "step_scale"),
                                          ("fedlada", "first_round"), ("fedwmsam", "perturbation")])
def test_bad_value_names_the_setting(name, setting):
    with pytest.raises(ConfigError, match=rf"`algorithm\.{setting}` must be 'paper' or 'released', got 'code'"):
        fedlight.create(name, **{setting: "code"})


def test_step_scale_needs_variant_2_and_alpha_at_most_1():
    with pytest.raises(ConfigError, match="variant: 2"):
        fedlight.create("fedadamw", variant=3, step_scale="released")
    with pytest.raises(ConfigError, match="alpha"):
        fedlight.create("fedadamw", alpha=1.5, step_scale="released")

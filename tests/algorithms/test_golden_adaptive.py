"""Golden tests for the adaptive rules (FedAdam, Local Adam/AdamW, FedLADA, FedAdamW): two rounds on the
3-client softmax regression (full batch, 64-true) equal an independent numpy derivation of ALGORITHMS.md to
1e-10, including the rule state (server moments, m̃, v̄, Δ_G, t). The numpy Adam math below never calls
torch.optim."""

import math

import fedtest
import numpy as np
import pytest
import torch
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
    problem,
    run_rounds,
    zeros,
)
from torch import nn

import fedlight
from fedlight.algorithms.fedadamw import hessian_partition, make_partition, num_blocks
from fedlight.core.sampling import sample_clients
from fedlight.errors import ConfigError

K, LR, R = 3, 0.05, 2


def run(name, rounds=R, local_steps=K, lr=LR, clients=None, theta=None, model=None, loop_kw=None, **kw):
    """Build the rule ``name(**kw)`` and run ``rounds`` rounds; ``loop_kw`` goes to the loop."""
    loop_kw = dict(loop_kw or {})
    if "clients_per_round" in kw:
        loop_kw["clients_per_round"] = kw.pop("clients_per_round")
    if clients is None:
        clients, theta = problem()
    loop = make_loop(fedlight.create(name, **kw), clients, model or linear_model(theta), local_steps=local_steps,
                     lr=lr, rounds=rounds, **loop_kw)
    return run_rounds(loop, rounds), clients, theta, loop


def sgd_clients(x, clients, S):
    deltas = []
    for i in S:
        y = dict(x)
        for _ in range(K):
            y = lin((1, y), (-LR, grad(y, *clients[i])))
        deltas.append(lin((1, y), (-1, x)))
    return deltas


# ------------------------------------------------------------------------------------------------ FedAdam
@pytest.mark.parametrize("bias_correction", [False, True])
def test_fedadam(bias_correction):
    eta_s, b1, b2, tau = 0.1, 0.9, 0.99, 0.01
    got, clients, theta, loop = run("fedadam", server_lr=eta_s, bias_correction=bias_correction)
    x, m, v = theta, zeros(theta), zeros(theta)
    for r in range(R):
        D = mean(sgd_clients(x, clients, range(len(clients))))
        m = emap(lambda m, d: b1 * m + (1 - b1) * d, m, D)  # m ← β1 m + (1 − β1) Δ̄
        v = emap(lambda v, d: b2 * v + (1 - b2) * d * d, v, D)  # v ← β2 v + (1 − β2) Δ̄²
        c1, c2 = (1 - b1 ** (r + 1), 1 - b2 ** (r + 1)) if bias_correction else (1.0, 1.0)
        x = emap(lambda x, m, v: x + eta_s * (m / c1) / (np.sqrt(v / c2) + tau), x, m, v)
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.m), m)
    assert_params_close(as_np(loop.server.v), v)
    assert loop.server.steps == R
    assert loop.rows[-1]["bytes_up"] == 3 * 96 and loop.rows[-1]["bytes_down"] == 3 * 96  # 1 model each way


# ------------------------------------------------------------------------------------------------ Local Adam/AdamW
def adam_client(y, xi, yi, clip, wd, decoupled, b1=0.9, b2=0.999, eps=1e-8, lr=LR):
    m, v = zeros(y), zeros(y)
    for k in range(1, K + 1):
        g = clip(grad(y, xi, yi))
        if not decoupled:
            g = lin((1, g), (wd, y))  # coupled L2
        m = emap(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = emap(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        step = emap(lambda m, v: (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps), m, v)
        if decoupled:
            step = lin((1, step), (wd, y))  # decoupled decay
        y = lin((1, y), (-lr, step))
    return y


@pytest.mark.parametrize("name,decoupled,wd", [("local_adam", False, 0.01), ("local_adamw", True, 0.2)])
def test_local_adam(name, decoupled, wd):
    clip = Clip(0.3)
    # the loop's SGD weight decay (0.5) is ignored: the rule builds its own optimizer
    got, clients, theta, loop = run(name, weight_decay=wd, loop_kw={"weight_decay": 0.5, "max_grad_norm": 0.3})
    assert isinstance(loop.local.make_optimizer([torch.zeros(1)], 0.1, None),
                      torch.optim.AdamW if decoupled else torch.optim.Adam)
    x = theta
    for _r in range(R):  # fresh moments every round
        ys = [adam_client(dict(x), *clients[i], clip, wd, decoupled) for i in range(len(clients))]
        x = mean(ys)
    assert_params_close(got, x)
    assert clip.active > 0


# ------------------------------------------------------------------------------------------------ FedLADA
def test_fedlada():
    gamma, b1, b2, eps, wd = 0.9, 0.9, 0.999, 1e-8, 0.01
    clip = Clip(0.3)
    got, clients, theta, loop = run("fedlada", gamma=gamma, loop_kw={"weight_decay": wd, "max_grad_norm": 0.3})
    x, mt, vbar = theta, zeros(theta), zeros(theta)
    for _r in range(R):
        deltas, vs = [], []
        for xi, yi in clients:
            y, m, v = dict(x), zeros(x), dict(vbar)  # m_0 = 0, v_0 = v̄
            for _ in range(K):
                g = lin((1, clip(grad(y, xi, yi))), (wd, y))  # clip, then coupled L2 (loop's weight_decay)
                m = emap(lambda m, g: b1 * m + (1 - b1) * g, m, g)
                v = emap(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
                y = emap(lambda y, m, v: y - (1 - gamma) * LR * m / (np.sqrt(v) + eps), y, m, v)  # no bias corr.
                y = lin((1, y), (gamma * LR / K, mt))  # y ← y + γ·η·m̃/K
            deltas.append(lin((1, y), (-1, x)))
            vs.append(v)
        D = mean(deltas)
        x, vbar, mt = lin((1, x), (1, D)), mean(vs), lin((1 / LR, D))  # x ← x + Δ̄; v̄ ← mean v_i; m̃ ← Δ̄/η
    assert clip.active > 0
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.m_tilde), mt)
    assert_params_close(as_np(loop.server.v_bar), vbar, tol=1e-12)
    assert loop.rows[-1]["bytes_down"] == 3 * 3 * 96 and loop.rows[-1]["bytes_up"] == 3 * 2 * 96  # 3/2 models


# ------------------------------------------------------------------------------------------------ FedAdamW
class HeadModel(nn.Module):
    """Softmax regression whose layer is named like a ViT classifier (``head.weight``, ``head.bias``)."""

    def __init__(self, theta):
        super().__init__()
        self.head = linear_model(theta)

    def forward(self, x):
        return self.head(x)


def block_ids(shapes, blocks, head_rows_groups=None):
    """Independent numpy block assignment per key (flattened): tensor → all 0; none → arange; hessian on
    HeadModel: ``head.weight`` rows grouped as ``head_rows_groups``, ``head.bias`` one block."""
    ids = {}
    for k, shp in shapes.items():
        n = int(np.prod(shp))
        if blocks == "none":
            ids[k] = np.arange(n)
        elif blocks == "hessian" and k.endswith("head.weight"):
            row_id = np.concatenate([[j] * len(g) for j, g in enumerate(head_rows_groups)])
            ids[k] = np.repeat(row_id, shp[1])
        else:
            ids[k] = np.zeros(n, dtype=int)
    return ids


def fedadamw_ref(clients, theta, ids, *, alpha=0.5, lam=0.01, b1=0.9, b2=0.999, eps=1e-8, variant=2,
                 aggregate_v=True, decoupled=True, clip=None, server_lr=1.0, sampled=None, key_map=None, cosine=False):
    key_map = key_map or {"weight": "weight", "bias": "bias"}

    def gradf(y, xi, yi):
        g = grad({a: y[b] for a, b in key_map.items()}, xi, yi)
        return {key_map[a]: v for a, v in g.items()}

    def means(k, v):
        return np.bincount(ids[k], weights=v.reshape(-1)) / np.bincount(ids[k])  # block means

    def expand(k, vb, shape):
        return vb[ids[k]].reshape(shape)

    clip = clip or Clip(None)
    x, dG, t = theta, zeros(theta), 0
    vbar = {k: means(k, np.zeros_like(v)) for k, v in theta.items()}
    for r in range(R):
        S = sampled(r) if sampled else range(len(clients))
        deltas, vbs = [], []
        for i in S:
            y, m = dict(x), zeros(x)
            v = {k: expand(k, vbar[k], x[k].shape) for k in x} if aggregate_v else zeros(x)  # v_0 = v̄ or 0
            for k in range(1, K + 1):
                g = clip(gradf(y, *clients[i]))
                if not decoupled:
                    g = lin((1, g), (lam, y))
                m = emap(lambda m, g: b1 * m + (1 - b1) * g, m, g)
                v = emap(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
                cv = 1 - b2 ** ((t + k) if aggregate_v else k)  # global t = r·K + k for v̂
                mth = emap(lambda m, v: (m / (1 - b1**k)) / (np.sqrt(v / cv) + eps), m, v)  # m̂ ⊙ ϑ
                d = lin((1, mth), (alpha, dG)) if variant == 2 else lin((alpha, mth), (1 - alpha, dG))
                if decoupled:
                    d = lin((1, d), (lam, y))
                eta = 0.5 * LR * (1 + np.cos(np.pi * (k - 1) / K)) if cosine else LR  # in-round cosine, step k − 1
                y = lin((1, y), (-eta, d))
            deltas.append(lin((1, y), (-1, x)))
            vbs.append({k: means(k, v[k]) for k in v})
        D = mean(deltas)
        dG = lin((-1 / (K * LR), D))  # Δ_G ← −Δ̄/(Kη)
        if aggregate_v:
            vbar = mean(vbs)
        t += K
        x = lin((1, x), (server_lr, D)) if variant == 2 else lin((1, x), (-server_lr * K * LR, dG))
    return x, dG, vbar, t


CASES = {
    "tensor": ({}, {}),
    "tensor-partial": ({"clients_per_round": 2}, {}),
    "none": ({"blocks": "none"}, {}),
    "alpha0-coupled": ({"alpha": 0.0, "decoupled": False, "lam": 0.05}, {"alpha": 0.0, "decoupled": False,
                                                                        "lam": 0.05}),
    "no-aggregate-v": ({"aggregate_v": False}, {"aggregate_v": False}),
    "local-cosine": ({"loop": {"local_lr_schedule": "cosine"}}, {"cosine": True}),  # Δ_G still ÷ K·η_r (line 18)
    "variant3": ({"variant": 3, "alpha": 0.7, "server_lr": 0.5},
                 {"variant": 3, "alpha": 0.7, "b1": 0.0, "lam": 0.0, "server_lr": 0.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fedadamw(case):
    kw, ref_kw = CASES[case]
    kw = dict(kw)
    clip = Clip(0.3)
    got, clients, theta, loop = run("fedadamw", loop_kw={"max_grad_norm": 0.3, "seed": 2, **kw.pop("loop", {})}, **kw)
    sampled = None
    if "clients_per_round" in kw:
        sampled = lambda r: sample_clients(len(clients), kw["clients_per_round"], 2, r)  # noqa: E731
        assert sampled(0) == [0, 1] and sampled(1) == [1, 2]
    blocks = kw.get("blocks", "tensor")
    ids = block_ids({k: v.shape for k, v in theta.items()}, blocks)
    x, dG, vbar, t = fedadamw_ref(clients, theta, ids, clip=clip, sampled=sampled, **ref_kw)
    assert clip.active > 0
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.delta_G), dG)
    assert loop.server.t == t == R * K
    if kw.get("aggregate_v", True):
        assert_params_close({k: v.reshape(-1) for k, v in as_np(loop.server.v_bar).items()}, vbar, tol=1e-12)
    # byte accounting: down = x + Δ_G + v̄ (B scalars) + t; up = Δ + v̄_i (B scalars); 64-true: 8 bytes each
    B = {"tensor": 2, "none": 12}[blocks]
    S = kw.get("clients_per_round", 3)
    vb = 8 * B if kw.get("aggregate_v", True) else 0
    assert loop.rows[-1]["rule/num_blocks"] == B
    assert loop.rows[-1]["bytes_down"] == S * (2 * 96 + vb + 4)
    assert loop.rows[-1]["bytes_up"] == S * (96 + vb)


@pytest.mark.parametrize("min_block_size,groups", [(1, [[0], [1], [2]]), (4, [[0, 1], [2]])])
def test_fedadamw_hessian_head_rows(min_block_size, groups):
    """``blocks: hessian`` on a model named like a ViT head: v̄ per output row (merged under the cap)."""
    clients, theta0 = problem()
    theta = {"head.weight": theta0["weight"], "head.bias": theta0["bias"]}
    got, _, _, loop = run("fedadamw", clients=clients, theta=theta, model=HeadModel(theta0), blocks="hessian",
                          min_block_size=min_block_size)
    ids = block_ids({k: v.shape for k, v in theta.items()}, "hessian", groups)
    x, dG, vbar, t = fedadamw_ref(clients, theta, ids, key_map={"weight": "head.weight", "bias": "head.bias"})
    assert_params_close(got, x)
    assert_params_close(as_np(loop.server.v_bar), vbar, tol=1e-12)
    assert_params_close(as_np(loop.server.delta_G), dG)
    assert loop.server.v_bar["head.weight"].shape == (len(groups),)
    assert loop.rows[-1]["rule/num_blocks"] == len(groups) + 1


def test_fedadamw_without_alignment_or_v_is_local_adamw():
    """α = 0, λ = 0, v_0 = 0 (local bias correction) is Local AdamW with wd 0 (ties AmendedAdam to torch)."""
    a, *_ = run("fedadamw", alpha=0.0, lam=0.0, aggregate_v=False, loop_kw={"max_grad_norm": 0.3})
    b, *_ = run("local_adamw", weight_decay=0.0, loop_kw={"max_grad_norm": 0.3})
    assert_params_close(a, b, tol=1e-12)


@pytest.mark.parametrize("name", ["fedadam", "fedlada", "fedadamw"])
def test_resume_is_bitwise(name, tmp_path):
    """The server state (m, v, steps / m̃, v̄ / Δ_G, v̄, t) round-trips through a checkpoint bitwise."""
    clients, theta = problem()
    first = make_loop(fedlight.create(name), clients, linear_model(theta), local_steps=K, lr=LR, rounds=R,
                      out_dir=tmp_path)
    first.run_round(0)
    fedtest.save_checkpoint(first, first.out_dir)
    second = make_loop(fedlight.create(name), clients, linear_model(theta), local_steps=K, lr=LR, rounds=R,
                       out_dir=tmp_path)
    fedtest.resume(second, tmp_path / "checkpoints" / "last.ckpt")
    first.run_round(1)
    second.run_round(1)
    for k in first.x:
        assert torch.equal(second.x[k], first.x[k])


# ------------------------------------------------------------------------------------------------ blocks
def tiny_vit(embed_dim=128, num_heads=2):
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=5, embed_dim=embed_dim, depth=1,
                             num_heads=num_heads, mlp_ratio=4.0, qkv_bias=True)


def test_block_counting_vit():
    shapes = {k: tuple(p.shape) for k, p in tiny_vit().named_parameters()}
    T, d = len(shapes), sum(math.prod(s) for s in shapes.values())
    assert num_blocks(make_partition(shapes, "tensor"), shapes) == T
    assert num_blocks(make_partition(shapes, "none"), shapes) == d
    natural = hessian_partition(shapes, head_dim=64, min_block_size=1)
    B = {k: sum(c for c, _ in r) for k, r in natural.items()}
    assert B["blocks.0.attn.qkv.weight"] == 2 + 2 + 128  # q, k per head; v per output row
    assert natural["blocks.0.attn.qkv.weight"] == [(2, 64 * 128), (2, 64 * 128), (128, 128)]
    assert B["blocks.0.attn.proj.weight"] == 128 and B["blocks.0.mlp.fc1.weight"] == 512
    assert B["blocks.0.mlp.fc2.weight"] == 128 and B["head.weight"] == 5 and B["pos_embed"] == 5
    for k in ("cls_token", "patch_embed.proj.weight", "blocks.0.attn.qkv.bias", "blocks.0.norm1.weight",
              "head.bias", "norm.bias"):
        assert B[k] == 1, k
    assert sum(B.values()) == 132 + 128 + 512 + 128 + 5 + 5 + (T - 6)
    # the cap: B ≤ ⌊d/512⌋, every run covers its tensor, no block straddles q/k/v
    capped = hessian_partition(shapes, head_dim=64, min_block_size=512)
    Bc = num_blocks(capped, shapes)
    assert T <= Bc <= d // 512 < sum(B.values())
    for k, runs in capped.items():
        assert sum(c * s for c, s in runs) == math.prod(shapes[k]), k
    bounds = np.cumsum([s for c, s in capped["blocks.0.attn.qkv.weight"] for _ in range(c)])
    assert 128 * 128 in bounds and 256 * 128 in bounds
    assert num_blocks(hessian_partition(shapes, 64, 1, max_blocks=300), shapes) <= 300
    # a cap below the number of tensors falls back to one block per tensor
    assert num_blocks(hessian_partition(shapes, 64, 1, max_blocks=3), shapes) == T


def test_hessian_head_dim_errors():
    shapes = {k: tuple(p.shape) for k, p in tiny_vit().named_parameters()}
    with pytest.raises(ConfigError, match="algorithm.head_dim"):
        hessian_partition(shapes, head_dim=48)  # 128 is not a multiple of 48
    alg = fedlight.create("fedadamw", blocks="hessian", head_dim=32)
    with pytest.raises(ConfigError, match="head_dim: 64"):
        alg.local.blocks.check_model(tiny_vit())


def test_fedadamw_hessian_tiny_vit_runs():
    """One round of ``blocks: hessian`` on a real (tiny) timm ViT: v̄ has one scalar per block, bytes add up."""
    torch.manual_seed(0)
    model = tiny_vit(embed_dim=64, num_heads=1)  # every tensor < 32k elements: no intra-op threading
    gen = torch.Generator().manual_seed(0)
    clients = [(torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in range(2)]
    loop = make_loop(fedlight.create("fedadamw", blocks="hessian", min_block_size=64), clients, model,
                     local_steps=2, lr=3e-4, rounds=1, precision="32-true", max_grad_norm=10.0)
    row = loop.run_round(0)
    shapes = {k: tuple(v.shape) for k, v in loop.x.items()}
    part = hessian_partition(shapes, 64, 64)
    B = num_blocks(part, shapes)
    assert sum(c for c, _ in part["blocks.0.mlp.fc1.weight"]) == 256  # natural blocks fit under the cap here
    assert row["rule/num_blocks"] == B == sum(v.numel() for v in loop.server.v_bar.values())
    assert all(v.numel() == sum(c for c, _ in part[k]) for k, v in loop.server.v_bar.items())
    assert all(bool((v > 0).all()) for v in loop.server.v_bar.values())
    model_bytes = 4 * sum(math.prod(s) for s in shapes.values())
    assert row["bytes_up"] == 2 * (model_bytes + 4 * B)
    assert row["bytes_down"] == 2 * (2 * model_bytes + 4 * B + 4)
    assert loop.server.t == 2


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("name,kw,arg", [
    ("fedadam", {"server_lr": 0.0}, "server_lr"), ("fedadam", {"beta1": 1.0}, "beta1"),
    ("fedadam", {"beta2": -0.1}, "beta2"), ("fedadam", {"tau": 0.0}, "tau"),
    ("local_adam", {"weight_decay": -1.0}, "weight_decay"), ("local_adam", {"eps": 0.0}, "eps"),
    ("local_adamw", {"beta2": 1.0}, "beta2"), ("local_adamw", {"server_lr": -1.0}, "server_lr"),
    ("fedlada", {"gamma": 1.0}, "gamma"), ("fedlada", {"gamma": -0.1}, "gamma"),
    ("fedlada", {"beta1": 1.0}, "beta1"), ("fedlada", {"eps": 0.0}, "eps"),
    ("fedadamw", {"alpha": -0.1}, "alpha"), ("fedadamw", {"variant": 3, "alpha": 1.5}, "alpha"),
    ("fedadamw", {"lam": -1.0}, "lam"), ("fedadamw", {"beta1": 1.0}, "beta1"), ("fedadamw", {"beta2": 1.0}, "beta2"),
    ("fedadamw", {"eps": 0.0}, "eps"), ("fedadamw", {"server_lr": 0.0}, "server_lr"),
    ("fedadamw", {"blocks": "rows"}, "blocks"), ("fedadamw", {"variant": 4}, "variant"),
    ("fedadamw", {"head_dim": 0}, "head_dim"), ("fedadamw", {"min_block_size": 0}, "min_block_size"),
    ("fedadamw", {"max_blocks": 0}, "max_blocks"), ("fedadamw", {"local_schedule": "cosine"}, "local_schedule"),
])
def test_validation(name, kw, arg):
    with pytest.raises(ConfigError, match=f"`algorithm.{arg}`"):
        fedlight.create(name, **kw)


def test_registry():
    specs = {n: fedlight.core.registry.get_algorithm(n) for n in ("fedadam", "local_adam", "local_adamw", "fedlada",
                                                            "fedadamw")}
    assert {n: s.comm for n, s in specs.items()} == {"fedadam": (1, 1), "local_adam": (1, 1),
                                                      "local_adamw": (1, 1), "fedlada": (3, 2), "fedadamw": (2, 1)}
    assert all(s.backprops == 1 and not s.stateful_clients for s in specs.values())
    alg = fedlight.create("fedadamw", variant=3)
    assert alg.local.beta1 == 0.0 and alg.local.lam == 0.0
    alg = fedlight.create("fedadamw")
    assert alg.local.beta1 == 0.9 and alg.local.lam == 0.01 and alg.local.alpha == 0.5

"""Differential privacy (fedlight.privacy): clip, noise, accountant, calibration, resume, stacking, refusals.

1 process equals 2 for a private run in tests/algorithms/test_contract.py (tests/privacy_rules.py's DPScaffold rides
along with every rule, so no second interpreter is started for it).

The loops are the contract setting of tests/fedtest.py (4 clients, 3 a round, K = 2) so each run costs milliseconds.
"""

import io
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from fedtest import image_clients, make_loop, resume, save_checkpoint, tiny_cnn
from privacy_rules import dp

import fedlight
from fedlight.core import params as P
from fedlight.errors import ConfigError
from fedlight.privacy import PrivacyConfig, accountant, private
from fedlight.privacy.clip import upload_norm
from fedlight.privacy.server import adaptive_clip, update_noise

ALGOS = fedlight.list_algorithms()
TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")


def _loop(algo, rounds=1, **kw):
    args = dict(local_steps=2, lr=0.05, clients_per_round=3, precision="32-true", weight_decay=1e-3,
                max_grad_norm=10.0, batch_size=4, rounds=rounds, weighting="uniform")
    return make_loop(algo, image_clients(), kw.pop("model", None) or tiny_cnn(), **{**args, **kw})


def _equal(a, b, what="x"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _equal(a[k], b[k], f"{what}.{k}")
    else:
        assert a == b, what


@pytest.mark.parametrize("name", [n for n in ALGOS if n != "fedwmsam"])
def test_no_noise_and_an_unreached_clip_leave_every_rule_bit_for_bit(name):
    """σ = 0, C = 1e30, actual-count denominator: the private run is the plain one (uniform weights in both)."""
    plain, priv = _loop(fedlight.create(name)), _loop(dp(name, noise_multiplier=0.0, clip=1e30, denominator="actual"))
    plain.run_round(0)
    row = priv.run_round(0)
    _equal(plain.x, priv.x)
    _equal(plain.server.state_dict(), priv.server.state_dict()["inner"], "server")
    assert row["privacy/epsilon"] == math.inf


class _Spy:
    """Records the norm of every upload the private client half returns."""

    def __init__(self, local):
        self.local, self.norms, self.finish_inner = local, [], local.finish

    def __call__(self, model, ctx):
        result = self.finish_inner(model, ctx)
        self.norms.append((float(upload_norm(result)), P.norm(result.delta).item()))
        return result


@pytest.mark.parametrize("name", ["scaffold", "fedcm_client"])
def test_every_clipped_upload_extras_included_is_within_the_clip(name):
    C = 0.05
    algo = dp(name, noise_multiplier=0.0, clip=C)
    spy = _Spy(algo.local)
    algo.local.finish = spy
    loop = _loop(algo, rounds=2)
    for r in range(2):
        loop.run_round(r)
    assert len(spy.norms) == 6
    for whole, delta in spy.norms:
        assert whole == pytest.approx(C, rel=1e-6)  # every upload was larger than C: clipped to exactly C
        assert delta < whole  # the extras carry part of the norm


def test_central_noise_has_the_stated_std():
    """σ = 2, C = 0.5 on zero sums of 40,000 coordinates: std(noise) = σC = 1 within 3 % (the sample std of n normal
    draws has relative sd 1/√(2n) = 0.35 %, so 3 % is ~8 sd), mean within 0.03."""
    algo = dp("fedavg", noise_multiplier=2.0, clip=0.5)
    sums = {"delta": {"w": torch.zeros(200, 200, dtype=torch.float64)}, "extras": {}, "metrics": {}}
    div = algo.server.privatize(sums, 3.0, round=5)
    z = sums["delta"]["w"]
    assert div == 3.0  # the fixed denominator: m = clients_per_round
    assert z.std().item() == pytest.approx(1.0, rel=0.03)
    assert abs(z.mean().item()) < 0.03
    again = {"delta": {"w": torch.zeros(200, 200, dtype=torch.float64)}, "extras": {}, "metrics": {}}
    algo.server.privatize(again, 3.0, round=5)
    assert torch.equal(again["delta"]["w"], z)  # seeded by (seed, round): every process draws the same


def test_adaptive_clipping_follows_the_paper_on_a_hand_computed_case():
    """Andrew et al. Alg. 1 with C = 0.05, γ = 0.5, η_C = 0.2, σ = 1, σ_b = 1, m = 3: 2 of 3 clients unclipped.
    σ_Δ = (1 − 1/4)^-1/2 = 1.1547005; b̄ = (2 + 1·z)/3 with z the round's count draw; C' = C·exp(−0.2(b̄ − 0.5))."""
    assert update_noise(1.0, 1.0) == pytest.approx(1.1547005383792515, abs=1e-15)
    assert adaptive_clip(1.0, 0.8, 0.5, 0.2) == pytest.approx(math.exp(-0.06), abs=1e-15)
    algo = dp("fedavg", adaptive=True, count_noise=1.0, target_quantile=0.5, clip_lr=0.2)
    assert algo.server.update_sigma == pytest.approx(1.1547005383792515)
    sums = {"delta": {"w": torch.zeros(3, dtype=torch.float64)}, "extras": {},
            "metrics": {"dp_unclipped": torch.tensor(2.0, dtype=torch.float64)}}
    algo.server.privatize(sums, 3.0, round=0)
    from fedlight.privacy import noise

    z = noise.scalar_normal(noise.generator(0, 0, noise.COUNT))
    assert algo.server.unclipped == pytest.approx((2 + z) / 3, abs=1e-15)
    assert "dp_unclipped" not in sums["metrics"]  # the exact count is not logged
    algo.server.setup({"w": torch.zeros(3)})
    from fedlight.core.rules import ClientResult, RoundInfo

    algo.server.update({"w": torch.zeros(3)}, ClientResult({"w": torch.zeros(3)}), RoundInfo(0, 0.1, 2, 4))
    assert algo.local.bound.value == pytest.approx(0.05 * math.exp(-0.2 * ((2 + z) / 3 - 0.5)), abs=1e-15)


def test_epsilon_is_the_librarys_own_and_calibration_reaches_the_target():
    import dp_accounting as dpa
    from dp_accounting import rdp

    lib = rdp.RdpAccountant(accountant.ORDERS, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.SampledWithoutReplacementDpEvent(20, 4, dpa.GaussianDpEvent(1.3 / 2))  # replace-one: σC/(2C)
    lib.compose(dpa.SelfComposedDpEvent(event, 3))
    assert accountant.epsilon(1.3, 20, 4, 3, 1e-3) == pytest.approx(lib.get_epsilon(1e-3), rel=1e-12)
    sigma = accountant.calibrate(6.0, 1e-3, 20, 4, 3)
    assert accountant.epsilon(sigma, 20, 4, 3, 1e-3) == pytest.approx(6.0, abs=1e-3)
    assert accountant.epsilon(sigma * 0.99, 20, 4, 3, 1e-3) > 6.0  # the smallest such σ


def test_resume_is_bitwise_and_the_round_reports_epsilon(tmp_path):
    def run(rounds):
        return _loop(dp("scaffold", adaptive=True, count_noise=1.0, rounds=4), rounds=rounds)

    full = run(4)
    rows = [full.run_round(r) for r in range(4)]
    first = run(4)
    for r in range(2):
        first.run_round(r)
    second = run(4)
    resume(second, save_checkpoint(first, tmp_path))
    for r in range(2, 4):
        second.run_round(r)
    _equal(second.x, full.x)
    _equal(second.server.state_dict(), full.server.state_dict(), "server")
    assert full.server.state_dict()["clip"] != 0.05  # adaptive clipping moved C, and resumed it
    assert [r["privacy/epsilon"] for r in rows] == [accountant.epsilon(1.0, 4, 3, t, 1e-3) for t in (1, 2, 3, 4)]
    buf = io.BytesIO()
    torch.save(full.server.state_dict(), buf)  # the checkpoint's server state holds plain values


def test_vmap_equals_sequential_for_a_private_run():
    seq = _loop(dp("fedavg"), precision="64-true", client_parallelism="sequential")
    vec = _loop(dp("fedavg"), precision="64-true", client_parallelism="vmap")
    seq.run_round(0)
    vec.run_round(0)
    for k in seq.x:
        torch.testing.assert_close(vec.x[k], seq.x[k], rtol=0, atol=1e-10)
    assert vec.runner.name != seq.runner.name


@pytest.mark.parametrize("settings, match", [
    (dict(noise_multiplier=-1.0), "privacy.noise_multiplier"),
    (dict(clip=0.0), "privacy.clip"),
    (dict(delta=0.0), "privacy.delta"),
    (dict(delta=1.0), "privacy.delta"),
    (dict(noise_multiplier=None, target_epsilon=1e-6, delta=1e-10), "out of reach"),
    (dict(level="record", adaptive=True), "privacy.adaptive"),
    (dict(adaptive=True, count_noise=0.1), "privacy.count_noise"),
    (dict(mechanism="laplace"), "laplace"),
])
def test_bad_settings_are_refused_in_one_line(settings, match):
    with pytest.raises(ConfigError, match=match) as e:
        dp("fedavg", **settings)
    assert "\n" not in str(e.value)


def test_a_self_aggregating_server_or_an_unbounded_upload_is_refused_and_a_large_delta_warns():
    from robust_rules import MedianFedAvg

    with pytest.raises(ConfigError, match="FedWMSAM uploads the similarity"):
        dp("fedwmsam")

    with pytest.raises(ConfigError, match="aggregates the client results itself"):
        private(MedianFedAvg(), PrivacyConfig(noise_multiplier=1.0), 0, 4, 3, 2)
    with pytest.warns(UserWarning, match="1/\\(number of clients\\)"):
        dp("fedavg", delta=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp("fedavg", delta=0.1)  # below 1/4: no warning


def test_cli_run_records_epsilon_refuses_bad_input_and_a_resume_must_agree(tmp_path, capsys):
    from fedlight.config.cli import main

    out = tmp_path / "run"
    flags = ["fit", "--config", TINY, "--out_dir", str(out), "--loop.rounds", "2", "--privacy.noise_multiplier", "1.0",
             "--privacy.clip", "0.5", "--privacy.delta", "1e-3"]
    assert main(flags) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    eps = [accountant.epsilon(1.0, 6, 4, t, 1e-3) for t in (1, 2)]
    assert [r["privacy/epsilon"] for r in rows] == eps
    summary = json.loads((out / "summary.json").read_text())["privacy"]
    assert summary["epsilon"] == eps[-1] and summary["noise_multiplier"] == 1.0 and summary["clip"] == 0.5
    assert summary["sampling_rate"] == 4 / 6 and summary["rounds"] == 2 and summary["accountant_version"]
    assert main([*flags[:-4], "--privacy.clip", "0.25", "--privacy.delta", "1e-3", "--resume", "auto"]) == 2
    assert "privacy.clip is 0.5 there and 0.25 here" in capsys.readouterr().err
    assert main([*flags, "--privacy.clip", "-1", "--out_dir", str(tmp_path / "bad")]) == 2
    assert "`privacy.clip` (C) must be > 0" in capsys.readouterr().err



@pytest.mark.parametrize("placement, extra", [
    ("central", []), ("distributed", []),
    ("central", ["--loop.sampling", "poisson", "--privacy.accountant", "pld", "--privacy.relation", "replace_one"])])
def test_two_processes_equal_one_for_a_private_run(placement, extra, tmp_path, monkeypatch):
    """`--devices 2` (Fabric's ddp launcher, gloo) and 1 process give the same private run: the central noise is
    drawn once from (seed, round) and added once to the all-reduced sum, each client's share of distributed noise
    is drawn from (seed, round, client) wherever the client trains, and adaptive clipping's noised count is the
    same on every process; Poisson sampling (PLD, replace-one) draws the same clients on every process. The same
    global model, ε and clip after every round."""
    import subprocess
    import sys

    from fedlight.config.cli import main

    def args(n):
        return ["fit", "--config", TINY, "--devices", str(n), "--accelerator", "cpu", "--loop.rounds", "3",
                "--privacy.noise_multiplier", "1.0", "--privacy.clip", "0.5", "--privacy.adaptive", "true",
                "--privacy.count_noise", "2.0", "--privacy.delta", "1e-3", "--privacy.placement", placement, *extra,
                "--out_dir", str(tmp_path / f"d{n}")]

    res = subprocess.run([sys.executable, "-m", "fedlight.config.cli", *args(2)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(args(1)) == 0
    rows = {n: [json.loads(x) for x in (tmp_path / f"d{n}" / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)}
    for key in ("privacy/epsilon", "privacy/clip", "privacy/unclipped_fraction"):
        assert [r[key] for r in rows[2]] == [r[key] for r in rows[1]], key
    finals = {n: torch.load(tmp_path / f"d{n}" / "final_model.pt", weights_only=True) for n in (1, 2)}
    for k in finals[1]:
        torch.testing.assert_close(finals[2][k], finals[1][k], rtol=0, atol=0)

class _Zeros:
    """A client rule whose upload is 40,000 zeros: what a client adds to it is its noise alone."""

    needs_true_grad_norm, stacked_unsupported, scalar_uploads, brings_optimizer = False, None, None, False

    def finish(self, model, ctx):
        from fedlight.core.rules import ClientResult

        return ClientResult({"w": torch.zeros(200, 200)})


@pytest.mark.parametrize("settings, std", [
    (dict(placement="distributed", noise_multiplier=2.0, clip=0.5), 2.0 * 0.5 / math.sqrt(3)),  # σC/√m, m = 3
    (dict(level="local", noise_multiplier=2.0, clip=0.5), 2.0 * 0.5),  # σC
    (dict(level="local", mechanism="laplace", noise_multiplier=2.0, clip=0.5), math.sqrt(2) * 2.0 * 0.5),  # √2·b
])
def test_a_clients_own_noise_has_the_stated_std(settings, std):
    """Within 3 % of the stated std on 40,000 coordinates (~8 sd of the sample std); seeded by (seed, round, client):
    two clients draw differently, the same client twice the same."""
    from types import SimpleNamespace

    from fedlight.core.rules import Algorithm

    algo = private(Algorithm(_Zeros()), PrivacyConfig(delta=1e-3, **settings), 0, 4, 3, 2)
    draw = [algo.local.finish(None, SimpleNamespace(round=1, client_id=c)).delta["w"] for c in (0, 1, 0)]
    assert draw[0].std().item() == pytest.approx(std, rel=0.03)
    assert torch.equal(draw[0], draw[2]) and not torch.equal(draw[0], draw[1])


def test_local_dp_reports_its_epsilon_per_upload_and_refuses_stacking():
    row = _loop(dp("fedavg", level="local", mechanism="laplace", noise_multiplier=4.0)).run_round(0)
    assert row["privacy/epsilon"] == 2 / 4.0  # L1 diameter 2C over the scale 4C
    row = _loop(dp("fedavg", level="local", noise_multiplier=4.0)).run_round(0)
    assert row["privacy/epsilon"] == accountant.gaussian_epsilon(4.0, 1e-3)
    with pytest.raises(ConfigError, match="drawn per client id"):
        _loop(dp("fedavg", level="local", noise_multiplier=4.0), client_parallelism="vmap")


def test_a_killed_private_run_resumes_bit_for_bit(tmp_path):
    """SIGKILL in round 2's training (FEDLIGHT_FAULT), then `--resume auto`: the final model equals an unbroken run's
    (adaptive clipping: C and the noise streams are restored from the checkpoint and (seed, round))."""
    import os
    import signal
    import subprocess
    import sys

    from fedlight.config.cli import main

    flags = ["--config", TINY, "--loop.rounds", "3", "--privacy.noise_multiplier", "0.5", "--privacy.clip", "0.5",
             "--privacy.delta", "1e-3", "--privacy.adaptive", "true", "--privacy.count_noise", "1.0"]
    assert main(["fit", *flags, "--out_dir", str(tmp_path / "ref")]) == 0
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "fedlight.config.cli", "fit", *flags, "--out_dir", str(out)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "FEDLIGHT_FAULT": "train@2"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert main(["fit", *flags, "--out_dir", str(out), "--resume", "auto"]) == 0
    ref, got = (torch.load(d / "final_model.pt", weights_only=True) for d in (tmp_path / "ref", out))
    _equal(got, ref, "final model")
    clip = [json.loads((d / "summary.json").read_text())["privacy"]["clip"] for d in (tmp_path / "ref", out)]
    assert clip[0] == clip[1] != 0.5


def test_record_level_step_is_the_mean_of_per_example_clipped_gradients_and_sam_is_refused():
    """FedAvg, one full-batch step of lr 0.5 on the softmax regression of fedtest.problem (3 clients of 4 examples),
    σ = 0, C = 1.3: Δ_i = −0.5·(1/4)Σ_b min(1, C/‖g_b‖)·g_b with g_b each example's gradient by autograd, one at a
    time; the mean over the clients is the update. ε counts a record once per round (one epoch)."""
    from fedtest import linear_model, problem

    clients, theta = problem()
    algo = dp("fedavg", level="record", noise_multiplier=0.0, clip=1.3, num_clients=3, per_round=3)
    loop = make_loop(algo, clients, linear_model(theta), rounds=1, local_steps=1, lr=0.5, precision="64-true")
    row = loop.run_round(0)
    deltas, clipped = [], 0
    for x, y in clients:
        model = linear_model(theta).double()
        total = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
        for b in range(len(y)):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.tensor(x[b:b + 1])), torch.tensor(y[b:b + 1])).backward()
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
            clipped += norm.item() > 1.3
            for k, p in model.named_parameters():
                total[k] += min(1.0, 1.3 / norm.item()) * p.grad
        deltas.append({k: -0.5 * v / len(y) for k, v in total.items()})
    for k in loop.x:
        expect = torch.tensor(theta[k]) + sum(d[k] for d in deltas) / 3
        torch.testing.assert_close(loop.x[k], expect, rtol=0, atol=1e-12)
    assert 0 < clipped < 12  # the clip acts on some examples, not all
    assert row["privacy/epsilon"] == math.inf  # σ = 0
    assert accountant.gaussian_epsilon(2.0, 1e-3, 3) > accountant.gaussian_epsilon(2.0, 1e-3, 2)
    with pytest.raises(ConfigError, match="privacy.level: record` is refused for FedSAM"):
        dp("fedsam", level="record")

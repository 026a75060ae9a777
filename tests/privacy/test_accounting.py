"""Issue 58: an ε that is never understated, under the convention the run names.

Every ε fedlight prints is checked against dp-accounting driven here, independently of fedlight.privacy.accountant:
the events are built in the test from the σ each round really had, for every supported (sampling, relation,
accountant). The defects of issue 58 each have a test here that fails on the code before it: a target_epsilon run
extended past its rounds, BatchNorm statistics released in the clear, distributed noise with dropped clients, NaN
σ, the record-level refusals before round 1.
"""

import json
import math
from pathlib import Path

import dp_accounting as dpa
import pytest
import torch
from dp_accounting import pld, rdp
from fedtest import image_clients, make_loop, resume, save_checkpoint, tiny_cnn
from torch import nn

import fedlight
from fedlight.core.sampling import client_fails, poisson_clients, sample_clients
from fedlight.errors import ConfigError
from fedlight.privacy import PrivacyConfig, private
from fedlight.privacy.accountant import ORDERS, update_noise
from fedlight.privacy.wrap import check_model

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
REL = {"replace_one": dpa.NeighboringRelation.REPLACE_ONE, "add_remove": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE}


def reference(history, N, m, delta, sampling="fixed", relation="replace_one", acct="rdp"):
    """dp-accounting's ε(δ) of rounds at the given per-client multipliers, built here from the library alone:
    fixed-size sampling, replace-one: Gaussian(σ/2) (the sum moves by the diameter 2C); Poisson: Gaussian(σ)
    (the library's replace-one PLD doubles the per-client sensitivity itself)."""
    acc = rdp.RdpAccountant(ORDERS, REL[relation]) if acct == "rdp" else pld.PLDAccountant(REL[relation])
    for g, n in history:
        one = (dpa.SampledWithoutReplacementDpEvent(N, m, dpa.GaussianDpEvent(g / 2)) if sampling == "fixed"
               else dpa.PoissonSampledDpEvent(m / N, dpa.GaussianDpEvent(g)))
        acc.compose(dpa.SelfComposedDpEvent(one, n))
    return acc.get_epsilon(delta)


def _private(name="fedavg", N=4, m=3, rounds=3, sampling="fixed", **settings):
    cfg = PrivacyConfig(**{"noise_multiplier": 1.0, "clip": 0.05, "delta": 1e-3, **settings})
    return private(fedlight.create(name), cfg, 0, N, m, rounds, sampling=sampling)


def _loop(algo, rounds=3, **kw):
    return make_loop(algo, image_clients(), tiny_cnn(), rounds=rounds, local_steps=2, lr=0.05, clients_per_round=3,
                     precision="32-true", batch_size=4, weighting="uniform", **kw)


# ------------------------------------------------------------------ defect 1: extending a target_epsilon run
def test_a_target_epsilon_run_extended_recalibrates_the_rounds_left_and_epsilon_never_falls(tmp_path):
    """Calibrated to ε = 6 over 4 rounds, checkpointed after 2, resumed with 8 rounds planned: rounds 3-8 get the σ
    that brings the 8-round composition (2 rounds at the first σ, 6 at the new one) to 6; every round's ε is
    dp-accounting's composition of what was used, and never falls."""
    first = _loop(_private(noise_multiplier=None, target_epsilon=6.0, rounds=4), rounds=4)
    rows = [first.run_round(r) for r in range(2)]
    s1 = first.server.sigma
    second = _loop(_private(noise_multiplier=None, target_epsilon=6.0, rounds=8), rounds=8)
    resume(second, save_checkpoint(first, tmp_path))
    s2 = second.server.sigma
    assert s2 > s1 and second.server.update_sigma == s2
    rows += [second.run_round(r) for r in range(2, 8)]
    eps = [r["privacy/epsilon"] for r in rows]
    assert eps == sorted(eps)  # never falls
    for t, e in enumerate(eps, 1):
        history = [(s1, min(t, 2))] + ([(s2, t - 2)] if t > 2 else [])
        assert e == pytest.approx(reference(history, 4, 3, 1e-3), rel=1e-9)
    assert eps[-1] == pytest.approx(6.0, abs=2e-3)
    assert second.server.summary()["noise_multipliers"] == [[s1, 2], [s2, 6]]


def test_extending_a_finished_target_epsilon_run_is_refused_before_its_first_new_round(tmp_path, capsys):
    from fedlight.config.cli import main

    out = tmp_path / "run"
    flags = ["fit", "--config", TINY, "--out_dir", str(out), "--privacy.target_epsilon", "8", "--privacy.clip", "0.5",
             "--privacy.delta", "1e-3"]
    assert main(flags) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main([*flags, "--loop.rounds", "4", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "`privacy.target_epsilon` 8 is spent: the 2 rounds trained at σ = " in err and "keep `loop.rounds` 2" in err
    assert (out / "metrics.jsonl").read_text() == before  # no round trained


# ------------------------------------------------------------------ defect 2: BatchNorm statistics
def test_running_statistics_are_refused_at_client_level_naming_group_norm(tmp_path, capsys):
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    for level in ("client", "local"):
        with pytest.raises(ConfigError, match="BatchNorm2d running statistics .* `norm: group`") as e:
            check_model(bn, PrivacyConfig(noise_multiplier=1.0, level=level), "32-true")
        assert "\n" not in str(e.value)
    check_model(bn, PrivacyConfig(noise_multiplier=1.0), "32-true", aggregate_buffers=False)  # never released
    check_model(nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2)), PrivacyConfig(noise_multiplier=1.0), "32-true")
    from fedlight.config.cli import main

    flags = ["fit", "--config", TINY, "--out_dir", str(tmp_path / "bn"), "--privacy.noise_multiplier", "1",
             "--privacy.delta", "1e-3", "--model", "fedlight.models.SmallCNN", "--model.init_args.in_channels", "1",
             "--model.init_args.norm", "batch"]
    assert main(flags) == 2
    assert "`norm: group`" in capsys.readouterr().err
    assert not (tmp_path / "bn" / "metrics.jsonl").exists()


# ------------------------------------------------------------------ defect 3: distributed noise, dropped clients
def test_distributed_noise_with_dropped_clients_is_accounted_for_the_noise_added():
    """loop.client_dropout 0.5: a round in which n of m clients reported carried N(0, σ²C²·n/m) on the sum, so its
    multiplier is σ√(n/m); ε is the composition of those (the reporting counts are found here from the seeds)."""
    loop = _loop(_private(placement="distributed", noise_multiplier=2.0, rounds=6), rounds=6, client_dropout=0.5)
    rows = [loop.run_round(r) for r in range(6)]
    reported = [sum(not client_fails(0, r, c, 0.5) for c in sample_clients(4, 3, 0, r)) for r in range(6)]
    assert min(reported) < 3 and min(reported) > 0  # the seed drops some clients, none a round of nobody
    for t in range(1, 7):
        history = [(2.0 * math.sqrt(n / 3), 1) for n in reported[:t]]
        assert rows[t - 1]["privacy/epsilon"] == pytest.approx(reference(history, 4, 3, 1e-3), rel=1e-9)
    assert rows[-1]["privacy/epsilon"] > reference([(2.0, 6)], 4, 3, 1e-3)  # more than the nominal σ's


def test_distributed_adaptive_clients_add_the_update_noise_share():
    """Under adaptive clipping each client adds σ_Δ·C/√m (it added σ·C/√m before, so the pair cost more than σ)."""
    algo = _private(placement="distributed", adaptive=True, count_noise=2.0, noise_multiplier=2.0, clip=0.5)
    assert algo.local.client_noise.scale == pytest.approx(update_noise(2.0, 2.0) / math.sqrt(3), rel=1e-15)


class _Tiny:
    """A client rule whose upload is one zero (its norm 0 ≤ C: every report says "not clipped")."""

    needs_true_grad_norm, stacked_unsupported, scalar_uploads, brings_optimizer = False, None, None, False

    def finish(self, model, ctx):
        from fedlight.core.rules import ClientResult

        return ClientResult({"w": torch.zeros(1)})


def test_distributed_adaptive_clients_add_the_count_noise_and_the_server_none():
    """Distributed placement under adaptive clipping: each client adds its share N(0, σ_b²/m) of the count query's
    noise to its clipped-or-not report (std within 4 % over 6,000 reports, ~4.4 sd of the sample std; seeded by
    (seed, round, client)), and the server adds none: b̄ is the sum it receives over m. Central placement: the clients'
    reports are exact and the server adds N(0, σ_b²) (the same draw as before)."""
    from types import SimpleNamespace

    from fedlight.core.rules import Algorithm
    from fedlight.privacy import noise

    cfg = dict(placement="distributed", adaptive=True, count_noise=2.0, noise_multiplier=1.0, delta=1e-3)
    algo = private(Algorithm(_Tiny()), PrivacyConfig(**cfg), 0, 4, 3, 2)
    assert algo.local.client_noise.count_scale == pytest.approx(2.0 / math.sqrt(3), rel=1e-15)
    reports = torch.tensor([float(algo.local.finish(None, SimpleNamespace(round=r, client_id=c)).metrics[
        "dp_unclipped"]) for r in range(2000) for c in range(3)], dtype=torch.float64)
    assert (reports - 1).std().item() == pytest.approx(2.0 / math.sqrt(3), rel=0.04)
    assert abs((reports - 1).mean().item()) < 4 * 2.0 / math.sqrt(3) / math.sqrt(6000)
    again = algo.local.finish(None, SimpleNamespace(round=7, client_id=1)).metrics["dp_unclipped"]
    assert float(again) == float(reports[7 * 3 + 1])  # (seed, round, client)
    sums = {"delta": {}, "extras": {}, "metrics": {"dp_unclipped": torch.tensor(2.5, dtype=torch.float64)}}
    algo.server.privatize(sums, 3.0, 5)
    assert algo.server.unclipped == 2.5 / 3  # no server noise on the count
    central = private(Algorithm(_Tiny()), PrivacyConfig(**{**cfg, "placement": "central"}), 0, 4, 3, 2)
    assert float(central.local.finish(None, SimpleNamespace(round=1, client_id=0)).metrics["dp_unclipped"]) == 1.0
    sums["metrics"]["dp_unclipped"] = torch.tensor(2.5, dtype=torch.float64)
    central.server.privatize(sums, 3.0, 5)
    assert central.server.unclipped == (2.5 + 2.0 * noise.scalar_normal(noise.generator(0, 5, noise.COUNT))) / 3


def test_distributed_adaptive_noise_with_dropped_clients_is_accounted_for_both_shares_added():
    """Distributed adaptive clipping with loop.client_dropout 0.5: a round in which n of m reported carried
    N(0, σ_Δ²C²·n/m) on the sum and N(0, σ_b²·n/m) on the count, so its multiplier is σ√(n/m) (both queries lost the
    same shares); ε is dp-accounting's composition of those."""
    algo = _private(placement="distributed", adaptive=True, count_noise=2.0, noise_multiplier=1.5, rounds=6)
    loop = _loop(algo, rounds=6, client_dropout=0.5)
    rows = [loop.run_round(r) for r in range(6)]
    reported = [sum(not client_fails(0, r, c, 0.5) for c in sample_clients(4, 3, 0, r)) for r in range(6)]
    assert min(reported) < 3 and min(reported) > 0
    for t in range(1, 7):
        history = [(1.5 * math.sqrt(n / 3), 1) for n in reported[:t]]
        assert rows[t - 1]["privacy/epsilon"] == pytest.approx(reference(history, 4, 3, 1e-3), rel=1e-9)


def test_skipping_nonfinite_clients_with_distributed_noise_is_refused_before_round_1(tmp_path, capsys):
    """A client skipped for its own non-finite update would take its noise share with it (noise that depends on
    the data): refused in one line, exit 2, before anything is written; central placement may skip."""
    with pytest.raises(ConfigError, match="`loop.on_nonfinite: skip_client` with `privacy.placement: distributed`"
                       ) as e:
        private(fedlight.create("fedavg"), PrivacyConfig(noise_multiplier=1.0, delta=1e-3, placement="distributed"),
                0, 4, 3, 2, on_nonfinite="skip_client")
    assert "\n" not in str(e.value)
    private(fedlight.create("fedavg"), PrivacyConfig(noise_multiplier=1.0, delta=1e-3), 0, 4, 3, 2,
            on_nonfinite="skip_client")
    capsys.readouterr()
    from fedlight.config.cli import main

    out = tmp_path / "run"
    assert main(["fit", "--config", TINY, "--out_dir", str(out), "--privacy.noise_multiplier", "1", "--privacy.delta",
                 "1e-3", "--privacy.placement", "distributed", "--loop.on_nonfinite", "skip_client"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use `loop.on_nonfinite: stop`, or `privacy.placement: central`" in err[0]
    assert not (out / "metrics.jsonl").exists()


# ------------------------------------------------------------------ defect 4: one line, before round 1
@pytest.mark.parametrize("settings, match", [
    (dict(noise_multiplier=float("nan")), "`privacy.noise_multiplier` must be a finite number, got nan"),
    (dict(clip=float("inf")), "`privacy.clip` must be a finite number"),
    (dict(noise_multiplier=None, target_epsilon=4.0, level="record"), "for `privacy.level: record` give"),
    (dict(relation="add_remove"), "not valid for fixed-size sampling"),
    (dict(accountant="pld"), "not valid for fixed-size sampling"),
    (dict(relation="sideways"), "`privacy.relation` must be one of"),
])
def test_bad_values_are_one_line_naming_the_setting(settings, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")) as e:
        _private(**settings)
    assert "\n" not in str(e.value)


def test_record_level_batchnorm_and_bf16_are_refused_before_round_1(tmp_path, capsys):
    with pytest.raises(ConfigError, match="BatchNorm2d's batch statistics mix; use a model with `norm: group`"):
        check_model(tiny_cnn(), PrivacyConfig(noise_multiplier=1.0, level="record"), "32-true")
    with pytest.raises(ConfigError, match="got bf16-mixed; use --precision 32-true"):
        check_model(nn.Linear(2, 2), PrivacyConfig(noise_multiplier=1.0, level="record"), "bf16-mixed")
    from fedlight.config.cli import main

    out = tmp_path / "bf16"
    assert main(["fit", "--config", TINY, "--out_dir", str(out), "--privacy.noise_multiplier", "1", "--privacy.level",
                 "record", "--privacy.delta", "1e-3", "--precision", "bf16-mixed", "--algorithm",
                 "fedlight.algorithms.FedAvg"]) == 2
    assert "got bf16-mixed" in capsys.readouterr().err and not (out / "metrics.jsonl").exists()


# ------------------------------------------------------------------ Poisson sampling and the conventions
def test_poisson_sampling_is_seeded_has_the_expected_count_and_may_be_empty():
    """Each client independently with probability q: over 4,000 rounds of 50 clients at q = 0.1 the mean count is
    5 within 0.1 (its sd is √(50·0.09/4000) = 0.034); the same (seed, round) gives the same set."""
    counts = [len(poisson_clients(50, 0.1, 7, r)) for r in range(4000)]
    assert abs(sum(counts) / 4000 - 5.0) < 0.1
    assert 0 in counts and max(counts) > 10
    assert poisson_clients(50, 0.1, 7, 3) == poisson_clients(50, 0.1, 7, 3) != poisson_clients(50, 0.1, 8, 3)


CONVENTIONS = [("fixed", "replace_one", "rdp"), ("poisson", "add_remove", "rdp"), ("poisson", "add_remove", "pld"),
               ("poisson", "replace_one", "pld")]


@pytest.mark.parametrize("sampling, relation, acct", CONVENTIONS)
@pytest.mark.parametrize("adaptive", [False, True])
def test_every_epsilon_is_dp_accountings_for_its_convention(sampling, relation, acct, adaptive):
    """Three rounds of FedAvg at σ = 1.5 (adaptive: σ_b = 2, the update noise σ_Δ chosen so the pair costs one query
    of σ under the relation): every round's ε equals dp-accounting's for that sampling, relation and accountant;
    the fixed denominator is the expected count m = 3 whatever the round's sample was."""
    settings = dict(noise_multiplier=1.5, relation=relation, accountant=acct, adaptive=adaptive, count_noise=2.0)
    loop = _loop(_private(sampling=sampling, **settings), sampling=sampling)
    rows = [loop.run_round(r) for r in range(3)]
    for t in range(1, 4):
        assert rows[t - 1]["privacy/epsilon"] == pytest.approx(reference([(1.5, t)], 4, 3, 1e-3, sampling,
                                                                          relation, acct), rel=1e-9)
    s = loop.server.summary()
    assert (s["sampling"], s["relation"], s["accountant_kind"]) == (sampling, relation, acct)
    assert s["epsilon_convention"] == f"client level, {acct.upper()}, {sampling} sampling, " \
        f"{relation.replace('_', '/')}, δ = 0.001"
    if adaptive:
        k = 2 if relation == "replace_one" else 1
        assert loop.server.update_sigma == pytest.approx((1.5 ** -2 - (k * 2.0) ** -2) ** -0.5, rel=1e-14)
    assert loop.server.privatize({"delta": {}, "extras": {}, "metrics": {"dp_unclipped": 0.0}}, 1.0, 9) == 3.0


def _pair_epsilon(q, sigma, N, rounds, delta, empty_released, h=0.01, L=8.0):
    """A lower bound on the ε(δ) of the mechanism a Poisson run releases, for one concrete pair of neighbouring
    populations: N − 1 clients whose clipped uploads are 0, and the same with one more client whose upload is C (in
    units of C, along its direction). A round's sum is then N(0, σ²) without it and (1 − q)N(0, σ²) + qN(1, σ²) with
    it; a run that releases an empty round unchanged (no noise) instead releases the atom "unchanged" with the
    probability that nobody was sampled, (1 − q)^(N−1) without it, (1 − q)^N with it, and the sum otherwise. The
    outputs are binned (post-processing: the binned pair's ε is at most the pair's), dp-accounting's PLD of the two
    probability mass functions is taken with optimistic rounding of the losses and composed over the rounds, both
    directions (add and remove)."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_distribution as pldm
    from scipy.stats import norm

    edges = np.concatenate([[-np.inf], np.arange(-L, L + 1 + h / 2, h), [np.inf]])
    g0, g1 = np.diff(norm.cdf(edges / sigma)), np.diff(norm.cdf((edges - 1) / sigma))
    a = (1 - q) ** (N - 1) if not empty_released else 0.0
    absent, present = dict(enumerate((1 - a) * g0)), dict(enumerate((1 - q) * (1 - a) * g0 + q * g1))
    if not empty_released:
        absent["unchanged"], present["unchanged"] = a, a * (1 - q)
    logs = [{k: math.log(p) for k, p in d.items() if p > 0} for d in (absent, present)]
    return max(pldm.from_two_probability_mass_functions(lo, up, pessimistic_estimate=False, symmetric=False)
               .self_compose(rounds).get_epsilon_for_delta(delta) for lo, up in (logs, logs[::-1]))


def test_an_empty_poisson_round_is_released_with_its_noise_and_counted():
    """30 clients, one expected a round (Poisson q = 1/30), σ = 1, 10 rounds, δ = 1e-3, PLD, add/remove; the seed
    samples nobody in 4 of the 10 rounds. Each such round is the sampled Gaussian mechanism the accountant composes:
    the server adds its noise to a zero sum (the model moves by exactly N(0, σ²C²)/m, the round's central stream) and
    the round is counted. The reported ε is dp-accounting's for all 10 rounds, and it is at least the ε that one
    concrete pair of neighbouring populations needs for the mechanism the run released (an empty round left unchanged
    would need 0.72 there, while its 6 counted rounds reported 0.39); that pair is the worst case, so the bound comes
    within 1 % of the accountant's."""
    from fedlight.privacy import noise

    q, C, rounds = 1 / 30, 0.5, 10
    algo = private(fedlight.create("fedavg"), PrivacyConfig(noise_multiplier=1.0, clip=C, delta=1e-3,
                                                            accountant="pld"), 0, 30, 1, rounds, sampling="poisson")
    loop = make_loop(algo, image_clients(30, n=4), tiny_cnn(), rounds=rounds, local_steps=1, lr=0.05,
                     clients_per_round=1, precision="64-true", batch_size=4, weighting="uniform", sampling="poisson")
    empty = [r for r in range(rounds) if not poisson_clients(30, q, 0, r)]
    assert len(empty) == 4
    rows, moves = [], {}
    for r in range(rounds):
        x0 = {k: v.clone() for k, v in loop.x.items()}
        rows.append(loop.run_round(r))
        moves[r] = {k: loop.x[k] - x0[k] for k in x0}
    released = all(any(bool(v.any()) for v in moves[r].values()) for r in empty)  # the mechanism the run released
    eps = rows[-1]["privacy/epsilon"]
    bound = _pair_epsilon(q, 1.0, 30, rounds, 1e-3, empty_released=released)
    assert bound <= eps <= 1.01 * bound
    for r in range(rounds):
        assert rows[r]["privacy/epsilon"] == pytest.approx(
            reference([(1.0, r + 1)], 30, 1, 1e-3, "poisson", "add_remove", "pld"), rel=1e-9)
    for r in empty:
        z = {k: torch.zeros_like(v) for k, v in moves[r].items()}
        noise.gaussian_(z, 1.0 * C, noise.generator(0, r, noise.CENTRAL))
        for k in z:
            torch.testing.assert_close(moves[r][k], z[k], rtol=0, atol=1e-12)
        assert rows[r]["clients_reported"] == 0 and "train_loss" not in rows[r] and rows[r]["update_norm"] > 0
    assert loop.server.summary()["noise_multipliers"] == [[1.0, rounds]] and loop.server.rounds == rounds
    assert _pair_epsilon(q, 1.0, 30, rounds, 1e-3, empty_released=False) > 0.7 > eps  # what leaving them would need


def test_poisson_sampling_refuses_what_it_makes_private():
    with pytest.raises(ConfigError, match="needs `privacy.accountant: pld`"):
        _private(sampling="poisson", relation="replace_one")
    with pytest.raises(ConfigError, match="`privacy.denominator: actual` divides by how many"):
        _private(sampling="poisson", denominator="actual")
    with pytest.raises(ConfigError, match="`privacy.placement: distributed` with Poisson"):
        _private(sampling="poisson", placement="distributed")


def test_a_poisson_round_of_any_size_trains_and_resumes_bit_for_bit(tmp_path):
    """q = 3/4 over 4 clients and 6 rounds: the rounds hold different numbers of clients (each one the seeded
    Poisson sample); the run checkpointed after 3 rounds and resumed equals the unbroken run bit for bit, ε too."""
    def run():
        return _loop(_private(sampling="poisson", accountant="pld", adaptive=True, count_noise=2.0, rounds=6),
                     rounds=6, sampling="poisson")

    full = run()
    rows = [full.run_round(r) for r in range(6)]
    sizes = [len(poisson_clients(4, 0.75, 0, r)) for r in range(6)]
    assert len(set(sizes)) > 1 and [r.get("num_clients", None) or len(full.plan(i).info.sampled)
                                    for i, r in enumerate(rows)] == sizes
    part = run()
    for r in range(3):
        part.run_round(r)
    rest = run()
    resume(rest, save_checkpoint(part, tmp_path))
    tail = [rest.run_round(r) for r in range(3, 6)]
    for k in full.x:
        assert torch.equal(rest.x[k], full.x[k]), k
    assert [r["privacy/epsilon"] for r in tail] == [r["privacy/epsilon"] for r in rows[3:]]
    assert rest.server.state_dict()["clip"] == full.server.state_dict()["clip"]


def test_summary_and_console_name_the_convention(tmp_path, capsys):
    from fedlight.config.cli import main

    out = tmp_path / "run"
    assert main(["fit", "--config", TINY, "--out_dir", str(out), "--loop.sampling", "poisson", "--privacy.accountant",
                 "pld", "--privacy.target_epsilon", "8", "--privacy.clip", "0.5", "--privacy.delta", "1e-3"]) == 0
    err = capsys.readouterr().err
    assert "after 2 rounds of 4 of 6 clients (PLD, poisson sampling, add/remove)" in err
    summary = json.loads((out / "summary.json").read_text())["privacy"]
    assert summary["epsilon_convention"] == "client level, PLD, poisson sampling, add/remove, δ = 0.001"
    sigma = summary["noise_multiplier"]
    assert summary["epsilon"] == pytest.approx(reference([(sigma, 2)], 6, 4, 1e-3, "poisson", "add_remove", "pld"),
                                               rel=1e-9)
    assert summary["epsilon"] == pytest.approx(8.0, abs=2e-3)


def test_poisson_sampling_is_a_loop_option_without_privacy():
    """q = 1/4 over 4 clients: the rounds train the seeded Poisson sample (round 1: nobody, and the model stays as it
    was; round 6: two clients), whatever the rule."""
    loop = make_loop(fedlight.create("fedavg"), image_clients(), tiny_cnn(), rounds=6, clients_per_round=1,
                     local_steps=2, lr=0.05, precision="32-true", batch_size=4, sampling="poisson")
    x0 = {k: v.clone() for k, v in loop.x.items()}
    for r in range(6):
        assert list(loop.plan(r).info.sampled) == poisson_clients(4, 0.25, 0, r)
        loop.run_round(r)
        if r == 0:
            assert all(torch.equal(loop.x[k], x0[k]) for k in x0)  # an empty round leaves the model as it was
    assert loop.state.rounds_done == 6 and not all(torch.equal(loop.x[k], x0[k]) for k in x0)

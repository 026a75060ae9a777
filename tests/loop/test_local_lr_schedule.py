"""``loop.local_lr_schedule``: the in-round lr the loop gives every rule (the FedAdamW paper's "cosine decay ...
over the 50 local steps per round", Appendix C), and FedAdamW's numbers unchanged by moving it into the loop."""

import math
from pathlib import Path

import pytest
import torch
import yaml
from fedtest import linear_model, make_loop, problem, run_rounds

import fedlight
from fedlight.algorithms import FedAdamW
from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import LocalContext
from fedlight.core.schedule import InRoundLR
from fedlight.core.spec import build
from fedlight.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
K, LR = 5, 0.05


def cosine(lr, k, steps, eta_min=0.0):  # the documented formula, written out here
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * k / steps)) / 2


def test_local_lr_is_the_documented_formula():
    cfg = LoopConfig(lr=0.1, local_lr_schedule="cosine", local_lr_eta_min=0.01)
    assert [cfg.local_lr(0.1, k, 4) for k in range(4)] == pytest.approx([cosine(0.1, k, 4, 0.01) for k in range(4)],
                                                                        rel=1e-15)
    assert cfg.local_lr(0.1, 0, 4) == 0.1 and cfg.local_lr(0.1, 2, 4) == pytest.approx(0.055, rel=1e-15)
    assert LoopConfig(lr=0.1).local_lr(0.07, 3, 4) == 0.07  # constant: η_k = η_r


@pytest.mark.parametrize("kw, match", [({"local_lr_schedule": "linear"}, "loop.local_lr_schedule"),
                                       ({"local_lr_eta_min": 0.1}, "loop.local_lr_eta_min"),
                                       ({"local_lr_eta_min": -1e-3}, "loop.local_lr_eta_min")])
def test_bad_local_schedule_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        LoopConfig(lr=0.1, **kw)


def table_rules():
    """Every row's rule of Tables 2 and 3, built from the spec (the FedAdamW row is the base recipe's rule)."""
    out = []
    for table in ("fedadamw_table2", "fedadamw_table3"):
        spec = yaml.safe_load((ROOT / "recipes" / "tables" / f"{table}.yaml").read_text())
        for row, ov in spec["rows"].items():
            out.append(pytest.param((ov or {}).get("algorithm", {"class_path": "fedlight.algorithms.FedAdamW"}),
                                    id=f"{table}-{row}"))
    return out


@pytest.mark.parametrize("algorithm", table_rules())
def test_every_table_row_runs_the_in_round_cosine(algorithm, monkeypatch):
    """The lr each local step is taken with (read from the optimizer at the step) is the formula's η_k, every rule."""
    seen = []
    apply = LocalContext.apply

    def spy(self, *a, **kw):
        seen.append((self.step_index, self.num_steps, self.optimizer.param_groups[0]["lr"]))
        return apply(self, *a, **kw)

    monkeypatch.setattr(LocalContext, "apply", spy)
    clients, theta = problem()
    loop = make_loop(build(algorithm), clients, linear_model(theta), local_steps=K, lr=LR, rounds=1,
                     local_lr_schedule="cosine")
    run_rounds(loop, 1)
    assert len(seen) == 3 * K  # 3 clients × K steps
    assert [lr for *_, lr in seen] == [cosine(LR, k, n) for k, n, _ in seen]
    assert seen[1][2] < LR == seen[0][2]


def test_fedadamw_numbers_are_bitwise_those_of_its_former_own_cosine():
    """``loop.local_lr_schedule: cosine`` gives FedAdamW exactly the numbers of its former ``local_schedule: cosine``
    (its client wrapped in InRoundLR with ½η_r(1 + cos(πk/K))); Δ_G still divides by K·η_r (line 18)."""
    clients, theta = problem()
    new = make_loop(FedAdamW(), clients, linear_model(theta), local_steps=K, lr=LR, rounds=3,
                    local_lr_schedule="cosine", max_grad_norm=0.3)
    old_rule = FedAdamW()
    old_rule.local = InRoundLR(old_rule.local, lambda lr, k, n: 0.5 * lr * (1.0 + math.cos(math.pi * k / n)))
    old = make_loop(old_rule, clients, linear_model(theta), local_steps=K, lr=LR, rounds=3, max_grad_norm=0.3)
    run_rounds(new, 3)
    run_rounds(old, 3)
    for k in old.x:
        assert torch.equal(new.x[k], old.x[k]) and torch.equal(new.server.delta_G[k], old.server.delta_G[k])
    flat = make_loop(FedAdamW(), clients, linear_model(theta), local_steps=K, lr=LR, rounds=3, max_grad_norm=0.3)
    run_rounds(flat, 3)
    assert not torch.equal(flat.x["weight"], new.x["weight"])  # the schedule does act


def test_a_rule_with_its_own_in_round_lr_is_refused():
    clients, theta = problem()
    with pytest.raises(ConfigError, match="loop.local_lr_schedule"):
        make_loop(fedlight.create("fedswa", rho=0.5), clients, linear_model(theta), local_lr_schedule="cosine")

"""``loop.optimizer``: a class path plus init arguments, checked against the class before training."""

import pytest
import torch

from fedlight.core.loop_config import LoopConfig
from fedlight.errors import ConfigError


@pytest.mark.parametrize("kw, match", [
    ({"optimizer": "torch.nn.Linear"}, "not an importable torch.optim.Optimizer"),
    ({"optimizer": "torch.optim.Adam", "momentum": 0.5}, "loop.momentum.*not an argument"),
    ({"optimizer_args": {"betaz": 1}}, r"\['betaz'\]"),
    ({"optimizer_args": {"lr": 1.0}}, r"\['lr'\].*loop.lr"),
    ({"optimizer_args": {"weight_decay": 0.1}}, r"\['weight_decay'\].*loop.weight_decay"),
])
def test_bad_optimizer_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        LoopConfig(**kw)


def test_factory_builds_the_class_with_its_arguments():
    p = [torch.nn.Parameter(torch.zeros(2))]
    sgd = LoopConfig(momentum=0.9, weight_decay=0.01).optimizer_factory()(p, lr=0.5)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 0.5
    adamw = LoopConfig(optimizer="torch.optim.AdamW", optimizer_args={"betas": (0.8, 0.9)}).optimizer_factory()(p, lr=1)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.8, 0.9)
    assert "momentum" not in adamw.defaults and adamw.defaults["weight_decay"] == 1e-3

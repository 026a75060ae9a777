"""Swin/ViT fine-tuning path: Hub weights (mocked, never downloaded), the offline error, device resize +
RandAugment in a CIFAR-100 module, and one round of ``fedlight.fit`` with a tiny Swin through all of it."""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from fedtest import waited_on_probes_only

import fedlight
from fedlight import models
from fedlight.config import cli
from fedlight.core.loop_config import LoopConfig
from fedlight.core.sampling import client_generator
from fedlight.data import CIFAR100, Dirichlet, RandAugment
from fedlight.data.augment import resize
from fedlight.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
VIT = {"img_size": 32, "kwargs": {"patch_size": 4, "depth": 1}}
SWIN = {"img_size": 64, "kwargs": {"patch_size": 8, "window_size": 4, "depths": (1, 1), "num_heads": (1, 2),
                                   "embed_dim": 16}}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """The Hub is unreachable and its cache empty: HF_HUB_OFFLINE=1 with a fresh cache folder."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_pretrained_offline_is_one_config_error_naming_the_checkpoint_fix(offline):
    with pytest.raises(ConfigError) as e:
        models.Timm("vit_tiny_patch16_224.augreg_in21k", num_classes=10, pretrained=True, **VIT)
    msg = str(e.value)
    assert "`model.pretrained: true`" in msg and "HF_HUB_OFFLINE" in msg
    assert "`model.init_args.checkpoint`" in msg and "timm/vit_tiny_patch16_224.augreg_in21k" in msg


def test_pretrained_offline_exits_2_before_round_1(offline, tmp_path, capsys):
    cfg = tmp_path / "swin.yaml"
    cfg.write_text("model:\n  class_path: fedlight.models.Timm\n  init_args: {name: vit_tiny_patch16_224.augreg_in21k,"
                   " pretrained: true, num_classes: 10, img_size: 32, kwargs: {patch_size: 4, depth: 1}}\n")
    out = tmp_path / "run"
    code = cli.main(["fit", "--config", str(ROOT / "tests/configs/tiny.yaml"), "--config", str(cfg),
                     "--out_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert "model.init_args.checkpoint" in err and not (out / "metrics.jsonl").exists()


def test_pretrained_unknown_weights_name_the_choices():
    with pytest.raises(ConfigError, match="`model.pretrained`.*augreg_in21k"):
        models.Timm("vit_tiny_patch16_224.no_such_tag", pretrained=True, **VIT)


def test_pretrained_loads_hub_weights_and_replaces_the_head(monkeypatch):
    source = timm.create_model("vit_tiny_patch16_224", num_classes=21843, img_size=32, patch_size=4, depth=1)
    asked = []

    def fake_hub(model_id, filename=None, **kw):  # what timm fetches from the Hub, without the network
        asked.append(model_id)
        return {k: v.clone() for k, v in source.state_dict().items()}

    monkeypatch.setattr(timm.models._builder, "load_state_dict_from_hf", fake_hub)
    monkeypatch.setattr("fedlight.models.hub.reachable", lambda timeout=3.0: True)  # as if the Hub answered
    model = models.Timm("vit_tiny_patch16_224.augreg_in21k", num_classes=10, pretrained=True, **VIT)
    assert asked == ["timm/vit_tiny_patch16_224.augreg_in21k"]
    assert torch.equal(model.model.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    assert torch.equal(model.model.pos_embed, source.pos_embed) and model.model.head.weight.shape == (10, 192)


def test_local_checkpoint_wins_over_pretrained_and_safetensors_load(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    source = models.Timm("vit_tiny_patch16_224", num_classes=10, **VIT)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.model.state_dict().items()}, str(path))
    monkeypatch.setattr(timm.models._builder, "load_state_dict_from_hf", lambda *a, **k: pytest.fail("fetched"))
    loaded = models.Timm("vit_tiny_patch16_224.augreg_in21k", num_classes=10, pretrained=True, checkpoint=str(path),
                         **VIT)
    for k, v in source.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k


# ---------------------------------------------------------------------------------------------- data + fit
def fake_cifar100(root: Path, n_train=96, n_test=16):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("test", n_test)):
        data = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "fine_labels": list(np.arange(n) % 10)}
        with open(folder / name, "wb") as f:
            pickle.dump(data, f)


def cifar(root, **kw):
    return CIFAR100(root=str(root), num_clients=4, batch_size=8, partition=Dirichlet(0.5), resize=64,
                    randaugment=RandAugment(), eval_batch_size=8, **kw)


def test_resized_randaugmented_batches_are_seeded_per_client(tmp_path):
    fake_cifar100(tmp_path)
    data = cifar(tmp_path)
    data.setup("cpu", seed=0)
    assert data.input_shape == (3, 64, 64) and data.augmentation.steps[0].pad == 8  # 4 px at 32 -> 8 at 64

    def batches(r, c):
        return [x for x, _ in data.client_batches(c, 3, client_generator(0, r, c))]

    a, b = batches(1, 2), batches(1, 2)
    assert all(x.shape == (8, 3, 64, 64) and x.dtype == torch.float32 for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # same (seed, round, client): same images
    assert not torch.equal(batches(2, 2)[0], a[0]) and not torch.equal(batches(1, 3)[0], a[0])
    x, _ = next(data.test_batches())  # the test set is resized, never augmented
    plain = CIFAR100(root=str(tmp_path), num_clients=4, batch_size=8, eval_batch_size=8)
    plain.setup("cpu", seed=0)
    assert x.shape == (8, 3, 64, 64) and torch.equal(x, plain.to_input(resize(plain._test_x[:8], 64)))
    lo, hi = plain.to_input(torch.zeros(1, 3, 1, 1)), plain.to_input(torch.full((1, 3, 1, 1), 255.0))
    assert (a[0] >= lo - 1e-5).all() and (a[0] <= hi + 1e-5).all()


def test_one_round_of_fit_with_a_tiny_swin_at_the_resized_size(tmp_path):
    fake_cifar100(tmp_path)
    torch.manual_seed(0)
    model = models.Timm("swin_tiny_patch4_window7_224", num_classes=100, **SWIN)
    algo = fedlight.algorithms.FedAdamW(blocks="hessian", head_dim=16)
    loop = LoopConfig(rounds=1, clients_per_round=2, local_steps=2, lr=1e-4, local_lr_schedule="cosine",
                      progress=False)
    fedlight.fit(model, cifar(tmp_path), algo, loop=loop, seed=0, out_dir=str(tmp_path / "run"))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["round"] == 1 and np.isfinite(row["train_loss"]) and 0 <= row["test_acc"] <= 1


def test_drop_path_counts_as_dropout_for_the_runner_choice():
    from fedlight.runners import _drops

    def swin(rate):
        return models.Timm("swin_tiny_patch4_window7_224", num_classes=10, img_size=64,
                           kwargs={**SWIN["kwargs"], "drop_path_rate": rate})

    assert any(_drops(m) for m in swin(0.2).modules())  # timm's Swin default is 0.1 as well
    assert not any(_drops(m) for m in swin(0.0).modules())


# ------------------------------------------------------------------------------------- the checkpoint's preprocessing
def vit_with_weights(tmp_path, num_classes=10, **kw):
    """A ViT-Tiny in21k model built from a local weights file (its pretrained_cfg is timm's, offline)."""
    path = tmp_path / "vit.pth"
    if not path.exists():
        torch.save(models.Timm("vit_tiny_patch16_224", num_classes=10, **VIT).model.state_dict(), path)
    return models.Timm("vit_tiny_patch16_224.augreg_in21k", num_classes=num_classes, checkpoint=str(path), **VIT, **kw)


def normalised(data, value):
    return data.to_input(torch.full((1, 3, 1, 1), float(value))).flatten().tolist()


def test_pretrained_models_default_to_their_checkpoints_normalisation(tmp_path, capsys):
    from fedlight.data.augment import adopt_preprocessing

    fake_cifar100(tmp_path)
    want = timm.models.get_pretrained_cfg("vit_tiny_patch16_224.augreg_in21k")  # mean = std = 0.5, bicubic
    data = cifar(tmp_path)
    line = adopt_preprocessing(vit_with_weights(tmp_path), data)
    data.setup("cpu", seed=0)
    assert data.mean == want.mean and data.std == want.std and data.interpolation == want.interpolation == "bicubic"
    assert normalised(data, 0) == pytest.approx([(0 - m) / s for m, s in zip(want.mean, want.std)])  # (0 − .5)/.5
    assert normalised(data, 255) == pytest.approx([1.0, 1.0, 1.0])
    assert "pretrained_cfg" in line and "bicubic" in line
    x, _ = next(iter(data.test_batches()))
    ref = data.to_input(resize(data._test_x[:8], 64, "bicubic"))
    assert torch.equal(x, ref) and not torch.equal(x, data.to_input(resize(data._test_x[:8], 64)))


@pytest.mark.parametrize("kw, mean, mode", [
    ({"preprocessing": "dataset"}, CIFAR100.mean, "bilinear"),
    ({"interpolation": "bilinear"}, (0.5, 0.5, 0.5), "bilinear"),  # the paper's resize, the checkpoint's statistics
    ({"preprocessing": "dataset", "interpolation": "bicubic"}, CIFAR100.mean, "bicubic"),
])
def test_a_recipe_may_override_the_checkpoints_preprocessing(tmp_path, kw, mean, mode):
    from fedlight.data.augment import adopt_preprocessing

    fake_cifar100(tmp_path)
    data = cifar(tmp_path)
    adopt_preprocessing(vit_with_weights(tmp_path, **kw), data)
    assert data.mean == mean and data.interpolation == mode


def test_random_models_keep_the_datasets_preprocessing(tmp_path):
    from fedlight.data.augment import adopt_preprocessing

    data = cifar(tmp_path)
    assert adopt_preprocessing(models.Timm("vit_tiny_patch16_224.augreg_in21k", num_classes=10, **VIT), data) is None
    assert data.mean == CIFAR100.mean and data.interpolation == "bilinear"


def test_the_run_header_says_which_preprocessing(tmp_path, capsys):
    fake_cifar100(tmp_path)
    loop = LoopConfig(rounds=1, clients_per_round=2, local_steps=1, lr=1e-4, progress=False)
    data = CIFAR100(root=str(tmp_path), num_clients=4, batch_size=8, partition=Dirichlet(0.5), eval_batch_size=8)
    fedlight.fit(vit_with_weights(tmp_path, num_classes=100), data, fedlight.create("fedavg"), loop=loop,
                 out_dir=str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert ("fedlight: inputs normalised with mean (0.5, 0.5, 0.5), std (0.5, 0.5, 0.5), resize interpolation "
            "bicubic: from vit_tiny_patch16_224.augreg_in21k's pretrained_cfg (model.init_args.preprocessing: "
            "checkpoint)") in out


# -------------------------------------------------------------------------------------------- no network: fast
@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE unset, every proxy pointed at a closed local port, an empty Hub cache."""
    from huggingface_hub import constants

    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("HF_HUB_OFFLINE", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return Path(constants.HF_HUB_CACHE)


def test_pretrained_without_network_fails_after_the_probe_alone_naming_hf_download(no_network, network_waits):
    with pytest.raises(ConfigError) as e:
        models.Timm("vit_tiny_patch16_224.augreg_in21k", num_classes=10, pretrained=True, **VIT)
    assert waited_on_probes_only(network_waits), network_waits  # no download tried, no retry: fast on any load
    msg = str(e.value)
    assert "cannot be reached within 3 s" in msg and "`model.init_args.checkpoint`" in msg
    assert "`hf download timm/vit_tiny_patch16_224.augreg_in21k model.safetensors --local-dir DIR`" in msg


def test_pretrained_without_network_reads_the_hub_cache(no_network):
    from safetensors.torch import save_file

    source = timm.create_model("vit_tiny_patch16_224", num_classes=21843, img_size=32, patch_size=4, depth=1)
    repo = no_network / "models--timm--vit_tiny_patch16_224.augreg_in21k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()},
              str(repo / "snapshots" / "abc123" / "model.safetensors"))
    model = models.Timm("vit_tiny_patch16_224.augreg_in21k", num_classes=10, pretrained=True, **VIT)
    assert torch.equal(model.model.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)

"""Shapes, parameter counts, normalization buffers, argument errors and checkpoint loading of fedlight.models."""

import inspect

import pytest
import torch
from torch import nn

import fedlight.models as models
from fedlight.errors import ConfigError
from fedlight.models import MLP, VGG11, LeNet5, ResNet18, ResNet34, ResNet50, SmallCNN


def n_params(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def conv(c_in: int, c_out: int, k: int) -> int:  # bias-free conv
    return c_in * c_out * k * k


def fc(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


@pytest.mark.parametrize(
    "make, shape, classes",
    [
        (lambda: MLP(), (2, 1, 28, 28), 10),
        (lambda: LeNet5(), (2, 3, 32, 32), 10),
        (lambda: LeNet5(in_channels=1, num_classes=7, input_size=28), (2, 1, 28, 28), 7),
        (lambda: VGG11(), (2, 3, 32, 32), 10),
        (lambda: VGG11(num_classes=100), (2, 3, 32, 32), 100),
        (lambda: SmallCNN(), (2, 1, 28, 28), 10),
        (lambda: SmallCNN(in_channels=3, norm="group"), (2, 3, 32, 32), 10),
        (lambda: SmallCNN(norm="none"), (2, 1, 5, 7), 10),
        (lambda: ResNet18(num_classes=100), (2, 3, 32, 32), 100),
        (lambda: ResNet18(norm="batch", in_channels=1), (2, 1, 28, 28), 10),
        (lambda: ResNet34(), (2, 3, 32, 32), 10),
        (lambda: ResNet50(norm="batch"), (2, 3, 32, 32), 10),
        (lambda: models.ViTTiny(), (2, 3, 32, 32), 100),
        (lambda: models.ViTTiny(num_classes=200, img_size=64, depth=1), (2, 3, 64, 64), 200),
    ],
)
def test_output_shape(make, shape, classes):
    model = make()
    assert model(torch.randn(shape)).shape == (shape[0], classes)


def test_param_counts():
    # FedAvg's 2NN: 784-200-200-10.
    assert n_params(MLP()) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10 == 199_210
    # LeNet-5 on CIFAR: 32 -conv5-> 28 -pool-> 14 -conv5-> 10 -pool-> 5, so FC input 64·5·5 = 1600.
    lenet = (3 * 64 * 25 + 64) + (64 * 64 * 25 + 64) + fc(1600, 384) + fc(384, 192) + fc(192, 10)
    assert n_params(LeNet5()) == lenet == 797_962
    # On 28×28: 28 -> 24 -> 12 -> 8 -> 4, so FC input 64·4·4 = 1024.
    assert n_params(LeNet5(in_channels=1, input_size=28)) == lenet - 2 * 64 * 25 - (1600 - 1024) * 384


def test_resnet18_param_count():
    # ResNet-18, 100 classes. Convs have no bias; every norm (GN or BN) has 2·C affine parameters.
    def norm(c):
        return 2 * c

    def basic_block(c_in, c_out):  # two 3×3 convs + two norms, plus a 1×1 conv + norm shortcut when shape changes
        shortcut = conv(c_in, c_out, 1) + norm(c_out) if c_in != c_out else 0
        return conv(c_in, c_out, 3) + norm(c_out) + conv(c_out, c_out, 3) + norm(c_out) + shortcut

    stem = conv(3, 64, 3) + norm(64)  # 1,856
    stages = sum(
        basic_block(c_in, c_out) + basic_block(c_out, c_out)
        for c_in, c_out in [(64, 64), (64, 128), (128, 256), (256, 512)]
    )  # 147,968 + 525,568 + ...
    expected = stem + stages + fc(512, 100)  # head 51,300
    assert expected == 11_220_132  # ≈ 11.2M, as in the FedNSAM/FedSWA papers' ResNet-18 on CIFAR-100
    assert n_params(ResNet18(num_classes=100)) == expected
    assert n_params(ResNet18(num_classes=100, norm="batch")) == expected


@pytest.mark.parametrize("cls", [ResNet18, ResNet50])
def test_resnet_norm_buffers(cls):
    bn, gn = cls(norm="batch"), cls(norm="group", group_norm_groups=4)
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn.modules())
    assert any(k.endswith("running_mean") for k, _ in bn.named_buffers())
    assert list(gn.buffers()) == []
    groups = {m.num_groups for m in gn.modules() if isinstance(m, nn.GroupNorm)}
    assert groups == {4}
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())


def test_smallcnn_norm_buffers():
    assert any(k.endswith("running_var") for k, _ in SmallCNN(norm="batch").named_buffers())
    assert list(SmallCNN(norm="group").buffers()) == []
    assert n_params(SmallCNN()) < 5_000


def test_vgg11_head_follows_class_count():
    assert VGG11(num_classes=10).classifier[0].out_features == 100
    assert VGG11(num_classes=100).classifier[0].out_features == 256
    assert not any(isinstance(m, nn.BatchNorm2d) for m in VGG11().modules())


def test_vit_tiny_config():
    vit = models.ViTTiny()
    assert len(vit.blocks) == 6 and vit.embed_dim == 192 and vit.patch_embed.num_patches == 64
    assert vit.blocks[0].attn.qkv.bias is not None and vit.norm.eps == 1e-6 and vit.global_pool == "token"


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: ResNet18(norm="layer"), "model.norm"),
        (lambda: ResNet18(group_norm_groups=3), "model.group_norm_groups"),
        (lambda: ResNet34(num_classes=0), "model.num_classes"),
        (lambda: SmallCNN(norm="batchnorm"), "model.norm"),
        (lambda: SmallCNN(width=0), "model.width"),
        (lambda: MLP(hidden=[200, -1]), "model.hidden"),
        (lambda: LeNet5(input_size=8), "model.input_size"),
        (lambda: VGG11(in_channels=0), "model.in_channels"),
        (lambda: models.ViTTiny(img_size=30), "model.img_size"),
        (lambda: models.ViTTiny(embed_dim=100), "model.embed_dim"),
        (lambda: models.ViTTiny(drop_rate=1.5), "model.drop_rate"),
        (lambda: models.Timm("swin_tiny_patch4_window7"), "model.name"),
        (lambda: models.LoRA(rank=0), "model.init_args.lora.rank"),
        (lambda: models.Timm("resnet18", num_classes=2, img_size=32), "model.img_size"),
    ],
)
def test_bad_args_raise_config_error(make, arg):
    with pytest.raises(ConfigError, match=f"`{arg}`"):
        make()


def test_unknown_timm_name_suggests_close_matches():
    with pytest.raises(ConfigError, match="swin_tiny_patch4_window7_224"):
        models.Timm("swin_tiny_patch4_window7")


def tiny_vit(**kw):
    return models.Timm("vit_tiny_patch16_224", img_size=32, kwargs={"patch_size": 4, "depth": 2}, **kw)


def test_timm_checkpoint_round_trip(tmp_path):
    source = tiny_vit(num_classes=10)
    path = tmp_path / "w.pt"
    torch.save(source.model.state_dict(), path)
    loaded = tiny_vit(num_classes=10, checkpoint=str(path))
    for k, v in source.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(source.eval()(x), loaded.eval()(x))

    # {"model": state_dict} from a training script, keys of the wrapper ("model." prefix), different head size.
    torch.save({"model": source.state_dict(), "epoch": 3}, path)
    with pytest.warns(UserWarning, match="classifier head"):
        other = tiny_vit(num_classes=5, checkpoint=str(path))
    assert torch.equal(other.model.blocks[1].mlp.fc2.weight, source.model.blocks[1].mlp.fc2.weight)
    assert other(x).shape == (2, 5)


def test_timm_checkpoint_errors(tmp_path):
    with pytest.raises(ConfigError, match="`model.checkpoint`"):
        tiny_vit(checkpoint=str(tmp_path / "missing.pt"))
    torch.save({"blocks.0.norm1.weight": torch.ones(192)}, tmp_path / "partial.pt")
    with pytest.raises(ConfigError, match="`model.checkpoint`.*lacks"):
        tiny_vit(checkpoint=str(tmp_path / "partial.pt"))


@pytest.mark.parametrize(
    "name",
    [
        "swin_tiny_patch4_window7_224",
        "swin_small_patch4_window7_224",
        "swin_base_patch4_window7_224",
        "vit_base_patch16_224",
    ],
)
def test_large_timm_models_construct(name):
    # Swin-T is built for real; the larger ones on the meta device (no memory, no init cost), where a forward
    # still checks every shape.
    device = torch.device("cpu" if name.startswith("swin_tiny") else "meta")
    with device:
        model = models.Timm(name, num_classes=100)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224, device=device)).shape == (1, 100)


def test_lora_freezes_all_but_adapters_and_head():
    pytest.importorskip("peft")
    full = tiny_vit(num_classes=10)
    lora = tiny_vit(num_classes=10, lora=models.LoRA(rank=4, alpha=8.0))
    trainable = {k for k, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in k or k.startswith("model.head.") for k in trainable)
    # 2 blocks × (qkv: 4·(192 + 576) + proj: 4·(192 + 192)) + head 192·10 + 10
    assert n_params(lora, trainable_only=True) == 2 * (4 * (192 + 576) + 4 * (192 + 192)) + 1930 == 11_146
    assert n_params(lora, trainable_only=True) < n_params(full) / 50
    out = lora(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is None for p in lora.parameters() if not p.requires_grad)
    with pytest.raises(ConfigError, match="`model.init_args.lora.target_modules`"):
        tiny_vit(lora=models.LoRA(target_modules=["no_such_layer"]))


def test_registry_and_documented_args():
    assert set(models.MODELS) <= set(models.__all__)
    for name in models.MODELS:
        cls = getattr(models, name)
        assert isinstance(cls, type) and issubclass(cls, nn.Module)
        doc = inspect.getdoc(cls)
        assert "Args:" in doc, name
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            assert p.annotation is not inspect.Parameter.empty, (name, p.name)
            assert f"    {p.name}:" in doc, (name, p.name)
            assert p.default is not inspect.Parameter.empty or (name, p.name) == ("Timm", "name")


def test_jsonargparse_builds_models_from_config():
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--model", type=nn.Module)
    cfg = parser.parse_object(
        {"model": {"class_path": "fedlight.models.ResNet18", "init_args": {"num_classes": 100, "norm": "batch"}}}
    )
    model = parser.instantiate(cfg).model
    assert isinstance(model, ResNet18) and model.linear.out_features == 100
    cfg = parser.parse_object(
        {
            "model": {
                "class_path": "fedlight.models.Timm",
                "init_args": {
                    "name": "vit_tiny_patch16_224",
                    "num_classes": 3,
                    "img_size": 32,
                    "kwargs": {"patch_size": 4, "depth": 1},
                    "lora": {"rank": 2},
                },
            }
        }
    )
    assert cfg.model.init_args.lora.rank == 2 and cfg.model.init_args.lora.target_modules is None  # the family's
    pytest.importorskip("peft")
    model = parser.instantiate(cfg).model
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    adapted = {n.split(".lora_")[0] for n, _ in model.named_parameters() if ".lora_" in n}
    assert adapted == {"model.blocks.0.attn.qkv", "model.blocks.0.attn.proj"}  # timm default: attn.qkv, attn.proj

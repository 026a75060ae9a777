"""Models: plain ``nn.Module`` classes that know nothing of federated learning.

A recipe names one as ``model: {class_path: fedlight.models.ResNet18, init_args: {...}}``. The timm-based models
(``ViTTiny``, ``Timm``) and the Hugging Face wrappers (``HFSequenceClassifier``, ``HFCausalLM``; the ``nlp`` extra),
which share one ``LoRA`` configuration (``HFLoRA`` is its former name), are imported on first use, so importing this
package imports neither timm nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedlight.models.cnn import MLP, VGG11, LeNet5, SmallCNN
from fedlight.models.gpt import TinyGPT
from fedlight.models.resnet import ResNet, ResNet18, ResNet34, ResNet50

if TYPE_CHECKING:
    from fedlight.models.adapters import LoRA
    from fedlight.models.hf import HFCausalLM, HFLoRA, HFSequenceClassifier
    from fedlight.models.timm import Timm
    from fedlight.models.vit import ViTTiny

MODELS: tuple[str, ...] = (
    "MLP",
    "LeNet5",
    "VGG11",
    "SmallCNN",
    "ResNet18",
    "ResNet34",
    "ResNet50",
    "ViTTiny",
    "Timm",
    "TinyGPT",
    "HFSequenceClassifier",
    "HFCausalLM",
)
"""Names of the models a recipe can use (``fedlight ls``)."""

_LAZY = {"ViTTiny": "fedlight.models.vit", "Timm": "fedlight.models.timm", "LoRA": "fedlight.models.adapters",
         **dict.fromkeys(("HFSequenceClassifier", "HFCausalLM", "HFLoRA"), "fedlight.models.hf")}

__all__ = [
    "MODELS",
    "HFCausalLM",
    "HFLoRA",
    "HFSequenceClassifier",
    "LoRA",
    "LeNet5",
    "MLP",
    "ResNet",
    "ResNet18",
    "ResNet34",
    "ResNet50",
    "SmallCNN",
    "Timm",
    "TinyGPT",
    "VGG11",
    "ViTTiny",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The tensor-dict helpers under their short path: ``from fedlight import params as P`` is
``from fedlight.core import params as P``. The definitions live in :mod:`fedlight.core.params`."""

from fedlight.core.params import (
    Params,
    add,
    add_,
    clone,
    copy_,
    cosine,
    dot,
    flatten,
    float_buffers,
    in_stacked,
    is_finite,
    joint_clip_,
    lincomb,
    nbytes,
    norm,
    numel,
    scale,
    scale_,
    sqnorm,
    stacked,
    sub,
    trainable,
    unflatten,
    unit,
    zeros_like,
)

__all__ = ["Params", "add", "add_", "clone", "copy_", "cosine", "dot", "flatten", "float_buffers", "in_stacked",
           "is_finite", "joint_clip_", "lincomb", "nbytes", "norm", "numel", "scale", "scale_", "sqnorm", "stacked",
           "sub", "trainable", "unflatten", "unit", "zeros_like"]

"""GPU-path switches that must not change the math: channels-last memory format and torch.compile."""

import torch
from fedtest import image_clients, make_loop, tiny_cnn

import fedlight


def _two_rounds(**kw):
    loop = make_loop(fedlight.create("fedsam"), image_clients(), tiny_cnn(), precision="32-true", batch_size=4,
                     local_steps=3, clients_per_round=3, max_grad_norm=10.0, weight_decay=1e-3, **kw)
    for r in range(2):
        loop.run_round(r)
    return loop


def test_channels_last_changes_layout_not_results():
    ref = _two_rounds()
    cl = _two_rounds(channels_last=True)
    conv = [m for m in cl.model.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1][0]
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()  # really NHWC, not a 1x1 corner case
    x, _ = next(cl.data.client_batches(0, 1, torch.Generator().manual_seed(0)))
    assert x.is_contiguous(memory_format=torch.channels_last)  # 1 channel: NHWC and NCHW strides coincide
    for k in ref.x:
        torch.testing.assert_close(cl.x[k], ref.x[k], rtol=0, atol=1e-6, msg=k)


def test_compiled_model_trains_like_the_eager_one():
    ref = _two_rounds()
    comp = _two_rounds(compile="eager")  # dynamo graph capture without code generation: fast enough for CI
    assert comp.model._compiled_call_impl is not None
    for k in ref.x:
        torch.testing.assert_close(comp.x[k], ref.x[k], rtol=0, atol=1e-6, msg=k)


def test_compile_with_vmap_compiles_the_stacked_loss():
    """Once refused; now the stacked runner's loss is what gets compiled (equality: tests/loop/test_runners.py)."""
    loop = _two_rounds(compile="eager", client_parallelism="vmap")
    assert loop.runner.name == "stacked" and loop.runner.forward.compiled
    assert getattr(loop.model, "_compiled_call_impl", None) is None  # the model itself is left alone

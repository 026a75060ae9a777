"""The device data path of stacked clients (fedlight.data.gather): one gather per stacked step gives bitwise the
batches each client draws alone, with and without augmentation, in either memory layout; equal images are copied to
a device once per process; the stacked runner takes that path and trains exactly as before."""

import pytest
import torch
from fedtest import DEVICES

from fedlight.data import device_copy, gather
from fedlight.data.augment import CropFlip
from fedlight.data.base import FederatedDataModule
from fedlight.data.partition import QuantitySkew
from fedlight.runners.stacking import stack_tree


class Images(FederatedDataModule):
    """Random uint8 CIFAR-like images with the CIFAR recipe's normalisation and crop + flip."""

    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    augmentation = CropFlip(pad=2)

    def _load_all(self, train):
        g = torch.Generator().manual_seed(int(train))
        n = 90 if train else 10
        return (torch.randint(0, 256, (n, 3, 6, 6), generator=g, dtype=torch.uint8),
                torch.randint(0, 4, (n,), generator=g))


def data(augment=True, memory_format=torch.contiguous_format, resize_to=None, partition=None, device="cpu"):
    d = Images(num_clients=6, batch_size=4, augment=augment, partition=partition)
    d.memory_format, d.resize_to = memory_format, resize_to
    d.setup(device, seed=3)
    return d


def gen(c):
    return torch.Generator().manual_seed(100 + c)


def one_by_one(d, clients, K):
    return [stack_tree(b, "batch") for b in zip(*(d.client_batches(c, K, gen(c)) for c in clients))]


def gathered(d, clients, K):
    return list(gather.stacked_batches(d, [gather.plan(d, c, K, gen(c)) for c in clients]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("augment", [True, False])
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "resized"])
def test_one_gather_per_step_is_bitwise_the_clients_own_batches(augment, layout, device):
    d = data(augment, torch.channels_last if layout == "channels_last" else torch.contiguous_format,
             8 if layout == "resized" else None, device=device)
    assert gather.supports(d)
    clients, K = [4, 0, 2], 9  # 15 samples a client, batch 4: 4 steps an epoch, so K = 9 takes three epochs
    want, got = one_by_one(d, clients, K), gathered(d, clients, K)
    assert len(got) == len(want) == K
    for (wx, wy), (gx, gy) in zip(want, got):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)
        assert gx.stride() == wx.stride() and gx.dtype == wx.dtype
    # each generator is drawn from exactly as client_batches draws from it: its state afterwards agrees too
    a, b = gen(0), gen(0)
    list(d.client_batches(4, K, a)), gather.plan(d, 4, K, b)
    assert torch.equal(a.get_state(), b.get_state())


def test_clients_of_different_sizes_with_equal_batches():
    d = data(partition=QuantitySkew(1.0))  # 25, 36, 10, 3, 10, 6 samples
    sizes = {c: d.batch_sizes(c, 3) for c in range(6)}
    clients = [c for c in range(6) if sizes[c] == (4, 4, 4)]
    assert len({d.num_samples(c) for c in clients}) > 1, "the check wants clients of different sizes"
    for (wx, wy), (gx, gy) in zip(one_by_one(d, clients, 3), gathered(d, clients, 3)):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)


def test_equal_images_are_copied_to_a_device_once():
    a = torch.randint(0, 256, (5, 3, 4, 4), dtype=torch.uint8)
    on = device_copy.on_device(a, torch.device("meta"))
    assert device_copy.on_device(a.clone(), torch.device("meta")) is on  # another run's load of the same images
    assert device_copy.on_device(a + 1, torch.device("meta")) is not on
    meta = torch.device("meta")
    assert device_copy.on_device(a.float(), meta) is not device_copy.on_device(a.float(), meta)


def test_overriding_data_modules_keep_their_own_batches():
    class Own(Images):
        def client_batches(self, client_id, num_steps, generator):
            yield from super().client_batches(client_id, num_steps, generator)

    assert not gather.supports(Own(num_clients=2))
    assert gather.supports(Images(num_clients=2))

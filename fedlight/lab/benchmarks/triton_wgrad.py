"""The grouped convolution's weight gradient as one Triton kernel (issue 42's third candidate; measured by
``tools/gpu_profile.py --sections wgrad`` against cuDNN's grouped weight-gradient kernel, the costliest kernel of
the stacked round, §6.2 of ``results/performance.md``).

For client ``c`` of a grouped convolution over ``C`` clients, ``dW_c = Gy_c · Cols_c``: ``Gy_c`` the output
gradient (out × N) and ``Cols_c`` the input patches (N × in·kh·kw), N = batch × output pixels. The kernel forms
the patches as it reads them (implicit im2col, zero padding by masks), one program per (client, block of output
channels, block of (input channel, kh, kw)), accumulating in float32 over N. Checked against autograd on a CPU
with ``TRITON_INTERPRET=1`` (``tests/loop/test_route_candidates.py``), which must be set before this module is
imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _wgrad(x_ptr, gy_ptr, dw_ptr, B, CIN, H, W, COUT, HO, WO,
           sb_x, sc_x, sh_x, sw_x, sb_g, sc_g, sh_g, sw_g,
           KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr,
           BO: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    c = tl.program_id(0)
    o = tl.program_id(1) * BO + tl.arange(0, BO)  # client c's output channels
    k = tl.program_id(2) * BK + tl.arange(0, BK)  # (input channel, kh, kw), flattened
    i, kh, kw = k // (KH * KW), (k // KW) % KH, k % KW
    N = B * HO * WO
    acc = tl.full((BO, BK), 0.0, tl.float32)  # (tl.zeros is a jit function of its own: not interpretable late)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        b, ho, wo = n // (HO * WO), (n // WO) % HO, n % WO
        g = tl.load(gy_ptr + b[None, :] * sb_g + (c * COUT + o[:, None]) * sc_g + ho[None, :] * sh_g
                    + wo[None, :] * sw_g, mask=(o[:, None] < COUT) & (n[None, :] < N), other=0.0)  # [BO, BN]
        hi = ho[:, None] * STRIDE - PAD + kh[None, :] * DIL
        wi = wo[:, None] * STRIDE - PAD + kw[None, :] * DIL  # [BN, BK]
        ok = (n[:, None] < N) & (k[None, :] < CIN * KH * KW) & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
        xv = tl.load(x_ptr + b[:, None] * sb_x + (c * CIN + i[None, :]) * sc_x + hi * sh_x + wi * sw_x, mask=ok,
                     other=0.0)
        acc += tl.dot(g, xv.to(g.dtype))
    out = dw_ptr + (c * COUT + o[:, None]) * (CIN * KH * KW) + k[None, :]
    tl.store(out, acc, mask=(o[:, None] < COUT) & (k[None, :] < CIN * KH * KW))


def grouped_wgrad(xg: Tensor, gy: Tensor, clients: int, kernel: int = 3, stride: int = 1, padding: int = 1,
                  dilation: int = 1, blocks: tuple[int, int, int] = (64, 64, 32)) -> Tensor:
    """``∂L/∂w`` (float32, ``[clients·out, in, k, k]``) of ``F.conv2d(xg, w, None, stride, padding, dilation,
    groups=clients)`` given the output gradient ``gy``; ``blocks``: (output channels, patch entries, N) per step."""
    B, cc, H, W = xg.shape
    cin, cout, (ho, wo) = cc // clients, gy.shape[1] // clients, gy.shape[-2:]
    dw = torch.empty(clients * cout, cin, kernel, kernel, device=xg.device, dtype=torch.float32)
    bo, bk, bn = blocks
    grid = (clients, triton.cdiv(cout, bo), triton.cdiv(cin * kernel * kernel, bk))
    _wgrad[grid](xg, gy, dw, B, cin, H, W, cout, ho, wo, *xg.stride(), *gy.stride(), KH=kernel, KW=kernel,
                 STRIDE=stride, PAD=padding, DIL=dilation, BO=bo, BK=bk, BN=bn)
    return dw

"""Spatial attention (CBAM, document 004): the fused channel pooling and sigmoid gate, thin
wrappers over ``torch.ops.attn_ext.channel_pool`` / ``spatial_gate``.

The CBAM spatial gate of a feature map ``x`` (N, C, H, W) is
``x * sigmoid(conv7x7(channel_pool(x)))``: :func:`channel_pool` reads ``x`` once for both pooled
maps, the 7x7 convolution is ATen's, and :func:`spatial_gate` applies the sigmoid and the
broadcast product in one pass (its backward makes one pass too). Both accept NCHW and
channels-last ``x`` without converting it, in float32, float64, bfloat16 and float16.
"""

import torch

from ._ops import ops as _ops

__all__ = ["channel_pool", "spatial_gate"]


def channel_pool(x: torch.Tensor, *, return_argmax: bool = False):
    """``torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)`` in one read of ``x``.

    x: (N, C, H, W), NCHW or channels-last. Returns ``pooled`` (N, 2, H, W) in ``x``'s dtype,
    always channels-last (the layout oneDNN and cuDNN convolve fastest; channel 0 the mean over
    channels, channel 1 the max), and with ``return_argmax=True`` also the
    channel each max came from, (N, 1, H, W) int32. Ties go to the first maximal channel and a
    NaN counts as maximal, as in ``torch.max(x, 1)``; the max's gradient flows to that channel
    alone. Mean and max accumulate in float32 (float64 for float64).
    """
    pooled, argmax = _ops.channel_pool(x)
    return (pooled, argmax) if return_argmax else pooled


def spatial_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(gate)`` with ``gate`` (N, 1, H, W) broadcast over the channels of ``x``
    (N, C, H, W), in one pass; the sigmoid is taken in float32 (float64 for float64) and not
    rounded to ``x``'s dtype before the product. ``gate`` has ``x``'s dtype, or float32 for a
    bfloat16/float16 ``x``. The output has ``x``'s dtype and memory format. Differentiable in
    both arguments (the gate's gradient in the gate's dtype)."""
    return _ops.spatial_gate(x, gate)

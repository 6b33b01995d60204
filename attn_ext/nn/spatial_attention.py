"""CBAM (Woo et al., "CBAM: Convolutional Block Attention Module", ECCV 2018) on attn_ext's
fused spatial kernels.

* :class:`ChannelAttention` -- ``M_c(F) = sigmoid(MLP(AvgPool(F)) + MLP(MaxPool(F)))``, one MLP
  ``C -> C/r -> C`` (ReLU between) shared by both pooled descriptors; returns ``F * M_c(F)``.
* :class:`SpatialAttention` -- ``M_s(F) = sigmoid(conv_kxk([AvgPool_c(F); MaxPool_c(F)]))``;
  returns ``F * M_s(F)``. The channel pooling is :func:`attn_ext.spatial.channel_pool` (one read of
  ``F``), the convolution ATen's (in float32 for bfloat16/float16 inputs), and the sigmoid and
  product one fused pass (:func:`attn_ext.spatial.spatial_gate`); the backward makes one pass
  over ``F`` for the gradients of both the gate and the pooling.
* :class:`CBAM` -- the channel gate, then the spatial gate on its output.

Every module takes NCHW or channels-last input and returns the same memory format.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .._ops import ops as _ops
from ..spatial import channel_pool

__all__ = ["CBAM", "ChannelAttention", "SpatialAttention"]


def _check_map(name: str, x: torch.Tensor, channels=None) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name}: x must be 4-D (N, C, H, W), got {x.dim()}-D {tuple(x.shape)}")
    if channels is not None and x.size(1) != channels:
        raise ValueError(
            f"{name}: x must have {channels} channels (dim 1), got shape {tuple(x.shape)}"
        )


class ChannelAttention(nn.Module):
    """CBAM's channel attention: ``x * sigmoid(mlp(avgpool(x)) + mlp(maxpool(x)))``.

    Args:
        channels: ``C`` of the input.
        reduction_ratio: ``r``; the hidden width is ``max(1, C // r)`` (16 in the paper).
        bias: whether the MLP's two linear layers have biases (the paper's equation has none).

    Parameters: ``mlp`` = ``Sequential(Linear(C, C/r), ReLU, Linear(C/r, C))``.
    """

    def __init__(
        self,
        channels: int,
        reduction_ratio: int = 16,
        *,
        bias: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if channels <= 0 or reduction_ratio <= 0:
            raise ValueError(
                f"ChannelAttention: channels and reduction_ratio must be > 0, "
                f"got channels={channels}, reduction_ratio={reduction_ratio}"
            )
        self.channels = channels
        hidden = max(1, channels // reduction_ratio)
        kw = dict(device=device, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.Linear(channels, hidden, bias=bias, **kw),
            nn.ReLU(),
            nn.Linear(hidden, channels, bias=bias, **kw),
        )

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """``M_c(x)``, (N, C, 1, 1)."""
        _check_map(type(self).__name__, x, self.channels)
        logits = self.mlp(x.mean(dim=(2, 3))) + self.mlp(x.amax(dim=(2, 3)))
        return torch.sigmoid(logits)[:, :, None, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.attention_map(x)


def _conv_dtype(dtype):
    # The 2-channel map is tiny next to x; oneDNN convolves it in float32 several times faster
    # than in bfloat16/float16 on CPUs without native bf16 units, and more accurately.
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class _SpatialGate(torch.autograd.Function):
    """x * sigmoid(conv(channel_pool(x), weight)) with one fused backward pass over x: the gate's
    backward writes grad_x, and the pooling's gradient is added to it in place (instead of a
    second full-size gradient and a sum of the two)."""

    @staticmethod
    def forward(ctx, x, weight, padding):
        pooled, argmax = _ops.channel_pool(x)
        cdt = _conv_dtype(x.dtype)
        pooled, w = pooled.to(cdt), weight.to(cdt)
        logits = F.conv2d(pooled, w, padding=padding)
        ctx.save_for_backward(x, pooled, w, logits, argmax)
        ctx.padding, ctx.weight_dtype = padding, weight.dtype
        return _ops.spatial_gate(x, logits)

    @staticmethod
    def backward(ctx, grad_out):
        x, pooled, w, logits, argmax = ctx.saved_tensors
        grad_x, grad_logits = _ops.spatial_gate_backward(grad_out, x, logits)
        p = ctx.padding
        grad_pooled, grad_w, _ = torch.ops.aten.convolution_backward(
            grad_logits,
            pooled,
            w,
            None,
            [1, 1],
            [p, p],
            [1, 1],
            False,
            [0, 0],
            1,
            [True, ctx.needs_input_grad[1], False],
        )
        _ops.channel_pool_backward_accumulate_(grad_x, grad_pooled.to(x.dtype), argmax)
        return grad_x, (grad_w.to(ctx.weight_dtype) if grad_w is not None else None), None


class SpatialAttention(nn.Module):
    """CBAM's spatial attention: ``x * sigmoid(conv([mean_c(x); max_c(x)]))``.

    Args:
        kernel_size: odd size of the convolution (7 in the paper), padded to keep H x W.

    Parameters: ``conv`` = ``Conv2d(2, 1, kernel_size, padding=kernel_size // 2, bias=False)``;
    its input channel 0 is the channel mean, 1 the channel max.

    ``forward(x)`` returns the gated map (N, C, H, W); :meth:`attention_map` returns the gate
    ``M_s(x)`` (N, 1, H, W) itself (what document 004's class returns, see
    :class:`attn_ext.compat.attention_zoo.SpatialAttention`).
    """

    def __init__(self, kernel_size: int = 7, *, device=None, dtype=None) -> None:
        super().__init__()
        if kernel_size <= 0 or kernel_size % 2 == 0:
            raise ValueError(
                f"SpatialAttention: kernel_size must be odd and positive, got {kernel_size}"
            )
        self.conv = nn.Conv2d(
            2, 1, kernel_size, padding=kernel_size // 2, bias=False, device=device, dtype=dtype
        )

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        _check_map(type(self).__name__, x)
        return torch.sigmoid(self.conv(channel_pool(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_map(type(self).__name__, x)
        return _SpatialGate.apply(x, self.conv.weight, self.conv.padding[0])


class CBAM(nn.Module):
    """Convolutional Block Attention Module: ``F' = M_c(F) * F``, ``F'' = M_s(F') * F'``.

    Args:
        channels, reduction_ratio, bias: of the :class:`ChannelAttention`.
        kernel_size: of the :class:`SpatialAttention`.

    Submodules: ``channel_attention``, ``spatial_attention``.
    """

    def __init__(
        self,
        channels: int,
        reduction_ratio: int = 16,
        kernel_size: int = 7,
        *,
        bias: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.channel_attention = ChannelAttention(
            channels, reduction_ratio, bias=bias, device=device, dtype=dtype
        )
        self.spatial_attention = SpatialAttention(kernel_size, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spatial_attention(self.channel_attention(x))

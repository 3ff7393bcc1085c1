"""Quantized K/V caches read in place: `quantize_kv` and `QuantizedKV`.

The format is MLX's affine quantization per group of `group_size` consecutive elements along the
head dim: x ~= scale * q + bias, q unsigned in [0, 2^bits - 1] rounded to nearest, bias the group's
minimum, scale = (max - min) / (2^bits - 1) (a constant group has scale 0 and is exact). The data
is uint8, (..., D) for 8 bits and (..., D // 2) for 4 bits with element 2i in the low nibble of
byte i; scales and biases are (..., D // group_size) of the original dtype (float16, bfloat16 or
float32). The kernels read all three through their strides and dequantize as they load
(metal/fa_quant.h), never expanding the cache; `dequantize` gives exactly the values they see.
"""

from __future__ import annotations

import torch

from ._options import _DTYPE_CODES, given, type_name

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)


def _check_bits_and_group(bits, group_size, who: str) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"{who}: bits must be 8 or 4, got {given(bits)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"{who}: group_size must be 32, 64 or 128, got {given(group_size)}")


def _rows_shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


class QuantizedKV:
    """A quantized K or V: `data` (uint8), `scales` and `biases` (the original dtype), read in place.

    shape, dtype: the original tensor's (logical) shape and dtype; device: the tensors' device;
    bits (8 or 4) and group_size (32, 64 or 128, dividing the head dim). `dequantize()` returns the
    tensor of `dtype` the kernels see; `narrow(dim, start, length)` is a view of all three tensors
    (no copy). Build one with `quantize_kv`, or from tensors in this format (checked here)."""

    __slots__ = ("data", "scales", "biases", "bits", "group_size")

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int):
        who = "QuantizedKV"
        _check_bits_and_group(bits, group_size, who)
        for name, t in (("data", data), ("scales", scales), ("biases", biases)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type_name(t)}")
        if data.dtype != torch.uint8:
            raise TypeError(f"{who}: data must be uint8, got {data.dtype}")
        if scales.dtype not in _DTYPE_CODES or biases.dtype != scales.dtype:
            raise TypeError(
                f"{who}: scales and biases must share one of float32, float16, bfloat16, got {scales.dtype} and "
                f"{biases.dtype}"
            )
        if not (data.device == scales.device == biases.device):
            raise ValueError(
                f"{who}: data, scales and biases must be on one device, got {data.device}, {scales.device}, "
                f"{biases.device}"
            )
        if data.dim() < 1:
            raise ValueError(f"{who}: data must have a head dim, got shape {_rows_shape(data)}")
        columns = data.shape[-1] * (8 // bits)
        groups = (*data.shape[:-1], columns // group_size)
        if columns % group_size != 0 or scales.shape != groups or biases.shape != groups:
            raise ValueError(
                f"{who}: data {_rows_shape(data)} at {bits} bits holds rows of {columns} elements, so scales and "
                f"biases must be {groups} in groups of {group_size} (and {group_size} must divide {columns}), got "
                f"scales {_rows_shape(scales)}, biases {_rows_shape(biases)}"
            )
        if scales.requires_grad or biases.requires_grad:
            raise ValueError(f"{who}: scales and biases take no gradient; detach them")
        self.data, self.scales, self.biases = data, scales, biases
        self.bits, self.group_size = bits, group_size

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * (8 // self.bits)))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self) -> torch.Tensor:
        """The tensor of `dtype` the kernels see: scale * q + bias per element, in float32 with one
        rounding to `dtype`."""
        q = self.data
        if self.bits == 4:
            q = torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)
        groups = self.scales.shape[-1]
        q = q.float().unflatten(-1, (groups, self.group_size))
        values = torch.addcmul(self.biases.float().unsqueeze(-1), q, self.scales.float().unsqueeze(-1))
        return values.flatten(-2).to(self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedKV:
        """A view of rows (or of whole groups of the head dim) of all three tensors; no copy."""
        ndim = self.data.dim()
        if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
            raise IndexError(f"QuantizedKV.narrow: dim must be an int in [{-ndim}, {ndim}), got {given(dim)}")
        dim %= ndim
        if dim < ndim - 1:
            return QuantizedKV(
                self.data.narrow(dim, start, length),
                self.scales.narrow(dim, start, length),
                self.biases.narrow(dim, start, length),
                self.bits,
                self.group_size,
            )
        if start % self.group_size != 0 or length % self.group_size != 0:
            raise ValueError(
                f"QuantizedKV.narrow: along the head dim, start ({start}) and length ({length}) must be multiples of "
                f"the group size {self.group_size}"
            )
        per_byte = 8 // self.bits
        g0, groups = start // self.group_size, length // self.group_size
        return QuantizedKV(
            self.data.narrow(dim, start // per_byte, length // per_byte),
            self.scales.narrow(dim, g0, groups),
            self.biases.narrow(dim, g0, groups),
            self.bits,
            self.group_size,
        )

    def transpose(self, dim0: int, dim1: int) -> QuantizedKV:
        """A view with two dims other than the head dim swapped (e.g. a (B, S, H, D) cache seen as
        (B, H, S, D)); no copy."""
        ndim = self.data.dim()
        for d in (dim0, dim1):
            if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim or d % ndim == ndim - 1:
                raise IndexError(f"QuantizedKV.transpose: dims must be ints in [{-ndim}, {ndim - 1}), got {given(d)}")
        return QuantizedKV(
            self.data.transpose(dim0, dim1),
            self.scales.transpose(dim0, dim1),
            self.biases.transpose(dim0, dim1),
            self.bits,
            self.group_size,
        )

    def __repr__(self) -> str:
        return (
            f"QuantizedKV(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, bits={self.bits}, "
            f"group_size={self.group_size})"
        )


def quantize_rows(x: torch.Tensor, bits: int, group_size: int) -> tuple:
    """(data, scales, biases) of x (..., D), D a multiple of group_size: the quantize_kv rule."""
    levels = (1 << bits) - 1
    groups = x.detach().float().unflatten(-1, (x.shape[-1] // group_size, group_size))
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    # Stored in x's dtype; q is rounded against the stored values, so the reconstruction uses them.
    scales = ((high - low) / levels).to(x.dtype)
    biases = low.to(x.dtype)
    step = scales.float().unsqueeze(-1)
    q = torch.where(step > 0, (groups - biases.float().unsqueeze(-1)) / step, torch.zeros_like(groups))
    q = q.round().clamp(0, levels).to(torch.uint8).flatten(-2)
    if bits == 4:
        pairs = q.unflatten(-1, (q.shape[-1] // 2, 2))
        q = pairs[..., 0] | (pairs[..., 1] << 4)
    return q, scales, biases


def quantize_kv(x: torch.Tensor, bits: int = 8, group_size: int = 64) -> QuantizedKV:
    """Quantizes K or V (any shape (..., D), float32, float16 or bfloat16) to `bits` (8 or 4) per
    element in groups of `group_size` (32, 64 or 128, dividing D) consecutive elements of each row,
    as MLX's `mx.quantize` defines it: bias the group's minimum, scale (max - min) / (2^bits - 1),
    q = round((x - bias) / scale) clamped to [0, 2^bits - 1] (against the scale and bias as stored
    in x's dtype). Scales and biases keep x's dtype. A group holding inf or NaN dequantizes to
    non-finite values (attention then propagates NaN). Returns a QuantizedKV; x is not kept."""
    who = "quantize_kv"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: x must be a torch.Tensor, got {type_name(x)}")
    if x.dtype not in _DTYPE_CODES:
        raise TypeError(f"{who}: x has dtype {x.dtype}; quantize_kv takes float32, float16 or bfloat16")
    _check_bits_and_group(bits, group_size, who)
    if x.dim() < 1 or x.shape[-1] % group_size != 0:
        raise ValueError(
            f"{who}: the head dim (last) of x {_rows_shape(x)} must be a multiple of group_size {group_size}"
        )
    return QuantizedKV(*quantize_rows(x, bits, group_size), bits, group_size)


def check_quantized_call(q, k, v, who: str, needs_grad=None) -> tuple:
    """The (k, v) QuantizedKV-or-None pair of an attention call whose K, V or both are quantized,
    after checking q, k and v in their logical shapes and dtype (as for unquantized ones) and, for a
    call that runs (needs_grad given: whether the call's other inputs want a gradient), that no
    gradient is asked for."""
    if isinstance(q, QuantizedKV):
        raise TypeError(f"{who}: q must be a torch.Tensor; only k and v may be a QuantizedKV")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, (torch.Tensor, QuantizedKV)):
            raise TypeError(f"{who}: {name} must be a torch.Tensor or (k, v) a QuantizedKV, got {type_name(t)}")
    if q.dtype not in _DTYPE_CODES:
        raise TypeError(f"{who}: q has dtype {q.dtype}; supported are float32, float16 and bfloat16")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{who}: q, k, v must share one dtype (a QuantizedKV's is that of its scales), got {q.dtype}, {k.dtype}, "
            f"{v.dtype}"
        )
    ks, vs = tuple(k.shape), tuple(v.shape)
    shapes = f"q {_rows_shape(q)}, k {ks}, v {vs}"
    if q.dim() not in (3, 4) or len(ks) != q.dim() or len(vs) != q.dim():
        raise ValueError(f"{who}: q, k, v must all be 4-D (B, H, L, E) or all 3-D (H, L, E), got {shapes}")
    if q.dim() == 4 and not (q.shape[0] == ks[0] == vs[0]):
        raise ValueError(f"{who}: batch sizes differ: {shapes}")
    if ks[-3] != vs[-3] or ks[-2] != vs[-2]:
        raise ValueError(f"{who}: k and v must have the same heads and sequence length: {shapes}")
    if q.shape[-1] != ks[-1]:
        raise ValueError(f"{who}: q and k must have the same head dim: {shapes}")
    if ks[-3] == 0 or q.shape[-3] % ks[-3] != 0:
        raise ValueError(f"{who}: query heads must be a multiple of key/value heads: {shapes}")
    if needs_grad is None:
        return (k if isinstance(k, QuantizedKV) else None, v if isinstance(v, QuantizedKV) else None)
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"{who}: quantized K/V are read by eager calls only, not under torch.compile")
    plain_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if torch.is_grad_enabled() and (plain_grad or needs_grad()):
        raise ValueError(
            f"{who}: no gradient flows through quantized K/V (q, k, v or sinks require grad here); call it under "
            "torch.no_grad() or detach them"
        )
    return (k if isinstance(k, QuantizedKV) else None, v if isinstance(v, QuantizedKV) else None)


def batched(t):
    """t with a batch dim of 1 in front (views): a QuantizedKV's three tensors alike."""
    if isinstance(t, QuantizedKV):
        return QuantizedKV(t.data.unsqueeze(0), t.scales.unsqueeze(0), t.biases.unsqueeze(0), t.bits, t.group_size)
    return t.unsqueeze(0)


def operand(t):
    """The tensor an attention slot reads for k or v: a QuantizedKV's data, else t."""
    return t.data if isinstance(t, QuantizedKV) else t

"""The torch calls and values the explicit-attention tracker (`attention.pattern`) recognises.

A TorchFunctionMode sees a Tensor method as either Tensor's Python wrapper or TensorBase's C method,
so each spelling is a set of callables (`torch_callables`). The small predicates below decide whether an
argument is a scale, a causal fill value or a precise-enough cast; `version_of` reads the version
counter that proves a tensor unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from remat.compat.torch_private import tensor_base

__all__ = ["torch_callables", "version_of",
           "arg", "is_last_two", "positive_factor", "at_least_as_precise", "is_minus_inf_fill",
           "MASK_OPS", "TRANSPOSE_OPS", "MT_OPS", "MATMUL_OPS", "MUL_OPS", "DIV_OPS", "MASKED_FILL_OPS",
           "ADD_OPS", "IMUL_OPS", "IDIV_OPS", "IMASKED_FILL_OPS", "IADD_OPS", "SOFTMAX_OPS", "WHERE_OPS",
           "CAST_OPS", "DATA_OPS"]


def torch_callables(*names: str, funcs: tuple = ()) -> frozenset:
    """The callables a TorchFunctionMode sees for these Tensor methods (Tensor's own Python
    wrappers and TensorBase's C methods) plus the given functions."""
    found = set(funcs)
    for name in names:
        for cls in (torch.Tensor, tensor_base):
            if hasattr(cls, name):
                found.add(getattr(cls, name))
    return frozenset(found)


# ops that build masks: replayed on the shadows, cheap and deterministic (none of them in place)
MASK_OPS = torch_callables("__getitem__", "__invert__", "logical_not", "bitwise_not", "__eq__", "__ne__", "__lt__",
                 "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt", "ge", "tril", "triu", "view",
                 "reshape", "unsqueeze", "expand", "bool", "to", "float", "__and__", "__or__", "logical_and",
                 "logical_or", "t", "transpose", "masked_fill", "__mul__", "__rmul__", "mul", "__sub__",
                 "__rsub__", "sub",
                 funcs=(torch.logical_not, torch.bitwise_not, torch.eq, torch.ne, torch.lt, torch.le, torch.gt,
                        torch.ge, torch.tril, torch.triu, torch.ones, torch.zeros, torch.ones_like,
                        torch.zeros_like, torch.full, torch.arange, torch.logical_and, torch.logical_or,
                        torch.masked_fill, torch.where, torch.mul, torch.sub))
TRANSPOSE_OPS = torch_callables("transpose", funcs=(torch.transpose,))
MT_OPS = frozenset({torch.Tensor.mT.__get__, tensor_base.mT.__get__})
MATMUL_OPS = torch_callables("__matmul__", "matmul", funcs=(torch.matmul,))
MUL_OPS = torch_callables("__mul__", "__rmul__", "mul", funcs=(torch.mul,))
DIV_OPS = torch_callables("__truediv__", "div", funcs=(torch.div,))
MASKED_FILL_OPS = torch_callables("masked_fill", funcs=(torch.masked_fill,))
ADD_OPS = torch_callables("__add__", "__radd__", "add", funcs=(torch.add,))
# the in-place spellings understood exactly (the op is applied to args[0], which is returned)
IMUL_OPS = torch_callables("__imul__", "mul_")
IDIV_OPS = torch_callables("__itruediv__", "__idiv__", "div_")
IMASKED_FILL_OPS = torch_callables("masked_fill_")
IADD_OPS = torch_callables("__iadd__", "add_")
SOFTMAX_OPS = torch_callables("softmax", funcs=(F.softmax, torch.softmax))
WHERE_OPS = torch_callables("where", funcs=(torch.where,))  # torch.where(cond, input, other) / input.where(cond, other)
CAST_OPS = torch_callables("float", "to", "type_as")
# `.data` aliases a tensor's storage under a new version counter: in-place ops through it are invisible
DATA_OPS = frozenset({torch.Tensor.data.__get__, tensor_base.data.__get__})


def version_of(t) -> int | None:
    """`t._version` (bumped by every in-place op on t or a view sharing its storage), or None
    when t is not a tensor or does not track versions (inference tensors)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t._version
    except Exception:  # inference tensors have no version counter: nothing about them is provable
        return None


def arg(args, kwargs, i: int, name: str, default=None):
    """Argument `name` of a call, given by keyword or at position `i`."""
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def is_last_two(d0, d1, ndim: int) -> bool:
    """Whether dims d0, d1 (negative allowed) are the last two of an ndim-dim tensor."""
    return isinstance(d0, int) and isinstance(d1, int) and {d0 % ndim, d1 % ndim} == {ndim - 2, ndim - 1}


def positive_factor(other) -> float | None:
    """A python scalar scale (not bool, not a tensor: a 0-d tensor's value is not known while
    tracing), finite and > 0; else None."""
    if isinstance(other, bool) or not isinstance(other, (int, float)):
        return None
    try:
        f = float(other)
    except OverflowError:
        return None
    return f if math.isfinite(f) and f > 0 else None


def at_least_as_precise(dtype: torch.dtype, than: torch.dtype) -> bool:
    """A floating dtype that holds every value of `than` exactly (fp32 for fp16/bf16, fp64 ...)."""
    if not (dtype.is_floating_point and than.is_floating_point) or dtype.is_complex:
        return False
    a, b = torch.finfo(dtype), torch.finfo(than)
    return a.eps <= b.eps and a.max >= b.max and a.tiny <= b.tiny


def is_minus_inf_fill(value, dtype: torch.dtype) -> bool:
    """-inf, or a value <= finfo(dtype).min (e.g. HF's torch.finfo(dtype).min): exp(value - max)
    underflows to exactly 0 as for -inf, as long as the row sees some key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not dtype.is_floating_point:
        return False
    return value == float("-inf") or value <= torch.finfo(dtype).min

"""The structure of a model's output: which leaves are tensors (computed by the planned step on
every call), which are constants (passed through), and how to build the same structure again.

Any torch pytree works (tuples, lists, dicts, namedtuples, Hugging Face `ModelOutput`s, which
register themselves), and so do dataclasses that are not registered: their fields are flattened
here, without registering the user's class anywhere. A leaf that is neither a tensor nor a plain
constant (a cache object, a custom class) may hold tensors of the traced call, which a later call
would hand back as they were at trace time; such outputs are refused when tracing, by name.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.core.errors import RematError
from remat.compat.torch_private import pytree

__all__ = ["OutputError", "OutputStructure", "CONSTANT_TYPES"]

# Leaves a call returns unchanged: immutable values that cannot hold a tensor. With the input
# shapes and non-tensor arguments fixed by the plan, the model returns the same ones every call.
CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                  torch.Size, enum.Enum)


class OutputError(RematError, TypeError):
    """An output the optimized module cannot return on every call (e.g. a cache object holding
    the traced call's tensors); the message names it."""


def _unregistered_dataclass(x: Any) -> bool:
    return (dataclasses.is_dataclass(x) and not isinstance(x, type)
            and type(x) not in pytree.SUPPORTED_NODES)


@dataclass
class _Dataclass:
    """How to build an unregistered dataclass instance again from its fields' values."""

    cls: type
    init_fields: tuple[str, ...]
    other_fields: tuple[str, ...]  # init=False fields, set after construction
    fields: "OutputStructure"  # the structure of the tuple of all field values

    def build(self, values: tuple) -> Any:
        by_name = dict(zip(self.init_fields + self.other_fields, values))
        obj = self.cls(**{k: by_name[k] for k in self.init_fields})
        for k in self.other_fields:
            object.__setattr__(obj, k, by_name[k])  # frozen dataclasses too
        return obj


@dataclass
class OutputStructure:
    """`spec` flattens the output into leaves; `tensors` are the positions of tensor leaves,
    `constants` the constant leaves by position, `dataclasses` the nested structures of the
    unregistered dataclass leaves by position."""

    spec: pytree.TreeSpec
    tensors: list[int]
    constants: dict[int, Any]
    dataclasses: dict[int, _Dataclass]
    single_scalar: bool = False  # the output is one one-element tensor (a loss) and nothing else
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # of the tensors, for messages
    kind: str = ""  # the output's type name, for messages

    @classmethod
    def of(cls, out: Any, where: str = "output") -> tuple["OutputStructure", list[torch.Tensor]]:
        """The structure of `out` and its tensors in order; OutputError for a leaf that is
        neither a tensor nor a constant (`where` names the output in the message)."""
        pairs, spec = pytree.tree_flatten_with_path(out, is_leaf=_unregistered_dataclass)
        tensors: list[torch.Tensor] = []
        st = cls(spec, [], {}, {})
        for i, (path, x) in enumerate(pairs):
            name = where + pytree.keystr(path)
            if isinstance(x, torch.Tensor):
                st.tensors.append(i)
                tensors.append(x)
            elif _unregistered_dataclass(x):
                fields = dataclasses.fields(x)
                init = tuple(f.name for f in fields if f.init)
                other = tuple(f.name for f in fields if not f.init)
                sub, sub_tensors = cls.of(tuple(getattr(x, k) for k in init + other), name)
                d = st.dataclasses[i] = _Dataclass(type(x), init, other, sub)
                try:  # fail now rather than on every call
                    d.build(sub.rebuild(sub_tensors))
                except Exception as e:
                    raise OutputError(f"{name} is a {type(x).__qualname__}, a dataclass remat cannot build "
                                      f"again from its fields ({type(e).__name__}: {e}); return its tensors "
                                      f"in a tuple or a dict instead") from e
                st.tensors.append(i)  # a slot filled by the dataclass's own tensors, see rebuild
                tensors.extend(sub_tensors)
            elif isinstance(x, CONSTANT_TYPES):
                st.constants[i] = x
            else:
                raise OutputError(
                    f"{name} is a {type(x).__module__}.{type(x).__qualname__}: the optimized module "
                    f"returns tensors (computed on every call) and constants (None, numbers, strings), "
                    f"and this object may hold tensors of the traced call, which later calls would "
                    f"return unchanged. Return tensors only (Hugging Face: pass use_cache=False so no "
                    f"cache object is returned).")
        st.shapes = [tuple(t.shape) for t in tensors]
        st.kind = "Tensor" if isinstance(out, torch.Tensor) else type(out).__name__
        st.single_scalar = (spec.num_leaves == 1 and len(tensors) == 1 and not st.dataclasses
                            and tensors[0].numel() == 1)
        return st, tensors

    @property
    def num_tensors(self) -> int:
        return sum(self.dataclasses[i].fields.num_tensors if i in self.dataclasses else 1 for i in self.tensors)

    def describe(self) -> str:
        """A few words for messages: what the model returns."""
        shapes = ", ".join(str(s) for s in self.shapes)
        if self.kind == "Tensor":
            return f"a tensor of shape {shapes}"
        return f"{self.kind} with {len(self.shapes)} tensors of shapes {shapes}"

    def rebuild(self, tensors: list) -> Any:
        """The output again, with `tensors` (in `of`'s order) in place of the traced ones."""
        leaves: list[Any] = [None] * self.spec.num_leaves
        it = 0
        for i in self.tensors:
            if i in self.dataclasses:
                d = self.dataclasses[i]
                k = d.fields.num_tensors
                leaves[i] = d.build(d.fields.rebuild(list(tensors[it:it + k])))
                it += k
            else:
                leaves[i] = tensors[it]
                it += 1
        for i, c in self.constants.items():
            leaves[i] = c
        return pytree.tree_unflatten(leaves, self.spec)

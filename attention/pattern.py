"""Recognise the explicit attention pattern, softmax(mask(Q K^T * scale)) V, while a step is traced.

Many models (nanoGPT, minGPT, the default model) spell attention out:

    att = (q @ k.transpose(-2, -1)) * scale          # or / sqrt(d), or att /= sqrt(d) in place
    att = att.masked_fill(~causal_mask[..., :T, :T], float("-inf"))   # or + mask (0 / -inf); optional
    att = F.softmax(att, dim=-1)
    att = dropout(att)                                # optional
    y = att @ v

`ExplicitAttentionTracker` follows that chain op by op inside a TorchFunctionMode: each step tags
its result with what it has seen so far (q, k, scale, mask). When the chain ends in `att @ v`, the
router returns the fused op's output instead; the scores, mask and softmax it traced on the way
are then unused and dropped from the graph as dead code, so the s x s tensors never exist.

Nothing is fused that the tracker cannot prove to be the fused op's function:

* In-place ops. Every tensor has a version counter (`t._version`) that each in-place op bumps (views
  share their base's counter; it also works on AOTAutograd's FunctionalTensors). A tag remembers the
  version of the tensor it describes, and the chain remembers the versions of q and k when the scores
  were computed (the fused op reads q and k again at the closing `@ v`). A tag whose tensor has been
  modified since, or q/k modified before the closing `@ v`, leaves the chain unfused with the reason
  "in-place op on ...". The common in-place spellings are understood exactly instead: `att /= s`,
  `att *= s`, `div_`/`mul_` by a positive python scalar, `masked_fill_` with a causal mask, and
  `+=`/`add_` of a causal 0/-inf mask, each applied to an untouched chain value (the router reads the
  version before the op runs).
* Masks must be known to be causal (or empty), filled (masked_fill, torch.where) with -inf or a value
  <= finfo(dtype).min (HF's spelling), or added as 0 / (-inf or <= finfo(dtype).min / 2). Rows that see no key at all
  (Sq > Sk) are refused: eager softmax gives NaN or a uniform row there, the fused op zeros.
* Casts stay in the chain only to floating dtypes at least as precise as q's (an upcast around
  softmax, and the cast back); softmax only over the last dim; every step keeps the scores' shape.

Dropout on the probabilities is fused only when the router is asked to (`fuse_dropout`): the
tracker then replaces it with the op's own hashed dropout (`dropout_hash.hashed_dropout`, same
distribution, masks from remat's generator rather than torch's), so that the fused op, given the
same seed, computes exactly what the spelled-out chain would. In-place dropout is never replaced.

Masks are small deterministic tensors (a causal buffer, or tril(ones(T, T)) built in forward), so
the tracker keeps a real copy ("shadow") of each one next to the traced value: it copies the
model's small buffers before tracing, and replays cheap mask-building ops (slicing, ~, tril,
comparisons, ...) on the copies. A shadow is used only while its tensor's version is the one it
was made at (an in-place op on a mask, e.g. `ones(T, T).tril_()`, makes it unknown). Anything it
cannot prove causal is left alone, and the reason is reported.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from remat.attention.dropout_hash import draw_seed, hashed_dropout
from remat.attention.spellings import (ADD_OPS, CAST_OPS, DATA_OPS, DIV_OPS, IADD_OPS, IDIV_OPS, IMASKED_FILL_OPS,
                                       IMUL_OPS, MASKED_FILL_OPS, MASK_OPS, MATMUL_OPS, MT_OPS, MUL_OPS,
                                       SOFTMAX_OPS, TRANSPOSE_OPS, WHERE_OPS, arg, at_least_as_precise,
                                       is_last_two, is_minus_inf_fill, positive_factor, version_of)
from remat.compat.torch_private import disable_current_modes, is_fake, pytree

__all__ = ["ExplicitAttentionTracker", "AttentionChain", "version_of"]

# masks bigger than this are not shadowed (a causal mask for S = 4096 has 16M entries)
_SHADOW_MAX_NUMEL = 1 << 26


@dataclass(frozen=True)
class AttentionChain:
    """What the value at one step of the pattern is made of."""

    stage: str  # "kT" | "scores" | "masked" | "probs"
    q: torch.Tensor | None
    k: torch.Tensor
    scale: float = 1.0
    causal: bool = False
    dropout_p: float = 0.0  # dropout applied to the probabilities
    seed: torch.Tensor | None = None  # the hashed dropout's seed, when dropout was replaced
    version: int | None = None  # the tagged tensor's version when it was tagged
    reads: tuple = ()  # ((tensor, version, name), ...): what the fused op reads again (q, k)
    broken: str | None = None  # why this chain no longer computes what the tags say


class ExplicitAttentionTracker:
    """Tags traced tensors with their place in the explicit attention pattern (see module doc)."""

    def __init__(self, fuse_dropout: bool = False):
        self.fuse_dropout = fuse_dropout
        self.chains = WeakIdKeyDictionary()  # traced tensor -> AttentionChain
        self.shadows = WeakIdKeyDictionary()  # traced mask tensor -> (real CPU copy, version)
        self._handles = []
        # a `.data` alias of any tensor was made: in-place ops through it bump no version counter
        # that the guard could see (it may alias q, k or a base they view), so no chain is proven
        self.data_aliased: str | None = None

    # ---- mask shadows ------------------------------------------------------------------------
    def watch_buffers(self, model: nn.Module) -> None:
        """Copy the model's small buffers now; when a module runs during tracing, map the traced
        buffer it sees to that copy (AOTAutograd swaps buffers for traced values)."""
        for mod in model.modules():
            # masks are square in their last two dims; other buffers (running stats, rotary
            # caches) are not copied
            # a buffer without data (meta device, fake tensor: a model planned without its memory)
            # has no values to copy: a mask read from it is not known, so never proven causal
            small = {n: (b, b.detach().to("cpu", copy=True), version_of(b)) for n, b in mod._buffers.items()
                     if b is not None and not b.is_meta and not is_fake(b)
                     and b.dim() >= 2 and b.shape[-1] == b.shape[-2]
                     and b.numel() <= _SHADOW_MAX_NUMEL and not b.dtype.is_complex}
            if not small:
                continue

            def pre(m, args, _small=small):
                for name, (orig, real, orig_version) in _small.items():
                    traced = m._buffers.get(name)
                    if not isinstance(traced, torch.Tensor) or traced in self.shadows:
                        continue  # the version at first sight stays the reference
                    # the buffer itself (eager) must still be at the version it was copied at;
                    # a traced stand-in starts at version 0, anything else was modified in place
                    expect = orig_version if traced is orig else 0
                    if expect is not None and version_of(traced) == expect:
                        self.shadows[traced] = (real, expect)

            self._handles.append(mod.register_forward_pre_hook(pre))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _shadow_of(self, x):
        """The real copy of traced mask `x`, or None if it has none or was modified in place since."""
        entry = self.shadows.get(x) if isinstance(x, torch.Tensor) else None
        if entry is None or version_of(x) != entry[1]:
            return None
        return entry[0]

    def replay_mask_op(self, func, args, kwargs, out) -> None:
        """If `func` builds a mask from shadowed (or no) tensors, compute its shadow too."""
        if func not in MASK_OPS or not isinstance(out, torch.Tensor) or out.numel() > _SHADOW_MAX_NUMEL:
            return
        leaves, spec = pytree.tree_flatten((args, kwargs))
        real = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                s = self._shadow_of(x)
                if s is None:
                    return
                real.append(s)
            elif isinstance(x, torch.device):
                real.append(torch.device("cpu"))
            else:
                real.append(x)
        r_args, r_kwargs = pytree.tree_unflatten(real, spec)
        if "device" in r_kwargs:
            r_kwargs["device"] = "cpu"
        with disable_current_modes():
            try:
                shadow = func(*r_args, **r_kwargs)
                if isinstance(shadow, torch.Tensor):  # `.to("cuda")` would move the copy: keep it on CPU
                    shadow = shadow.cpu()
            except Exception:  # a mask we cannot replay is simply not known
                return
        version = version_of(out)
        if isinstance(shadow, torch.Tensor) and tuple(shadow.shape) == tuple(out.shape) and version is not None:
            self.shadows[out] = (shadow, version)

    def _mask_kind(self, mask, sq: int, sk: int) -> str | None:
        """'causal' (bottom-right aligned, as the fused op), 'none' (masks nothing), or None."""
        with disable_current_modes():  # the shadows are real tensors: step outside fake mode
            return self._real_mask_kind(self._shadow_of(mask), sq, sk)

    def _additive_mask_kind(self, bias, sq: int, sk: int, dtype: torch.dtype) -> str | None:
        """The same for an additive float mask: 0 where visible, -inf or <= finfo(dtype).min / 2
        where not (HF adds finfo(dtype).min; the sum with any ordinary score stays far below every
        visible score, so its exp underflows to exactly 0 as for -inf)."""
        with disable_current_modes():
            real = self._shadow_of(bias)
            if not isinstance(real, torch.Tensor) or not real.dtype.is_floating_point or not dtype.is_floating_point:
                return None
            blocked = (real == float("-inf")) | (real <= torch.finfo(dtype).min / 2)
            if not bool((blocked | (real == 0)).all()):
                return None  # a real bias (ALiBi, relative positions): not the fused op's function
            return self._real_mask_kind(blocked, sq, sk)

    @staticmethod
    def _real_mask_kind(real, sq: int, sk: int) -> str | None:
        if not isinstance(real, torch.Tensor) or real.dtype != torch.bool or real.dim() < 2:
            return None
        if tuple(real.shape[-2:]) != (sq, sk):
            try:
                real = torch.broadcast_to(real, real.shape[:-2] + (sq, sk))
            except RuntimeError:
                return None
        flat = real.reshape(-1, sq, sk)
        if not flat.any():
            return "none"
        if sq > sk:  # rows that see no key: eager gives NaN (-inf) or uniform rows, the fused op zeros
            return None
        causal = torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq)
        return "causal" if bool((flat == causal).all()) else None

    # ---- the chain ---------------------------------------------------------------------------
    def _current(self, x) -> AttentionChain | None:
        """The chain tagged on `x`; marked broken if `x` was modified in place since (directly or
        through a view: views share the version counter)."""
        chain = self.chains.get(x) if isinstance(x, torch.Tensor) else None
        if chain is not None and chain.broken is None and (chain.version is None or version_of(x) != chain.version):
            chain = replace(chain, broken=f"in-place op on the attention {chain.stage}")
        return chain

    def _tag(self, out: torch.Tensor, chain: AttentionChain, broken: str | None = None) -> None:
        self.chains[out] = replace(chain, version=version_of(out), broken=chain.broken or broken)

    def step(self, func, args, kwargs, out, pre_version: int | None = None) -> str | None:
        """Tag `out` if `func(*args, **kwargs)` extends a chain. `pre_version` is args[0]'s version
        before the op ran (for in-place ops). Returns a reason when a chain is broken in a way the
        user may want to know about."""
        if not isinstance(out, torch.Tensor):
            return None
        x = args[0] if args else None
        if func in DATA_OPS:
            self.data_aliased = f"`.data` of a {tuple(out.shape)} tensor was taken while tracing " \
                                f"(in-place ops through it are invisible to the version guard)"
            return None
        if func in TRANSPOSE_OPS or func in MT_OPS:
            if isinstance(x, torch.Tensor) and x.dim() == 4:
                d0, d1 = (-2, -1) if func in MT_OPS else (arg(args, kwargs, 1, "dim0"), arg(args, kwargs, 2, "dim1"))
                if is_last_two(d0, d1, 4):
                    self._tag(out, AttentionChain("kT", None, x))
            return None
        if func in MATMUL_OPS and len(args) >= 2:
            a, b = args[0], args[1]
            cb = self._current(b)
            if cb is not None and cb.stage == "kT" and isinstance(a, torch.Tensor) and a.dim() == 4 \
                    and version_of(a) is not None and version_of(cb.k) is not None:
                # the fused op reads q and k again at the closing `@ v`: they must not change before
                reads = ((a, version_of(a), "q"), (cb.k, version_of(cb.k), "k"))
                self._tag(out, AttentionChain("scores", a, cb.k, reads=reads, broken=cb.broken))
            return None
        if func in ADD_OPS and len(args) > 1 and kwargs.get("alpha", 1) == 1:
            return self._add_mask(args[0], args[1], out)
        if func in WHERE_OPS and len(args) == 3 and not kwargs:
            cond, a, b = args if func is torch.where else (args[1], args[0], args[2])
            return self._where(cond, a, b, out)
        inplace = func in IMUL_OPS or func in IDIV_OPS or func in IMASKED_FILL_OPS or func in IADD_OPS
        if inplace:
            return self._inplace(func, args, kwargs, out, pre_version)
        chain = self._current(x)
        if chain is None or chain.stage == "kT" or tuple(out.shape) != tuple(x.shape):
            return None  # every step of the pattern keeps the scores' shape
        if func in MUL_OPS or func in DIV_OPS:
            return self._scale(chain, func in MUL_OPS, args, kwargs, out)
        if func in MASKED_FILL_OPS:
            return self._masked_fill(chain, x, arg(args, kwargs, 1, "mask"), arg(args, kwargs, 2, "value"), out)
        if func in SOFTMAX_OPS:
            dim = arg(args, kwargs, 1, "dim")
            # dtype is F.softmax's 4th parameter (after _stacklevel), Tensor.softmax's/torch.softmax's 3rd
            dtype = arg(args, kwargs, 3 if func is F.softmax else 2, "dtype")
            if chain.stage in ("scores", "masked") and isinstance(dim, int) and dim in (-1, out.dim() - 1) \
                    and (dtype is None or at_least_as_precise(out.dtype, x.dtype)):
                self._tag(out, replace(chain, stage="probs"))
            return None
        if func is F.dropout and chain.stage == "probs":
            p, training = arg(args, kwargs, 1, "p", 0.5), arg(args, kwargs, 2, "training", True)
            if arg(args, kwargs, 3, "inplace", False):
                # in training it changed `x` in place: the stale tag on x breaks the chain below
                return None
            self._tag(out, replace(chain, dropout_p=float(p) if training else 0.0))
            return None
        if func in CAST_OPS and chain.stage in ("scores", "masked", "probs"):
            # casts around softmax do not change the pattern, as long as nothing is rounded below
            # q's precision (the fused op computes in it) and the value stays on its device
            if out.device == x.device and at_least_as_precise(out.dtype, chain.q.dtype) \
                    and at_least_as_precise(out.dtype, chain.k.dtype):
                self._tag(out, chain)
        return None

    @staticmethod
    def _scale_factor(is_mul: bool, args, kwargs) -> float | None:
        if kwargs.get("rounding_mode") is not None:
            return None
        f = positive_factor(arg(args, kwargs, 1, "other"))
        return None if f is None else positive_factor(f if is_mul else 1.0 / f)

    def _masked_fill(self, chain: AttentionChain, x, mask, value, out) -> str | None:
        if chain.stage != "scores":
            return None
        kind = self._mask_kind(mask, out.shape[-2], out.shape[-1])
        if kind is None:
            return "explicit attention: mask not recognised as causal"
        if not is_minus_inf_fill(value, x.dtype):
            return f"explicit attention: masked_fill value {value!r} (not -inf or <= finfo({x.dtype}).min)"
        self._tag(out, replace(chain, stage="masked", causal=kind == "causal"))
        return None

    def _where(self, cond, a, b, out: torch.Tensor) -> str | None:
        """torch.where(visible, scores, -inf) or torch.where(blocked, -inf, scores); the fill a
        python scalar or a 0-d tensor with a known value (HF's GPT-2: torch.full([], finfo.min))."""
        for scores, value, keep_where_true in ((a, b, True), (b, a, False)):
            chain = self._current(scores)
            if chain is None or chain.stage != "scores":
                continue
            if tuple(out.shape) != tuple(scores.shape) or out.dtype != scores.dtype:
                return None  # a condition or fill that broadcasts or promotes the scores
            with disable_current_modes():
                real = self._shadow_of(cond)
                blocked = None if not isinstance(real, torch.Tensor) or real.dtype != torch.bool \
                    else (~real if keep_where_true else real)
                kind = self._real_mask_kind(blocked, out.shape[-2], out.shape[-1])
                if isinstance(value, torch.Tensor):
                    known = self._shadow_of(value)
                    value = known.item() if isinstance(known, torch.Tensor) and known.numel() == 1 else value
            if kind is None:
                return "explicit attention: torch.where mask not recognised as causal"
            if not is_minus_inf_fill(value, scores.dtype):
                return f"explicit attention: torch.where fill {value!r} (not -inf or <= finfo({scores.dtype}).min)"
            self._tag(out, replace(chain, stage="masked", causal=kind == "causal"))
            return None
        return None

    def _scale(self, chain: AttentionChain, multiply: bool, args, kwargs, out) -> None:
        """Scores times (or divided by) a positive finite python scalar, in place or not."""
        factor = self._scale_factor(multiply, args, kwargs)
        if chain.stage == "scores" and factor is not None and positive_factor(chain.scale * factor):
            self._tag(out, replace(chain, scale=chain.scale * factor))
        return None

    def _inplace(self, func, args, kwargs, out, pre_version) -> str | None:
        """`att /= s`, `att *= s`, `att.masked_fill_(...)`, `att += mask` on an untouched chain value:
        re-tag the same tensor with what it now holds. Anything else leaves its tag stale."""
        x = args[0]
        chain = self.chains.get(x) if isinstance(x, torch.Tensor) else None
        if chain is None or chain.broken is not None or out is not x or pre_version != chain.version:
            return None  # not a chain value, or already modified: the version check catches it
        if func in IMUL_OPS or func in IDIV_OPS:
            return self._scale(chain, func in IMUL_OPS, args, kwargs, out)
        if func in IMASKED_FILL_OPS:
            return self._masked_fill(chain, x, arg(args, kwargs, 1, "mask"), arg(args, kwargs, 2, "value"), out)
        if kwargs.get("alpha", 1) == 1 and len(args) > 1:  # += / add_
            return self._add_mask(x, args[1], out, inplace=True)
        return None

    def _add_mask(self, a, b, out: torch.Tensor, inplace: bool = False) -> str | None:
        """scores + mask (either order; only `scores += mask` in place), the mask 0 where visible
        and -inf where not."""
        for scores, bias in ((a, b),) if inplace else ((a, b), (b, a)):
            chain = self.chains.get(scores) if inplace else self._current(scores)
            if chain is None or chain.stage != "scores":
                continue
            if tuple(out.shape) != tuple(scores.shape):
                return None  # a bias that broadcasts the scores to a bigger shape
            kind = self._additive_mask_kind(bias, out.shape[-2], out.shape[-1], out.dtype) \
                if isinstance(bias, torch.Tensor) else None
            if kind is None:
                return "explicit attention: the bias added to the scores is not a causal 0/-inf mask"
            self._tag(out, replace(chain, stage="masked", causal=kind == "causal"))
            return None
        return None

    def replace_dropout(self, func, args, kwargs) -> torch.Tensor | None:
        """With `fuse_dropout`, dropout on a chain's probabilities becomes the fused op's hashed
        dropout (returned here, instead of running torch's); otherwise None. In-place dropout is
        never replaced (the model reads the tensor it modified)."""
        if not self.fuse_dropout or func is not F.dropout or not args:
            return None
        chain = self._current(args[0])
        p, training = arg(args, kwargs, 1, "p", 0.5), arg(args, kwargs, 2, "training", True)
        if chain is None or chain.broken is not None or chain.stage != "probs" or not training \
                or arg(args, kwargs, 3, "inplace", False) or isinstance(p, bool) \
                or not isinstance(p, (int, float)) or not 0.0 < p < 1.0 or args[0].dim() != 4:
            return None
        seed = draw_seed(args[0].device)
        out = hashed_dropout(args[0], float(p), seed)
        self._tag(out, replace(chain, dropout_p=float(p), seed=seed))
        return out

    def final(self, func, args, kwargs) -> tuple[AttentionChain, torch.Tensor, str | None] | None:
        """(chain, v, reason) if `func(*args)` is the closing `probs @ v` of a chain; reason (why
        it cannot be fused: in-place ops) is None when the chain still holds."""
        if func not in MATMUL_OPS or len(args) < 2 or kwargs.get("out") is not None:
            return None  # matmul(p, v, out=buf): the model reads buf, which the fused op would not fill
        p, v = args[0], args[1]
        chain = self._current(p)
        if chain is None or chain.stage != "probs" or not isinstance(v, torch.Tensor) or v.dim() != 4:
            return None
        reason = chain.broken or self.data_aliased
        for t, version, name in chain.reads:
            if reason is None and version_of(t) != version:
                reason = f"in-place op on {name} after the scores were computed"
        return chain, v, reason

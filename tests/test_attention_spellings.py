"""Property test: however a tiny causal self-attention block spells its attention, remat computes the
same loss and gradients as the unmodified eager model, and fuses exactly the spellings it can prove.

Hypothesis draws the spelling: scale (out of place, in place `/=`, `*=`, `div_`, `mul_`, on q, as a
0-d tensor), `@`/`matmul`/`bmm` on 3-D reshapes/`einsum`, `.mT`/`transpose(-2, -1)`/`transpose(2, 3)`,
the mask (none, `masked_fill` with a bool buffer, a minGPT float buffer `== 0`, `tril` built in
forward, `masked_fill_` in place, `finfo.min`, `torch.where` (a python or 0-d tensor fill), additive
0/-inf buffer out of place and in place, HF's `finfo.min` additive mask, LLaMA's
`triu(full(-inf))`), an optional learned bias (before or after the mask, in place or not), the
softmax (`dim=-1`/`dim=3`, `F.softmax`, `torch.softmax`, the method, `dtype=float32`, `.float()`
and cast back), grouped-query attention via `repeat_interleave`, and dropout p=0 or p>0 with the
model in train mode.

Half the draws vary everything, half only what a fusable spelling may vary (uniform draws are fusable
fewer than 1 time in 10). Each spelling is compared, with the same seed before each step (dropout masks
are drawn in block order in both), against the model's own eager step:
* `test_routed_spelling_matches_eager` (210 drawn spellings + 4 explicit, one block each): the step run
  eagerly inside `route_attention(model=...)`, the tracker and router code the capture uses, on real
  tensors;
* `test_optimized_spellings_match_eager` (4 drawn stacks of 12 spellings, all distinct within a stack, +
  one stack of the 7 explicit spellings + plain nanoGPT alone: 56 spellings in 6 `remat.optimize(...,
  solver="keep_all")` calls, the real module). Each `optimize` call costs ~0.7 s of its own (the AOT
  trace, the graph build) plus ~0.2 s a block, so one model stacks 12 residual blocks (not 6: half the
  calls for the same spellings), each spelled its own way: fused and unfused blocks
  mixed in one graph, the loss and every parameter's gradient compared, and each block's fused ops
  found by the module path the capture records. A failure names the differing blocks and their
  spellings, then runs each spelling alone to give the smallest reproducer (no hypothesis shrinking:
  every try would trace a stack).
Both also check that each spelling is fused exactly when it is expected to be: the plain and in-place
nanoGPT spellings must be fused (the in-place guard must not simply switch fusion off), a learned bias,
dropout p>0 (the default "exact" mode), a 0-d tensor scale and bmm/einsum must not.

Tolerance rtol=1e-5/atol=1e-6: the fused op sums in another order (fp32 rounding, ~1e-7 relative); a
spelling whose meaning changed (a lost scale, mask or bias) is off by 1e-3 or more.
"""
import math
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.attention.router import route_attention
from tests.fuzz_scale import fuzz_count

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed: property tests skipped")
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

B, H, T, D, V = 2, 2, 8, 8, 16
C = H * D
RTOL, ATOL = 1e-5, 1e-6
BLOCKS, STACKS = 12, fuzz_count(4)  # the optimized test: 4 drawn stacks of 12 spellings each (tests/fuzz_scale.py)

SCALES = ["div", "mul", "rmul", "idiv", "imul", "div_", "mul_", "q_prescale", "tensor"]
MATMULS = ["@", "matmul", "bmm", "einsum"]
TRANSPOSES = ["transpose(-2,-1)", "mT", "transpose(2,3)", "transpose(-1,-2)"]
MASKS = ["none", "fill_bool_buffer", "fill_float_buffer_eq0", "fill_tril_forward", "fill_inplace",
         "fill_finfo_min", "where", "where_blocked_first", "where_hf_0d", "add_float_buffer", "add_inplace",
         "add_finfo_min", "add_llama_left"]
BIASES = ["none", "before_mask", "before_mask_inplace", "after_mask"]
SOFTMAXES = ["F-1", "F3", "torch", "method", "F_dtype32", "upcast_and_back"]

_any_spelling = st.fixed_dictionaries({
    "scale": st.sampled_from(SCALES), "matmul": st.sampled_from(MATMULS),
    "transpose": st.sampled_from(TRANSPOSES), "mask": st.sampled_from(MASKS), "bias": st.sampled_from(BIASES),
    "softmax": st.sampled_from(SOFTMAXES), "gqa": st.booleans(), "dropout": st.sampled_from([0.0, 0.0, 0.3]),
})
# drawn uniformly, fewer than 1 in 10 spellings is one the matcher can fuse: half the draws vary only
# what the fused spellings may vary (see expect_fused), so that both paths are well covered
_fusable_spelling = st.fixed_dictionaries({
    "scale": st.sampled_from([s for s in SCALES if s != "tensor"]), "matmul": st.sampled_from(["@", "matmul"]),
    "transpose": st.sampled_from(TRANSPOSES), "mask": st.sampled_from(MASKS), "bias": st.just("none"),
    "softmax": st.sampled_from(SOFTMAXES), "gqa": st.booleans(), "dropout": st.just(0.0),
})
spellings = st.one_of(_any_spelling, _fusable_spelling)


def _key(s: dict) -> tuple:
    """Hashable: the blocks of one stack are drawn distinct."""
    return tuple(sorted(s.items()))


NANOGPT = dict(scale="mul", matmul="@", transpose="transpose(-2,-1)", mask="fill_float_buffer_eq0", bias="none",
               softmax="F-1", gqa=False, dropout=0.0)
NANOGPT_INPLACE = dict(NANOGPT, scale="idiv", mask="fill_inplace")
NANOGPT_INPLACE_ADD = dict(NANOGPT, scale="mul_", mask="add_inplace", softmax="method")
HF_EAGER = dict(scale="mul", matmul="matmul", transpose="transpose(2,3)", mask="add_finfo_min", bias="none",
                softmax="F_dtype32", gqa=True, dropout=0.0)


def expect_fused(s: dict) -> bool:
    """What the matcher can prove: a python-scalar scale, `@`/matmul of q and k transposed, a causal
    (or no) mask by masked_fill, torch.where or an additive 0/-inf mask, softmax over the last dim, no learned
    bias, no dropout on the probabilities (the default "exact" mode)."""
    return (s["bias"] == "none" and s["dropout"] == 0.0 and s["scale"] != "tensor"
            and s["matmul"] in ("@", "matmul"))


class SpelledAttention(nn.Module):
    """One causal self-attention block spelled as `s` says: x (B, T, C) -> its projected output."""

    def __init__(self, s: dict):
        super().__init__()
        self.s = s
        kv = 1 if s["gqa"] else H
        self.q, self.kv, self.proj = nn.Linear(C, C), nn.Linear(C, 2 * kv * D), nn.Linear(C, C)
        self.drop = nn.Dropout(s["dropout"])
        if s["bias"] != "none":
            self.rel_bias = nn.Parameter(0.5 * torch.randn(H, T, T))
        self.register_buffer("causal", torch.tril(torch.ones(T, T, dtype=torch.bool)))
        self.register_buffer("tril", torch.tril(torch.ones(T, T)).view(1, 1, T, T))  # nanoGPT/minGPT
        self.register_buffer("additive", torch.zeros(T, T).masked_fill(~self.causal, float("-inf")))

    def _scale(self, att):
        kind, d = self.s["scale"], math.sqrt(D)
        if kind == "div":
            return att / d
        if kind == "mul":
            return att * (1.0 / d)
        if kind == "rmul":
            return (1.0 / d) * att
        if kind == "idiv":
            att /= d
        elif kind == "imul":
            att *= 1.0 / d
        elif kind == "div_":
            att.div_(d)
        elif kind == "mul_":
            att.mul_(1.0 / d)
        elif kind == "tensor":
            return att * torch.tensor(1.0 / d)
        return att

    def _bias(self, att):
        if self.s["bias"] == "before_mask_inplace":
            att += self.rel_bias
            return att
        return att + self.rel_bias

    def _mask(self, att):
        kind, t = self.s["mask"], att.shape[-1]
        if kind == "fill_bool_buffer":
            return att.masked_fill(~self.causal[:t, :t], float("-inf"))
        if kind == "fill_float_buffer_eq0":
            return att.masked_fill(self.tril[:, :, :t, :t] == 0, float("-inf"))
        if kind == "fill_tril_forward":
            causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=att.device))
            return att.masked_fill(causal.logical_not(), float("-inf"))
        if kind == "fill_inplace":
            att.masked_fill_(~self.causal, float("-inf"))
        elif kind == "fill_finfo_min":
            return att.masked_fill(~self.causal, torch.finfo(att.dtype).min)
        elif kind == "where":
            return torch.where(self.causal, att, float("-inf"))
        elif kind == "where_blocked_first":
            return torch.where(~self.causal, float("-inf"), att)
        elif kind == "where_hf_0d":  # HF's GPT-2: a 0-d finfo.min tensor, the method spelling
            fill = torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype, device=att.device)
            return att.where(self.tril[:, :, :t, :t].bool(), fill)
        elif kind == "add_float_buffer":
            return att + self.additive
        elif kind == "add_inplace":
            att += self.additive
        elif kind == "add_finfo_min":  # HF: 0 where visible, finfo(dtype).min where not, (B, 1, T, T)
            mask = torch.full((t, t), torch.finfo(att.dtype).min, device=att.device).triu(1)
            return att + mask[None, None].expand(att.shape[0], 1, t, t)
        elif kind == "add_llama_left":
            return torch.triu(torch.full((t, t), float("-inf"), device=att.device), diagonal=1) + att
        return att

    def _softmax(self, att, dtype):
        kind = self.s["softmax"]
        if kind == "F-1":
            return F.softmax(att, dim=-1)
        if kind == "F3":
            return F.softmax(att, dim=3)
        if kind == "torch":
            return torch.softmax(att, -1)
        if kind == "method":
            return att.softmax(-1)
        if kind == "F_dtype32":
            return F.softmax(att, dim=-1, dtype=torch.float32).to(dtype)
        return F.softmax(att.float(), dim=-1).to(dtype)

    def forward(self, x):
        s, b = self.s, x.shape[0]
        kv = 1 if s["gqa"] else H
        q = self.q(x).view(b, T, H, D).transpose(1, 2)
        k, v = (t.reshape(b, T, kv, D).transpose(1, 2) for t in self.kv(x).split(kv * D, dim=2))
        if s["gqa"]:
            k, v = k.repeat_interleave(H // kv, dim=1), v.repeat_interleave(H // kv, dim=1)
        if s["scale"] == "q_prescale":
            q = q * D ** -0.5
        kT = {"transpose(-2,-1)": lambda: k.transpose(-2, -1), "mT": lambda: k.mT,
              "transpose(2,3)": lambda: k.transpose(2, 3), "transpose(-1,-2)": lambda: k.transpose(-1, -2)}[
            s["transpose"]]()
        if s["matmul"] == "@":
            att = q @ kT
        elif s["matmul"] == "matmul":
            att = torch.matmul(q, kT)
        elif s["matmul"] == "bmm":
            att = torch.bmm(q.reshape(b * H, T, D), kT.reshape(b * H, D, T)).view(b, H, T, T)
        else:
            att = torch.einsum("bhqd,bhkd->bhqk", q, k)
        att = self._scale(att)
        if s["bias"] in ("before_mask", "before_mask_inplace"):
            att = self._bias(att)
        att = self._mask(att)
        if s["bias"] == "after_mask":
            att = self._bias(att)
        att = self.drop(self._softmax(att, q.dtype))
        y = (att @ v).transpose(1, 2).reshape(b, T, C)
        return self.proj(y)


class SpelledModel(nn.Module):
    """Embedding -> a residual stack of attention blocks, block i spelled as `specs[i]` says -> linear
    head -> cross entropy. One spelling: the classic single-block model."""

    def __init__(self, specs: list[dict]):
        super().__init__()
        self.specs = list(specs)
        self.emb, self.head = nn.Embedding(V, C), nn.Linear(C, V)
        self.blocks = nn.ModuleList(SpelledAttention(s) for s in self.specs)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).view(-1, V), targets.view(-1))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one thread runs each op in microseconds, several threads (on a shared
    2-core runner) spend milliseconds per op synchronising. Put back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model_and_inputs(specs: list[dict]):
    torch.manual_seed(0)
    model = SpelledModel(specs).train()
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    return model, (idx, targets)


def _step(fn, model, inputs):
    """loss and parameter gradients of one step of `fn`, seeded as the reference is (dropout blocks
    draw their masks in block order, eagerly and in the optimized step alike)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = fn(*inputs)
    loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _block_of(name: str) -> int | None:
    """blocks.3.q.weight -> 3; the embedding and the head belong to no block."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


def _fmt(s: dict) -> str:
    """A spelling as the code that writes it: dict(scale='div', matmul='@', ...)."""
    return "dict(" + ", ".join(f"{k}={s[k]!r}" for k in ("scale", "matmul", "transpose", "mask", "bias",
                                                           "softmax", "gqa", "dropout")) + ")"


def _mismatches(model, got, expect) -> list[str]:
    """What differs between two steps of `model`: the loss, then the gradients block by block, each
    block named with its spelling."""
    (loss, grads), (ref_loss, ref_grads) = got, expect
    wrong = []
    if not torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL):
        wrong.append(f"loss {loss.item()!r} != eager {ref_loss.item()!r}")
    by_block: dict[int | None, list[str]] = {}
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if g is None or r is None:
            what = f"{name}: no gradient (optimized {g is not None}, eager {r is not None})"
        elif not torch.allclose(g, r, rtol=RTOL, atol=ATOL):
            what = f"{name} off by {(g - r).abs().max().item():.3g}"
        else:
            continue
        i = _block_of(name)
        by_block.setdefault(i, []).append(what if i is None else what.split(".", 2)[2])  # blocks.3.q.weight
    for i, whats in by_block.items():
        wrong.append(f"{'outside the blocks' if i is None else f'block {i} {_fmt(model.specs[i])}'}: "
                     f"gradients {', '.join(whats)}")
    return wrong


def _routed(model):
    routers = []

    def run(*inputs):
        with route_attention(True, model=model) as router:
            routers.append(router)
            return model(*inputs)
    return run, routers


def _optimized_failures(specs: list[dict]) -> list[str]:
    """Run the stack `specs` eagerly and through `remat.optimize(..., solver="keep_all")` with the same
    seed; what differs: a block fused when it should not be (or not fused when it should), the loss,
    a parameter's gradient."""
    model, inputs = _model_and_inputs(specs)
    expect = _step(model, model, inputs)
    opt = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="keep_all")
    # the fused forward and backward ops, attributed to their block by the capture's module paths
    fused = Counter(n.module_path for n in opt.graph.nodes if n.op.startswith("flash_attention"))
    wrong = []
    for i, s in enumerate(specs):
        want, got = 2 if expect_fused(s) else 0, fused.pop(f"blocks.{i}", 0)
        if got != want:
            wrong.append(f"block {i} {_fmt(s)}: {got} fused attention op(s), expected {want}")
    wrong += [f"{n} fused attention op(s) outside any block, at {path!r}" for path, n in fused.items()]
    if wrong:  # for the message: what the router left unfused, and why
        run, routers = _routed(model)
        run(*inputs)
        wrong.append(f"the router, run eagerly, passed: {routers[0].passed}")
    return wrong + _mismatches(model, _step(opt, model, inputs), expect)


def _check_optimized(specs: list[dict]) -> None:
    wrong = _optimized_failures(specs)
    if not wrong:
        return
    lines = [f"the stack of {len(specs)} spelling(s) differs from eager:", *wrong]
    if len(specs) > 1:
        # point at the culprit: each spelling alone (a wrong forward in block i changes the loss and every
        # gradient, a wrong backward the gradients of blocks 0..i only)
        alone = [i for i, s in enumerate(specs) if _optimized_failures([s])]
        lines += ([f"block {i} also fails alone: reproduce with _check_optimized([{_fmt(specs[i])}])"
                   for i in alone] or
                  [f"no spelling fails alone: reproduce with _check_optimized([{', '.join(map(_fmt, specs))}])"])
    raise AssertionError("\n  ".join(lines))


SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


@settings(max_examples=210, **SETTINGS)
@given(s=spellings)
@example(s=NANOGPT)
@example(s=NANOGPT_INPLACE)
@example(s=NANOGPT_INPLACE_ADD)
@example(s=HF_EAGER)
def test_routed_spelling_matches_eager(s):
    model, inputs = _model_and_inputs([s])
    expect = _step(model, model, inputs)
    run, routers = _routed(model)
    got = _step(run, model, inputs)
    wrong = _mismatches(model, got, expect)
    assert not wrong, (s, wrong)
    assert routers[0].routed == int(expect_fused(s)), (s, routers[0].passed)


EXPLICIT = [NANOGPT, NANOGPT_INPLACE, NANOGPT_INPLACE_ADD, HF_EAGER, dict(NANOGPT, bias="before_mask_inplace"),
            dict(NANOGPT, mask="where_hf_0d", transpose="mT", softmax="upcast_and_back"),
            dict(NANOGPT, mask="fill_tril_forward", scale="div_", gqa=True)]


@settings(max_examples=STACKS, phases=(Phase.explicit, Phase.generate), **SETTINGS)
@given(specs=st.lists(spellings, min_size=BLOCKS, max_size=BLOCKS, unique_by=_key))
@example(specs=[NANOGPT])
@example(specs=EXPLICIT)
def test_optimized_spellings_match_eager(specs):
    """BLOCKS spellings per `remat.optimize` call: one residual stack, each block spelled its own way.
    No shrinking (each try traces a stack): a failure names the blocks and re-runs each spelling alone."""
    _check_optimized(specs)

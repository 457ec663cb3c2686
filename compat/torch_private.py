"""Every private PyTorch API remat uses, in one module, each behind a named entry point.

remat works at the level torch.compile works: AOTAutograd's joint graph, its partitioner, the
profiler's raw memory events, autograd's sequence numbers. Several of these have no public
spelling. They are reached only through this module, so that a torch upgrade breaks in one place,
and `tests/test_torch_private.py` checks each entry point against the installed torch, failing with
the torch version in the message when one changed. pyproject pins torch to the versions those tests
passed on (see `TESTED_TORCH`). Why this file is long: it is that one place, and each entry point
needs the few lines that adapt torch's private spelling to what remat asks of it.

Entry points (what each is for):
* `pytree`: torch.utils._pytree, flattening the model's inputs and outputs (dataclasses, ModelOutput);
* `disable_current_modes()`: run code with the active dispatch modes (fake tensors) switched off;
* `disable_torch_function()`: run code with torch-function overrides (the attention router) off;
* `tensor_base`: torch._C.TensorBase, whose descriptors (`.mT`, `.data`) the attention tracker sees;
* `autograd_sequence_nr()`: the autograd node counter, to tie graph nodes to module paths;
* `autocast_supported_devices()`: the device types autocast knows;
* `backward_without_autocast()`: trace the backward with autocast off, as eager autograd runs it;
* `aot_export_joint(stack, module, args)`, `joint_needs_autograd(joint)`, `joint_graph(joint)`,
  `joint_state_names(joint)`, `aot_compile_joint(joint, partition_fn, fw_compiler, bw_compiler)`:
  AOTAutograd in two stages (trace the joint graph; compile it with a given split), so that the
  split is decided between them, outside any callback;
* `joint_metadata(joint)`: AOTAutograd's metadata of a traced step, written out, to tell whether
  two traced steps are one function (graph_capture/step_identity.py);
* `default_partition`, `extract_fwd_bwd_modules`: AOTAutograd's partitioner and its extraction of
  the two graphs;
* `as_partitioner_runs()`: the grad and autocast modes AOTAutograd runs its partitioner under;
* `allow_retained_backward(forward)`: let a step AOTAutograd compiled run a backward
  with `retain_graph=True` (it refuses once compiled with donated buffers);
* `backward_keeps_graph()`: inside a backward, whether it runs with `retain_graph=True`;
* `is_input_mutation_output(desc)`: whether a joint-graph output descriptor is a mutated input;
* `tangent_output(desc)`: the forward output a joint-graph tangent input is the gradient of;
* `aot_backward_node(outputs)`: the autograd node of AOTAutograd's compiled function (its class
  is made per function), to hook its backward;
* `compile_session()`: hold `torch.compiler.is_compiling()` true, as torch.compile does;
* `profiler_events(prof)`: the profiler's raw event list ([memory] events included);
* `profiler_allocations(prof)`: the profile's allocations and frees with their addresses;
* `profiler_enabled()`: whether a profiler is recording now (torch keeps one session at a time);
* `compiled_submodules(model)`: which modules torch.compile wrapped (`torch.compile(m)`, `m.compile()`);
* `inductor_compile(fn, inputs, is_backward)`: Inductor's compiler for one already-partitioned
  forward or backward graph (what torch.compile runs after its own partitioner);
* `clear_cublas_workspaces()`: release cuBLAS's per-(handle, stream) workspaces, to measure them;
* `rnn_dropout_between_layers()`: the traced LSTM, GRU and RNN made to apply their dropout between
  stacked layers, as eager does (torch._decomp's loop drops it);
* `count_grouped_query_attention()`: torch.utils.flop_counter's SDPA formulas made to count
  grouped-query shapes as torch 2.13 does (earlier versions assert; the cost model and
  FlopCounterMode then saw 0 FLOPs for Hugging Face's enable_gqa attention);
* `fake_tensor_mode()`, `is_fake(t)`: a FakeTensorMode (tensors with shapes, dtypes and devices but no
  data) to trace and plan a step without its memory, and whether a tensor is one of its fakes;
* `tensor_checks_as_asserts(message)`: while a step is traced, `torch._check_tensor_all` on a fake
  tensor records `torch._assert_async` (an op of the graph, run on each call's values) instead of
  reading the value a fake tensor does not have (graph_capture/tensor_checks.py);
* `fresh_fake_tensor_cache()`: empty the fake tensors' dispatch cache, so that a trace starting
  after it meets the cache as every trace of the same module does (a cached output of an op that
  returns a view into a larger storage is a fresh storage of the view's size: a module's second
  trace would count other bytes than its first).
"""
from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._functorch.partitioners import _extract_fwd_bwd_modules, default_partition
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["TESTED_TORCH", "count_grouped_query_attention", "rnn_dropout_between_layers", "pytree", "disable_current_modes", "disable_torch_function", "tensor_base",
           "autograd_sequence_nr", "autocast_supported_devices", "backward_without_autocast",
           "aot_export_joint", "joint_needs_autograd", "joint_graph", "joint_state_names", "joint_metadata", "aot_compile_joint",
           "as_partitioner_runs", "default_partition", "extract_fwd_bwd_modules",
           "allow_retained_backward", "backward_keeps_graph",
           "is_input_mutation_output", "aot_backward_node", "tangent_output", "compile_session", "profiler_events", "profiler_allocations",
           "profiler_enabled", "compiled_submodules",
           "inductor_compile", "clear_cublas_workspaces", "fake_tensor_mode", "is_fake", "fresh_fake_tensor_cache",
           "tensor_checks_as_asserts"]

# The torch releases the tests of this module passed on (pyproject pins the same range).
TESTED_TORCH = ((2, 13),)

tensor_base = torch._C.TensorBase
extract_fwd_bwd_modules = _extract_fwd_bwd_modules


def disable_current_modes():
    """A context manager that switches off the active dispatch modes (FakeTensorMode, ...)."""
    return _disable_current_modes()


def disable_torch_function():
    """A context manager that switches off torch-function overrides (TorchFunctionMode, ...)."""
    return torch._C.DisableTorchFunction()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd node will get (increases with every recorded op)."""
    return torch._C._autograd._get_sequence_nr()


def autocast_supported_devices() -> set[str]:
    """The device types torch.autocast accepts."""
    return set(torch._C._autocast_supported_devices())


def backward_without_autocast():
    """A context manager under which AOTAutograd traces the backward with autocast off (its default
    traces it under the forward's autocast state)."""
    return torch._functorch.config.patch(backward_pass_autocast="off")


def aot_export_joint(stack, module: torch.nn.Module, args: list):
    """AOTAutograd's first stage on `module(*args)`: its joint forward+backward graph, with the
    module's parameters and buffers lifted as the graph's first inputs (`aot_export_joint_with_descriptors`).
    `stack` (an entered ExitStack) holds AOTAutograd's contexts; it must stay open until
    `aot_compile_joint` is done."""
    return aot_export_joint_with_descriptors(stack, module, tuple(args))


def joint_needs_autograd(joint) -> bool:
    """Whether the traced step has a backward (some output requires grad); without one AOTAutograd
    traced a forward only."""
    return bool(joint._aot_state.needs_autograd)


def joint_graph(joint) -> torch.fx.GraphModule:
    """The joint graph: primals then tangents in; the forward's outputs (mutated inputs' new
    values first), then one gradient per primal, out."""
    return joint.graph_module


def joint_state_names(joint) -> list[str]:
    """The names of the parameters and buffers the joint graph takes first, in its order."""
    return list(joint.params_spec) + list(joint.buffers_spec)


def joint_metadata(joint) -> str:
    """AOTAutograd's metadata of the traced step (`ViewAndMutationMeta`: which inputs it mutates,
    which outputs alias inputs, what requires grad), written out: what its runtime wrapper acts on,
    so two steps are compared on it (graph_capture/step_identity.py)."""
    return repr(joint._aot_state.fw_metadata)


def aot_compile_joint(joint, partition_fn: Callable, fw_compiler: Callable, bw_compiler: Callable) -> Callable:
    """AOTAutograd's second stage: the traced joint graph split by `partition_fn` and compiled, as
    `aot_module_simplified` runs it (`aot_stage2_compile`; `aot_compile_joint_with_descriptors`
    would add a tracing context and a serializable forward compiler, which change what Inductor
    compiles). Returns the runtime function taking one list (parameters, buffers, then the inputs)
    and returning the outputs' list."""
    from torch._functorch.aot_autograd import aot_stage2_compile

    run, _ = aot_stage2_compile(joint._aot_state, joint._aot_graph_capture, partition_fn, fw_compiler, bw_compiler)
    return run


@contextmanager
def as_partitioner_runs() -> Iterator[None]:
    """Grad mode off and autocast off, as AOTAutograd runs a partition function: work on the joint
    graph (rewrites, measuring ops, the split) runs as it would inside one."""
    with torch.no_grad():
        if torch._C._is_any_autocast_enabled():
            with torch._C._DisableAutocast():
                yield
        else:
            yield


def allow_retained_backward(forward: Callable) -> int:
    """Let the compiled step `forward` (what `aot_compile_joint` returned) run a backward with
    `retain_graph=True`, as eager autograd does. AOTAutograd records which saved tensors its
    backward may donate (`ViewAndMutationMeta.bw_donated_idxs`) and, while
    `torch._functorch.config.donated_buffer` is on, refuses a retained backward once the backward
    was compiled for single use ("compiled with non-empty donated buffers"). Donation only lets
    Inductor reuse saved tensors inside a backward AOTAutograd compiled itself; remat's graphs are
    compiled by remat (runtime/compile.py), outside AOTAutograd's context, so nothing is donated and
    the list is emptied. The flag cannot be switched off for one backward instead: AOTAutograd's
    backward reads it in another context than autograd's hooks run in. Returns how many metadata
    objects were found (the forward's closures and the autograd.Function's class, walked boundedly)."""
    from torch._functorch._aot_autograd.schemas import ViewAndMutationMeta

    found: list = []
    seen: set[int] = set()
    todo: list[tuple[object, int]] = [(forward, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 12:
            continue
        seen.add(id(obj))
        if isinstance(obj, ViewAndMutationMeta):
            found.append(obj)
            continue
        kids: list = []
        if isinstance(obj, types.FunctionType):
            kids = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            kids += [getattr(obj, "__wrapped__", None)]
        elif isinstance(obj, types.MethodType):
            kids = [obj.__func__, obj.__self__]
        elif isinstance(obj, (list, tuple)):
            kids = list(obj)
        elif type(obj).__module__.startswith("torch._functorch") or (
                isinstance(obj, type) and obj.__module__.startswith("torch._functorch")):
            kids = list(vars(obj).values())
        todo.extend((k, depth + 1) for k in kids if k is not None)
    for meta in found:
        meta.bw_donated_idxs = []
    return len(found)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True


def backward_keeps_graph() -> bool:
    """Inside a backward: whether it was asked to keep the graph (`retain_graph=True`), from
    autograd's current graph task (`torch._C._autograd._get_current_graph_task_keep_graph`)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def aot_backward_node(outputs) -> object | None:
    """The autograd node of AOTAutograd's compiled function among `outputs`' grad_fns (its class is
    made per compiled function, named "CompiledFunctionBackward"); None where no output has it
    (every output an alias AOTAutograd regenerated outside the function)."""
    for t in outputs:
        fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if fn is not None and type(fn).__name__ == "CompiledFunctionBackward":
            return fn
    return None


def tangent_output(desc) -> object | None:
    """The forward output descriptor a joint-graph tangent input's descriptor (node.meta["desc"])
    is the incoming gradient of; None for any other input, or on a torch without descriptors."""
    if desc is None or not hasattr(desc, "is_tangent") or not desc.is_tangent():
        return None
    return getattr(desc, "output", None)


def is_input_mutation_output(desc) -> bool | None:
    """Whether a joint-graph output descriptor (node.meta["desc"]) stands for a mutated input's new
    value; None when this torch has no output descriptors."""
    try:
        from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
    except ImportError:
        return None
    return isinstance(desc, InputMutationAOTOutput)


@contextmanager
def compile_session() -> Iterator[None]:
    """Hold `torch.compiler.is_compiling()` true, as torch.compile does for its whole compile
    session (`torch.compiler._compile_session_context`; torch 2.11 has no such context, so its flag
    `torch.compiler._is_compiling_flag` is held directly)."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def clear_cublas_workspaces() -> bool:
    """Release the cuBLAS/cuBLASLt workspaces PyTorch's caching allocator holds for each (handle,
    stream) (`torch._C._cuda_clearCublasWorkspaces`); False where this torch has no CUDA."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def profiler_events(prof: torch.profiler.profile) -> list:
    """The raw events of a finished profile (`prof.profiler.kineto_results.events()`): op ranges and,
    with profile_memory=True, "[memory]" events with `nbytes()` (+ alloc, - free), `start_ns()`,
    `device_type()`. Public `prof.events()` aggregates away the memory events' order."""
    return list(prof.profiler.kineto_results.events())


class Allocation(NamedTuple):
    """One allocation (`nbytes` > 0) or free (`nbytes` < 0) a profile with profile_memory=True saw."""
    time_ns: int  # on the clock of `profiler_events`' start_ns()
    nbytes: int
    ptr: int  # the block's address
    device: str  # "cpu", "cuda", ...


def profiler_enabled() -> bool:
    """Whether a profiler (torch.profiler.profile, torch.autograd.profiler.profile) is recording now."""
    return bool(torch._C._autograd._profiler_enabled())


def profiler_allocations(prof: torch.profiler.profile) -> list[Allocation]:
    """The allocations and frees of a finished profile, in no particular order. Unlike the
    "[memory]" events of `profiler_events` these carry the block's address (the event tree's
    Allocation events), which tells a free of a block the profile saw allocated from one it did not."""
    allocation = torch._C._profiler._EventType.Allocation
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == allocation:
            f = event.extra_fields
            out.append(Allocation(event.start_time_ns, int(f.alloc_size), int(f.ptr), f.device.type))
    return out


def compiled_submodules(model: torch.nn.Module) -> list[str]:
    """Names of the modules of `model` (itself: "") that torch.compile wraps: an OptimizedModule
    (`torch.compile(module)`) or a module whose `.compile()` was called."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [name for name, m in model.named_modules()
            if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None]


# random ops stay whole so Inductor runs them as ATen fallbacks (config.fallback_random): the masks
# are drawn as eager draws them, where Inductor's own decomposition (rand < p) would draw others
PLAN_FUSION_SIZE = 4  # see inductor_compile
_KEEP_WHOLE = ("native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint")


def inductor_compile(fn: Callable, inputs: list, is_backward: bool) -> Callable[[list], object]:
    """Compile one partitioned forward or backward graph (`fn(*inputs)` runs it: ATen ops, no
    autograd) with Inductor, as torch.compile compiles the graphs its own partitioner made: traced
    again with Inductor's decompositions (`select_decomp_table`, random ops left whole), then
    `compile_fx_inner`. `inputs` are the tensors of one call (real or fake). Returns a boxed
    function: it takes the list of inputs and empties it, so each is freed after its last use."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    table = {op: fn for op, fn in select_decomp_table().items()
             if getattr(getattr(op, "overloadpacket", None), "__name__", None) not in _KEEP_WHOLE}
    decomposed = make_fx(fn, decomposition_table=table, tracing_mode="fake")(*inputs)
    # fused kernels of up to PLAN_FUSION_SIZE nodes: Inductor's default (64) fuses nodes far apart
    # in the plan's order into one kernel, which keeps their buffers alive from the first to the last.
    # No layout optimisation: converting convolutions' tensors to channels-last adds copies the plan
    # did not count (benchmarks/compile_budget.py: the U-Net's compiled step at 70% peaked 16% over
    # its budget with it, 4% without)
    with inductor_config.patch(fallback_random=True, max_fusion_size=PLAN_FUSION_SIZE, layout_optimization=False):
        return compile_fx_inner(decomposed, list(inputs), is_backward=is_backward)


def fake_tensor_mode():
    """A new FakeTensorMode (torch._subclasses.fake_tensor): tensors made under it have shapes,
    strides, dtypes and devices but no data, and ops on them compute only those. Real tensors
    passed to its ops are refused (allow_non_fake_inputs=False): every tensor must be made fake
    first, so no real data is read by mistake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def fresh_fake_tensor_cache() -> None:
    """Empty the dispatch cache all FakeTensorModes share (AOTAutograd's, `fake_tensor_mode()`'s). On
    a hit the cache makes an op's output a fresh storage of the output's own size, where the op's
    fake kernel (slice_scatter into a sliced buffer, as Longformer's sliding chunks do) returns a
    view into a larger storage: a trace that met a cache its module's earlier trace had filled
    counted other bytes. From an empty cache every trace of a module hits and misses alike (and
    keeps the cache's speed within the trace: running every fake kernel instead made captures ~50%
    slower)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()


def is_fake(t) -> bool:
    """Whether `t` is a FakeTensor (or a functional/autograd wrapper of one): a tensor without data."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(t, torch.Tensor) and bool(_is_fake(t))


@contextmanager
def tensor_checks_as_asserts(message: str) -> Iterator[None]:
    """While held, `torch._check_tensor_all(cond)` (and `torch._check_tensor_all_with`) on a fake
    tensor records `torch._assert_async(cond.all(), message)`, an op of the traced graph (torch.fx
    keeps it: side-effecting) that raises RuntimeError with `message` where a call's values break
    it, instead of reading `cond`'s value (`.item()`: a DataDependentOutputException on a fake
    tensor). A check on any other tensor runs as torch runs it. torch._check_tensor_all calls
    torch._check_tensor_all_with through torch's module globals, so replacing that one covers both."""
    original = torch._check_tensor_all_with

    def check(error_type, cond, message_fn=None):
        if isinstance(cond, torch.Tensor) and cond.dtype == torch.bool and is_fake(cond):
            torch._assert_async(cond.all(), message)
            return
        original(error_type, cond, message_fn)

    torch._check_tensor_all_with = check
    try:
        yield
    finally:
        torch._check_tensor_all_with = original


def count_grouped_query_attention() -> bool:
    """Make torch.utils.flop_counter count SDPA with fewer key/value heads than query heads as the
    same attention with each key/value head repeated for its queries (what the kernels compute, and
    torch 2.13's formula), where the installed torch's formula refuses those shapes. Its registered
    formulas call the module's sdpa_flop_count / sdpa_backward_flop_count by name, so replacing those
    two covers every SDPA backend's formula. Returns whether it replaced them (idempotent)."""
    import torch.utils.flop_counter as fc

    fwd, bwd = fc.sdpa_flop_count, fc.sdpa_backward_flop_count
    try:
        fwd((1, 4, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8))
        return False  # this torch counts them already (or they were replaced before)
    except AssertionError:
        pass

    def heads(q, kv):
        return (kv[0], q[1], *kv[2:])

    def sdpa_flop_count(query_shape, key_shape, value_shape):
        return fwd(query_shape, heads(query_shape, key_shape), heads(query_shape, value_shape))

    def sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape):
        return bwd(grad_out_shape, query_shape, heads(query_shape, key_shape), heads(query_shape, value_shape))

    fc.sdpa_flop_count, fc.sdpa_backward_flop_count = sdpa_flop_count, sdpa_backward_flop_count
    return True


def rnn_dropout_between_layers() -> bool:
    """Make the traced LSTM, GRU and RNN apply their dropout between stacked layers, as eager does.
    AOTAutograd traces them through torch._decomp's decompositions, whose shared layer loop
    (`_rnn_helper`) sets the dropout to 0 for every layer (`num_layers < i - 1` never holds): a
    stacked RNN with dropout traced in training computed another function than the model, silently
    (a 2-layer LSTM with dropout 0.1, float64: loss 4.80928 against eager's 4.80785, gradients off
    by 5e-3). The loop is replaced by one that runs it one layer at a time with `torch.dropout`
    between layers, as eager's RNNs apply it (the same op, in the same order: the same masks from
    the same seed); torch.compile in the same process traces the fixed loop too. Returns whether it
    replaced it (idempotent)."""
    from torch._decomp import decompositions

    layer_loop = decompositions._rnn_helper
    if getattr(layer_loop, "_remat_layer_by_layer", False):
        return False

    def layer_by_layer(input, hidden, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
                       layer_fn):
        if not (dropout and train and num_layers > 1):
            return layer_loop(input, hidden, params, has_biases, num_layers, dropout, train, bidirectional,
                              batch_first, layer_fn)
        per_layer = 2 if bidirectional else 1  # params and hidden hold one entry per layer and direction
        out = input.transpose(0, 1) if batch_first else input
        finals = []
        for i in range(num_layers):
            at = slice(i * per_layer, (i + 1) * per_layer)
            out, final = layer_loop(out, hidden[at], params[at], has_biases, 1, 0.0, train, bidirectional, False,
                                    layer_fn)
            finals += final
            if i < num_layers - 1:
                out = torch.dropout(out, dropout, train=True)
        return (out.transpose(0, 1) if batch_first else out), finals

    layer_by_layer._remat_layer_by_layer = True
    decompositions._rnn_helper = layer_by_layer
    return True


# applied once, when remat imports torch's private entry points (the cost model's FLOPs, the fused
# attention's formulas and FlopCounterMode read the module's functions at call time, and so do the
# RNN decompositions their layer loop)
count_grouped_query_attention()
rnn_dropout_between_layers()

"""Each private PyTorch API remat uses (remat.compat.torch_private) still does what remat relies on.

One test per entry point, each on the smallest case that exercises it. A failure here means the
installed torch changed that API: the message names the torch version and the entry point, so the
fix goes to compat/torch_private.py (and the pin in pyproject.toml), not to the callers.
"""
import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from remat.compat import torch_private as tp

TORCH = torch.__version__


def _fail(entry: str, what: str) -> str:
    return f"torch {TORCH}: remat.compat.torch_private.{entry}: {what}; update compat/torch_private.py"


def test_the_installed_torch_is_a_tested_release():
    major, minor = (int(x) for x in TORCH.split("+")[0].split(".")[:2])
    assert (major, minor) in tp.TESTED_TORCH, _fail("TESTED_TORCH", f"{major}.{minor} was never tested")


def test_pytree_flattens_and_rebuilds_nested_outputs():
    tree = {"a": (torch.ones(1), [torch.zeros(2)]), "b": 3}
    leaves, spec = tp.pytree.tree_flatten(tree)
    assert len(leaves) == 3, _fail("pytree", "tree_flatten")
    rebuilt = tp.pytree.tree_unflatten(leaves, spec)
    assert rebuilt["b"] == 3 and torch.equal(rebuilt["a"][1][0], torch.zeros(2)), _fail("pytree", "tree_unflatten")
    pairs, _ = tp.pytree.tree_flatten_with_path(tree)
    assert tp.pytree.keystr(pairs[0][0]) == "['a'][0]", _fail("pytree", "keystr / tree_flatten_with_path")


def test_disable_current_modes_leaves_a_dispatch_mode():
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.ones(2) + 1
        n = len(seen)
        with tp.disable_current_modes():
            torch.ones(2) + 1
    assert n > 0 and len(seen) == n, _fail("disable_current_modes", "the dispatch mode still saw ops")


def test_disable_torch_function_leaves_a_function_mode():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        with tp.disable_torch_function():
            torch.ones(2).add(1)
    assert not seen, _fail("disable_torch_function", "the torch-function mode still saw calls")


def test_tensor_base_holds_the_descriptors_the_tracker_matches():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.ones(2, 3)
    with Spy():
        x.mT
        x.data
    wanted = {tp.tensor_base.mT.__get__, torch.Tensor.mT.__get__}
    assert seen and seen[0] in wanted, _fail("tensor_base", f".mT reaches torch function as {seen[:1]}")
    assert seen[1] in {tp.tensor_base.data.__get__, torch.Tensor.data.__get__}, _fail("tensor_base", ".data")


def test_autograd_sequence_nr_counts_recorded_ops():
    x = torch.ones(2, requires_grad=True)
    a = tp.autograd_sequence_nr()
    y = (x * 2).sum()
    b = tp.autograd_sequence_nr()
    assert b >= a + 2, _fail("autograd_sequence_nr", f"{a} -> {b} after two recorded ops")
    assert y.grad_fn._sequence_nr() < b


def test_autocast_supported_devices_include_cpu():
    devs = tp.autocast_supported_devices()
    assert {"cpu", "cuda"} <= devs, _fail("autocast_supported_devices", f"got {sorted(devs)}")


def test_backward_without_autocast_is_a_config_patch():
    from torch._functorch import config

    before = config.backward_pass_autocast
    with tp.backward_without_autocast():
        assert config.backward_pass_autocast == "off", _fail("backward_without_autocast", "not applied")
    assert config.backward_pass_autocast == before


class _Tuple(nn.Module):
    """AOTAutograd's two stages take modules that return tuples."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return (self.inner(x),)


def _aot(model, x, compiler, partition=None):
    """AOTAutograd's runtime function of `model(x)` (parameters, buffers, then x in one list)."""
    import contextlib

    with contextlib.ExitStack() as stack:
        joint = tp.aot_export_joint(stack, model, [x])
        return tp.aot_compile_joint(joint, partition or tp.default_partition, compiler, compiler)


def test_aot_two_stages_give_the_joint_graph_and_run_with_passed_parameters():
    import contextlib

    torch.manual_seed(0)
    model, x = _Tuple(nn.Linear(3, 2)), torch.randn(4, 3, requires_grad=True)
    with contextlib.ExitStack() as stack:
        joint = tp.aot_export_joint(stack, model, [x])
        assert tp.joint_needs_autograd(joint), _fail("joint_needs_autograd", "a step with a backward says none")
        assert tp.joint_state_names(joint) == ["inner.weight", "inner.bias"], _fail(
            "joint_state_names", str(tp.joint_state_names(joint)))
        gm = tp.joint_graph(joint)
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        assert placeholders == ["primals_1", "primals_2", "primals_3", "tangents_1"], _fail("joint_graph", str(placeholders))
        handed = []

        def partition(joint_gm, inputs, **kw):
            handed.append(joint_gm is gm)
            return tp.default_partition(joint_gm, inputs, **kw)

        run = tp.aot_compile_joint(joint, partition, lambda g, ex: make_boxed_func(g), lambda g, ex: make_boxed_func(g))
    assert handed == [True], _fail("aot_compile_joint", "the partition function did not get the exported joint graph")
    params = list(model.parameters())
    new = [torch.zeros_like(p).requires_grad_() for p in params]
    out = run([*new, x])[0]
    assert torch.equal(out, torch.zeros(4, 2)), _fail("aot_compile_joint", "the passed parameters were not used")
    out.sum().backward()
    assert torch.equal(new[1].grad, torch.full((2,), 4.0)), _fail("aot_compile_joint", "wrong gradient")
    with contextlib.ExitStack() as stack:  # nothing requires grad: AOTAutograd traces no backward
        frozen = _Tuple(nn.Linear(3, 2)).requires_grad_(False)
        assert not tp.joint_needs_autograd(tp.aot_export_joint(stack, frozen, [torch.randn(4, 3)]))


def test_joint_metadata_writes_out_what_the_step_mutates_and_requires_grad():
    import contextlib

    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)  # an input mutation AOTAutograd's runtime applies
            return (self.lin(x),)

    written = []
    for model in (_Tuple(nn.Linear(3, 2)), _Tuple(nn.Linear(3, 2)), Counts()):
        with contextlib.ExitStack() as stack:
            written.append(tp.joint_metadata(tp.aot_export_joint(stack, model, [torch.randn(4, 3)])))
    assert all(isinstance(w, str) for w in written) and "mutates_data=True" in written[2], _fail(
        "joint_metadata", written[2][:300])
    assert written[0] == written[1] != written[2], _fail("joint_metadata", "two equal steps written out differently")


def test_as_partitioner_runs_turns_grad_and_autocast_off():
    with torch.autocast("cpu", dtype=torch.bfloat16), tp.as_partitioner_runs():
        assert not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"), _fail(
            "as_partitioner_runs", "grad or autocast still on")
    assert torch.is_grad_enabled()


def test_default_partition_and_extract_fwd_bwd_modules_split_a_joint_graph():
    seen = {}

    def partition(joint, inputs, **kw):
        fw, bw = tp.default_partition(joint, inputs, **kw)
        seen["n"] = kw["num_fwd_outputs"]
        fw_outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        saved = [n for n in joint.graph.nodes if n.name in {o.name for o in fw_outputs[kw["num_fwd_outputs"]:]}]
        fw2, bw2 = tp.extract_fwd_bwd_modules(joint, saved, [], num_fwd_outputs=kw["num_fwd_outputs"])
        seen["same"] = len(list(fw2.graph.nodes)) == len(list(fw.graph.nodes))
        return fw, bw

    model, x = _Tuple(nn.Sequential(nn.Linear(3, 3), nn.Tanh())), torch.randn(2, 3)
    run = _aot(model, x, lambda gm, ex: make_boxed_func(gm), partition)
    run([*model.parameters(), x])[0].sum().backward()
    assert seen.get("n") == 1 and seen.get("same"), _fail("default_partition/extract_fwd_bwd_modules", str(seen))


def test_input_mutation_outputs_are_told_apart():
    class Mut(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count.add_(1)
            return (x * 2,)

    descs = []

    def compiler(gm, ex):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        descs.extend(out.meta.get("desc") or [])
        return make_boxed_func(gm)

    x = torch.randn(2, requires_grad=True)
    mut = Mut()
    _aot(mut, x, compiler)([*mut.buffers(), x])
    flags = [tp.is_input_mutation_output(d) for d in descs]
    assert None not in flags, _fail("is_input_mutation_output", "no output descriptors in this torch")
    assert flags.count(True) == 1, _fail("is_input_mutation_output", f"flags {flags} for {descs}")


def test_tangents_name_their_output_and_the_compiled_function_has_its_backward_node():
    import contextlib

    torch.manual_seed(0)
    model, x = _Tuple(nn.Linear(3, 2)), torch.randn(4, 3, requires_grad=True)
    with contextlib.ExitStack() as stack:
        joint = tp.aot_export_joint(stack, model, [x])
        gm = tp.joint_graph(joint)
        out_descs = gm.graph.output_node().meta.get("desc") or []
        tangents = [tp.tangent_output(n.meta.get("desc")) for n in gm.graph.nodes if n.op == "placeholder"]
        assert tangents[:3] == [None, None, None], _fail("tangent_output", f"a primal read as a tangent: {tangents}")
        assert out_descs and tangents[3] == out_descs[0], _fail("tangent_output", f"{tangents[3]} vs {out_descs[:1]}")
        run = tp.aot_compile_joint(joint, tp.default_partition, lambda g, ex: make_boxed_func(g),
                                   lambda g, ex: make_boxed_func(g))
    outs = run([*model.parameters(), x])
    node = tp.aot_backward_node(outs)
    assert node is not None and len(node.next_functions) == 3, _fail("aot_backward_node", f"{outs[0].grad_fn}")


def test_compile_session_makes_is_compiling_true():
    assert not torch.compiler.is_compiling()
    with tp.compile_session():
        assert torch.compiler.is_compiling(), _fail("compile_session", "is_compiling() stayed False")
    assert not torch.compiler.is_compiling()


def test_profiler_events_have_ordered_memory_events():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        del a
    mem = [e for e in tp.profiler_events(prof) if e.name() == "[memory]"]
    sizes = [e.nbytes() for e in sorted(mem, key=lambda e: e.start_ns())]
    assert (1 << 20) in sizes and -(1 << 20) in sizes, _fail("profiler_events", f"memory events {sizes}")
    assert all(e.device_type() == torch.autograd.DeviceType.CPU for e in mem), _fail("profiler_events", "device")


def test_profiler_allocations_carry_address_size_and_device():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        ptr = a.data_ptr()
        del a
    seen = sorted((x for x in tp.profiler_allocations(prof) if x.ptr == ptr), key=lambda x: x.time_ns)
    assert [(x.nbytes, x.device) for x in seen] == [(1 << 20, "cpu"), (-(1 << 20), "cpu")], \
        _fail("profiler_allocations", f"allocations at the block's address {seen}")


def test_profiler_enabled_says_whether_a_profiler_records():
    assert not tp.profiler_enabled(), _fail("profiler_enabled", "on outside any profiler")
    with profile(activities=[ProfilerActivity.CPU]):
        assert tp.profiler_enabled(), _fail("profiler_enabled", "off inside torch.profiler.profile")
    assert not tp.profiler_enabled(), _fail("profiler_enabled", "still on after the profiler stopped")


def test_fake_tensor_mode_makes_tensors_without_data():
    mode = tp.fake_tensor_mode()
    with mode:
        x = torch.empty_strided((4, 8), (1, 4), dtype=torch.float32, device="cpu")
        y = x.t() @ torch.empty(4, 3)
    assert tuple(y.shape) == (8, 3) and y.device.type == "cpu", _fail("fake_tensor_mode", "shapes or devices")
    assert x.stride() == (1, 4), _fail("fake_tensor_mode", "empty_strided lost its strides")
    assert tp.is_fake(x) and tp.is_fake(y), _fail("is_fake", "a FakeTensor is not recognised")
    assert not tp.is_fake(torch.ones(2)) and not tp.is_fake(torch.empty(2, device="meta")) \
        and not tp.is_fake(3), _fail("is_fake", "a real or meta tensor (or no tensor) is taken for a fake")
    try:
        with mode:
            x + torch.ones(8, 4)  # a real tensor in a fake op: refused, never read
    except Exception:
        pass
    else:
        raise AssertionError(_fail("fake_tensor_mode", "real tensors are accepted as inputs"))


def test_fresh_fake_tensor_cache_makes_a_sequence_of_fake_ops_repeat():
    """After fresh_fake_tensor_cache the same fake ops give the storages they gave the first time
    (the dispatch cache, filled by the first run, made a later slice_scatter into a sliced buffer a
    storage of the output's own size where its kernel's output views a larger one)."""
    def storages():
        with tp.fake_tensor_mode():
            base = torch.zeros(4, 9, 33)
            view = base[:, 1:]
            src = torch.ones(4, 8, 30)
            out = [torch.ops.aten.slice_scatter.default(view, src, 2, 3, 33) for _ in range(2)]
            return [(o.untyped_storage().nbytes(), o.storage_offset()) for o in out]

    tp.fresh_fake_tensor_cache()
    first = storages()
    tp.fresh_fake_tensor_cache()
    assert storages() == first, _fail("fresh_fake_tensor_cache", "fake outputs differ after the cache was emptied")


def test_rnn_decompositions_apply_dropout_between_layers():
    """The LSTM decomposition AOTAutograd traces, with the entry point applied (as importing remat
    does): dropout 1 between two layers zeroes the second layer's input, so its output is the
    second layer run on zeros, not what dropout 0 gives; the entry point replaces the loop once."""
    from torch._decomp import decompositions

    assert tp.rnn_dropout_between_layers() is False  # applied when remat imported compat
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 4, num_layers=2, dropout=0.5)
    x = torch.randn(3, 2, 4)
    hx = (torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))
    weights = lstm._flat_weights

    def run(dropout, inp=x, layers=2, params=weights):
        return decompositions.lstm_impl(inp, hx if layers == 2 else (hx[0][:1], hx[1][:1]), params, True, layers,
                                        dropout, True, False, False)[0]

    second_on_zeros = run(0.0, torch.zeros(3, 2, 4), 1, weights[4:])
    torch.testing.assert_close(run(1.0), second_on_zeros)
    assert not torch.allclose(run(0.0), second_on_zeros)


def test_tensor_checks_as_asserts_records_an_assert_on_fakes_and_checks_real_tensors():
    with tp.fake_tensor_mode() as mode:
        cond = mode.from_tensor(torch.tensor([True, False]))
        with tp.tensor_checks_as_asserts("kept"):
            torch._check_tensor_all(cond)  # no value read: the fake's assert records nothing to fail
    with tp.tensor_checks_as_asserts("kept"), pytest.raises(RuntimeError):
        torch._check_tensor_all(torch.tensor([True, False]))  # a real tensor: checked as torch checks it
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda t: (torch._check_tensor_all(t > 0), t * 2)[1], tracing_mode="fake")
    with tp.tensor_checks_as_asserts("kept"):
        gm = graph(torch.ones(3))
    assert any("_assert_async" in str(n.target) for n in gm.graph.nodes), \
        _fail("tensor_checks_as_asserts", "no _assert_async op in the traced graph")
    with pytest.raises(RuntimeError, match="kept"):
        gm(-torch.ones(3))
    assert torch._check_tensor_all_with.__module__ == "torch"  # put back

"""The baselines (chen_greedy, per_block, selective, revolve) on hand-made graphs whose right answer
is known, and each end to end through remat.optimize on a tiny model (gradients equal eager's,
measured peak == predicted peak <= budget)."""
from __future__ import annotations

import pytest
import torch

import remat
from remat.core.training_graph import Node, TrainingGraph
from remat.solver import chen_greedy, get_solver, per_block, revolve, selective
from remat.solver.revolve import NotAChainError, griewank_p, optimal_advances
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate
from tests.conftest import transformer_like

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _chain(sizes, paths=None, *, source=True) -> TrainingGraph:
    """s (a random input-like value, never recomputed) -> f1 -> ... -> fn, and the mirrored
    backward b_n .. b_1 where b_i reads b_{i+1} and f_i (the backward of a step reads its output,
    as ReLU's or tanh's does). `paths`: module paths of f1..fn."""
    n = len(sizes)
    nodes = [Node("s", "rand", (), 1, is_random=True)] if source else []
    for i, b in enumerate(sizes, 1):
        prev = (f"f{i - 1}",) if i > 1 else (("s",) if source else ())
        nodes.append(Node(f"f{i}", "op", prev, b, cost=1.0, module_path=(paths or [""] * n)[i - 1]))
    for i in range(n, 0, -1):
        ins = (f"f{i}",) if i == n else (f"b{i + 1}", f"f{i}")
        nodes.append(Node(f"b{i}", "bwd", ins, 1, kept_bytes=1 if i == 1 else 0, is_backward=True))
    return TrainingGraph(nodes=tuple(nodes), resident_bytes=0, name=f"chain{n}")


# ---- chen_greedy --------------------------------------------------------------------------------

def test_chen_greedy_segments_by_accumulated_bytes():
    g = _chain([10, 20, 5, 5, 30, 10, 10, 10])
    # candidates: f1..f7 (articulation points; f8 is a leaf). Algorithm 3: temp += size; split
    # where temp > B at a candidate, then temp = 0
    kept, x, y = chen_greedy.segment(g, 15)
    assert kept == ["f2", "f5", "f7"]  # temps: s 1 + 10 + 20 = 31; 5 + 5 + 30 = 40; 10 + 10 = 20
    assert x == 20 + 30 + 10 and y == 40
    kept, x, y = chen_greedy.segment(g, 25)
    assert kept == ["f2", "f5"] and x == 50 and y == 40  # 10 + 10 = 20 at f7 is not over 25
    assert chen_greedy.segment(g, 0)[0] == [f"f{i}" for i in range(1, 8)]  # every candidate
    assert chen_greedy.segment(g, 10**9)[0] == []  # one segment
    # the sqrt(x*y) guesses start at B = 0
    th = chen_greedy.thresholds(g, grid=0, ntrial=0)
    _, x0, y0 = chen_greedy.segment(g, 0)
    assert 0.0 in th and pytest.approx((x0 * y0) ** 0.5) in th


def test_chen_greedy_cheapest_fitting_plan():
    g = _chain([10, 20, 5, 5, 30, 10, 10, 10])
    full = simulate(g, keep_all_schedule(g)).peak_bytes
    lowest = chen_greedy.solve(g, 1)
    assert lowest.status == "infeasible" and lowest.predicted_peak_bytes < full
    budget = (lowest.predicted_peak_bytes + full) // 2
    plan = chen_greedy.solve(g, budget)
    assert plan.status == "heuristic" and plan.predicted_peak_bytes <= budget
    # no split set of the thresholds tried is cheaper and fits
    for b in chen_greedy.thresholds(g):
        kept, _, _ = chen_greedy.segment(g, b)
        from remat.solver.schedule import schedule_from_kept

        sim = simulate(g, schedule_from_kept(g, kept))
        if sim.peak_bytes <= budget:
            assert plan.extra_cost <= sim.extra_cost


# ---- per_block ----------------------------------------------------------------------------------

def _blocky() -> TrainingGraph:
    """emb -> [h.0: a, b] -> [h.1: a, b] -> head, a Sequential stem with three different layers,
    and a nested numbered container inside each block."""
    paths = ["stem.0", "stem.1", "stem.2", "h.0.sub.0", "h.0.sub.1", "h.0", "h.1.sub.0", "h.1.sub.1", "h.1", "head"]
    nodes, prev = [], ()
    ops = ["conv", "bn", "relu", "mm", "gelu", "add", "mm", "gelu", "add", "mm"]
    for k, (p, op) in enumerate(zip(paths, ops)):
        nodes.append(Node(f"n{k}", op, prev, 10, module_path=p))
        prev = (f"n{k}",)
    fwd = nodes
    bwd = []
    for k in range(len(fwd) - 1, -1, -1):
        ins = ((f"d{k + 1}",) if k < len(fwd) - 1 else ()) + (f"n{k}",)
        bwd.append(Node(f"d{k}", "bwd", ins, 10, is_backward=True))
    return TrainingGraph(nodes=tuple(fwd + bwd), resident_bytes=0)


def test_per_block_finds_the_repeated_container():
    g = _blocky()
    assert per_block.repeated_containers(g) == ["h"]  # not "stem" (different layers), not "h.0.sub"
    assert per_block.find_blocks(g) == {"h.0": ["n3", "n4", "n5"], "h.1": ["n6", "n7", "n8"]}


def test_per_block_keeps_exactly_the_block_inputs_and_outputs():
    g = _blocky()
    kept = per_block.block_kept(g, per_block.find_blocks(g))
    # outside the blocks: stem and head; of each block only its output (the next one's input)
    assert kept == ["n0", "n1", "n2", "n5", "n8", "n9"]
    plan = per_block.solve(g)
    assert set(plan.recomputed) == {"n3", "n4", "n6", "n7"}  # the inside of each block
    assert plan.details["blocks"] == 2 and plan.status == "heuristic"
    assert per_block.solve(g, 1).status == "infeasible"


def test_per_block_on_transformer_like():
    g = transformer_like(3)
    blocks = per_block.find_blocks(g)
    assert list(blocks) == ["h.0", "h.1", "h.2"]
    plan = per_block.solve(g)
    kept_outputs = {f"h.{b}.res2" for b in range(3)}
    recomputed = set(plan.recomputed)
    assert recomputed and all(n.startswith("h.") for n in recomputed)
    assert not recomputed & kept_outputs  # block outputs are kept
    assert plan.predicted_peak_bytes < simulate(g, keep_all_schedule(g)).peak_bytes


# ---- selective ----------------------------------------------------------------------------------

def test_selective_recomputes_exactly_the_attention_core():
    g = transformer_like(2)
    cores = selective.attention_cores(g)
    assert [set(c) for c in cores] == [{f"h.{b}.{x}" for x in ("scores", "scale", "softmax", "attn.drop", "av")}
                                       for b in range(2)]
    assert [selective.core_outputs(g, c) for c in cores] == [[f"h.{b}.av"] for b in range(2)]
    plan = selective.solve(g)
    # the backward reads softmax (softmax's derivative), attn.drop (kept: random), av (kept: the
    # core's output, the projection's input) and q, k, v, so what is recomputed is the softmax and
    # the scores and scale it is made from, nothing else
    assert set(plan.recomputed) == {f"h.{b}.{x}" for b in range(2) for x in ("scores", "scale", "softmax")}
    assert all(len(v) == 1 for v in plan.recomputed.values())


def test_selective_ignores_a_classifier_softmax():
    nodes = (Node("x", "mm", (), 10), Node("p", "_softmax.default", ("x",), 10),
             Node("dp", "bwd", ("p",), 10, is_backward=True), Node("dx", "bwd", ("dp",), 10, kept_bytes=1,
                                                                     is_backward=True))
    g = TrainingGraph(nodes=nodes, resident_bytes=0)
    assert selective.attention_cores(g) == []
    assert selective.solve(g).schedule == keep_all_schedule(g)


# ---- revolve --------------------------------------------------------------------------------------

def test_griewank_recursion_equals_the_closed_form():
    for n in range(1, 30):
        for c in range(0, n):
            assert optimal_advances(n, c) == griewank_p(n, c + 1), (n, c)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13])
def test_revolve_recomputations_match_griewank(n):
    g = _chain([4] * n)
    chain = revolve.find_chain(g)
    assert chain.length == n and chain.states == tuple(f"f{i}" for i in range(1, n))
    for c in range(n):
        plan = revolve.solve(g, None, snapshots=c)
        sim = simulate(g, plan.schedule)
        p = griewank_p(n, c + 1)  # c snapshot slots besides x_0 (the inputs)
        assert plan.details["advances"] == p
        assert sim.recomputations == p  # one node per step: each advance/youturn recomputes one
        assert sim.peak_bytes == plan.predicted_peak_bytes


def test_revolve_memory_falls_with_fewer_snapshots_and_budget_is_met():
    g = _chain([4] * 10)
    peaks = [revolve.solve(g, None, snapshots=c).predicted_peak_bytes for c in range(10)]
    assert peaks[0] < peaks[-1]
    budget = peaks[2]
    plan = revolve.solve(g, budget)
    assert plan.predicted_peak_bytes <= budget and plan.status == "heuristic"
    assert plan.extra_cost <= revolve.solve(g, None, snapshots=2).extra_cost
    assert revolve.solve(g, 1).status == "infeasible"


def test_revolve_refuses_a_graph_that_is_not_a_chain():
    g = _chain([4] * 5)
    # a backward node reading values of two different steps
    nodes = list(g.nodes) + [Node("bx", "bwd", ("b1", "f1", "f4"), 1, is_backward=True)]
    bad = TrainingGraph(nodes=tuple(nodes), resident_bytes=0)
    with pytest.raises(NotAChainError, match="bx"):
        revolve.solve(bad, None)
    assert issubclass(NotAChainError, ValueError)


def test_revolve_one_step_graph_keeps_everything():
    # a diamond: no articulation point on the main line, one step, nothing recomputed
    nodes = (Node("a", "op", (), 5), Node("b", "op", ("a",), 5), Node("c", "op", ("a",), 5),
             Node("d", "op", ("b", "c"), 5), Node("db", "bwd", ("d", "b", "c"), 5, is_backward=True),
             Node("da", "bwd", ("db", "a"), 5, kept_bytes=1, is_backward=True))
    g = TrainingGraph(nodes=nodes, resident_bytes=0)
    plan = revolve.solve(g, None)
    assert plan.details["steps"] == 1 and plan.extra_cost == 0


# ---- end to end -----------------------------------------------------------------------------------

def _eager(model, inputs, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(*inputs)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.fixture(scope="module")
def tiny():
    from remat.default_model import GPTConfig, default_inputs, default_model

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1, batch_size=2)
    model, inputs = default_model(cfg), default_inputs(cfg)
    graph = remat.capture(model, inputs)
    keep = remat.solve(graph, None, solver="keep_all").predicted_peak_bytes
    return model, inputs, _eager(model, inputs), keep


@pytest.mark.parametrize("strategy", ["chen_greedy", "per_block", "selective", "revolve"])
def test_end_to_end(tiny, strategy):
    model, inputs, (ref_loss, ref_grads), keep = tiny
    g = remat.capture(model, inputs)
    lowest = get_solver(strategy)(g, 1).predicted_peak_bytes  # budget-independent for per_block, selective
    budget = lowest if strategy in ("per_block", "selective") else (lowest + keep) // 2
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, solver=strategy)
    assert opt.plan.strategy == strategy and opt.plan.fits and opt.plan.status == "heuristic"
    if strategy != "selective" or opt.plan.details["cores"]:
        assert opt.plan.extra_cost > 0  # it does recompute
    params = list(model.parameters())

    def step():
        loss = opt(*inputs)
        loss.backward()
        return loss

    model.zero_grad(set_to_none=True)
    peak = remat.measure_peak(step, resident=[model, *inputs])
    assert peak == opt.plan.predicted_peak_bytes <= budget
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = step()
    assert torch.equal(loss.detach(), ref_loss)
    for p, r in zip(params, ref_grads):
        assert torch.allclose(p.grad, r, rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)


def test_end_to_end_unet_per_block():
    """A model of remat.models (BatchNorm, skip connections): two block containers."""
    from remat.models import build_unet, unet_inputs

    model, inputs = build_unet(width=4, depth=2), unet_inputs(batch=2, size=16)
    ref_loss, ref_grads = _eager(model, inputs)
    g = remat.capture(model, inputs)
    plan = remat.solve(g, None, solver="per_block")
    assert plan.details["containers"] == ["down", "up"] and plan.details["blocks"] == 4
    opt = remat.optimize(model, budget_bytes=plan.predicted_peak_bytes, example_inputs=inputs, solver="per_block")

    def step():
        loss = opt(*inputs)
        loss.backward()
        return loss

    model.zero_grad(set_to_none=True)
    assert remat.measure_peak(step, resident=[model, *inputs]) == opt.plan.predicted_peak_bytes
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = step()
    assert torch.allclose(loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(p.grad, r, rtol=1e-5, atol=1e-6) for p, r in zip(model.parameters(), ref_grads))

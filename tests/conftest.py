"""Synthetic TrainingGraphs for the solver tests, and an exact brute-force reference solver.

* `training_chain`: Checkmate's linear training graph (n forward nodes f1..fn, mirrored backward
  nodes bn..b1 where b_i reads b_{i+1} and f_i), with seeded random bytes and costs.
* `transformer_like`: an ATen-flavoured stack of pre-norm transformer blocks (views, layer norm
  pieces, matmuls, softmax, dropout, residual adds) with a synthesised backward, ~50 nodes a block.
* `random_dag`: a random training-shaped DAG (random forward DAG + synthesised backward).
* `brute_force`: exhaustive Dijkstra search over every schedule in the simulator's model.
"""
from __future__ import annotations

import heapq
import os
import random

import pytest

from remat.core.training_graph import Node, TrainingGraph

__all__ = ["training_chain", "transformer_like", "random_dag", "with_backward", "brute_force", "random_schedule"]


def pytest_configure(config):
    """Under pytest-xdist (the README's `-n auto`), the workers share the machine's cores: each gets
    its share as torch threads, rather than every worker starting one thread per core."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // int(workers)))


@pytest.fixture(autouse=True)
def _plans_from_nothing():
    """Each test plans from nothing: the lowest-peak plans checkmate keeps per graph
    (solver/checkmate/lowest_peak.py) and the level plans kept per block graph
    (remat/block_levels.py) are forgotten before it, so no test reads another's."""
    from remat.block_levels import forget_level_plans
    from remat.solver.checkmate import lowest_peak

    lowest_peak._LOWEST.clear()
    forget_level_plans()
    yield


def training_chain(n: int, seed: int = 0, *, max_bytes: int = 20, max_cost: int = 9,
                   workspace: bool = True, kept: bool = True, resident: int = 7,
                   random_at: tuple[int, ...] = ()) -> TrainingGraph:
    """Checkmate's linear graph: f1 -> ... -> fn -> bn -> ... -> b1, plus f_i -> b_i.

    Bytes and costs are seeded random integers; backward nodes get random kept bytes (parameter
    gradients) and some nodes a workspace. `random_at` marks forward nodes as random (dropout)."""
    rng = random.Random(seed)
    nodes = []
    for i in range(1, n + 1):
        nodes.append(Node(name=f"f{i}", op="fwd", inputs=(f"f{i-1}",) if i > 1 else (),
                          out_bytes=rng.randint(1, max_bytes), cost=float(rng.randint(1, max_cost)),
                          workspace_bytes=rng.randint(0, max_bytes // 2) if workspace and rng.random() < 0.3 else 0,
                          is_random=i in random_at))
    for i in range(n, 0, -1):
        inputs = (f"f{i}",) if i == n else (f"b{i+1}", f"f{i}")
        nodes.append(Node(name=f"b{i}", op="bwd", inputs=inputs, out_bytes=rng.randint(1, max_bytes),
                          kept_bytes=rng.randint(0, 3) if kept else 0,
                          workspace_bytes=rng.randint(0, max_bytes // 2) if workspace and rng.random() < 0.3 else 0,
                          cost=float(rng.randint(1, max_cost)), is_backward=True))
    return TrainingGraph(nodes=tuple(nodes), resident_bytes=resident, name=f"chain{n}_s{seed}")


def with_backward(fwd: list[Node], resident: int, name: str, rng: random.Random,
                  saves: dict[str, tuple[str, ...]] | None = None) -> TrainingGraph:
    """Append a synthesised backward to a forward node list: for each forward node v (reverse
    order) a node d_v that reads the gradients of v's users and the forward values v's derivative
    needs (`saves[v]`, default: v's inputs), allocating a gradient the size of v. The last forward
    node is the loss (kept output)."""
    saves = saves or {}
    users: dict[str, list[str]] = {n.name: [] for n in fwd}
    for n in fwd:
        for i in n.inputs:
            users[i].append(n.name)
    bwd: list[Node] = []
    for v in reversed(fwd):
        grads = tuple(f"d_{u}" for u in users[v.name])
        saved = saves.get(v.name, v.inputs)
        inputs = tuple(dict.fromkeys(grads + tuple(saved) + ((v.name,) if not grads else ())))
        bwd.append(Node(name=f"d_{v.name}", op="bwd", inputs=inputs, out_bytes=v.out_bytes,
                        kept_bytes=v.out_bytes // 4 if v.op == "mm" else 0,
                        workspace_bytes=v.workspace_bytes,
                        cost=2 * v.cost, flops=2 * v.flops, is_backward=True,
                        module_path=v.module_path))
    return TrainingGraph(nodes=tuple(fwd) + tuple(bwd), resident_bytes=resident, name=name)


def transformer_like(blocks: int = 6, seed: int = 0, *, d: int = 1 << 16) -> TrainingGraph:
    """A GPT-like ATen graph: per block layer norm (mean/sub/var/rsqrt/mul/mul/add), qkv matmul,
    head views, scores, softmax, dropout, attention matmul, projection, dropout, residual add,
    second layer norm, MLP (matmul, gelu, matmul, dropout), residual add. Views are 0 bytes."""
    rng = random.Random(seed)
    fwd: list[Node] = []
    saves: dict[str, tuple[str, ...]] = {}
    s_bytes = 2 * d  # attention scores (s x s per head) are bigger than the residual stream

    def add(name, op, inputs, out, cost, *, ws=0, rand=False, kept=0, path="", save=None):
        fwd.append(Node(name=name, op=op, inputs=tuple(inputs), out_bytes=int(out), cost=float(cost),
                        flops=int(cost * 1000) if op == "mm" else 0, workspace_bytes=int(ws),
                        is_random=rand, kept_bytes=kept, module_path=path))
        if save is not None:
            saves[name] = tuple(save)
        return name

    x = add("embed", "embedding", (), d, 1, path="wte")
    for b in range(blocks):
        p = f"h.{b}"
        j = lambda s: f"{p}.{s}"  # noqa: E731
        def norm(tag, x):
            m = add(j(f"{tag}.mean"), "mean", [x], d // 256, 1, path=p)
            c = add(j(f"{tag}.sub"), "sub", [x, m], d, 1, path=p)
            v = add(j(f"{tag}.var"), "var", [c], d // 256, 1, path=p)
            r = add(j(f"{tag}.rsqrt"), "rsqrt", [v], d // 256, 1, path=p)
            n = add(j(f"{tag}.mul"), "mul", [c, r], d, 1, path=p)
            w = add(j(f"{tag}.mulw"), "mul", [n], d, 1, path=p)
            return add(j(f"{tag}.addb"), "add", [w], d, 1, path=p, save=())
        h = norm("ln1", x)
        qkv = add(j("qkv"), "mm", [h], 3 * d, 12 + rng.random(), ws=d // 4, path=p)
        qkv_v = add(j("qkv.view"), "view", [qkv], 0, 0.01, path=p)
        q = add(j("q"), "view", [qkv_v], 0, 0.01, path=p)
        k = add(j("k"), "view", [qkv_v], 0, 0.01, path=p)
        v = add(j("v"), "view", [qkv_v], 0, 0.01, path=p)
        kt = add(j("kT"), "transpose", [k], 0, 0.01, path=p)
        sc = add(j("scores"), "bmm", [q, kt], s_bytes, 8, path=p)
        sm = add(j("scale"), "mul", [sc], s_bytes, 1, path=p, save=())
        sx = add(j("softmax"), "softmax", [sm], s_bytes, 2, path=p, save=(j("softmax"),))
        dr = add(j("attn.drop"), "dropout", [sx], s_bytes, 1, rand=True, path=p, save=(j("attn.drop"),))
        av = add(j("av"), "bmm", [dr, v], d, 8, path=p)
        y = add(j("y.view"), "view", [av], 0, 0.01, path=p)
        pr = add(j("proj"), "mm", [y], d, 4 + rng.random(), path=p)
        pd = add(j("proj.drop"), "dropout", [pr], d, 1, rand=True, path=p, save=(j("proj.drop"),))
        x = add(j("res1"), "add", [x, pd], d, 1, path=p, save=())
        h = norm("ln2", x)
        fc = add(j("fc"), "mm", [h], 4 * d, 16 + rng.random(), ws=d // 4, path=p)
        ge = add(j("gelu"), "gelu", [fc], 4 * d, 2, path=p)
        mp = add(j("mlp.proj"), "mm", [ge], d, 16 + rng.random(), path=p)
        md = add(j("mlp.drop"), "dropout", [mp], d, 1, rand=True, path=p, save=(j("mlp.drop"),))
        x = add(j("res2"), "add", [x, md], d, 1, path=p, save=())
    h = add("lnf", "layer_norm", [x], d, 3, path="ln_f")
    lg = add("logits", "mm", [h], 4 * d, 16, path="lm_head")
    add("loss", "cross_entropy", [lg], 0, 2, kept=4, path="loss")
    return with_backward(fwd, resident=8 * d, name=f"transformer{blocks}", rng=rng, saves=saves)


def random_dag(n_fwd: int, seed: int = 0, *, max_bytes: int = 50) -> TrainingGraph:
    """A random forward DAG (each node reads 0-2 recent nodes, some views of 0 bytes, some random
    nodes) plus a synthesised backward."""
    rng = random.Random(seed)
    fwd: list[Node] = []
    for i in range(n_fwd):
        k = rng.choice([1, 1, 1, 2]) if i else 0
        inputs = sorted(set(rng.sample(range(max(0, i - 4), i), min(k, i)))) if i else []
        fwd.append(Node(name=f"v{i}", op="op", inputs=tuple(f"v{j}" for j in inputs),
                        out_bytes=0 if rng.random() < 0.2 else rng.randint(1, max_bytes),
                        workspace_bytes=rng.randint(0, max_bytes) if rng.random() < 0.2 else 0,
                        cost=float(rng.randint(1, 9)), is_random=rng.random() < 0.1,
                        kept_bytes=rng.randint(1, 5) if i == n_fwd - 1 else 0))
    return with_backward(fwd, resident=rng.randint(0, 20), name=f"dag{n_fwd}_s{seed}", rng=rng)


# ---- exact reference --------------------------------------------------------------------------

# brute_force's answers, by (graph, budget, objective, max_states): parametrized tests ask for the
# same graph's smallest peak once per budget they check (a graph is a frozen value)
_BRUTE_FORCE: dict = {}


def brute_force(graph: TrainingGraph, budget: int | None, *, objective: str = "cost",
                max_states: int = 3_000_000):
    """Exact optimum over ALL schedules in the simulator's model (`_brute_force`), remembered."""
    key = (graph, None if objective == "peak" else budget, objective, max_states)
    if key not in _BRUTE_FORCE:
        _BRUTE_FORCE[key] = _brute_force(graph, budget, objective=objective, max_states=max_states)
    best, sched = _BRUTE_FORCE[key]
    return best, None if sched is None else list(sched)


def _brute_force(graph: TrainingGraph, budget: int | None, *, objective: str = "cost",
                 max_states: int = 3_000_000):
    """Exact optimum over ALL schedules in the simulator's model, by Dijkstra.

    State: (bitmask of live value instances, bitmask of nodes computed at least once). An action
    computes a node v whose inputs are all live (v itself not live; a second computation only if v
    is recomputable), and then frees any subset of {v} U inputs(v): these are the instances whose
    last read is this step. That is exactly the simulator's semantics: a flat schedule frees every
    instance right after its last read, so each schedule is one path here (free at the last read)
    and each path is a schedule whose simulated peak is at most the path's (the simulator never
    frees later than the path does). A value is only ever freed at a step that reads it, which
    loses nothing: between steps, memory is never measured. Memory at a step is
        resident + kept outputs so far + live instances + out + kept + workspace of v,
    as in the simulator. With objective="cost" it returns (min total cost, schedule) over paths
    whose every step fits `budget`; with objective="peak" (budget ignored) it returns
    (min peak, schedule): a bottleneck shortest path. Returns (None, None) when nothing fits.
    """
    nodes = graph.nodes
    n = len(nodes)
    idx = graph.index
    inp = [tuple(idx[i] for i in v.inputs) for v in nodes]
    inmask = [sum(1 << i for i in ins) for ins in inp]
    users = [[] for _ in nodes]
    for k, ins in enumerate(inp):
        for i in ins:
            users[i].append(k)
    rec = [v.recomputable for v in nodes]
    out = [v.out_bytes for v in nodes]
    kept = [v.kept_bytes for v in nodes]
    ws = [v.workspace_bytes for v in nodes]
    cost = [v.cost for v in nodes]
    full = (1 << n) - 1

    def needed(i: int, done: int) -> bool:
        """Can the value of i still be read? (some user not done, or a recomputable user)"""
        return any(not (done >> u) & 1 or rec[u] for u in users[i])

    def mem_of(live: int, done: int) -> int:
        m = graph.resident_bytes
        for i in range(n):
            if (live >> i) & 1:
                m += out[i]
            if (done >> i) & 1:
                m += kept[i]
        return m

    start = (0, 0)
    best = {start: 0.0}
    prev: dict = {start: None}
    heap = [(0.0, 0, start)]
    counter = 0
    while heap:
        d, _, state = heapq.heappop(heap)
        if best.get(state, float("inf")) < d:
            continue
        live, done = state
        if done == full:
            sched = []
            s = state
            while prev[s] is not None:
                s, v = prev[s]
                sched.append(nodes[v].name)
            return d, sched[::-1]
        base = mem_of(live, done)
        for v in range(n):
            if (live >> v) & 1 or (inmask[v] & live) != inmask[v]:
                continue
            first = not (done >> v) & 1
            if not first and not rec[v]:
                continue
            if not first and not needed(v, done):
                continue
            step = base + out[v] + (kept[v] if first else 0) + ws[v]
            if objective == "cost" and budget is not None and step > budget:
                continue
            ndone = done | (1 << v)
            live1 = live | (1 << v)
            cands = [v] + list(inp[v])
            # instances that can never be read again are freed at once (dominant); the rest branch
            forced = [i for i in cands if not needed(i, ndone)]
            free_opt = [i for i in cands if i not in forced]
            for sub in range(1 << len(free_opt)):
                nl = live1
                for i in forced:
                    nl &= ~(1 << i)
                for b, i in enumerate(free_opt):
                    if (sub >> b) & 1:
                        nl &= ~(1 << i)
                ns = (nl, ndone)
                nd = d + cost[v] if objective == "cost" else max(d, step)
                if nd < best.get(ns, float("inf")):
                    best[ns] = nd
                    prev[ns] = (state, v)
                    counter += 1
                    if counter > max_states:
                        raise RuntimeError("brute force state limit reached")
                    heapq.heappush(heap, (nd, counter, ns))
    return None, None


def random_schedule(g, rng, p=0.3):
    """A random valid schedule: every node in order, with random recomputations of recomputable
    nodes (their inputs have been computed before, so the simulator accepts it)."""
    sched, done = [], []
    for v in g.nodes:
        while done and rng.random() < p:
            cand = [x for x in done if g.node(x).recomputable]
            if not cand:
                break
            sched.append(rng.choice(cand))
        sched.append(v.name)
        done.append(v.name)
    return sched

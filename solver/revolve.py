"""revolve: Griewank's binomial checkpointing for chains, by dynamic programming.

Source: A. Griewank, "Achieving logarithmic growth of temporal and spatial complexity in reverse
automatic differentiation", Optimization Methods and Software 1 (1992); A. Griewank and
A. Walther, "Algorithm 799: Revolve", ACM TOMS 26(1) (2000). To reverse a chain of l steps
x_0 -> x_1 -> ... -> x_l with s snapshots (x_0 included), the least number of step evaluations
beyond the taped ones is p(l, s) = t*l - C(s+t, t-1), with t the repetition number,
C(s+t-1, t-1) < l <= C(s+t, t). Revolve attains it.

The chain of a TrainingGraph (`find_chain`): its *states* are the forward values s that are
ancestors of the last forward node and separate it from their own ancestors (in the undirected
forward graph, every path from an ancestor of s to the last node passes through s: an
articulation point on the main line, such as the residual stream between blocks, not one that a
parallel branch bypasses) and are comparable (ancestor or descendant) with each other; the m
states split the forward into l = m + 1 *steps*: step i is every forward node that is an
ancestor of state i (or state i itself) but not of state i-1, and the last step the remaining
ancestors of the last node (the loss): that is the *main line*.
A value off the main line (one only the backward reads) joins the step of its latest input (one
without inputs, the step of its first reader). The graph is a chain when

  1. every recomputable forward node of step i reads recomputable forward values of step i or
     state i-1 only (values that are never recomputed, such as saved generator states, may be read from
     anywhere: they stay in memory);
  2. every backward node reads recomputable forward values of one step i, and possibly state i-1
     (its *reversal* is step i's); a backward node that reads none runs in the reversal of the
     latest step whose reversal computed one of its inputs;
  3. no backward node needs a gradient that a later reversal computes (the backward can run as
     reversals of steps l, l-1, ..., 1).

Anything else raises NotAChainError naming the node that breaks the rule. A graph without
articulation points is a chain of one step (revolve then keeps everything). The backward runs as
those reversals, l first; within one, in graph order: an order that can differ from the graph's
(checkmate's stages follow the graph's order, so it cannot express such a plan).

What is implemented, exactly: the step-count-optimal reversal by Griewank's recursion
F(1, c) = 0, F(n, 0) = n(n-1)/2, F(n, c) = min_j [ j + F(n-j, c-1) + F(j, c) ] (c free snapshot
slots besides x_0, which is the model's inputs and free; the largest optimal j is used), whose
value is p(n, c+1) (tests/test_baseline_strategies.py checks it against the closed form). Steps
count as equal, as in Griewank's model, whatever their real cost. The forward pass is the first
sweep (every forward node once, in graph order); an *advance* recomputes every recomputable node
of the steps it crosses, in graph order, without keeping them for the backward; a *snapshot* is a
state whose instance later advances read; a *youturn* re-runs a step ("taping" it: each value its
reversal reads is recomputed on demand just before the backward node that reads it) and runs the
step's backward nodes; the last step's values come from the forward pass (Revolve's "firsturn").
Random values and step outputs are never recomputed (they stay in memory, as everywhere in
remat), so an advance through one of them recomputes only what comes after it: instances that
nothing reads are dropped from the schedule, as the runtime's dead-code elimination would. The
number of snapshot slots c is swept from 0 to l-1 and the cheapest plan (cost model) whose
simulated peak fits the budget is returned (`snapshots=` fixes c); when none fits, the
lowest-peak one, status "infeasible" (as equal_spacing).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

import networkx as nx

from remat.core.errors import RematError
from remat.solver.options import StrategyOptions, check_int
from remat.core.training_graph import TrainingGraph
from remat.core.plan import Plan, finished, plan_from_schedule
from remat.solver.schedule import cheapest_fitting

__all__ = ["Options", "solve", "NotAChainError", "Chain", "find_chain", "revolve_actions", "griewank_p", "optimal_advances"]


class NotAChainError(RematError, ValueError):
    """The training graph is not a chain in revolve's sense (see remat.solver.revolve): the message
    names the node that breaks it. Use another strategy (checkmate, equal_spacing, ...)."""


@dataclass(frozen=True)
class Chain:
    """A TrainingGraph seen as a chain: `states[i-1]` ends step i; `steps[i-1]` are step i's
    forward nodes and `groups[i-1]` the backward nodes of its reversal (graph order)."""

    states: tuple[str, ...]
    steps: tuple[tuple[str, ...], ...]
    groups: tuple[tuple[str, ...], ...]
    main: frozenset[str] = frozenset()  # the last node's ancestors: what advances recompute

    @property
    def length(self) -> int:
        """l, the number of steps."""
        return len(self.steps)


def _ancestors(graph: TrainingGraph, fwd: list[str]) -> dict[str, int]:
    """Forward node -> bitmask (over `fwd` positions) of itself and its forward ancestors."""
    pos = {n: k for k, n in enumerate(fwd)}
    anc: dict[str, int] = {}
    for n in fwd:
        mask = 1 << pos[n]
        for i in graph.node(n).inputs:
            if i in anc:
                mask |= anc[i]
        anc[n] = mask
    return anc


def find_chain(graph: TrainingGraph) -> Chain:
    """The graph's states, steps and reversal groups (module docstring); NotAChainError if it is
    not a chain."""
    fwd = [n.name for n in graph.forward_nodes]
    if not fwd:
        raise NotAChainError("the graph has no forward nodes")
    fset = set(fwd)
    und = nx.Graph()
    und.add_nodes_from(fwd)
    und.add_edges_from((i, n) for n in fwd for i in graph.node(n).inputs if i in fset)
    anc = _ancestors(graph, fwd)
    pos = {n: k for k, n in enumerate(fwd)}
    last = fwd[-1]
    arts = set(nx.articulation_points(und))

    def separates(s: str) -> bool:  # no ancestor of s is connected to the last node without s
        reach = nx.node_connected_component(und.subgraph(x for x in fwd if x != s), last)
        return not any(anc[s] >> pos[x] & 1 for x in reach)

    spine = [n for n in fwd if n in arts and n != last and anc[last] >> pos[n] & 1 and separates(n)]

    def comparable(a: str, b: str) -> bool:
        return bool(anc[a] >> pos[b] & 1 or anc[b] >> pos[a] & 1)

    states = [a for a in spine if all(comparable(a, b) for b in spine)]
    # steps of the main line: ancestors of state i (itself included) that are not ancestors of
    # state i-1; the last step takes the rest of the last node's ancestors
    step_of: dict[str, int] = {}
    prev = 0
    for k, s in enumerate(states + [last]):
        for n in fwd:
            if (anc[s] & ~prev) >> pos[n] & 1:
                step_of[n] = k
        prev |= anc[s]
    # off the main line (values only the backward reads, or no one): the step of their latest
    # input; a node without inputs there goes with its first user, else to the last step
    for n in fwd:
        if n not in step_of:
            ins = [step_of[u] for u in graph.node(n).inputs if u in step_of]
            if ins:
                step_of[n] = max(ins)
    for n in reversed(fwd):
        if n not in step_of:
            us = [step_of[u] for u in graph.users[n] if u in step_of]
            step_of[n] = min(us) if us else len(states)
    steps = [[n for n in fwd if step_of[n] == k] for k in range(len(states) + 1)]
    main = anc[last]
    n_steps = len(steps)
    state_before = [None] + states  # state_before[i]: the state step i (0-based) starts from

    rec = {n: graph.node(n).recomputable for n in fwd}
    for n in fwd:  # rule 1
        if not rec[n]:
            continue
        i = step_of[n]
        for u in graph.node(n).inputs:
            if rec.get(u) and step_of[u] != i and u != state_before[i]:
                raise NotAChainError(f"not a chain: forward node {n!r} (step {i + 1} of {n_steps}) reads {u!r} "
                                     f"(step {step_of[u] + 1}), which is neither in its step nor the state "
                                     f"before it")
    group: dict[str, int] = {}
    bwd = [n.name for n in graph.backward_nodes]
    fixed: set[str] = set()
    for b in bwd:  # rule 2
        node = graph.node(b)
        us = [u for u in node.inputs if rec.get(u)]
        if us:
            i = max(step_of[u] for u in us)
            bad = [u for u in us if step_of[u] != i and u != state_before[i]]
            if bad:
                raise NotAChainError(f"not a chain: backward node {b!r} reads {us[0]!r}... from steps "
                                     f"{sorted({step_of[u] + 1 for u in us})}: the reversal of one step "
                                     f"may read that step's values and the state before it only")
            group[b] = i
            fixed.add(b)
    for b in bwd:  # nodes reading no forward value: as early as their inputs allow
        if b in fixed:
            continue
        gs = [group[i] for i in graph.node(b).inputs if i in group]
        if gs:
            group[b] = min(gs)
    for b in reversed(bwd):  # no input at all (e.g. zeros): with its first user
        if b not in group:
            gs = [group[u] for u in graph.users[b] if u in group]
            group[b] = max(gs) if gs else n_steps - 1
    for b in bwd:  # rule 3
        for i in graph.node(b).inputs:
            if i in group and group[i] < group[b]:
                raise NotAChainError(f"not a chain: backward node {b!r} (reversal of step {group[b] + 1}) "
                                     f"needs {i!r}, computed in the reversal of step {group[i] + 1}, later")
    groups = [[b for b in bwd if group[b] == k] for k in range(n_steps)]
    return Chain(states=tuple(states), steps=tuple(tuple(s) for s in steps),
                 groups=tuple(tuple(g) for g in groups),
                 main=frozenset(n for n in fwd if main >> pos[n] & 1))


# ---- Griewank's recursion ------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _best(n: int, c: int) -> tuple[int, int]:
    """(F(n, c), the largest optimal first advance j) for n steps and c free snapshot slots."""
    if n <= 1:
        return 0, 0
    if c == 0:
        return n * (n - 1) // 2, 0
    best, arg = None, 0
    for j in range(1, n):
        v = j + _best(n - j, c - 1)[0] + _best(j, c)[0]
        if best is None or v <= best:
            best, arg = v, j
    return best, arg


def optimal_advances(n: int, c: int) -> int:
    """F(n, c): the least step evaluations beyond one forward pass to reverse n steps with c free
    snapshot slots (x_0 stored for free), by Griewank's recursion."""
    return _best(n, min(c, max(n - 1, 0)))[0]


def griewank_p(n_steps: int, s: int) -> int:
    """Griewank's closed form p(l, s) = t*l - C(s+t, t-1), C(s+t-1, t-1) < l <= C(s+t, t), for
    l = n_steps steps and s >= 1 snapshots (x_0 included): the minimal number of advances."""
    from math import comb

    if n_steps <= 1:
        return 0
    t = 0
    while comb(s + t, t) < n_steps:
        t += 1
    return t * n_steps - comb(s + t, t - 1)


def revolve_actions(n_steps: int, c: int) -> list[tuple]:
    """Revolve's actions to reverse steps 1..n_steps from x_0 with c free snapshot slots, as
    ("advance", a, b) (recompute steps a+1..b from x_a), ("snapshot", j), ("youturn", k) (tape
    step k from x_{k-1} and reverse it), in execution order."""
    out: list[tuple] = []

    def rev(lo: int, hi: int, c: int) -> None:
        n = hi - lo
        if n == 1:
            out.append(("youturn", hi))
            return
        if c == 0:
            for k in range(hi, lo, -1):
                if k - 1 > lo:
                    out.append(("advance", lo, k - 1))
                out.append(("youturn", k))
            return
        j = _best(n, c)[1]
        out.append(("advance", lo, lo + j))
        out.append(("snapshot", lo + j))
        rev(lo + j, hi, c - 1)
        rev(lo, lo + j, c)

    rev(0, n_steps, min(c, max(n_steps - 1, 0)))
    return out


def _schedule(graph: TrainingGraph, chain: Chain, actions: list[tuple]) -> list[str]:
    """The flat schedule of `actions` (module docstring): the forward pass stands for the actions
    up to the first youturn (the first sweep), the rest recompute."""
    fwd = [n.name for n in graph.forward_nodes]
    sched = list(fwd)
    n_steps = chain.length
    first = next(k for k, a in enumerate(actions) if a[0] == "youturn")
    assert actions[first] == ("youturn", n_steps)
    step_of = {n: k + 1 for k, s in enumerate(chain.steps) for n in s}

    def reverse(k: int, available: set[str]) -> None:
        def ensure(u: str) -> None:
            node = graph.node(u)
            if u in available or node.is_backward or not node.recomputable:
                return
            assert step_of[u] == k, (u, k)
            for i in node.inputs:
                ensure(i)
            sched.append(u)
            available.add(u)

        for b in chain.groups[k - 1]:
            for u in graph.node(b).inputs:
                ensure(u)
            sched.append(b)

    state = lambda k: chain.states[k - 1] if k >= 1 else None  # noqa: E731
    reverse(n_steps, set(fwd))  # the firsturn: the forward's values are the tape
    for a in actions[first + 1:]:
        if a[0] == "advance":
            _, lo, hi = a
            steps = set(range(lo + 1, hi + 1))
            sched.extend(n for n in fwd if step_of[n] in steps and n in chain.main and graph.node(n).recomputable)
        elif a[0] == "youturn":
            k = a[1]
            reverse(k, {state(k - 1)} if k > 1 else set())
    return _drop_unread(graph, sched)


def _drop_unread(graph: TrainingGraph, sched: list[str]) -> list[str]:
    """Drop every instance of a recomputable value that nothing reads while another instance of it
    remains (what the runtime's dead-code elimination drops): e.g. an advance through a value
    that is never recomputed (BatchNorm's output in training mode) needs nothing before it."""
    first = {}
    for k, name in enumerate(sched):
        first.setdefault(name, k)
    needed: set[str] = set()  # names whose latest instance so far is read by a later step
    later: set[str] = set()  # names with a kept instance later in the schedule
    out = []
    for k in range(len(sched) - 1, -1, -1):
        name = sched[k]
        node = graph.node(name)
        if node.recomputable and name not in needed and (name in later or k != first[name]):
            continue
        needed.discard(name)
        needed.update(node.inputs)
        later.add(name)
        out.append(name)
    return out[::-1]


@dataclass(frozen=True)
class Options(StrategyOptions):
    """snapshots: the number of checkpoints c to use (None: the cheapest c that fits)."""

    snapshots: int | None = None

    def __post_init__(self) -> None:
        check_int("snapshots", self.snapshots, 0, optional=True)


def solve(graph: TrainingGraph, budget_bytes: int | None = None, *, snapshots: int | None = None) -> Plan:
    """The cheapest revolve plan over snapshot counts c = 0..l-1 (or `snapshots` only) whose
    simulated peak fits `budget_bytes` (None: no budget); status "heuristic", or "infeasible"
    with the lowest-peak plan when none fits. NotAChainError when the graph is not a chain.
    details: steps l, snapshots c, advances (step evaluations beyond one forward pass, Griewank's
    p(l, c+1)), states."""
    t0 = time.perf_counter()
    chain = find_chain(graph)
    n_steps = chain.length
    counts = range(max(n_steps, 1)) if snapshots is None else [max(0, min(snapshots, max(n_steps - 1, 0)))]
    plans = []
    for c in counts:
        actions = revolve_actions(n_steps, c)
        adv = sum(a[2] - a[1] for a in actions if a[0] == "advance")
        plans.append(plan_from_schedule(graph, _schedule(graph, chain, actions), strategy="revolve",
                                        budget_bytes=budget_bytes, status="heuristic",
                                        details={"steps": n_steps, "snapshots": c, "advances": adv,
                                                 "states": len(chain.states)}))
    return finished(cheapest_fitting(plans), t0)

"""checkmate: Checkmate's MILP (Jain et al., MLSys 2020) over a coarsened graph, solved with PuLP.

Variables, for stages t = 0..n-1 over the coarse nodes 0..n-1 in topological order:
  R[t,i]      binary: node i is computed in stage t
  S[t,i]      binary: i's value is kept in memory from stage t-1 into stage t
  FREE[t,i,k] in [0,1]: i's value is freed right after node k runs in stage t. Declared
              continuous: given binary R and S, its three upper bounds and one lower bound pin it
              to 0 or 1, exactly as Checkmate's binary FREE, with far fewer integers for CBC.
  U[t,k] >= 0: bytes of values in memory after node k runs in stage t (before frees at k)

The model is shrunk before it is built: R[t,t] = 1 and nothing after t exists (frontier
advancing); a node that may not be recomputed (backward, random, kept output) has R[t,i] only at
t = i (a constant 1); R[t,i] exists only at stages where some reader of i may run; S[t,i] only
where a later stage may read i, and S is a constant 1 where a non-recomputable value must wait for
its non-recomputable reader; FREE only where R[t,k] may be 1, and not at the stage's last node
(U after it is never read). Memory is counted in units of `unit` bytes: node bytes rounded up, the
budget rounded down, so a feasible MILP point never exceeds the budget in bytes.

After solving, the schedule is stage by stage, the R=1 nodes of a stage in topological order;
recomputations nobody reads are dropped, then it is expanded to the fine graph, and the Plan is
judged by the simulator on the FINE graph (its predicted peak is that simulator's number).

Solving (solver/backends.py): HiGHS by default, CBC as the fallback, each try recorded in
plan.details["attempts"]. The default limit is a node count, not wall clock, so the plan does not
depend on the machine's load. `solve` never raises for a solver failure and never calls a budget
infeasible that min_feasible_budget (same options) reported feasible: when the MILP has no fitting
plan it answers with equal_spacing's plan or the cached lowest-peak plan, refined on the fine graph.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field, replace

from remat.graph_capture.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.backends import BackendError, Limits, Outcome, attempts, default_backend
from remat.solver.backends import available as backend_available
from remat.solver.backends import run as run_backend
from remat.solver.coarsen import coarsen, expand_schedule
from remat.solver.plan import Plan, plan_from_schedule
from remat.solver.refine import drop_recomputations
from remat.solver.schedule import keep_all_schedule, schedule_from_kept
from remat.solver.simulator import simulate

__all__ = ["solve", "min_feasible_budget", "node_limit", "SolverFallbackWarning", "DEFAULT_COARSEN_TO",
           "NODE_WORK", "MIN_NODES"]

DEFAULT_COARSEN_TO = 90  # coarse nodes: the MILP's size grows with the square of it
# The default solve's work limit (no wall clock): branch-and-bound nodes after the root,
# NODE_WORK / binaries^2 (a node's LP grows with the model, and so does the tree), at least
# MIN_NODES. Measured on the 4-layer default GPT (256 nodes coarsened to 90, 4851 binaries; HiGHS,
# 2 cores): the root alone takes 48 s of CPU at 50% of keep_all, 3 to 30 nodes take 128 s, for
# the same final plan (and the same min-peak, 51.79 MiB), so it gets the root only; a 9-node
# chain (162 binaries) gets 1143 nodes, enough to prove optimality with CBC too.
NODE_WORK = 30_000_000
MIN_NODES = 1
POLISH_RESERVE_S = 3.0  # of a wall-clock time_limit_s, seconds kept for the fine refinement


class SolverFallbackWarning(UserWarning):
    """A MILP backend failed; the plan came from another backend or a heuristic (plan.details)."""


# ---- the model ----------------------------------------------------------------------------------

@dataclass
class _Model:
    g: TrainingGraph  # the (coarse) graph the MILP is over
    unit: int  # bytes per memory unit
    prob: object  # pulp.LpProblem
    R: dict  # (t, i) -> LpVariable or 1 (constant); absent = 0
    S: dict
    FREE: dict  # (t, i, k) -> LpVariable
    U: dict  # (t, k) -> LpVariable
    stages: list  # stages[t] = nodes that may run in stage t, ascending
    M: object = None  # peak variable when minimising the peak
    rows: list = field(default_factory=list)  # (t, k, extra units, constant bytes) per budget row
    counts: dict = field(default_factory=dict)


def _is0(x) -> bool:
    return isinstance(x, int) and x == 0


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _build(g: TrainingGraph, budget_bytes: int | None, unit: int, *, minimise_peak: bool = False,
           tighten: bool = True) -> _Model:
    import pulp

    n = len(g.nodes)
    idx = g.index
    inputs = [tuple(idx[i] for i in v.inputs) for v in g.nodes]
    users = [[] for _ in range(n)]
    for k, ins in enumerate(inputs):
        for i in ins:
            users[i].append(k)
    rec = [v.recomputable for v in g.nodes]
    mem = [math.ceil(v.out_bytes / unit) for v in g.nodes]
    # possible[v]: stages where v may be computed (its own, plus, if recomputable, any later stage
    # where one of its readers may be computed)
    possible = [0] * n
    for v in range(n - 1, -1, -1):
        possible[v] = 1 << v
        if rec[v]:
            for u in users[v]:
                possible[v] |= possible[u]
    lastread = [max((possible[u].bit_length() - 1 for u in users[i]), default=i) for i in range(n)]
    # a non-recomputable i must stay in memory until its last non-recomputable reader has run
    forced = [max((u for u in users[i] if not rec[u]), default=i) if not rec[i] else i
              for i in range(n)]

    prob = pulp.LpProblem("checkmate", pulp.LpMinimize)
    R: dict = {}
    S: dict = {}
    for i in range(n):
        for t in _bits(possible[i]):
            R[t, i] = 1 if t == i else pulp.LpVariable(f"R_{t}_{i}", cat="Binary")
        for t in range(i + 1, lastread[i] + 1):
            S[t, i] = 1 if t <= forced[i] else pulp.LpVariable(f"S_{t}_{i}", cat="Binary")
    S_at = [[] for _ in range(n + 1)]
    for (t, i), s in S.items():
        if mem[i]:
            S_at[t].append((i, s))
    stages = [[] for _ in range(n)]
    for (t, i) in R:
        stages[t].append(i)
    for st in stages:
        st.sort()

    def val(d, key):
        return d.get(key, 0)

    cons = 0
    # objective: min sum_t sum_i cost_i * R[t,i]; the constant first computations are left out, so
    # the objective is the extra cost and a relative MIP gap is relative to it
    if minimise_peak:
        M = pulp.LpVariable("M", lowBound=0)
        prob += M
    else:
        M = None
        prob += pulp.lpSum(g.nodes[i].cost * r for (t, i), r in R.items() if not isinstance(r, int))

    for t in range(n):
        for k in stages[t]:
            # dependencies: R[t,k] <= R[t,i] + S[t,i] for every edge (i,k)
            for i in inputs[k]:
                rhs = [x for x in (val(R, (t, i)), val(S, (t, i))) if not _is0(x)]
                if any(isinstance(x, int) for x in rhs):
                    continue  # a constant 1 on the right: always met
                if not rhs:
                    raise AssertionError(f"node {k} cannot read {i} in stage {t}")  # by construction
                prob += R[t, k] <= pulp.lpSum(rhs), f"dep_{t}_{i}_{k}"
                cons += 1
    # keeping: S[t+1,i] <= S[t,i] + R[t,i]
    for (t, i), s in S.items():
        if isinstance(s, int):
            continue
        rhs = [x for x in (val(S, (t - 1, i)), val(R, (t - 1, i))) if not _is0(x)]
        if any(isinstance(x, int) for x in rhs):
            continue
        prob += s <= pulp.lpSum(rhs), f"keep_{t}_{i}"
        cons += 1

    if tighten:
        # dominance cuts (they remove only wasteful points, never an optimum):
        # R[t,i] + S[t,i] <= 1 (never recompute a value already kept), and
        # S[t,i] <= S[t+1,i] + sum_{j users of i} R[t,j] (keep only what is read or kept on)
        for (t, i), s in S.items():
            if isinstance(s, int):
                continue
            r = val(R, (t, i))
            if not _is0(r):
                prob += s + r <= 1, f"rs_{t}_{i}"
                cons += 1
            rhs = [x for x in [val(S, (t + 1, i))] + [val(R, (t, j)) for j in users[i]] if not _is0(x)]
            if any(isinstance(x, int) for x in rhs):
                continue
            prob += s <= pulp.lpSum(rhs), f"use_{t}_{i}"
            cons += 1

    FREE: dict = {}
    U: dict = {}
    rows: list = []  # (t, k, workspace+kept units of k, constant bytes: resident + kept before t)
    kept_before = 0
    for t in range(n):
        st = stages[t]
        in_stage = set(st)
        # U[t,k1] = sum_i mem_i S[t,i] + mem_k1 R[t,k1];
        # U[t,k_{j+1}] = U[t,k_j] - sum_{i in inputs(k_j) + {k_j}} mem_i FREE[t,i,k_j] + mem R[t,k_{j+1}]
        prev = None
        for pos, k in enumerate(st):
            u = pulp.LpVariable(f"U_{t}_{k}", lowBound=0)
            U[t, k] = u
            if prev is None:
                expr = pulp.lpSum(mem[i] * s for i, s in S_at[t])
            else:
                kp = st[pos - 1]
                frees = [mem[i] * FREE[t, i, kp] for i in set(inputs[kp]) | {kp} if (t, i, kp) in FREE]
                expr = prev - pulp.lpSum(frees)
            prob += u == expr + mem[k] * R[t, k], f"mem_{t}_{k}"
            cons += 1
            # budget: U[t,k] + (workspace_k + kept_k) R[t,k] <= budget - resident - kept before t
            extra = math.ceil((g.nodes[k].workspace_bytes + g.nodes[k].kept_bytes) / unit)
            rows.append((t, k, extra, kept_before + g.resident_bytes))
            if minimise_peak:
                prob += u + extra * R[t, k] + math.ceil((kept_before + g.resident_bytes) / unit) <= M, \
                    f"peak_{t}_{k}"
            else:
                cap = (budget_bytes - g.resident_bytes - kept_before) // unit
                prob += u + extra * R[t, k] <= cap, f"budget_{t}_{k}"
            cons += 1
            prev = u
            if k == t:
                break
            # FREE[t,i,k] = R[t,k] (1 - S[t+1,i]) prod_{j users of i, j > k} (1 - R[t,j]):
            # FREE <= R[t,k]; FREE <= 1 - S[t+1,i]; FREE <= 1 - R[t,j];
            # FREE >= R[t,k] - S[t+1,i] - sum_j R[t,j]
            for i in set(inputs[k]) | {k}:
                if not mem[i]:
                    continue
                later = [j for j in users[i] if j > k and j in in_stage]
                s_next = val(S, (t + 1, i))
                hazards = [R[t, j] for j in later]
                if any(isinstance(h, int) for h in hazards) or isinstance(s_next, int) and s_next:
                    continue  # a constant 1 hazard: never freed here
                f = pulp.LpVariable(f"FREE_{t}_{i}_{k}", lowBound=0, upBound=1)
                FREE[t, i, k] = f
                if not isinstance(R[t, k], int):
                    prob += f <= R[t, k], f"fr_{t}_{i}_{k}"
                    cons += 1
                if not isinstance(s_next, int):
                    prob += f <= 1 - s_next, f"fs_{t}_{i}_{k}"
                    cons += 1
                for j, h in zip(later, hazards):
                    prob += f <= 1 - h, f"fu_{t}_{i}_{k}_{j}"
                    cons += 1
                prob += f >= R[t, k] - s_next - pulp.lpSum(hazards), f"fl_{t}_{i}_{k}"
                cons += 1
        kept_before += g.nodes[t].kept_bytes
    counts = {"R": sum(not isinstance(r, int) for r in R.values()),
              "S": sum(not isinstance(s, int) for s in S.values()), "FREE": len(FREE),
              "U": len(U), "constraints": cons}
    counts["binaries"] = counts["R"] + counts["S"]
    return _Model(g=g, unit=unit, prob=prob, R=R, S=S, FREE=FREE, U=U, stages=stages, M=M,
                  rows=rows, counts=counts)


# ---- schedules <-> R/S ----------------------------------------------------------------------------

def _stages_of(g: TrainingGraph, schedule: list[str]) -> list[list[int]] | None:
    """Split a flat schedule into frontier-advancing stages (stage t ends with the first
    computation of node t), each stage's nodes sorted in topological order; None if the first
    computations are not in the graph's order or a stage computes a node twice."""
    idx = g.index
    stages: list[list[int]] = [[] for _ in g.nodes]
    frontier = 0
    cur: list[int] = []
    seen: set[int] = set()
    for name in schedule:
        i = idx[name]
        if i not in seen:
            if i != frontier:
                return None
            seen.add(i)
            cur.append(i)
            if len(set(cur)) != len(cur):
                return None
            stages[frontier] = sorted(cur)
            frontier += 1
            cur = []
        else:
            cur.append(i)
    return stages


def _normalise(g: TrainingGraph, stages: list[list[int]]) -> list[list[int]]:
    """Move each recomputation that no node of its own stage reads to the next stage (the model
    only has R[t,i] where a reader of i may run in stage t), until none is left."""
    idx = g.index
    users = [[idx[u] for u in g.users[v.name]] for v in g.nodes]
    stages = [list(st) for st in stages]
    for t in range(len(stages)):
        changed = True
        while changed:
            changed = False
            here = set(stages[t])
            for i in sorted(stages[t], reverse=True):
                if i != t and not any(u in here for u in users[i]):
                    stages[t].remove(i)
                    here.discard(i)
                    if t + 1 < len(stages) and i not in stages[t + 1]:
                        stages[t + 1] = sorted(stages[t + 1] + [i])
                    changed = True
    return stages


def _flat(g: TrainingGraph, stages: list[list[int]]) -> list[str]:
    return [g.nodes[i].name for st in stages for i in st]


def _prune(g: TrainingGraph, schedule: list[str]) -> list[str]:
    """Drop computations whose instance nobody reads (each drop lowers cost and never raises the
    peak), until none is left. The first instance goes too when a later one exists: Checkmate's
    frontier-advancing stages compute node t in stage t even when it is recomputed before anyone
    reads it (the min-peak MILP, which does not price compute, leaves many such), and the runtime
    would drop such a dead instance as dead code, so the plan must not count it."""
    sched = list(schedule)
    while True:
        drop = set()
        pending: set[str] = set()  # names read later, before their next computation
        later: set[str] = set()  # names with a kept instance after this step
        for s in range(len(sched) - 1, -1, -1):
            name = sched[s]
            if name not in pending and name in later:
                drop.add(s)
                continue  # its reads are dropped with it
            later.add(name)
            pending.discard(name)
            pending.update(g.node(name).inputs)
        if not drop:
            return sched
        sched = [x for s, x in enumerate(sched) if s not in drop]


def _assign(model: _Model, stages: list[list[int]]) -> bool:
    """Set the variables' initial values to the schedule `stages` (a warm start); False if the
    schedule is not a point of the model (a variable that does not exist, or a budget row broken)."""
    g, R, S = model.g, model.R, model.S
    n = len(g.nodes)
    idx = g.index
    inputs = [tuple(idx[i] for i in v.inputs) for v in g.nodes]
    Rv = {(t, i): 1 for t, st in enumerate(stages) for i in st}
    reads = {(t, i) for t, st in enumerate(stages) for k in st for i in inputs[k]}
    Sv = {}
    for i in range(n):  # S[t,i]: the instance held at the start of t is read at t or later
        need = 0
        for t in range(n - 1, i, -1):
            need = 0 if (t, i) in Rv else int((t, i) in reads or need)
            if need:
                Sv[t, i] = 1
    for key in Rv:
        if key not in R:
            return False
    for key in Sv:
        if key not in S:
            return False
    for key, s in S.items():
        if isinstance(s, int) and s and key not in Sv:
            Sv[key] = 1  # a forced keep the schedule did not need: harmless, count it
    values = {}
    for key, r in R.items():
        if not isinstance(r, int):
            values[r] = Rv.get(key, 0)
        elif key not in Rv:
            return False
    for key, s in S.items():
        if not isinstance(s, int):
            values[s] = Sv.get(key, 0)
    for (t, i, k), f in model.FREE.items():
        later = [j for j in g.users[g.nodes[i].name] if idx[j] > k and (t, idx[j]) in Rv]
        values[f] = int((t, k) in Rv and not Sv.get((t + 1, i)) and not later)
    mem = [math.ceil(v.out_bytes / model.unit) for v in g.nodes]
    for t in range(n):
        prev = None
        for pos, k in enumerate(model.stages[t]):
            if prev is None:
                u = sum(mem[i] for (tt, i), s in Sv.items() if tt == t)
            else:
                kp = model.stages[t][pos - 1]
                u = prev - sum(mem[i] * values[model.FREE[t, i, kp]] for i in set(inputs[kp]) | {kp}
                               if (t, i, kp) in model.FREE)
            u += mem[k] * Rv.get((t, k), 0)
            values[model.U[t, k]] = u
            prev = u
    if model.M is not None:
        values[model.M] = max(values[model.U[t, k]] + extra * Rv.get((t, k), 0)
                              + math.ceil(const / model.unit) for t, k, extra, const in model.rows)
    for v, x in values.items():
        v.setInitialValue(x)
    # every row must hold at the start point (pulp evaluates rows with the initial values)
    for c in model.prob.constraints.values():
        if not c.valid(eps=1e-6):
            return False
    return True


# ---- solving -------------------------------------------------------------------------------------

def _solve_milp(model: _Model, backend: str, limits: Limits, warm: bool, msg: bool,
                log: list) -> Outcome:
    """Run the MILP on `backend`, falling back to the other backends (backends.attempts) when one
    fails: an error or crash (BackendError), or no solution for no known reason. A search its work
    limit stopped before any incumbent ("none", stopped_by set) is an answer, not a failure: the
    weaker backends would not do better within the same limit, so the caller's fallbacks follow.
    Each try is appended to `log`. Returns the first outcome that is not a failure, else "none"."""
    if limits.max_nodes is None:
        limits = replace(limits, max_nodes=node_limit(model.counts["binaries"]))
    deadline = None if limits.time_limit_s is None else time.perf_counter() + limits.time_limit_s
    last = Outcome("none")
    for name, w in attempts(backend, warm):
        lim = limits
        if deadline is not None:  # the wall-clock safety net covers all tries together
            lim = replace(limits, time_limit_s=max(1.0, deadline - time.perf_counter()))
        t = time.perf_counter()
        try:
            out = run_backend(model.prob, name, lim, warm=w, msg=msg)
        except BackendError as e:
            log.append({"backend": name, "warm_start": w, "error": str(e),
                        "s": round(time.perf_counter() - t, 3)})
            continue
        log.append({"backend": name, "warm_start": w, "status": out.status, "max_nodes": lim.max_nodes,
                    "stopped_by": out.stopped_by, "s": round(time.perf_counter() - t, 3)})
        if out.status != "none" or out.stopped_by is not None:
            return out
        last = out
    return last


def _milp_peak(model: _Model) -> int:
    """The MILP's own peak: max over stages and running nodes of U + workspace + kept + constants."""
    peak = 0
    for t, k, extra, const in model.rows:
        r = model.R[t, k]
        if isinstance(r, int) or (r.varValue or 0) > 0.5:
            peak = max(peak, round((model.U[t, k].varValue or 0) + extra) * model.unit + const)
    return peak


def _solution_stages(model: _Model) -> list[list[int]]:
    out = [[] for _ in model.g.nodes]
    for (t, i), r in model.R.items():
        if isinstance(r, int) or (r.varValue or 0) > 0.5:
            out[t].append(i)
    for st in out:
        st.sort()
    return out


def _baselines(fine: TrainingGraph, g: TrainingGraph, budget: int | None):
    """Candidate coarse schedules (name, schedule): keep_all, equal spacing on the coarse graph
    for every k, and the fine graph's equal-spacing kept sets mapped to their runs."""
    out = [("keep_all", keep_all_schedule(g))]
    cands = equal_spacing.checkpoint_candidates(g)
    for k in range(1, len(cands) + 2):
        out.append((f"equal_spacing(coarse k={k})", schedule_from_kept(g, cands[k - 1::k])))
    if fine is not g:
        owner = {m: v.name for v in g.nodes for m in v.members}
        fc = equal_spacing.checkpoint_candidates(fine)
        for k in range(1, len(fc) + 2):
            kept = {owner[x] for x in fc[k - 1::k]}
            out.append((f"equal_spacing(fine k={k})", schedule_from_kept(g, kept)))
    return out


def _unit(budget: int, g: TrainingGraph) -> int:
    # memory units of ~budget / 2^20: node bytes are rounded up, so the MILP stays conservative
    scale = max(budget, g.resident_bytes + sum(v.out_bytes + v.kept_bytes for v in g.nodes))
    return max(1, scale >> 20)


def _prepare(graph: TrainingGraph, coarsen_to: int | None) -> TrainingGraph:
    if coarsen_to is None or len(graph.nodes) <= coarsen_to:
        return graph
    return coarsen(graph, coarsen_to)


def _finish(graph, g, stages, *, strategy, budget, status, t0, gap, details) -> Plan:
    coarse_sched = _prune(g, _flat(g, stages))
    csim = simulate(g, coarse_sched)
    fine_sched = _prune(graph, expand_schedule(g, coarse_sched)) if g is not graph else coarse_sched
    details = {**details, "coarse_peak_bytes": csim.peak_bytes, "coarse_extra_cost": csim.extra_cost}
    plan = plan_from_schedule(graph, fine_sched, strategy=strategy, budget_bytes=budget,
                              status=status, solve_time_s=time.perf_counter() - t0, gap=gap,
                              details=details)
    plan._coarse_schedule = coarse_sched  # not serialised: lets a finer solve warm-start from it
    return plan


def _refine(coarser: TrainingGraph, g: TrainingGraph, schedule: list[str]) -> list[str] | None:
    """A schedule over `coarser` rewritten over `g` when every node of `coarser` is a union of
    consecutive nodes of `g` (the greedy merge is hierarchical, so a smaller target coarsens
    further); None otherwise."""
    start = {v.members[0]: k for k, v in enumerate(g.nodes)}
    parts = {}
    for v in coarser.nodes:
        k = start.get(v.members[0])
        names, m = [], 0
        while k is not None and k < len(g.nodes) and m < len(v.members):
            if g.nodes[k].members != v.members[m:m + len(g.nodes[k].members)]:
                return None
            names.append(g.nodes[k].name)
            m += len(g.nodes[k].members)
            k += 1
        if m != len(v.members):
            return None
        parts[v.name] = names
    return [x for name in schedule for x in parts[name]]


def _limits(time_limit_s, max_nodes, mip_gap, threads) -> Limits:
    return Limits(max_nodes=max_nodes, time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads)


def node_limit(binaries: int) -> int:
    """The default node limit of a MILP with `binaries` binary variables (a pure function of the
    model, so the same model always gets the same limit)."""
    return max(MIN_NODES, NODE_WORK // max(1, binaries) ** 2)


def _until(limits: Limits, deadline: float | None) -> Limits:
    """`limits` with the wall-clock limit cut to what is left before `deadline` (None: no wall
    clock), keeping POLISH_RESERVE_S for the work after the MILP."""
    if deadline is None:
        return limits
    return replace(limits, time_limit_s=max(1.0, deadline - time.perf_counter() - POLISH_RESERVE_S))


def solve(graph: TrainingGraph, budget_bytes: int, *, backend: str = "auto",
          max_nodes: int | None = None, time_limit_s: float | None = None,
          coarsen_to: int | None = DEFAULT_COARSEN_TO, warm_start: bool = True,
          mip_gap: float | None = 1e-4, threads: int | None = 1, msg: bool = False,
          presolve: bool = True, **_: object) -> Plan:
    """Checkmate's MILP under `budget_bytes` (the step's peak, resident memory included).

    backend: "auto" (default: HiGHS when highspy is installed, else CBC), "highs" or "cbc"; a
    backend that fails falls back to the next one, and then to the best heuristic plan, with a
    SolverFallbackWarning (plan.details["attempts"] and ["fallback"] say what happened).
    max_nodes: the deterministic work limit (branch-and-bound nodes after the root; None:
    node_limit(binaries), scaled to the model; the MILP runs single-threaded with threads=1): with
    it alone the same graph and budget give the same plan on an idle or a busy machine.
    time_limit_s: an optional wall-clock safety net (None: none); with it the plan depends on the
    machine's load. coarsen_to: coarse node count the MILP works on (None: the fine graph).

    Status "optimal" (proven, within `mip_gap` of the extra cost), "feasible" (a limit stopped the
    search with an incumbent, plan.gap is the relative gap; or a fallback plan that fits), or
    "infeasible" (no plan fits: the plan holds the lowest-peak baseline schedule, for
    information). Never "infeasible" for a budget at or above min_feasible_budget's answer with
    the same options: that plan is the last fallback. presolve: with CBC on 60+ coarse nodes,
    first solve a coarser MILP (a quarter of the limits) to warm-start this one."""
    t0 = time.perf_counter()
    requested = backend
    backend = default_backend() if backend == "auto" else backend
    attempts(backend, False)  # an unknown backend is a caller's error: raise before any work
    if backend == "highs" and not backend_available("highs"):
        raise ImportError("backend='highs' needs the `highspy` package (pip install highspy)")
    limits = _limits(time_limit_s, max_nodes, mip_gap, threads)
    g = _prepare(graph, coarsen_to)
    unit = _unit(budget_bytes, g)
    model = _build(g, budget_bytes, unit)
    details = {"coarse_nodes": len(g.nodes), "fine_nodes": len(graph.nodes), "backend": backend,
               "backend_requested": requested, "limits": asdict(limits),
               "unit_bytes": unit, "variables": {k: v for k, v in model.counts.items()
                                                 if k != "constraints"},
               "constraints": model.counts["constraints"], "build_s": round(time.perf_counter() - t0, 3)}
    # baselines on the coarse graph, in the MILP's own model: the cheapest fitting one warm-starts.
    # With CBC on a large coarse graph, a quick MILP on a coarser graph is one more candidate
    # (CBC's own incumbents are weak there; HiGHS does not need it)
    cands = _baselines(graph, g, budget_bytes)
    if presolve and backend == "cbc" and warm_start and g is not graph and len(g.nodes) >= 60:
        sub = solve(graph, budget_bytes, backend=backend, coarsen_to=int(len(g.nodes) * 0.65),
                    max_nodes=max(1, (max_nodes or node_limit(model.counts["binaries"])) // 4),
                    time_limit_s=time_limit_s and time_limit_s * 0.25, warm_start=True,
                    mip_gap=mip_gap, threads=threads, presolve=False)
        details["presolve"] = {"coarse_nodes": sub.details["coarse_nodes"], "status": sub.status,
                               "extra_cost": sub.extra_cost, "s": round(sub.solve_time_s, 3)}
        if sub.status != "infeasible" and getattr(sub, "_coarse_schedule", None) is not None:
            coarser = _prepare(graph, sub.details["coarse_nodes"])
            refined = _refine(coarser, g, sub._coarse_schedule)
            if refined is not None:
                cands.append((f"milp(coarse {len(coarser.nodes)})", refined))
    best_base = lowest = None
    for name, sched in cands:
        stages = _stages_of(g, _prune(g, sched))
        if stages is not None:
            stages = _normalise(g, stages)
        if stages is None:
            continue
        sim = simulate(g, _flat(g, stages))
        if lowest is None or sim.peak_bytes < lowest[1].peak_bytes:
            lowest = (name, sim, stages)
        if sim.peak_bytes <= budget_bytes and (best_base is None or sim.extra_cost < best_base[1].extra_cost):
            best_base = (name, sim, stages)
    warm = bool(warm_start and best_base is not None and _assign(model, best_base[2]))
    if best_base is not None:
        details["baseline"] = {"name": best_base[0], "extra_cost": best_base[1].extra_cost,
                               "coarse_peak_bytes": best_base[1].peak_bytes, "warm_start": warm}
    es = equal_spacing.solve(graph, budget_bytes)  # the fine graph's baseline, for the record
    details["equal_spacing"] = {"fits": es.fits, "extra_cost": es.extra_cost,
                                "peak_bytes": es.predicted_peak_bytes, "k": es.details.get("k")}
    t1 = time.perf_counter()
    details["attempts"] = []
    deadline = None if time_limit_s is None else t0 + time_limit_s
    out = _solve_milp(model, backend, _until(limits, deadline), warm, msg, details["attempts"])
    details["milp_s"] = round(time.perf_counter() - t1, 3)
    if details["attempts"] and details["attempts"][-1]["backend"] != backend:
        details["backend"] = details["attempts"][-1]["backend"]  # the one that answered
    failed = [a for a in details["attempts"] if "error" in a]
    if out.status in ("optimal", "feasible"):
        import pulp

        details["objective"] = pulp.value(model.prob.objective)
        details["best_bound"] = out.bound
        details["stopped_by"] = out.stopped_by
        details["milp_peak_bytes"] = _milp_peak(model)
        details["schedule_source"] = "milp"
        if failed:
            _warn(f"MILP backend failure ({failed[0]['error']}); answered by {details['backend']}")
        plan = _finish(graph, g, _solution_stages(model), strategy="checkmate", budget=budget_bytes,
                       status=out.status, t0=t0, gap=out.gap, details=details)
        if plan.fits:
            plan = _polish(graph, plan, [es], budget_bytes, t0)
            if es.fits and es.extra_cost < plan.details["milp_plan"]["extra_cost"] - 1e-9:
                plan.details["warning"] = (f"equal_spacing (k={es.details.get('k')}, extra cost "
                                           f"{es.extra_cost:g}) beats the MILP's own plan: the limits "
                                           "or the coarsening cost the MILP")
            return plan
        # rounding in the model; never expected, never hidden: the fallbacks below answer
        details["milp_overshoot_bytes"] = plan.predicted_peak_bytes - budget_bytes
        reason = "the MILP's plan overshoots the budget in the fine simulator"
    elif out.status == "infeasible":
        reason = "proven infeasible"
    elif out.stopped_by is not None:  # deterministic: no backend failed
        reason = f"no incumbent within the MILP's {out.stopped_by}"
    else:
        reason = ("every backend failed: " + "; ".join(f"{a['backend']}: {a.get('error') or a['status']}"
                                                       for a in details["attempts"]))
    details["reason"] = reason
    return _fallback(graph, g, budget_bytes, es, lowest, details, t0,
                     failed=bool(failed) or (out.status == "none" and out.stopped_by is None),
                     backend=requested, coarsen_to=coarsen_to, limits=limits, deadline=deadline)


def _warn(text: str) -> None:
    warnings.warn(text, SolverFallbackWarning, stacklevel=3)


def _fallback(graph, g, budget_bytes, es, lowest, details, t0, *, failed, backend, coarsen_to,
              limits, deadline) -> Plan:
    """No MILP plan fits: answer with the cheapest (after fine refinement) of equal_spacing's plan
    and the lowest-peak plan min_feasible_budget reports (cached per graph and options), when they
    fit; else an "infeasible" plan holding the lowest-peak schedule. `failed`: the MILP backends
    failed (not a proven infeasibility), so a SolverFallbackWarning says so."""
    fits = [es] if es.fits else []
    if not fits or details["reason"] == "proven infeasible" and g is not graph:
        # the coarse model is conservative: the lowest-peak plan may fit the fine graph; and a
        # budget at or above min_feasible_budget's answer must be answered with a plan
        low = _lowest_peak(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
        details["lowest_peak"] = {"peak_bytes": low.predicted_peak_bytes,
                                  "source": low.details.get("schedule_source")}
        if low.predicted_peak_bytes <= budget_bytes:
            fits.append(low)
    if fits:
        src = min(fits, key=lambda p: p.extra_cost)
        details["fallback"] = {"reason": details["reason"],
                               "candidates": [("equal_spacing" if p is es else "lowest_peak") for p in fits]}
        details["schedule_source"] = "fallback"
        details["coarse_peak_bytes"] = None
        if failed:
            _warn(f"checkmate: {details['reason']}; answering with the best heuristic plan that fits "
                  f"(equal_spacing / lowest-peak plan, refined on the fine graph)")
        start = plan_from_schedule(graph, src.schedule, strategy="checkmate", budget_bytes=budget_bytes,
                                   status="feasible", details=details)
        return _polish(graph, start, [p for p in fits if p is not src], budget_bytes, t0,
                       first="equal_spacing" if src is es else "lowest_peak")
    if failed:
        _warn(f"checkmate: {details['reason']}; no known plan fits {budget_bytes} bytes")
    name, _, stages = lowest
    details["schedule_source"] = name
    return _finish(graph, g, stages, strategy="checkmate", budget=budget_bytes, status="infeasible",
                   t0=t0, gap=None, details=details)


def _polish(graph: TrainingGraph, plan: Plan, others: list[Plan], budget_bytes: int, t0: float,
            first: str = "milp") -> Plan:
    """Spend the slack the coarse model leaves: drop, on the fine graph, every recomputation the
    budget does not need (solver/refine.py), starting from `plan` and from each fitting plan of
    `others` (equal_spacing's, the lowest-peak one); keep the cheaper. The MILP's own numbers stay
    in details."""
    cands = [(first, drop_recomputations(graph, plan.schedule, budget_bytes))]
    for p in others:
        if p.predicted_peak_bytes <= budget_bytes:
            name = "equal_spacing" if p.strategy == "equal_spacing" else "lowest_peak"
            cands.append((name, drop_recomputations(graph, p.schedule, budget_bytes)))
    judged = [(name, sched, simulate(graph, sched)) for name, sched in cands]
    name, sched, sim = min(judged, key=lambda c: (c[2].extra_cost, c[2].peak_bytes))
    details = {**plan.details, "milp_plan": {"extra_cost": plan.extra_cost,
                                             "peak_bytes": plan.predicted_peak_bytes},
               "refined": {n: {"extra_cost": r.extra_cost, "peak_bytes": r.peak_bytes} for n, _, r in judged},
               "refined_from": name}
    out = plan_from_schedule(graph, sched, strategy="checkmate", budget_bytes=budget_bytes,
                             status=plan.status, solve_time_s=time.perf_counter() - t0, gap=plan.gap,
                             details=details)
    out._coarse_schedule = getattr(plan, "_coarse_schedule", None)
    return out


def _min_peak(graph: TrainingGraph, g: TrainingGraph, backend: str, limits: Limits,
              attempts_log: list) -> Plan | None:
    """Minimise M >= U[t,k] + workspace + kept + resident over the MILP's space (no budget)."""
    t0 = time.perf_counter()
    total = g.resident_bytes + sum(v.out_bytes + v.kept_bytes + max(v.workspace_bytes, 0)
                                   for v in g.nodes)
    unit = _unit(total, g)
    model = _build(g, None, unit, minimise_peak=True)
    base = min(_baselines(graph, g, None), key=lambda ns: simulate(g, ns[1]).peak_bytes)
    stages = _stages_of(g, base[1])
    warm = stages is not None and _assign(model, stages)
    out = _solve_milp(model, backend, replace(limits, mip_gap=None), warm, False, attempts_log)
    if out.status not in ("optimal", "feasible"):
        return None
    return _finish(graph, g, _solution_stages(model), strategy="checkmate", budget=None,
                   status=out.status, t0=t0, gap=out.gap,
                   details={"milp_peak_bytes": _milp_peak(model), "coarse_nodes": len(g.nodes)})


# lowest-peak plans per (graph object, options): min_feasible_budget and solve's last fallback read
# the same entry, so the budget one reports is a budget the other accepts, whatever the limits
_LOWEST: dict = {}


def _lowest_peak(graph: TrainingGraph, *, backend: str, coarsen_to: int | None, limits: Limits,
                 deadline: float | None = None) -> Plan:
    """The lowest-peak plan known: the min-peak MILP's or equal_spacing's lowest, whichever peaks
    lower (cached per graph object and options `limits`, whatever wall clock was left before
    `deadline` when it was computed; a copy is returned)."""
    key = (id(graph), backend, coarsen_to, limits)
    hit = _LOWEST.get(key)
    if hit is not None and hit[0]() is graph:
        return copy.deepcopy(hit[1])
    t0 = time.perf_counter()
    name = default_backend() if backend == "auto" else backend
    g = _prepare(graph, coarsen_to)
    log: list = []
    plan = _min_peak(graph, g, name, _until(limits, deadline), log)
    # equal_spacing's lowest-peak plan is a valid answer too; the coarse model can miss it
    es = equal_spacing.solve(graph, 1)
    failed = [a for a in log if "error" in a]
    if plan is None or es.predicted_peak_bytes < plan.predicted_peak_bytes:
        if plan is not None:
            es.details["min_peak_milp_bytes"] = plan.predicted_peak_bytes
        es.strategy, es.status = "checkmate", "feasible"
        es.details["schedule_source"] = ("equal_spacing (lower peak than the min-peak MILP)" if plan is not None
                                         else "equal_spacing (the min-peak MILP found no plan)")
        plan = es
    else:
        plan.details["schedule_source"] = "min_peak_milp"
    if failed:
        _warn(f"min-peak MILP backend failure ({failed[0]['error']}); "
              f"answered by {log[-1]['backend'] if 'status' in log[-1] else 'equal_spacing'}")
    plan.details["attempts"] = log
    plan.budget_bytes = plan.predicted_peak_bytes
    plan.solve_time_s = time.perf_counter() - t0  # coarsening and the comparison included
    _LOWEST[key] = (weakref.ref(graph, lambda _, k=key: _LOWEST.pop(k, None)), plan)
    return copy.deepcopy(plan)


def min_feasible_budget(graph: TrainingGraph, *, backend: str = "auto",
                        max_nodes: int | None = None,
                        time_limit_s: float | None = None, coarsen_to: int | None = DEFAULT_COARSEN_TO,
                        threads: int | None = 1, mip_gap: float | None = 1e-4, return_plan: bool = False,
                        **_: object):
    """The smallest budget for which a plan was found: solve the MILP minimising the peak (a
    variable M >= U[t,k] + workspace + kept + resident for every t, k) and return the FINE
    simulated peak of that plan (with coarsening it can be below the coarse model's own peak,
    which is in plan.details). When equal_spacing's lowest-peak plan peaks lower (or the MILP
    finds nothing), that plan is the answer; plan.details says which one it is. `solve` with the
    same options accepts every budget at or above this answer: this plan is its last fallback
    (cached per graph object). Options as in `solve` (mip_gap does not apply: kept for symmetry)."""
    limits = _limits(time_limit_s, max_nodes, mip_gap, threads)
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    plan = _lowest_peak(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    return (plan.predicted_peak_bytes, plan) if return_plan else plan.predicted_peak_bytes

"""Checkmate's MILP (Jain et al., MLSys 2020) over a (coarse) graph, as a PuLP model: building it,
setting a warm start, and reading a solution back. solver/checkmate/strategy.py solves it.

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.backends import import_pulp

__all__ = ["MilpModel", "build_model", "set_start", "solution_stages", "milp_peak", "objective_value", "memory_unit"]


@dataclass
class MilpModel:
    """A built MILP: the PuLP problem, its variables by index (constants where the model is
    shrunk), and what reading a solution back needs."""

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


@dataclass
class _Shape:
    """What the model's shape is read from (the shrinking the module docstring describes): the
    edges as indices, memory in units, and where each node may be computed or kept."""

    inputs: list  # inputs[k]: k's inputs, as indices
    users: list  # users[i]: the nodes that read i
    mem: list  # mem[i]: i's output in units, rounded up
    possible: list  # possible[i]: bitmask of the stages where i may be computed
    lastread: list  # lastread[i]: the last stage where a reader of i may be computed
    forced: list  # forced[i]: the stage up to which a non-recomputable i must be kept


def _shape(g: TrainingGraph, unit: int) -> _Shape:
    """Where each node of `g` may be computed and kept, so that variables that can only be 0 are
    never made."""
    n = len(g.nodes)
    inputs = g.input_indices
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
    return _Shape(inputs=inputs, users=users, mem=mem, possible=possible, lastread=lastread, forced=forced)


def _rs_variables(sh: _Shape) -> tuple[dict, dict]:
    """R[t,i] and S[t,i] where they may be 1: a constant 1 where the value is fixed (i's own stage;
    a keep forced by a non-recomputable reader), a binary elsewhere, absent (0) otherwise."""
    pulp = import_pulp()

    R: dict = {}
    S: dict = {}
    for i in range(len(sh.inputs)):
        for t in _bits(sh.possible[i]):
            R[t, i] = 1 if t == i else pulp.LpVariable(f"R_{t}_{i}", cat="Binary")
        for t in range(i + 1, sh.lastread[i] + 1):
            S[t, i] = 1 if t <= sh.forced[i] else pulp.LpVariable(f"S_{t}_{i}", cat="Binary")
    return R, S


def _stages(R: dict, n: int) -> list[list[int]]:
    """stages[t]: the nodes that may run in stage t, ascending (the order memory is counted in)."""
    stages = [[] for _ in range(n)]
    for (t, i) in R:
        stages[t].append(i)
    for st in stages:
        st.sort()
    return stages


def _objective(m: MilpModel, minimise_peak: bool):
    """Set the objective; return the peak variable M when minimising the peak, else None.

    min sum_t sum_i cost_i * R[t,i]; the constant first computations are left out, so the objective
    is the extra cost and a relative MIP gap is relative to it."""
    pulp = import_pulp()

    if minimise_peak:
        M = pulp.LpVariable("M", lowBound=0)
        m.prob += M
        return M
    m.prob += pulp.lpSum(m.g.nodes[i].cost * r for (t, i), r in m.R.items() if not isinstance(r, int))
    return None


def _dependency_rows(m: MilpModel, sh: _Shape) -> int:
    """A node is computed only when its inputs are in memory: R[t,k] <= R[t,i] + S[t,i] for every
    edge (i,k). Rows with a constant 1 on the right always hold and are left out. Returns the count."""
    pulp = import_pulp()

    cons = 0
    for t, st in enumerate(m.stages):
        for k in st:
            for i in sh.inputs[k]:
                rhs = [x for x in (m.R.get((t, i), 0), m.S.get((t, i), 0)) if not _is0(x)]
                if any(isinstance(x, int) for x in rhs):
                    continue  # a constant 1 on the right: always met
                if not rhs:
                    raise AssertionError(f"node {k} cannot read {i} in stage {t}")  # by construction
                m.prob += m.R[t, k] <= pulp.lpSum(rhs), f"dep_{t}_{i}_{k}"
                cons += 1
    return cons


def _carry_rows(m: MilpModel) -> int:
    """A value is kept into a stage only if it was kept or computed in the stage before:
    S[t+1,i] <= S[t,i] + R[t,i]. Returns the count."""
    pulp = import_pulp()

    cons = 0
    for (t, i), s in m.S.items():
        if isinstance(s, int):
            continue
        rhs = [x for x in (m.S.get((t - 1, i), 0), m.R.get((t - 1, i), 0)) if not _is0(x)]
        if any(isinstance(x, int) for x in rhs):
            continue
        m.prob += s <= pulp.lpSum(rhs), f"keep_{t}_{i}"
        cons += 1
    return cons


def _dominance_rows(m: MilpModel, sh: _Shape) -> int:
    """Dominance cuts (they remove only wasteful points, never an optimum): R[t,i] + S[t,i] <= 1
    (never recompute a value already kept), and S[t,i] <= S[t+1,i] + sum_{j users of i} R[t,j]
    (keep only what is read or kept on). Returns the count."""
    pulp = import_pulp()

    cons = 0
    for (t, i), s in m.S.items():
        if isinstance(s, int):
            continue
        r = m.R.get((t, i), 0)
        if not _is0(r):
            m.prob += s + r <= 1, f"rs_{t}_{i}"
            cons += 1
        rhs = [x for x in [m.S.get((t + 1, i), 0)] + [m.R.get((t, j), 0) for j in sh.users[i]] if not _is0(x)]
        if any(isinstance(x, int) for x in rhs):
            continue
        m.prob += s <= pulp.lpSum(rhs), f"use_{t}_{i}"
        cons += 1
    return cons


def _memory_rows(m: MilpModel, sh: _Shape, budget_bytes: int | None) -> int:
    """Memory, stage by stage and node by node: U's accounting row, the budget (or peak) row, then
    the FREE rows of the values freed after the node, in that order. Returns the count."""
    n = len(m.stages)
    kept = [[] for _ in range(n + 1)]  # kept[t]: (i, S[t,i]) for the values with bytes
    for (t, i), s in m.S.items():
        if sh.mem[i]:
            kept[t].append((i, s))
    cons = 0
    kept_before = 0
    for t, st in enumerate(m.stages):
        in_stage = set(st)
        for pos, k in enumerate(st):
            cons += _accounting_row(m, sh, kept[t], t, st[pos - 1] if pos else None, k)
            cons += _budget_row(m, t, k, budget_bytes, kept_before)
            if k == t:
                break  # U after the stage's last node is never read: nothing is freed there
            cons += _free_rows(m, sh, t, k, in_stage)
        kept_before += m.g.nodes[t].kept_bytes
    return cons


def _accounting_row(m: MilpModel, sh: _Shape, kept_t: list, t: int, kp: int | None, k: int) -> int:
    """Make U[t,k], the units in memory after k runs in stage t: U[t,k1] = sum_i mem_i S[t,i] +
    mem_k1 R[t,k1]; U[t,k_{j+1}] = U[t,k_j] - sum_{i in inputs(k_j) + {k_j}} mem_i FREE[t,i,k_j]
    + mem R[t,k_{j+1}] (kp = k_j, the node before k in the stage, None for the first). Returns 1."""
    pulp = import_pulp()

    mem = sh.mem
    u = pulp.LpVariable(f"U_{t}_{k}", lowBound=0)
    m.U[t, k] = u
    if kp is None:
        expr = pulp.lpSum(mem[i] * s for i, s in kept_t)
    else:
        frees = [mem[i] * m.FREE[t, i, kp] for i in set(sh.inputs[kp]) | {kp} if (t, i, kp) in m.FREE]
        expr = m.U[t, kp] - pulp.lpSum(frees)
    m.prob += u == expr + mem[k] * m.R[t, k], f"mem_{t}_{k}"
    return 1


def _budget_row(m: MilpModel, t: int, k: int, budget_bytes: int | None, kept_before: int) -> int:
    """While k runs, U[t,k] + (workspace_k + kept_k) R[t,k] stays within budget - resident - kept
    before t; when minimising the peak, within M less those constants. The row is recorded in
    m.rows for milp_peak and set_start. Returns 1."""
    g, unit, u = m.g, m.unit, m.U[t, k]
    extra = math.ceil((g.nodes[k].workspace_bytes + g.nodes[k].kept_bytes) / unit)
    m.rows.append((t, k, extra, kept_before + g.resident_bytes))
    if m.M is not None:
        m.prob += u + extra * m.R[t, k] + math.ceil((kept_before + g.resident_bytes) / unit) <= m.M, \
            f"peak_{t}_{k}"
    else:
        cap = (budget_bytes - g.resident_bytes - kept_before) // unit
        m.prob += u + extra * m.R[t, k] <= cap, f"budget_{t}_{k}"
    return 1


def _free_rows(m: MilpModel, sh: _Shape, t: int, k: int, in_stage: set) -> int:
    """FREE's linearisation for the values k frees in stage t (its inputs and itself):
    FREE[t,i,k] = R[t,k] (1 - S[t+1,i]) prod_{j users of i, j > k} (1 - R[t,j]), as
    FREE <= R[t,k]; FREE <= 1 - S[t+1,i]; FREE <= 1 - R[t,j]; FREE >= R[t,k] - S[t+1,i] - sum_j R[t,j].
    Returns the count."""
    pulp = import_pulp()

    cons = 0
    R = m.R
    for i in set(sh.inputs[k]) | {k}:
        if not sh.mem[i]:
            continue
        later = [j for j in sh.users[i] if j > k and j in in_stage]
        s_next = m.S.get((t + 1, i), 0)
        hazards = [R[t, j] for j in later]
        if any(isinstance(h, int) for h in hazards) or isinstance(s_next, int) and s_next:
            continue  # a constant 1 hazard: never freed here
        f = pulp.LpVariable(f"FREE_{t}_{i}_{k}", lowBound=0, upBound=1)
        m.FREE[t, i, k] = f
        if not isinstance(R[t, k], int):
            m.prob += f <= R[t, k], f"fr_{t}_{i}_{k}"
            cons += 1
        if not isinstance(s_next, int):
            m.prob += f <= 1 - s_next, f"fs_{t}_{i}_{k}"
            cons += 1
        for j, h in zip(later, hazards):
            m.prob += f <= 1 - h, f"fu_{t}_{i}_{k}_{j}"
            cons += 1
        m.prob += f >= R[t, k] - s_next - pulp.lpSum(hazards), f"fl_{t}_{i}_{k}"
        cons += 1
    return cons


def build_model(g: TrainingGraph, budget_bytes: int | None, unit: int, *, minimise_peak: bool = False) -> MilpModel:
    """The MILP over `g` in memory units of `unit` bytes: minimise the extra compute cost with every
    step within `budget_bytes`, or (minimise_peak, budget None) minimise the peak M."""
    pulp = import_pulp()

    sh = _shape(g, unit)
    R, S = _rs_variables(sh)
    m = MilpModel(g=g, unit=unit, prob=pulp.LpProblem("checkmate", pulp.LpMinimize), R=R, S=S, FREE={}, U={},
                  stages=_stages(R, len(g.nodes)))
    m.M = _objective(m, minimise_peak)
    # the rows in Checkmate's order (the order the backends see them in)
    cons = _dependency_rows(m, sh)
    cons += _carry_rows(m)
    cons += _dominance_rows(m, sh)
    cons += _memory_rows(m, sh, budget_bytes)
    m.counts = {"R": sum(not isinstance(r, int) for r in R.values()),
                "S": sum(not isinstance(s, int) for s in S.values()), "FREE": len(m.FREE),
                "U": len(m.U), "constraints": cons}
    m.counts["binaries"] = m.counts["R"] + m.counts["S"]
    return m


def set_start(model: MilpModel, stages: list[list[int]]) -> bool:
    """Set the variables' initial values to the schedule `stages` (a warm start); False if the
    schedule is not a point of the model (a variable that does not exist, or a budget row broken)."""
    g, R, S = model.g, model.R, model.S
    n = len(g.nodes)
    idx = g.index
    inputs = g.input_indices
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


def solution_stages(model: MilpModel) -> list[list[int]]:
    """The solved model's stages: the nodes with R[t,i] = 1 in each stage t, ascending."""
    out = [[] for _ in model.g.nodes]
    for (t, i), r in model.R.items():
        if isinstance(r, int) or (r.varValue or 0) > 0.5:
            out[t].append(i)
    for st in out:
        st.sort()
    return out


def objective_value(model: MilpModel) -> float | None:
    """The objective's value at the solution the backend left in the model (PuLP's reading)."""
    pulp = import_pulp()

    return pulp.value(model.prob.objective)


def milp_peak(model: MilpModel) -> int:
    """The MILP's own peak: max over stages and running nodes of U + workspace + kept + constants."""
    peak = 0
    for t, k, extra, const in model.rows:
        r = model.R[t, k]
        if isinstance(r, int) or (r.varValue or 0) > 0.5:
            peak = max(peak, round((model.U[t, k].varValue or 0) + extra) * model.unit + const)
    return peak


def memory_unit(budget: int, g: TrainingGraph) -> int:
    """Bytes per memory unit of the MILP: about max(budget, everything `g` allocates) / 2^20, at
    least 1 (node bytes are rounded up to units, so the MILP stays conservative)."""
    scale = max(budget, g.resident_bytes + sum(v.out_bytes + v.kept_bytes for v in g.nodes))
    return max(1, scale >> 20)

"""The rows of the relaxation (solver/checkmate/relaxation.py, whose docstring states each fact): states row
by row and the sitting states, the links between consecutive states of a group, the memory rows,
and the cost.
"""
from __future__ import annotations

__all__ = ["build_rows", "rhs_of"]


def rhs_of(budget: int | None, fixed: int, ms: float, extra=()) -> float:
    """A memory or transient row's upper bound: (budget - fixed) / ms, plus each of `extra` (the
    bytes of inputs recomputed with the value, in model units) in turn; budget None: the peak's
    model (the peak variable is in the row). Relaxation.set_budget recomputes it the same way."""
    hi = (budget - fixed) / ms if budget is not None else -fixed / ms
    for e in extra:
        hi += e
    return hi


def build_rows(rel) -> None:
    """Build every variable and row of `rel` (a Relaxation whose data is prepared)."""
    m, n, nodes = rel.model, rel.n, rel.graph.nodes
    rec, P, lastrd, grp = rel.recomputable, rel.part_bytes, rel.last_read, rel.group_of
    ms = rel.mem_scale
    bases = rel.base_bytes()
    carry: dict = {}  # (group, state) -> {u: deadline the state's C must reach}
    closing = [[] for _ in range(n + 1)]  # parts whose modelled life ends at a row
    nonrec_closing = [[] for _ in range(n + 1)]
    open_by_group: dict = {}
    nonrec_open = 0  # bytes of non-recomputable parts some first computation at or after t reads
    sitting_at = [[] for _ in range(n)]  # row -> sitting states (their ids j) covering it
    for j, (_, a, b) in enumerate(rel.sitting_spans):
        for t in range(a, b + 1):
            sitting_at[t].append(j)
    hold = rel.hold
    for t in range(n):
        if t:
            u = t - 1
            for k, b in enumerate(P[u]):
                if hold[u][k] >= t:
                    closing[hold[u][k]].append((u, k))
                    if grp[u] >= 0:
                        open_by_group.setdefault(grp[u], set()).add((u, k))
                if not rec[u] and lastrd[u][k] >= t:
                    nonrec_open += b
                    nonrec_closing[lastrd[u][k]].append(b)
            for (u, k) in closing[t - 1]:
                if grp[u] >= 0:
                    open_by_group[grp[u]].discard((u, k))
            nonrec_open -= sum(nonrec_closing[t - 1])
        for j in sitting_at[t]:
            gi, a, _ = rel.sitting_spans[j]
            if a == t:
                _sitting_state(rel, j, t, open_by_group.get(gi, set()), carry)
        det = set(rel.run_at[t])
        read_t = set(rel.reads[t])
        Lt = _row_state(rel, t, det, open_by_group, carry)
        fixed = bases[t] + nodes[t].out_bytes + nodes[t].kept_bytes + nodes[t].workspace_bytes
        fixed += nonrec_open + sum(P[u][k] for u, k in read_t if rec[u])
        terms = [(col, P[u][k] / ms) for (u, k), col in Lt.items() if (u, k) not in read_t]
        sits = [rel.sitting[j][2] for j in sitting_at[t]]
        terms += [(col, 1.0) for col in sits]
        rel.memory_rows.append(m.num_rows)
        rel.memory_fixed.append(fixed)
        if rel.peak is not None:  # the peak's model: every row at most the variable P
            m.row(terms + [(rel.peak, -1.0)], hi=rhs_of(None, fixed, ms))
        else:
            if fixed > rel.budget and rel.infeasible_at is None:
                rel.infeasible_at = t
            rel.budget_rows.append((m.num_rows, fixed, ()))
            m.row(terms, hi=rhs_of(rel.budget, fixed, ms))
        ends = []
        for gi in sorted(det):
            a = rel.chain_prev.get((gi, t))
            if a is not None:
                ends += _link(rel, gi, a, t, carry)
        _dependencies(rel, t, ends, det)
        if rel.transients:
            _transients(rel, t, det, Lt, read_t, sits, bases[t] + nonrec_open,
                        [(u, R) for u, R in ends if rel.interval[u, t][0] == t - 1])
        for gi in det:
            _carry(rel, gi, t, carry)
    for col in rel.pending:
        _depend(rel, col)
    for gi in range(len(rel.groups)):  # a computation after the last state still costs
        last = rel.chain_last[gi]
        for u in rel.members[gi]:
            c = rel.again.get((u, last))
            if c is not None:
                R = _R(rel, u, last, -1)
                m.row([(c, 1.0), (R, -1.0)], hi=0.0)


def _R(rel, u: int, a: int, b: int) -> int:
    """The variable 'u is computed in the interval (a, b]', costing c_u in the objective (made
    once: a dependency may have made it before the link between a and b is built)."""
    col = rel.computed.get((u, b))
    if col is not None:
        assert rel.interval[u, b] == (a, b)
        return col
    cost = 0.0 if rel.peak is not None else rel.graph.nodes[u].cost / rel.cost_scale
    col = rel.model.var(0.0, 1.0, cost=cost, integral=True)
    rel.computed[u, b] = col
    rel.R_of[col] = (u, b)
    rel.interval[u, b] = (a, b)
    return col


def _state(rel, s: int, need_rec: list, cset: set, seeds: dict, within: set, t: int, held: list = ()) -> dict:
    """Variables and need/closure rows of state s: need_rec parts live or C; C for cset with
    deadlines (readers' deadlines propagate to their inputs; seeds carried from the previous
    state); closure to inputs whose group is in `within`; an L for each `held` part (modelled,
    not needed: its chain of keep rows goes on). Returns {(u, k): L column}."""
    m, rec, grp, lastrd = rel.model, rel.recomputable, rel.group_of, rel.last_read
    D = dict(seeds)
    for (u, k) in need_rec:
        D[u] = max(D.get(u, 0), rel.next_read(u, k, t))
    for v in sorted(cset, reverse=True):  # readers before their inputs
        for w, _ in rel.reads[v]:
            if w in cset:
                D[w] = max(D.get(w, 0), D[v])
    Ls: dict = {}

    def L(u, k):
        col = Ls.get((u, k))
        if col is None:
            col = Ls[u, k] = rel.live[u, k, s] = m.var(0.0, 1.0, integral=True)
        return col

    for u, d in D.items():
        rel.again[u, s] = m.var(0.0, 1.0)
        rel.deadline[u, s] = d
    for (u, k) in held:
        L(u, k)
    for (u, k) in need_rec:
        m.row([(L(u, k), 1.0), (rel.again[u, s], 1.0)], lo=1.0)
    for v in cset:
        for (u, k) in rel.reads[v]:
            if grp[u] not in within:
                continue
            if rec[u]:
                m.row([(rel.again[v, s], 1.0), (rel.again[u, s], -1.0), (L(u, k), -1.0)], hi=0.0)
            elif lastrd[u][k] <= t:  # a non-recomputable part no later first computation holds
                m.row([(rel.again[v, s], 1.0), (L(u, k), -1.0)], hi=0.0)
    return Ls


def _closure(rel, roots, within: set) -> set:
    rec, grp = rel.recomputable, rel.group_of
    cset, stack = set(), list(roots)
    while stack:
        u = stack.pop()
        if u in cset:
            continue
        cset.add(u)
        for w, _ in rel.reads[u]:
            if rec[w] and grp[w] in within and w not in cset:
                stack.append(w)
    return cset


def _row_state(rel, t: int, det: set, open_by_group: dict, carry: dict) -> dict:
    """Row t's state for the groups modelled in detail there (closure across them)."""
    rec, lastrd = rel.recomputable, rel.last_read
    opened = [(u, k) for gi in det for (u, k) in open_by_group.get(gi, ()) if rec[u]]
    need_rec = [(u, k) for u, k in opened if lastrd[u][k] > t]
    if rel.fwd_reads_only and t <= rel.forward_end:  # forward rows: only what the forward reads
        need_rec = [(u, k) for u, k in need_rec if rel.next_read(u, k, t) <= rel.forward_end]
    seeds: dict = {}
    for gi in det:
        seeds.update(carry.pop((gi, t), {}))
    cset = _closure(rel, [u for u, _ in need_rec], det)
    needed = set(need_rec)
    held = [(u, k) for u, k in opened if (u, k) not in needed]  # modelled, so no chain breaks
    return _state(rel, t, need_rec, cset, seeds, det, t, held)


def _sitting_state(rel, j: int, t0: int, open_parts: set, carry: dict) -> None:
    """Sitting state j: its group's one state over the sitting rows, and the column M of its live
    bytes there."""
    m, rec, P = rel.model, rel.recomputable, rel.part_bytes
    gi, a0, b0 = rel.sitting_spans[j]
    s = rel.n + j
    need_rec = [(u, k) for (u, k) in open_parts if rec[u] and rel.last_read[u][k] >= t0]
    held = [(u, k) for (u, k) in open_parts if rec[u] and rel.last_read[u][k] < t0]
    seeds = carry.pop((gi, s), {})
    cset = _closure(rel, [u for u, _ in need_rec], {gi})
    Ls = _state(rel, s, need_rec, cset, seeds, {gi}, t0, held)
    parts = [(col, P[u][k]) for (u, k), col in Ls.items()]
    M = m.var(0.0, sum(b for _, b in parts) / rel.mem_scale)
    m.row([(M, 1.0)] + [(col, -b / rel.mem_scale) for col, b in parts], lo=0.0)
    rel.sitting[j] = (a0, b0, M, parts)
    a = rel.chain_prev.get((gi, s))
    if a is not None:
        ends = _link(rel, gi, a, s, carry)
        _dependencies(rel, s, ends, {gi})
    _carry(rel, gi, s, carry)


def _link(rel, gi: int, a: int, b: int, carry: dict) -> list:
    """keep and count rows between consecutive states a, b of group gi; returns [(u, R)]."""
    m, rec, P = rel.model, rel.recomputable, rel.part_bytes
    top = a if a < rel.n else rel.n
    start_b = rel.row_of_state(b)
    out = []
    for u in rel.members[gi]:
        if u > top:
            break
        if rec[u]:
            cp = rel.again.get((u, a))
            ks = [k for k in range(len(P[u])) if (u, k, b) in rel.live and (u, k, a) in rel.live]
            if cp is None and not ks:
                continue
            R = _R(rel, u, a, b)
            out.append((u, R))
            if cp is not None:
                later = [] if rel.deadline[u, a] <= start_b else [(rel.again[u, b], -1.0)]
                m.row([(cp, 1.0), (R, -1.0)] + later, hi=0.0)
            for k in ks:
                m.row([(rel.live[u, k, b], 1.0), (rel.live[u, k, a], -1.0), (R, -1.0)], hi=0.0)
        else:
            for k in range(len(P[u])):
                if (u, k, b) in rel.live and (u, k, a) in rel.live:
                    m.row([(rel.live[u, k, b], 1.0), (rel.live[u, k, a], -1.0)], hi=0.0)
    return out


def _carry(rel, gi: int, s: int, carry: dict) -> None:
    """Deadlines of state s's C that reach past the next state's start: that state's C covers
    them (count row), so its deadline must be at least as late."""
    nxt = rel.chain_next.get((gi, s))
    if nxt is None:
        return
    start = rel.row_of_state(nxt)
    for u in rel.members[gi]:
        d = rel.deadline.get((u, s))
        if d is not None and d > start:
            seeds = carry.setdefault((gi, nxt), {})
            seeds[u] = max(seeds.get(u, 0), d)


def _dependencies(rel, b: int, ends: list, det: set) -> None:
    """Queue the dependency rows of every R in `ends`: they are built once every state exists
    (a dependency reaches states of other groups, some after b)."""
    rel.pending.extend(Rv for _, Rv in ends)


def _depend(rel, Rv: int) -> None:
    """R[v,(a,b)] <= L[u,k,s0] + sum of R[u, I] over u's intervals from s0 on until they cover
    (a, b], for each input part (u, k) of v: s0 is the last state of u's chain that stands for a
    row at or before a's (its own chain's a when u is in v's group: Checkmate's dependency). If v
    runs in (a, b], the instance of u it reads was computed in one of those intervals or before
    s0, and is then live at s0. Every R this makes gets its dependency rows too."""
    m, rec, grp = rel.model, rel.recomputable, rel.group_of
    todo = [Rv]
    while todo:
        col = todo.pop()
        if col in rel.depends_done:
            continue
        rel.depends_done.add(col)
        v, b = rel.R_of[col]
        a = rel.interval[v, b][0]
        if b < 0:  # after the last state: no state bounds it
            continue
        for u, k in set(rel.reads[v]):
            gi = grp[u]
            if gi < 0:
                continue
            cover = rel.covering(gi, a, b) if gi != grp[v] else (a, [b])
            if cover is None:
                continue
            s0, ends = cover
            Lp = rel.live.get((u, k, s0))
            if Lp is None:  # not modelled there (not computed yet, or past its hold): nothing said
                continue
            if not rec[u]:
                m.row([(col, 1.0), (Lp, -1.0)], hi=0.0)
                continue
            terms = [(col, 1.0), (Lp, -1.0)]
            prev = s0
            for e in ends:
                Ru = _R(rel, u, prev, e)
                terms.append((Ru, -1.0))
                todo.append(Ru)
                prev = e
            m.row(terms, hi=0.0)


def _transients(rel, t: int, det: set, Lt: dict, read_t: set, sits: list, fixed: int, ends: list) -> None:
    """Memory while v is recomputed between rows t-1 and t: `fixed` (resident, kept, held
    non-recomputable parts), the sitting groups, W >= the detailed parts carried through the
    interval (y >= (live after t or read at t) - R), v's bytes and workspace, and each input part
    computed in the same interval: m (R_v + R_u - 1)."""
    if not ends:
        return
    m, P, rec, grp, ms = rel.model, rel.part_bytes, rel.recomputable, rel.group_of, rel.mem_scale
    W = m.var(0.0, rel.budget / rel.mem_scale)  # (Relaxation.set_budget moves this bound)
    ys: list = []
    rel.carried[t] = (W, ys)
    terms = [(W, 1.0)] + [(c, -1.0) for c in sits]
    for (u, k) in set(Lt) | {(u, k) for u, k in read_t if rec[u] and grp[u] in det}:
        if not rec[u]:
            if rel.last_read[u][k] < t:  # not held for a first computation: not in `fixed`
                terms.append((Lt[u, k], -P[u][k] / ms))
                ys.append((None, u, k, False))
            continue
        R = rel.computed.get((u, t))
        if R is None or rel.interval[u, t][0] != t - 1:
            continue
        y = m.var(0.0, 1.0)
        if (u, k) in read_t:
            m.row([(y, 1.0), (R, 1.0)], lo=1.0)
        else:
            m.row([(y, 1.0), (Lt[u, k], -1.0), (R, 1.0)], lo=0.0)
        terms.append((y, -P[u][k] / ms))
        ys.append((y, u, k, (u, k) in read_t))
    m.row(terms, lo=0.0)
    nodes = rel.graph.nodes
    for v, Rv in ends:
        rel.transient_rows.append(m.num_rows)
        own = nodes[v].out_bytes + nodes[v].workspace_bytes
        row, extra = [(W, 1.0), (Rv, own / ms)], []
        if rel.peak is not None:
            row = row + [(rel.peak, -1.0)]
        for u, k in set(rel.reads[v]):
            Ru = rel.computed.get((u, t))
            if Ru is not None and rel.interval[u, t][0] == t - 1:
                row += [(Rv, P[u][k] / ms), (Ru, P[u][k] / ms)]
                extra.append(P[u][k] / ms)
        if rel.peak is None:
            rel.budget_rows.append((m.num_rows, fixed, tuple(extra)))
        m.row(row, hi=rhs_of(None if rel.peak is not None else rel.budget, fixed, ms, extra))

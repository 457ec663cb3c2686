"""solver/checkmate/peak_relief.py: moving values held across the peak to a recomputation after it.

Every result must be a schedule the simulator accepts, never peaking above its input, never below
what any schedule can reach (brute force on small graphs, the relaxation's bound on larger ones);
and on a transformer it must really lower the peak, as it does on the default GPT (where it takes
the lowest-peak plan from 45.5 MiB to within 1% of the relaxation's bound)."""
from __future__ import annotations

import pytest

from remat.solver import equal_spacing
from remat.solver import checkmate
from remat.solver.checkmate import min_feasible_budget
from remat.solver.checkmate.milp_stages import DEFAULT_COARSEN_TO
from remat.solver.checkmate.peak_relief import relieve_peak
from remat.core.plan import LOWEST_PEAK
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate
from tests.conftest import brute_force, random_dag, training_chain, transformer_like

GRAPHS = ([random_dag(n, s) for n in (3, 5, 7) for s in range(6)]
          + [training_chain(n, s, random_at=(2,)) for n in (3, 4) for s in range(4)])


@pytest.mark.parametrize("g", GRAPHS, ids=lambda g: g.name)
def test_relieved_schedule_is_valid_and_no_higher(g):
    for start in (keep_all_schedule(g), equal_spacing.solve(g, LOWEST_PEAK).schedule):
        before = simulate(g, start).peak_bytes
        after = simulate(g, relieve_peak(g, start)).peak_bytes  # raises if it cannot run
        assert after <= before
        low, _ = brute_force(g, None, objective="peak")
        assert after >= low


def test_transformer_peak_really_drops():
    g = transformer_like(2, 0, d=1 << 14)
    start = keep_all_schedule(g)
    relieved = relieve_peak(g, start)
    assert simulate(g, relieved).peak_bytes < simulate(g, start).peak_bytes
    # first computations stay in graph order: only recomputations are inserted
    firsts = list(dict.fromkeys(relieved))
    assert firsts == [v.name for v in g.nodes]


def test_deadline_in_the_past_returns_the_input():
    g = transformer_like(2, 1, d=1 << 14)
    start = keep_all_schedule(g)
    assert relieve_peak(g, start, deadline=0.0) == start


@pytest.mark.parametrize("seed", [0, 1])
def test_lowest_peak_is_above_its_bound_and_replays(seed):
    g = transformer_like(2, seed, d=1 << 14)
    peak, plan = min_feasible_budget(g, return_plan=True)
    assert simulate(g, plan.schedule).peak_bytes == peak == plan.predicted_peak_bytes
    assert plan.details["peak_lower_bound"] <= peak
    keep = simulate(g, keep_all_schedule(g)).peak_bytes
    es = equal_spacing.solve(g, LOWEST_PEAK).predicted_peak_bytes
    assert peak <= min(keep, es)


def test_the_relaxation_bisection_runs_only_above_the_floor(monkeypatch):
    """Where equal_spacing's relieved lowest-peak plan is within CLOSE_TO_FLOOR of the rows' floor
    (transformer stacks), min_feasible_budget answers with it without the relaxation's bisection
    (minutes on a few hundred nodes); where it is further above (a chain), the bisection runs."""
    from remat.solver.checkmate import lowest_peak
    from remat.solver.checkmate.peak_rows import peak_floor

    calls = []
    real = lowest_peak.lowest_peak_search
    monkeypatch.setattr(lowest_peak, "lowest_peak_search", lambda g, **kw: calls.append(g) or real(g, **kw))
    g = transformer_like(6, 0)
    peak, plan = min_feasible_budget(g, return_plan=True)
    floor = peak_floor(g)
    assert calls == [] and floor <= peak <= floor * (1 + lowest_peak.CLOSE_TO_FLOOR)
    assert plan.details["peak_lower_bound"] == floor and simulate(g, plan.schedule).peak_bytes == peak
    chain = training_chain(40, 0)
    es = simulate(chain, relieve_peak(chain, equal_spacing.solve(chain, LOWEST_PEAK).schedule)).peak_bytes
    assert es > peak_floor(chain) * (1 + lowest_peak.CLOSE_TO_FLOOR)
    peak, plan = min_feasible_budget(chain, return_plan=True)
    assert calls == [chain] and plan.details["peak_lower_bound"] <= peak <= es


@pytest.mark.parametrize("make, above_floor", [(lambda: training_chain(40, 0), True),
                                               (lambda: random_dag(40, 5), True),
                                               (lambda: random_dag(50, 3), True),
                                               (lambda: training_chain(30, 1), False),
                                               (lambda: transformer_like(3, 1), False)])
def test_the_lowest_peak_is_at_most_the_rows_low_peak_schedule_relieved(make, above_floor):
    """Where equal_spacing's (and the min-peak MILP's) relieved plans stay more than CLOSE_TO_FLOOR
    above the rows' floor, the rows' low-peak schedule, its peak relieved, is a candidate of
    min_feasible_budget on graphs the relaxation serves too: the answer peaks no higher, the
    candidates name it, and the plan fits its own peak. Within CLOSE_TO_FLOOR it is not run."""
    from remat.solver.checkmate import lowest_peak
    from remat.solver.checkmate.peak_rows import lowest_peak_by_rows, peak_floor

    g = make()
    assert len(g.nodes) <= lowest_peak.RELAXATION_MAX_NODES
    peak, plan = min_feasible_budget(g, return_plan=True)
    others = min(p for s, p in plan.details["lowest_peak_candidates"].items()
                 if s in ("equal_spacing", "min_peak_milp"))
    assert (others > peak_floor(g) * (1 + lowest_peak.CLOSE_TO_FLOOR)) == above_floor
    assert ("rows" in plan.details["lowest_peak_candidates"]) == above_floor
    if above_floor:
        rows = simulate(g, relieve_peak(g, lowest_peak_by_rows(g)[0])).peak_bytes
        assert peak <= plan.details["lowest_peak_candidates"]["rows"] <= rows
    assert simulate(g, plan.schedule).peak_bytes == peak >= plan.details["peak_lower_bound"]


@pytest.mark.parametrize("make, cheaper_somewhere", [(lambda: transformer_like(4, 1), True),
                                                     (lambda: random_dag(40, 5), False),
                                                     (lambda: training_chain(50, 1), False)])
def test_where_nothing_else_fits_the_cheapest_known_plan_answers(make, cheaper_somewhere, monkeypatch):
    """Where solve's own candidates fit nothing, the plans the lowest-peak search found answer: of
    those no other beats on peak and cost (known_plans: peak ascending, cost descending, the first
    the lowest-peak plan's), the cheapest that fits once the budget's needless recomputations are
    dropped; never dearer than the lowest-peak plan so dropped (what answered before), and on the
    transformer cheaper at a budget above the second known plan's peak."""
    from remat.solver.checkmate import lowest_peak, strategy
    from remat.solver.checkmate.milp_attempts import make_limits
    from remat.solver.refine import drop_recomputations

    g = make()
    monkeypatch.setattr(strategy, "choose", lambda *a, **kw: None)  # nothing else fits
    peak, low = min_feasible_budget(g, return_plan=True)
    known = lowest_peak.known_plans(g, backend="auto", coarsen_to=DEFAULT_COARSEN_TO,
                                    limits=make_limits(None, None, 1e-4, 1))
    assert known[0].peak_bytes == peak and known[0].extra_cost <= low.extra_cost
    assert all(a.peak_bytes < b.peak_bytes and a.extra_cost > b.extra_cost for a, b in zip(known, known[1:]))
    assert all(simulate(g, list(k.schedule)).peak_bytes == k.peak_bytes for k in known)
    cheaper = 0
    for budget in sorted({k.peak_bytes + d for k in known for d in (0, k.peak_bytes >> 4)}):
        plan = checkmate.solve(g, budget, certify=False)
        before = simulate(g, drop_recomputations(g, low.schedule, budget)).extra_cost
        fitting = [k for k in known if k.peak_bytes <= budget]
        assert plan.details["fallback"]["answered_by"] in {k.source for k in fitting}
        assert simulate(g, plan.schedule).peak_bytes <= budget and plan.extra_cost <= before
        assert plan.extra_cost <= min(k.extra_cost for k in fitting)
        cheaper += plan.extra_cost < before
    assert len(known) >= 2 and (cheaper > 0 or not cheaper_somewhere)


def test_budget_probes_solve_the_relaxation_at_each_budget():
    """BudgetProbe (one relaxation moved from budget to budget, each LP started from the last
    one's basis) answers what a relaxation built at that budget answers: nothing fits by the rows,
    an infeasible LP, or the same optimum; in any order of budgets, after an infeasible one too."""
    from remat.solver.checkmate.peak_bisection import BudgetProbe
    from remat.solver.checkmate.relaxation import Relaxation

    seen = set()
    for g, budgets in ((training_chain(20, 2), (0.7, 67, 0.5, 66, 0.3, 67, 0.9, 68)),
                       (transformer_like(3, 1), (0.7, 0.5, 0.3, 0.6, 0.35, 0.45))):
        keep = simulate(g, keep_all_schedule(g)).peak_bytes
        probe = BudgetProbe(g, keep)
        for b in budgets:
            b = int(b * keep) if b < 1 else b
            cold = Relaxation(g, b)
            hot = probe.solve(b)
            if cold.infeasible_at is not None:
                assert hot is None
                seen.add("rows")
                continue
            sol = cold.model.solve()
            assert hot.status == sol.status, (g.name, b)
            seen.add(sol.status)
            if sol.status == "optimal":
                assert hot.objective == pytest.approx(sol.objective, rel=1e-7), (g.name, b)
    assert seen == {"rows", "infeasible", "optimal"}


def test_hot_started_probes_give_the_cold_bisection(monkeypatch):
    """lowest_peak_search with its probes built and solved from nothing at each budget (as before
    BudgetProbe) finds the same schedule and bound as with the hot-started probes."""
    from remat.solver.checkmate import peak_bisection as bisection
    from remat.solver.checkmate.relaxation import Relaxation

    class ColdProbe:
        def __init__(self, graph, top):
            self.graph = graph

        def solve(self, budget):
            probed.append(budget)
            self.rel = Relaxation(self.graph, budget)
            return None if self.rel.infeasible_at is not None else self.rel.model.solve()

    for g in (training_chain(40, 0), random_dag(30, 1)):
        hot = bisection.lowest_peak_search(g)
        probed = []
        with monkeypatch.context() as m:
            m.setattr(bisection, "BudgetProbe", ColdProbe)
            cold = bisection.lowest_peak_search(g)
        assert probed  # the bisection reached the relaxation's probes
        assert hot[1] == cold[1] and simulate(g, hot[0]).peak_bytes == simulate(g, cold[0]).peak_bytes


def test_the_bisection_stops_within_its_resolution(monkeypatch):
    """lowest_peak_search stops once the best peak is within PEAK_RESOLUTION of the highest budget
    it found no plan at: the probes below it could only have found a peak above that budget, so
    its peak is within 1 / (1 - resolution) of the peak the bisection to the byte finds, in no
    more probes (the last probe's reading from nothing, `_cold_at`, set aside: it may go lower
    either way)."""
    from remat.solver.checkmate import peak_bisection as bisection

    real = bisection.fit
    monkeypatch.setattr(bisection, "_cold_at", lambda g, best, peak, budget: best)
    fewer = 0
    for g in (training_chain(40, 0), random_dag(30, 1), transformer_like(3, seed=2)):
        runs = {}
        for res in (0.0, 0.05):
            probed = []
            monkeypatch.setattr(bisection, "PEAK_RESOLUTION", res)
            monkeypatch.setattr(bisection, "fit", lambda gr, d, b, *a, **k: (probed.append(b) if k.get("max_rounds") == 30 else None)
                                or real(gr, d, b, *a, **k))
            sched, bound = bisection.lowest_peak_search(g)
            runs[res] = (simulate(g, sched).peak_bytes, bound, len(probed))
        (fine, fine_bound, fine_probes), (coarse, coarse_bound, coarse_probes) = runs[0.0], runs[0.05]
        assert fine_bound <= fine and coarse_bound <= coarse
        assert fine <= coarse <= fine / (1 - 0.05)
        assert coarse_probes <= fine_probes
        fewer += coarse_probes < fine_probes
    assert fewer  # the resolution cut some bisection short


def test_the_cold_read_stops_at_its_work_limit(monkeypatch):
    """`_cold_at` solves the last probe's relaxation from nothing within COLD_MAX_ITERATIONS
    simplex iterations: under the default limit these small graphs' LPs finish (optimal); with a
    limit of one iteration the search makes no cold read (its first probe's LP, from nothing too,
    took more) and returns the plan the hot-started probes found, and the read itself stops
    ("limit") with the plan it was handed."""
    from remat.solver.checkmate import peak_bisection as bisection
    from remat.solver.checkmate.sparse_lp import SparseModel

    statuses = []
    real_solve = SparseModel.solve

    def spy(self, **kw):
        sol = real_solve(self, **kw)
        if "max_iterations" in kw:
            statuses.append(sol.status)
        return sol

    monkeypatch.setattr(SparseModel, "solve", spy)
    real_cold = bisection._cold_at
    for g in (training_chain(20, 2), random_dag(30, 0), transformer_like(3, seed=2)):
        statuses.clear()
        full = bisection.lowest_peak_search(g)
        assert statuses == ["optimal"]  # the cold read ran, and within the default limit
        with monkeypatch.context() as m:
            m.setattr(bisection, "COLD_MAX_ITERATIONS", 1)
            statuses.clear()
            cut = bisection.lowest_peak_search(g)
            assert statuses == []  # the first probe's LP, from nothing too, went over the limit: no cold read
            m.setattr(bisection, "_cold_at", lambda gr, best, peak, budget: best)
            hot = bisection.lowest_peak_search(g)
            peak = simulate(g, hot[0]).peak_bytes
            assert real_cold(g, hot[0], peak, peak) == hot[0] and statuses == ["limit"]  # the read itself stops
        assert cut[0] == hot[0] and cut[1] == hot[1] == full[1]
        assert simulate(g, full[0]).peak_bytes == simulate(g, cut[0]).peak_bytes
    assert bisection._cold_at is real_cold


def test_the_first_probe_is_solved_with_the_next_where_it_finds_no_plan(monkeypatch):
    """FirstProbes: on a large relaxation (the size forced here), with two CPUs, the first probe's
    LP (from nothing, the costliest) is solved at once with the LP of the probe that follows where
    it finds no plan, on a second BudgetProbe in another thread; that probe then reads it, with no
    LP solved again; the search is deterministic. Not paired below the size, on one CPU, or when
    the caller says so (HiGHS on more threads)."""
    import threading

    from remat.solver.checkmate import peak_bisection as bisection
    from remat.solver.checkmate.relaxation import Relaxation

    g = random_dag(30, 1)
    real = bisection.BudgetProbe.solve
    log = []

    def spy(self, budget):
        sol = real(self, budget)
        log.append((id(self), budget, threading.current_thread() is threading.main_thread(), sol))
        return sol

    monkeypatch.setattr(bisection.BudgetProbe, "solve", spy)
    monkeypatch.setattr(bisection, "_cpus", lambda: 2)
    alone = bisection.lowest_peak_search(g)
    assert log and all(main for _, _, main, _ in log)  # under PAIR_MIN_VARIABLES: one probe after another
    monkeypatch.setattr(bisection, "PAIR_MIN_VARIABLES", 0)
    runs = []
    for paired, cpus in ((True, 2), (True, 2), (False, 2), (True, 1)):
        log.clear()
        monkeypatch.setattr(bisection, "_cpus", lambda: cpus)
        runs.append((bisection.lowest_peak_search(g, paired=paired), list(log)))
    (first, log2), (again, _), (unpaired, log3), (one_cpu, log4) = runs
    assert first == again  # deterministic
    assert unpaired == one_cpu == alone and all(main for _, _, main, _ in log3 + log4)
    (p1, b1, main1, _), (p2, b2, main2, ahead) = sorted(log2[:2], key=lambda e: not e[2])
    assert main1 and not main2 and p1 != p2 and b1 < b2  # the first probe, and the next one ahead
    assert [b for _, b, _, _ in log3[:2]] == [b1, b2]  # one after another too: the first found no plan
    # and the next probe read the LP solved ahead, not solved again
    assert b2 not in [b for _, b, _, _ in log2[2:]]
    assert ahead.objective == pytest.approx(Relaxation(g, b2).model.solve().objective, rel=1e-7)
    peak = simulate(g, first[0]).peak_bytes
    assert first[1] <= peak and first[1] == alone[1]


def test_searches_run_at_once_do_not_pair_their_first_probes(monkeypatch):
    """A search running beside others on the same CPUs (solving.at_once runs the loss heads'
    searches in threads) does not pair its first probes where that leaves it fewer than two CPUs of
    its own: four LPs on two cores took longer than two after two. Nested, the counts multiply."""
    import threading

    from remat.solver.checkmate import peak_bisection as bisection
    from remat.solving import at_once

    g = random_dag(30, 1)
    real = bisection.BudgetProbe.solve
    names = []

    def spy(self, budget):
        names.append(threading.current_thread().name)
        return real(self, budget)

    monkeypatch.setattr(bisection.BudgetProbe, "solve", spy)
    monkeypatch.setattr(bisection, "PAIR_MIN_VARIABLES", 0)
    unpaired = bisection.lowest_peak_search(g, paired=False)

    def probe_threads(cpus, run):
        names.clear()
        monkeypatch.setattr(bisection, "_cpus", lambda: cpus)
        found = run()
        return found, {n.split("_")[0] for n in names}

    paired, threads = probe_threads(2, lambda: bisection.lowest_peak_search(g))
    assert "remat-probe" in threads  # alone on two CPUs: paired

    def beside():
        with bisection.sharing_cpus(2):
            return bisection.lowest_peak_search(g)

    found, threads = probe_threads(2, beside)
    assert found == unpaired and threads == {"MainThread"}
    both, threads = probe_threads(2, lambda: at_once({0: lambda: bisection.lowest_peak_search(g),
                                                      1: lambda: bisection.lowest_peak_search(g)}, {}))
    assert both == {0: unpaired, 1: unpaired} and threads == {"remat-solve"}
    both, threads = probe_threads(4, lambda: at_once({0: lambda: bisection.lowest_peak_search(g),
                                                      1: lambda: bisection.lowest_peak_search(g)}, {}))
    assert both == {0: paired, 1: paired} and "remat-probe" in threads  # two CPUs each

    def nested():
        with bisection.sharing_cpus(2):
            return beside()

    found, threads = probe_threads(4, nested)
    assert found == unpaired and threads == {"MainThread"}
    assert bisection._SHARING.get() == 1  # every count is restored


def test_the_first_lp_probe_lies_three_quarters_of_the_way_up(monkeypatch):
    """On a large relaxation (the size forced here), until its first LP is solved,
    lowest_peak_search probes FIRST_PROBE_AT of the way from the highest budget without a plan (here
    the floor given) to the best peak (the top its probes are built at), not half way; the probes
    after it bisect. Under the size, the first probe lies half way."""
    from remat.solver.checkmate import peak_bisection as bisection

    monkeypatch.setattr(bisection, "PAIR_MIN_VARIABLES", 0)
    monkeypatch.setattr(bisection, "_cpus", lambda: 1)  # one probe after another
    monkeypatch.setattr(bisection, "fit", lambda *a, **k: None)  # every probe goes to its LP
    tops, budgets = [], []
    real_init, real_solve = bisection.FirstProbes.__init__, bisection.FirstProbes.solve

    def init(self, graph, top, paired):
        tops.append(top)
        real_init(self, graph, top, paired)

    def solve(self, budget, if_none):
        budgets.append(budget)
        return real_solve(self, budget, if_none)

    monkeypatch.setattr(bisection.FirstProbes, "__init__", init)
    monkeypatch.setattr(bisection.FirstProbes, "solve", solve)
    bisected = 0
    for g in (training_chain(40, 0), random_dag(30, 1), transformer_like(3, seed=2)):
        _, bound = bisection.lowest_peak_search(g)
        top = tops[-1]
        floor = (bound + top) // 2  # at or above the relaxation's own bound: the search starts there
        budgets.clear()
        _, lower = bisection.lowest_peak_search(g, floor=floor)
        assert tops[-1] == top and budgets
        assert budgets[0] == floor + int(bisection.FIRST_PROBE_AT * (top - floor)) > (floor + top) // 2
        if len(budgets) > 1:
            bisected += 1
            # then half way: up from it where it read no plan, else under the peak it found
            assert budgets[1] == (budgets[0] + top) // 2 or floor < budgets[1] < budgets[0]
        assert lower >= floor  # (not a proven floor here: it only sets where the search starts)
        monkeypatch.setattr(bisection, "PAIR_MIN_VARIABLES", 10 ** 9)
        budgets.clear()
        bisection.lowest_peak_search(g, floor=floor)
        assert budgets[0] == (floor + top) // 2
        monkeypatch.setattr(bisection, "PAIR_MIN_VARIABLES", 0)
    assert bisected  # some search went on from its first probe


def test_a_relaxation_too_large_to_solve_gives_no_schedule_and_the_others_answer(monkeypatch):
    """Over RELAXATION_MAX_VARIABLES the smallest peak's relaxation is not solved (BigBird-Pegasus,
    939 nodes: 305k variables, its LP over 5 minutes): the search gives no schedule, the floor given
    stays its bound, and min_feasible_budget answers with the other candidates' lowest peak, which
    the relaxation's plan may only have lowered."""
    import remat.solver.checkmate.lowest_peak as lowest_peak
    import remat.solver.checkmate.peak_bisection as bisection

    g = transformer_like(2, 0, d=1 << 12)
    with_relaxation = min_feasible_budget(g)
    monkeypatch.setattr(bisection, "RELAXATION_MAX_VARIABLES", 10)
    assert bisection.lowest_peak_search(g, floor=123) == (None, 123)
    monkeypatch.setattr(lowest_peak, "CLOSE_TO_FLOOR", -1.0)  # the search is reached whatever the others give
    lowest_peak._LOWEST.clear()
    without = min_feasible_budget(g)
    plan = lowest_peak.lowest_peak_plan(g, backend="auto", coarsen_to=DEFAULT_COARSEN_TO,
                                        limits=lowest_peak.make_limits(None, None, 1e-4, 1))
    assert "relaxation" not in plan.details["lowest_peak_candidates"]
    assert without >= with_relaxation and simulate(g, plan.schedule).peak_bytes == without


@pytest.mark.parametrize("make, present", [(lambda: training_chain(16, 2), False), (lambda: random_dag(40, 5), True),
                                           (lambda: random_dag(50, 3), True),
                                           (lambda: transformer_like(2, 0, d=1 << 12), True)])
def test_the_first_probes_plan_relieved_is_a_lowest_peak_candidate(make, present, monkeypatch):
    """The bisection's first probe plan that fitted (the highest-peaking of its probes' plans), its
    peak relieved, is a candidate of min_feasible_budget beside the bisection's last one, wherever the
    two differ: the answer peaks no higher than it relieved, and the candidates name it; where the
    bisection found one plan or none, it is not there."""
    from remat.solver.checkmate import lowest_peak

    monkeypatch.setattr(lowest_peak, "CLOSE_TO_FLOOR", -1.0)  # the bisection runs whatever the others give
    got = {}
    real = lowest_peak.lowest_peak_search

    def spy(graph, **kw):
        out = real(graph, **kw)
        got.update(fitted=list(kw["fitted"]), sched=out[0])
        return out

    monkeypatch.setattr(lowest_peak, "lowest_peak_search", spy)
    g = make()
    lowest_peak._LOWEST.clear()
    peak, plan = min_feasible_budget(g, return_plan=True)
    cands = plan.details["lowest_peak_candidates"]
    first = got["fitted"][0] if got["fitted"] else None
    if first is None or first == got["sched"]:
        assert "first_probe" not in cands
    else:
        relieved = simulate(g, relieve_peak(g, first)).peak_bytes
        assert peak <= cands["first_probe"] <= min(relieved, simulate(g, first).peak_bytes)
    assert simulate(g, plan.schedule).peak_bytes == peak >= plan.details["peak_lower_bound"]
    assert ("first_probe" in cands) == present  # (a case of each kind)


def test_the_descent_under_the_best_peak_takes_the_first_plan_that_fits(monkeypatch):
    """On graphs up to DESCEND_MAX_NODES nodes the certified search is asked for a plan one byte
    under the best peak: any plan that fits answers that step, so none of those searches prices its
    plans with the relaxation's MILP after finding one (a 45-node model with a loss head: 16.8 ->
    3.1 s, the same smallest budget and plan). The plan it ends with fits the peak reported, above
    the proven floor, and peaks under every other candidate's."""
    import torch
    import torch.nn.functional as F

    import remat
    from remat.solver.checkmate import lowest_peak

    class Tanhs(torch.nn.Module):  # six wide tanh layers, one more tanh, a 64-class head
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
            self.head = torch.nn.Linear(64, 64)

        def forward(self, x, y):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return F.cross_entropy(self.head(torch.tanh(x)), y)

    torch.manual_seed(0)
    g = remat.capture(Tanhs(), (torch.randn(256, 64), torch.randint(0, 64, (256,))), quiet=True)
    assert len(g.nodes) <= lowest_peak.DESCEND_MAX_NODES
    searches, real = [], lowest_peak.certified_search
    monkeypatch.setattr(lowest_peak, "certified_search", lambda *a, **k: searches.append(real(*a, **k)) or searches[-1])
    budget, plan = min_feasible_budget(g, return_plan=True)
    cands = plan.details["lowest_peak_candidates"]
    assert plan.details["schedule_source"] == "certified search" and any(s.schedule for s in searches)
    assert all("relaxation_milp" not in s.details for s in searches)
    assert plan.details["peak_lower_bound"] <= budget == simulate(g, plan.schedule).peak_bytes
    assert all(budget < peak for source, peak in cands.items() if source != "certified")

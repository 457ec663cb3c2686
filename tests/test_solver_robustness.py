"""The checkmate solver cannot crash, does not depend on machine load, never contradicts itself.

* backends: HiGHS is the default when highspy is installed; CBC still works; a failing backend
  (an exception, a segfaulting CBC binary, no solution) falls back to the next one and finally to
  the best heuristic plan, with a SolverFallbackWarning, never a traceback.
* determinism: the default limits are work limits (nodes), not wall clock: the same graph and
  budget give the same schedule, also while a CPU burner competes for the cores.
* consistency: a budget at or above the smallest feasible budget reported (by
  min_feasible_budget or InfeasibleBudgetError) is answered with a plan that fits.
* hygiene: no ResourceWarning (unclosed files), no temporary file or directory left behind.
"""
from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from dataclasses import replace

import pytest

import remat.api as api
from remat.solver import checkmate, equal_spacing
from remat.solver.checkmate import backends, milp_attempts, lowest_peak
from remat.solver.checkmate.backends import BackendError
from remat.solver.checkmate import SolverFallbackWarning
from remat.core.plan import InfeasibleBudgetError
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate
from remat.core.training_graph import TrainingGraph
from tests.conftest import brute_force, random_dag, training_chain, transformer_like

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

needs_highs = pytest.mark.skipif(not backends.available("highs"), reason="highspy is not installed")
needs_cbc = pytest.mark.skipif(not backends.available("cbc"), reason="PuLP's CBC is not available")


def _fits(g, plan, budget):
    sim = simulate(g, plan.schedule)  # the judge: never trust the plan's own numbers
    assert sim.peak_bytes == plan.predicted_peak_bytes
    assert sim.peak_bytes <= budget
    return sim


def _mid_budget(g):
    lo = equal_spacing.solve(g, 0).predicted_peak_bytes
    hi = simulate(g, keep_all_schedule(g)).peak_bytes
    return (lo + hi) // 2


# ---- backends -------------------------------------------------------------------------------------

@needs_highs
def test_highs_is_the_default_backend():
    assert backends.default_backend() == "highs"
    g = training_chain(6, 1)
    lo, _ = brute_force(g, None, objective="peak")
    plan = checkmate.solve(g, lo + 3)
    assert plan.details["backend_requested"] == "auto" and plan.details["backend"] == "highs"
    assert [a["backend"] for a in plan.details["attempts"]] == ["highs"]
    assert plan.status == "optimal" and plan.total_cost == pytest.approx(brute_force(g, lo + 3)[0])


@needs_cbc
@needs_highs
def test_highs_instances_made_in_threads_at_once_leave_stdout_as_it_was():
    # each constructor pointed stdout's descriptor at /dev/null and back: two threads doing it at
    # once (solves run two at a time) left it at /dev/null, and the user's prints vanished
    code = textwrap.dedent("""
        import threading, highspy
        from remat.solver.checkmate.backends import new_highs
        barrier = threading.Barrier(8)
        def make():
            barrier.wait()
            for _ in range(20):
                new_highs(highspy)
        threads = [threading.Thread(target=make) for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("stdout still here")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "stdout still here\n"  # and no banner


def test_cbc_still_works_and_is_the_default_without_highspy(monkeypatch):
    g = training_chain(7, 2)
    lo, _ = brute_force(g, None, objective="peak")
    best = brute_force(g, lo + 2)[0]
    plan = checkmate.solve(g, lo + 2, backend="cbc")
    assert plan.status == "optimal" and plan.total_cost == pytest.approx(best)
    real = backends.available
    monkeypatch.setattr(backends, "available", lambda b: b != "highs" and real(b))
    assert backends.default_backend() == "cbc"
    plan = checkmate.solve(g, lo + 2)
    assert plan.details["backend"] == "cbc" and plan.total_cost == pytest.approx(best)


@needs_cbc
@needs_highs
def test_a_failing_backend_falls_back_to_the_next(monkeypatch):
    real = backends.run

    def broken_highs(prob, backend, limits, **kw):
        if backend == "highs":
            raise BackendError("highs: simulated failure")
        return real(prob, backend, limits, **kw)

    monkeypatch.setattr(milp_attempts, "run_backend", broken_highs)
    g = training_chain(6, 0)
    budget = _mid_budget(g)
    with pytest.warns(SolverFallbackWarning, match="simulated failure"):
        plan = checkmate.solve(g, budget, milp="always")  # the MILP's backends are what is tested
    _fits(g, plan, budget)
    assert plan.status == "optimal" and plan.details["backend"] == "cbc"
    assert plan.details["attempts"][0] == {**plan.details["attempts"][0], "backend": "highs",
                                           "error": "highs: simulated failure"}
    assert plan.total_cost == pytest.approx(brute_force(g, budget)[0])


@pytest.mark.parametrize("how", ["error", "no solution"])
def test_every_backend_failing_gives_the_heuristic_plan(monkeypatch, how):
    def broken(prob, backend, limits, **kw):
        if how == "error":
            raise BackendError(f"{backend}: simulated crash")
        return backends.Outcome("none")  # no solution, and no limit to explain it

    monkeypatch.setattr(milp_attempts, "run_backend", broken)
    g = transformer_like(2)
    budget = _mid_budget(g)
    es = equal_spacing.solve(g, budget)
    assert es.fits
    with pytest.warns(SolverFallbackWarning, match="answering with the best heuristic plan"):
        plan = checkmate.solve(g, budget, coarsen_to=40)
    sim = _fits(g, plan, budget)
    # the MILP gave nothing; the rows' bound may still prove the fallback plan optimal
    assert plan.status == ("optimal" if plan.gap <= 1e-4 else "feasible") and plan.strategy == "checkmate"
    assert plan.details["fallback"]["reason"].startswith("every backend failed")
    assert sim.extra_cost <= es.extra_cost  # equal_spacing's plan, refined on the fine graph
    assert len(plan.details["attempts"]) >= 1


def test_node_limit_without_incumbent_is_not_a_failure(monkeypatch):
    """A search its node limit stopped before any incumbent is deterministic, not a crash: no
    other backend is tried, no warning; the heuristic plan answers and details say why."""
    tried = []

    def limited(prob, backend, limits, **kw):
        tried.append(backend)
        return backends.Outcome("none", stopped_by="node limit")

    monkeypatch.setattr(milp_attempts, "run_backend", limited)
    g = transformer_like(2)
    budget = _mid_budget(g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SolverFallbackWarning)
        plan = checkmate.solve(g, budget, coarsen_to=40)
    _fits(g, plan, budget)
    assert len(tried) == 1 and plan.status == ("optimal" if plan.gap <= 1e-4 else "feasible")
    assert plan.details["fallback"]["reason"] == "no incumbent within the MILP's node limit"


def _fake_cbc(tmp_path, body: str) -> str:
    path = tmp_path / "cbc"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


@needs_cbc
def test_cbc_segfault_on_warm_start_retries_cold(monkeypatch, tmp_path):
    """The bundled CBC crashes (SIGSEGV) on some warm starts: a CBC that segfaults whenever it is
    given a `-mips` start file must cost a retry without it, not a traceback."""
    import pulp

    real = pulp.PULP_CBC_CMD.pulp_cbc_path
    fake = _fake_cbc(tmp_path, f'case "$*" in *-mips*) kill -SEGV $$;; esac\nexec "{real}" "$@"')
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", fake)
    g = training_chain(6, 3)
    budget = _mid_budget(g)
    with pytest.warns(SolverFallbackWarning, match="cbc"):
        plan = checkmate.solve(g, budget, backend="cbc", milp="always")
    _fits(g, plan, budget)
    first, second = plan.details["attempts"][:2]
    assert first["backend"] == "cbc" and first["warm_start"] and "error" in first
    assert second == {**second, "backend": "cbc", "warm_start": False, "status": "optimal"}
    assert plan.total_cost == pytest.approx(brute_force(g, budget)[0])


@needs_cbc
def test_cbc_always_crashing_never_raises(monkeypatch, tmp_path):
    import pulp

    monkeypatch.setattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", _fake_cbc(tmp_path, "kill -SEGV $$"))
    monkeypatch.setattr(backends, "available", lambda b: b == "cbc")  # no HiGHS to fall back to
    g = random_dag(20, 4)
    budget = _mid_budget(g)
    with pytest.warns(SolverFallbackWarning):
        plan = checkmate.solve(g, budget, backend="cbc", milp="always")
    _fits(g, plan, budget)
    assert all("error" in a for a in plan.details["attempts"])
    with pytest.warns(SolverFallbackWarning):
        m, low = checkmate.min_feasible_budget(g, backend="cbc", return_plan=True)
    # the MILP never answers: the lowest of the other candidates (equal_spacing's, the relaxation's)
    assert m == low.predicted_peak_bytes <= equal_spacing.solve(g, 0).predicted_peak_bytes
    assert low.details["schedule_source"] != "min_peak_milp"


# ---- determinism ----------------------------------------------------------------------------------

def _limited_solve(g, budget):
    # one node and no gap tolerance: the search is cut by the node limit (not proven optimal), as
    # the default solve is on real models; a wall-clock limit here would make it load-dependent.
    # The MILP alone (certify=False): the certified search's determinism is
    # test_solver_scale.py's test_same_plan_every_time_and_a_time_limit_keeps_the_best_plan
    return checkmate.solve(g, budget, coarsen_to=40, max_nodes=1, mip_gap=0, certify=False)


@needs_highs
def test_same_schedule_every_time_even_under_load():
    g = transformer_like(3)
    lo = equal_spacing.solve(g, 0).predicted_peak_bytes
    budget = int(lo + (simulate(g, keep_all_schedule(g)).peak_bytes - lo) * 0.35)
    first = _limited_solve(g, budget)
    assert first.details["attempts"] == [{**first.details["attempts"][0], "backend": "highs",
                                          "status": "feasible", "stopped_by": "node limit"}]
    assert first.details["limits"]["time_limit_s"] is None
    # a fresh graph object, and nothing cached between the solves (the lowest-peak plans are
    # kept per graph, equal graphs alike)
    lowest_peak._LOWEST.clear()
    again = _limited_solve(transformer_like(3), budget)
    assert again.schedule == first.schedule
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    lowest_peak._LOWEST.clear()
    try:
        loaded = _limited_solve(transformer_like(3), budget)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert loaded.schedule == first.schedule
    assert loaded.details["objective"] == first.details["objective"]


# ---- consistency ----------------------------------------------------------------------------------

@pytest.mark.parametrize("g, opts", [
    (training_chain(8, 5), {}),
    # the coarse MILP is infeasible at the reported budget (its memory model is conservative) and
    # equal_spacing peaks higher: only the lowest-peak plan answers it
    (random_dag(50, 4), {"coarsen_to": 30}),
    (random_dag(40, 3), {"coarsen_to": 20, "max_nodes": 1}),  # a weak search: still consistent
], ids=["chain8", "dag50-coarse", "dag40-weak"])
def test_reported_smallest_budget_is_accepted(g, opts):
    m = checkmate.min_feasible_budget(g, **opts)
    for b in (m, m + 1, m + (m >> 6)):
        plan = api.solve(g, b, **opts)
        _fits(g, plan, b)
    with pytest.raises(InfeasibleBudgetError) as e:
        api.solve(g, m // 2, **opts)
    assert e.value.min_feasible_bytes == m
    _fits(g, api.solve(g, e.value.min_feasible_bytes, **opts), m)


def test_smallest_budget_is_accepted_even_if_a_second_search_would_differ(monkeypatch):
    """By construction, not by luck of the limits: the min-peak MILP answers once, then (as a
    time-limited search on a busier machine could) finds nothing; solve still accepts the budget
    reported, because it falls back to the same lowest-peak plan."""
    g = random_dag(50, 0)  # its relieved equal_spacing plan peaks over the rows' floor: the MILP runs
    real, calls = lowest_peak.min_peak_plan, []

    def once(*a, **kw):
        calls.append(1)
        return real(*a, **kw) if len(calls) == 1 else None

    monkeypatch.setattr(lowest_peak, "min_peak_plan", once)
    with pytest.raises(InfeasibleBudgetError) as e:
        api.solve(g, g.resident_bytes + 1, coarsen_to=30)
    m = e.value.min_feasible_bytes
    assert m < equal_spacing.solve(g, 0).predicted_peak_bytes  # the MILP's plan, not equal_spacing's
    plan = api.solve(g, m, coarsen_to=30)
    _fits(g, plan, m)
    assert len(calls) == 1  # the lowest-peak plan is kept: the second solve did not search again
    # the lowest-peak plan answers, unless the relaxation's or the rows' search found one at least as good
    assert plan.details["refined_from"] in ("lowest_peak", "relaxation", "peak_rows")


def test_the_min_peak_milp_does_not_run_where_equal_spacing_reaches_the_floor(monkeypatch):
    """Where equal_spacing's plan, relieved, peaks at the rows' floor (no schedule peaks lower), the
    min-peak MILP is not run, and the smallest budget is that floor; elsewhere it runs."""
    from remat.solver.checkmate.peak_rows import peak_floor

    real, calls = lowest_peak.min_peak_plan, []
    monkeypatch.setattr(lowest_peak, "min_peak_plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = random_dag(50, 4)  # 100 nodes, coarsened to 50 for the MILP
    with pytest.raises(InfeasibleBudgetError) as e:
        api.solve(g, g.resident_bytes + 1, coarsen_to=50)
    assert calls == [] and e.value.min_feasible_bytes == peak_floor(g)
    other = random_dag(50, 0)  # over the floor: the MILP runs
    with pytest.raises(InfeasibleBudgetError):
        api.solve(other, other.resident_bytes + 1, coarsen_to=50)
    assert calls == [1]


def test_at_the_smallest_budget_the_lowest_peak_plan_stands_in_for_a_cold_milp():
    """No heuristic fits at the smallest feasible budget: on a coarse graph over COLD_MILP_MAX_NODES
    the MILP, without a start, could run to its node limit for nothing; the lowest-peak search's
    plan is the candidate instead, and it fits."""
    from remat.solver.checkmate.candidates import COLD_MILP_MAX_NODES

    g = random_dag(50, 0)  # 100 nodes, coarsened to 50
    assert 50 > COLD_MILP_MAX_NODES
    with pytest.raises(InfeasibleBudgetError) as e:
        api.solve(g, g.resident_bytes + 1, coarsen_to=50)
    m = e.value.min_feasible_bytes
    plan = api.solve(g, m, coarsen_to=50)
    _fits(g, plan, m)
    assert plan.details["milp"].startswith("not run: no heuristic fits"), plan.details["milp"]
    assert plan.details["refined_from"] == "lowest_peak"


def _lowest_peak_searches(monkeypatch) -> list:
    """A list that grows by one at each lowest-peak search (each computes the rows' floor once)."""
    real, calls = lowest_peak.peak_floor, []

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(lowest_peak, "peak_floor", counted)
    return calls


def test_a_graph_traced_again_reads_the_kept_lowest_peak_plan(monkeypatch):
    """A refused budget asked again at the smallest one the refusal named traces the model again:
    a new graph object equal to the first, whose lowest-peak plan is not searched again. Another
    graph (one node's cost changed) is."""
    g = training_chain(8, 1)
    calls = _lowest_peak_searches(monkeypatch)
    m, plan = checkmate.min_feasible_budget(g, return_plan=True)
    again = TrainingGraph.from_json(g.to_json())
    assert again is not g and again == g and hash(again) == hash(g)
    m2, plan2 = checkmate.min_feasible_budget(again, return_plan=True)
    assert len(calls) == 1 and (m2, plan2.schedule) == (m, plan.schedule)
    assert plan2.graph is again and plan.graph is g
    _fits(again, api.solve(again, m), m)
    changed = TrainingGraph(tuple(replace(n, cost=n.cost * 2) if i == 3 else n for i, n in enumerate(g.nodes)),
                            g.resident_bytes, tangents=g.tangents)
    assert changed != g
    checkmate.min_feasible_budget(changed)
    assert len(calls) == 2
    for k in range(lowest_peak.CACHED_PROBLEMS + 1):  # the cache keeps the most recent problems only
        checkmate.min_feasible_budget(random_dag(12, 100 + k))
    assert len(lowest_peak._LOWEST) == lowest_peak.CACHED_PROBLEMS


def test_a_search_within_a_tighter_gap_serves_a_solve_asking_a_looser_one(monkeypatch):
    """The lowest-peak plans searched within the default gap serve a solve within a looser gap (its
    plans are as valid, its lowest peak as low: remat/block_levels.py solves a block's levels above
    its smallest budget that way): not searched again; a tighter gap, or other limits, are."""
    g = training_chain(8, 1)
    calls = _lowest_peak_searches(monkeypatch)
    m = checkmate.min_feasible_budget(g)
    searches = len(calls)
    assert searches >= 1
    _fits(g, api.solve(g, m, mip_gap=0.02), m)  # its last fallback reads the search within 1e-4
    assert len(calls) == searches
    checkmate.min_feasible_budget(g, mip_gap=0.02)
    assert len(calls) == searches
    checkmate.min_feasible_budget(g, mip_gap=1e-6)  # a tighter gap: searched
    assert len(calls) > searches
    searches = len(calls)
    checkmate.min_feasible_budget(g, mip_gap=0.02, max_nodes=7)  # other limits: searched
    assert len(calls) > searches


def test_smallest_budget_is_accepted_when_every_backend_fails(monkeypatch):
    def broken(prob, backend, limits, **kw):
        raise BackendError(f"{backend}: simulated crash")

    monkeypatch.setattr(milp_attempts, "run_backend", broken)
    g = random_dag(30, 0)  # its relieved equal_spacing plan peaks over the rows' floor: the min-peak MILP runs
    with pytest.warns(SolverFallbackWarning):
        with pytest.raises(InfeasibleBudgetError) as e:
            api.solve(g, g.resident_bytes + 1, coarsen_to=20)
    m = e.value.min_feasible_bytes
    with pytest.warns(SolverFallbackWarning):
        _fits(g, api.solve(g, m, coarsen_to=20), m)


# ---- hygiene --------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [pytest.param("highs", marks=needs_highs),
                                     pytest.param("cbc", marks=needs_cbc)])
def test_no_resource_warning_and_no_temp_files(backend, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # every temporary file goes here
    g = training_chain(6, 4)
    budget = _mid_budget(g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        plan = checkmate.solve(g, budget, backend=backend)
        checkmate.solve(g, g.resident_bytes, backend=backend)  # infeasible: the fallback path too
        gc.collect()
    _fits(g, plan, budget)
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert os.listdir(tmp_path) == []


def _rows_bound(details: dict) -> float:
    """The rows' bound, their rounds' where those ran (certify goes on with the rows a plan misses)."""
    rows = details["peak_rows"]
    return max(rows["bound"], rows.get("more_rows", {}).get("bound", 0.0))


def test_root_lp_stopped_by_its_limit_proves_nothing(monkeypatch):
    """A root LP its iteration limit stops is not an infeasibility proof: the plan answers with
    lower bound 0, and details say why (bound_source, certify's stopped_by)."""
    from remat.solver.checkmate import certified_search

    monkeypatch.setattr(certified_search, "ROOT_MIN_ITERATIONS", 1)
    monkeypatch.setattr(certified_search, "ROOT_WORK_ROWS", 1)
    g = transformer_like(2)
    budget = _mid_budget(g)
    plan = checkmate.solve(g, budget, coarsen_to=40, milp="never")
    _fits(g, plan, budget)
    assert plan.details["certify"]["stopped_by"] == "root LP limit"
    assert plan.details["certify"]["bound"] == 0  # the certified search proved nothing ...
    rows_bound = _rows_bound(plan.details)  # ... so the bound is the rows' (with their rounds')
    assert plan.lower_bound == pytest.approx(min(rows_bound, plan.extra_cost), rel=1e-12)
    assert plan.details["bound_source"].startswith("peak rows" if rows_bound > 0 else "none")


def test_bound_source_names_the_relaxation():
    g = training_chain(6, 1)
    plan = checkmate.solve(g, _mid_budget(g))
    d = plan.details
    if "certify" not in d:  # the rows proved the plan optimal: the whole step's relaxation did not run
        assert d["bound_source"].startswith("peak rows") and plan.gap <= 1e-4
    elif d["certify"]["bound"] >= d["peak_rows"]["bound"]:
        assert d["bound_source"].startswith("LP relaxation of the fine graph")
    else:
        assert d["bound_source"].startswith("peak rows")


def test_relaxation_too_large_is_not_solved(monkeypatch):
    """Over RELAXATION_MAX_VARIABLES the whole step's relaxation is built (cheap) but not solved:
    the rows' bound and plans answer, and details say why."""
    from remat.solver.checkmate import certified_search

    g = transformer_like(2)
    budget = _mid_budget(g)
    full = checkmate.solve(g, budget, coarsen_to=40, milp="never")
    if "certify" not in full.details:
        pytest.skip("the rows proved this budget: the certified search does not run")
    monkeypatch.setattr(certified_search, "RELAXATION_MAX_VARIABLES", 10)
    plan = checkmate.solve(g, budget, coarsen_to=40, milp="never")
    _fits(g, plan, budget)
    d = plan.details
    assert "certify" not in d and d["certify_skipped"].startswith("the relaxation has")
    assert plan.lower_bound == pytest.approx(min(_rows_bound(d), plan.extra_cost), rel=1e-12)
    assert d["bound_source"].startswith("peak rows" if _rows_bound(d) > 0 else "none")
    assert plan.extra_cost >= full.lower_bound * (1 - 1e-9)

"""The plan file (schema 2): JSON that carries its graph and context, loads only when it is what it
says, and refuses every damaged or edited file with one line saying what is wrong and what to do.
Hand-made graphs only (no tracing): the whole file runs in a few seconds."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import pytest

import remat
from remat.inspect_plan import summary_text
from remat.solver import equal_spacing, keep_all
from remat.core.plan import LOWEST_PEAK, SCHEMA_VERSION, Plan, PlanFileError, PlanStatus, finished
from remat.core.module_summary import TOP_LEVEL, module_summary, rollup, step_timeline
from remat.core.simulator import simulate
from tests.conftest import transformer_like


@pytest.fixture(scope="module")
def plan() -> Plan:
    g = transformer_like(blocks=3)
    keep = keep_all.solve(g).predicted_peak_bytes
    p = equal_spacing.solve(g, int(0.7 * keep))
    assert p.recomputed and p.fits and p.graph is g
    return dataclasses.replace(p, context={"model": "tests.Toy", "torch": "2.13.0", "device": "cpu"})


def _written(tmp_path, plan: Plan) -> tuple:
    path = tmp_path / "plan.json"
    plan.save(path)
    return path, json.loads(path.read_text())


def _refused(path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(PlanFileError) as e:
        Plan.load(path)
    msg = str(e.value)
    assert "\n" not in msg, msg  # one line
    assert str(path) in msg  # names the file
    assert "solve again" in msg or "Save the plan again" in msg, msg  # says what to do
    return msg


def test_round_trip_carries_graph_context_and_summary(tmp_path, plan):
    path, data = _written(tmp_path, plan)
    loaded = remat.load_plan(path)
    assert loaded == plan and loaded.context == plan.context
    assert loaded.graph.fingerprint() == plan.graph_fingerprint == plan.graph.fingerprint()
    assert loaded.graph == plan.graph and loaded.graph.meta == plan.graph.meta
    assert data["format"] == "remat plan" and data["schema_version"] == SCHEMA_VERSION
    for key in ("budget_bytes", "predicted_peak_bytes", "total_cost", "gap", "lower_bound", "strategy", "status",
                "context", "modules", "schedule", "graph", "graph_fingerprint"):
        assert key in data, key
    text = path.read_text()
    assert text.splitlines()[1] == ' "format": "remat plan",'  # one line per top-level key, readable
    assert len(text.splitlines()) == len(data) + 2
    assert data["modules"] == module_summary(plan.graph, plan.schedule)


def test_schema_1_files_still_load(tmp_path, plan):
    """A file as the code before schema versions wrote it: the Plan's fields, nothing else."""
    old = {k: v for k, v in asdict(plan).items() if k not in ("graph", "context", "lower_bound", "loaded_from")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = Plan.load(path)
    assert loaded.schedule == plan.schedule and loaded.graph is None and loaded.context == {}
    assert "no graph saved" in summary_text(loaded)


@pytest.mark.parametrize("version", [3, 0, "2", None, True])
def test_other_schema_versions_are_refused(tmp_path, plan, version):
    path, data = _written(tmp_path, plan)
    msg = _refused(path, json.dumps({**data, "schema_version": version}))
    assert "schema version" in msg and f"this remat reads versions 1 to {SCHEMA_VERSION}" in msg


def test_truncated_file(tmp_path, plan):
    path, _ = _written(tmp_path, plan)
    text = path.read_text()
    for cut in (len(text) // 3, len(text) - 2):
        assert "is not valid JSON" in _refused(path, text[:cut])


def test_hand_edited_schedule_reading_a_value_before_it_exists(tmp_path, plan):
    path, data = _written(tmp_path, plan)
    sched = list(data["schedule"])
    i = next(k for k, name in enumerate(sched) if plan.graph.node(name).inputs)  # a step that reads something
    reader = sched[i]
    read = plan.graph.node(reader).inputs[0]
    sched.remove(reader)
    sched.insert(sched.index(read), reader)  # now before the value it reads
    msg = _refused(path, json.dumps({**data, "schedule": sched}))
    assert "its schedule cannot run on its graph" in msg
    assert f"({reader}) reads {read}, which is not live (never computed)" in msg


def test_hand_edited_numbers_and_graph(tmp_path, plan):
    path, data = _written(tmp_path, plan)
    msg = _refused(path, json.dumps({**data, "predicted_peak_bytes": data["predicted_peak_bytes"] - 1}))
    assert "says its schedule peaks at" in msg and "the file was edited" in msg
    graph = json.loads(json.dumps(data["graph"]))
    graph["nodes"][3]["out_bytes"] += 8
    msg = _refused(path, json.dumps({**data, "graph": graph}))
    assert "its graph has fingerprint" in msg and plan.graph_fingerprint in msg
    graph["nodes"][3] = {"name": "x"}
    assert "holds a damaged graph" in _refused(path, json.dumps({**data, "graph": graph}))


def test_foreign_json(tmp_path, plan):
    path, data = _written(tmp_path, plan)
    with pytest.raises(PlanFileError, match="is a 'notebook' file, not a 'remat plan' file"):
        path.write_text(json.dumps({**data, "format": "notebook"}))
        Plan.load(path)


def test_module_summary_adds_up(plan):
    g = plan.graph
    rows = module_summary(g, plan.schedule)
    keep_rows = module_summary(g, keep_all.solve(g).schedule)
    assert sum(r["recomputations"] for r in rows) == len(plan.schedule) - len(g.nodes)
    assert sum(r["extra_cost"] for r in rows) == pytest.approx(plan.extra_cost)
    assert sum(r["cost"] for r in rows) == pytest.approx(g.total_cost)
    assert all(r["kept_bytes"] == r["saved_bytes"] and not r["recomputations"] for r in keep_rows)
    assert sum(r["saved_bytes"] for r in rows) == sum(r["saved_bytes"] for r in keep_rows)
    assert {"wte", "h.0", "h.2", "lm_head"} <= {r["module"] for r in rows} and TOP_LEVEL not in {r["module"] for r in rows}
    top = rollup(rows, 1)
    assert {r["module"] for r in top} == {"wte", "h", "ln_f", "lm_head", "loss"}
    assert sum(r["recomputed_bytes"] for r in top) == sum(r["recomputed_bytes"] for r in rows)


def test_step_timeline_is_the_simulators(plan):
    g = plan.graph
    t = step_timeline(g, plan.schedule)
    sim = simulate(g, plan.schedule)
    assert t.memory == sim.timeline and t.peak_bytes == plan.predicted_peak_bytes
    assert sum(t.recompute) == len(plan.schedule) - len(g.nodes)
    assert t.end[-1] == pytest.approx(plan.total_cost)
    assert not any(t.backward[: t.forward_end + 1] + t.recompute[: t.forward_end + 1])
    assert all(b or r for b, r in zip(t.backward[t.forward_end + 1:], t.recompute[t.forward_end + 1:]))


def test_summary_text_reads_like_a_report(plan):
    text = summary_text(plan, depth=2)
    assert "keep_all peak" in text and "this plan's peak" in text and "extra compute" in text
    assert "h.1" in text and "recomp MiB" in text and text.splitlines()[-1].startswith("total")


def test_plans_are_frozen_with_a_status_enum(tmp_path, plan):
    """A plan never changes under its holder; its status is a PlanStatus that reads and saves as
    the word; an unknown status is refused when built and when loaded."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.status = "optimal"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.lower_bound = 0.0
    assert plan.status is PlanStatus.HEURISTIC and plan.status == "heuristic"
    with pytest.raises(ValueError, match="unknown plan status 'great'"):
        dataclasses.replace(plan, status="great")
    path, data = _written(tmp_path, plan)
    text = path.read_text()
    assert data["status"] == "heuristic"
    loaded = Plan.load(path)
    assert loaded.status is PlanStatus.HEURISTIC and loaded.loaded_from == str(path)
    assert "loaded_from" not in json.loads(loaded.to_json())
    assert "status must be one of" in _refused(path, text.replace('"heuristic"', '"great"', 1))


def test_finished_marks_a_plan_over_its_budget_infeasible(plan):
    over = finished(plan, 0.0, budget_bytes=plan.predicted_peak_bytes - 1)
    assert over.status is PlanStatus.INFEASIBLE and over.solve_time_s > 0 and plan.status is PlanStatus.HEURISTIC
    assert finished(plan, 0.0).status is PlanStatus.HEURISTIC


def test_lowest_peak_is_each_strategys_lowest_plan():
    """LOWEST_PEAK asks a strategy for its lowest-peak plan: no budget-fitting plan of it peaks lower."""
    g = transformer_like(blocks=3)
    low = equal_spacing.solve(g, LOWEST_PEAK)
    assert low.status is PlanStatus.INFEASIBLE
    assert not equal_spacing.solve(g, low.predicted_peak_bytes - 1).fits
    assert equal_spacing.solve(g, low.predicted_peak_bytes).fits

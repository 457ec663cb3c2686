"""The simulator against peaks computed by hand on tiny graphs."""
import pytest

from remat.core.training_graph import Node, TrainingGraph
from remat.core.simulator import ScheduleError, last_read_nodes, last_reads, simulate


def graph(*nodes, resident=100):
    return TrainingGraph(nodes=tuple(nodes), resident_bytes=resident)


def N(name, inputs=(), out=0, **kw):
    return Node(name=name, op="op", inputs=tuple(inputs), out_bytes=out, **kw)


def test_chain_of_three():
    g = graph(N("a", (), 10, cost=1), N("b", ["a"], 20, cost=2), N("c", ["b"], 5, cost=3))
    r = simulate(g, ["a", "b", "c"])
    # a: 100+10 = 110; b: 110+20 = 130, then a is freed (120); c: 120+5 = 125, then b and c freed
    assert r.timeline == (110, 130, 125)
    assert (r.peak_bytes, r.peak_step) == (130, 1)
    assert (r.total_cost, r.extra_cost, r.recomputations) == (6.0, 0.0, 0)


def test_recomputation_frees_first_instance_at_its_last_read():
    # a feeds b and c; recomputing a before c lets the first instance die after b
    g = graph(N("a", (), 10, cost=4), N("b", ["a"], 20), N("c", ["a"], 5))
    r = simulate(g, ["a", "b", "a", "c"])
    # a: 110; b: 130 -> a (1st) and b (unread) freed: 100; a again: 110; c: 115
    assert r.timeline == (110, 130, 110, 115)
    assert r.peak_bytes == 130 and r.recomputations == 1 and r.extra_cost == 4.0
    # without recomputing, a stays live across b: 110, 130, 115
    assert simulate(g, ["a", "b", "c"]).timeline == (110, 130, 115)
    assert last_reads(g, ["a", "b", "a", "c"]) == [[], [("b", 0), ("a", 0)], [], [("c", 0), ("a", 0)]]
    assert last_read_nodes(g, ["a", "b", "a", "c"]) == [[], [1, 0], [], [2, 0]]  # the same, as node indices


def test_outputs_with_their_own_readers_die_separately():
    # x has two outputs: 8 bytes read only by y (early), 2 bytes read only by z (late)
    x = N("x", (), 10, cost=1, out_parts=((8, ("y",)), (2, ("z",))))
    g = graph(x, N("y", ["x"], 1), N("w", (), 4), N("z", ["x", "y", "w"], 1))
    r = simulate(g, ["x", "y", "w", "z"])
    assert last_read_nodes(g, ["x", "y", "w", "z"]) == [[], [0], [], [3, 0, 1, 2]]  # x once for each part
    # x: 110; y: 111, then x's first output (8) is freed: 103; w: 107; z: 108
    assert r.timeline == (110, 111, 107, 108)
    # as one value, x would stay whole until z: w would run at 115
    whole = graph(N("x", (), 10, cost=1), N("y", ["x"], 1), N("w", (), 4), N("z", ["x", "y", "w"], 1))
    assert simulate(whole, ["x", "y", "w", "z"]).timeline == (110, 111, 115, 116)


def test_workspace_counts_only_while_the_node_runs():
    g = graph(N("a", (), 10), N("b", ["a"], 20, workspace_bytes=50), N("c", ["b"], 5))
    assert simulate(g, ["a", "b", "c"]).timeline == (110, 180, 125)


def test_kept_outputs_stay_to_the_end():
    g = graph(N("a", (), 10), N("loss", ["a"], 1, kept_bytes=7), N("g", ["loss"], 4, kept_bytes=30),
              N("h", ["g"], 2))
    # a: 110; loss: 110+1+7 = 118 -> a freed: 108; g: 108+4+30 = 142 -> loss's 1 byte freed, its
    # kept 7 stays: 141; h: 141+2 = 143
    assert simulate(g, ["a", "loss", "g", "h"]).timeline == (110, 118, 142, 143)


def test_unread_value_is_freed_at_once():
    g = graph(N("big", (), 50), N("b", (), 1), N("c", ["b"], 2))
    assert simulate(g, ["big", "b", "c"]).timeline == (150, 101, 103)


def test_resident_only_graph_peak():
    g = graph(N("a", (), 0), resident=42)
    assert simulate(g, ["a"]).peak_bytes == 42


@pytest.mark.parametrize("schedule, message", [
    (["b", "a"], "never computed"),
    (["a", "b"], "never computes"),  # c missing
    (["a", "b", "c", "x"], "not in the graph"),
])
def test_invalid_schedules(schedule, message):
    g = graph(N("a", (), 1), N("b", ["a"], 1), N("c", ["b"], 1))
    with pytest.raises(ScheduleError, match=message):
        simulate(g, schedule)


def test_no_recomputing_random_or_backward_or_kept_nodes():
    g = graph(N("a", (), 1), N("drop", ["a"], 1, is_random=True), N("loss", ["drop"], 1, kept_bytes=1),
              N("g", ["loss", "drop"], 1, is_backward=True), N("h", ["g"], 1, is_backward=True))
    simulate(g, ["a", "drop", "loss", "g", "h"])
    simulate(g, ["a", "drop", "loss", "a", "g", "h"])  # a is recomputable
    for bad in (["a", "drop", "loss", "drop", "g", "h"], ["a", "drop", "loss", "loss", "g", "h"],
                ["a", "drop", "loss", "g", "g", "h"]):
        with pytest.raises(ScheduleError, match="may not be recomputed"):
            simulate(g, bad)


def test_reads_go_to_the_latest_instance():
    # a freed after b's read would make c's read invalid, unless a is recomputed: the simulator
    # extends an instance's life to its last read, so a plain second read keeps it alive instead
    g = graph(N("a", (), 10), N("b", ["a"], 20), N("c", ["a", "b"], 5))
    assert simulate(g, ["a", "b", "c"]).timeline == (110, 130, 135)
    assert simulate(g, ["a", "b", "a", "c"]).timeline == (110, 130, 130, 135)

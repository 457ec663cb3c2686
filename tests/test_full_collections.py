"""core/full_collections.py: full collections made rare during a solve, and the thresholds put back
after it, nested, across threads, and where the caller set their own."""
import gc
import threading

import pytest

from remat.core.full_collections import FULL_EVERY, rare_full_collections


@pytest.fixture(autouse=True)
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_raised_within_and_restored_after():
    with rare_full_collections():
        assert gc.get_threshold() == (700, 10, FULL_EVERY)
        with rare_full_collections():  # nested: one raise
            assert gc.get_threshold() == (700, 10, FULL_EVERY)
        assert gc.get_threshold() == (700, 10, FULL_EVERY)
    assert gc.get_threshold() == (700, 10, 10)


def test_restored_after_an_error():
    with pytest.raises(RuntimeError):
        with rare_full_collections():
            raise RuntimeError("solver failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_larger_threshold_of_the_callers_is_kept():
    gc.set_threshold(700, 10, 5 * FULL_EVERY)
    with rare_full_collections():
        assert gc.get_threshold()[2] == 5 * FULL_EVERY
    assert gc.get_threshold() == (700, 10, 5 * FULL_EVERY)


def test_a_threshold_set_within_stays():
    with rare_full_collections():
        gc.set_threshold(500, 20, 50)  # the caller's own setting, made during the solve
    assert gc.get_threshold() == (500, 20, 50)


def test_threads_share_one_raise_undone_by_the_last():
    inside, release = threading.Barrier(3), threading.Event()

    def solver():
        with rare_full_collections():
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=solver) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    with rare_full_collections():
        pass  # a third user leaving while two are inside
    assert gc.get_threshold()[2] == FULL_EVERY
    release.set()
    for t in threads:
        t.join()
    assert gc.get_threshold() == (700, 10, 10)


def test_decorated_solvers_keep_their_signature_and_raise():
    import inspect

    from remat.core.training_graph import Node, TrainingGraph
    from remat.solver.checkmate import min_feasible_budget, solve

    assert "budget_bytes" in inspect.signature(solve).parameters
    seen = []
    graph = TrainingGraph(nodes=(Node("a", "aten.relu", (), 4), Node("b", "aten.relu", ("a",), 4)), resident_bytes=0)
    orig = gc.set_threshold

    def spy(*a):
        seen.append(a)
        orig(*a)

    gc.set_threshold = spy
    try:
        solve(graph, 10**6)
        min_feasible_budget(graph)
    finally:
        gc.set_threshold = orig
    assert seen == [(700, 10, FULL_EVERY), (700, 10, 10)] * 2
    assert gc.get_threshold() == (700, 10, 10)

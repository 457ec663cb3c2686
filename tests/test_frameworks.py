"""remat modules inside the training frameworks people use, each against the same loop on the
unmodified model: Hugging Face's Trainer (it failed before the first step: it read `forward`'s
signature, found `(*args, **kwargs)` and dropped every column, "The batch received was empty"; with
remove_unused_columns=False it passed `num_items_in_batch`, which was refused), accelerate, and
PyTorch Lightning. The loops live in tests/framework_loops.py."""
import warnings

import pytest
import torch

import remat
from remat.solver import get_solver

pytest.importorskip("transformers")
from tests.framework_loops import example_batch, hf_pair, lightning_run, trainer_run  # noqa: E402


def _optimized(model, kind: str, batch: int):
    """remat's module of `model` planned for the largest batch shape, with equal_spacing (a plan that
    recomputes, solved in milliseconds: these tests are about the loops, not the solver), under a
    budget 10% above its peak there (the Trainer's calls also pass num_items_in_batch: their loss
    is a sum divided by it, a few temporaries more)."""
    example = example_batch(kind, batch)
    graph = remat.capture(model, (), example, quiet=True)
    budget = int(1.1 * get_solver("equal_spacing")(graph, None).predicted_peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.OutsideBudgetWarning)  # HF models return their logits too
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(), example_kwargs=example, quiet=True,
                             solver="equal_spacing")
    assert opt.plan.recomputed
    return opt, budget


def _same(a, b, rtol=1e-5, atol=1e-6):
    losses_a, params_a = a
    losses_b, params_b = b
    assert len(losses_a) == len(losses_b) >= 1
    assert losses_a == pytest.approx(losses_b, rel=rtol, abs=atol)
    assert max((x - y).abs().max().item() for x, y in zip(params_a, params_b)) <= atol + rtol


@pytest.mark.parametrize("kind,accumulation", [("llama", 1), ("llama", 4), ("bert", 1)])
def test_hugging_face_trainer_trains_the_module_as_the_model(kind, accumulation):
    model, ref = hf_pair(kind, dropout=0.1)
    opt, budget = _optimized(model, kind, batch=4)
    got = trainer_run(opt, kind, steps=8, accumulation=accumulation)
    want = trainer_run(ref, kind, steps=8, accumulation=accumulation)
    _same(got, want)
    assert all(r.predicted_peak_bytes <= budget for r in opt.plan_log)
    calls = {r.call for r in opt.plan_log}
    assert len(calls) == len(opt.plan_log) >= 2  # each padded shape planned once (8 and 16 tokens)


def test_accelerate_prepared_loop_trains_the_module_as_the_model():
    from tests.framework_loops import accelerate_run

    model, ref = hf_pair("llama", dropout=0.0)
    opt, _ = _optimized(model, "llama", batch=4)
    _same(accelerate_run(opt, "llama"), accelerate_run(ref, "llama"))


def test_lightning_module_calling_the_module_trains_as_the_model():
    pytest.importorskip("lightning")
    from tests.models import small_gpt

    torch.manual_seed(0)
    _, inputs = small_gpt(dropout=0.1)
    idx, tgt = inputs
    batches = [(idx[:b, :t].contiguous(), tgt[:b, :t].contiguous()) for b, t in [(4, 64), (3, 64), (4, 48), (4, 64)]]

    def net(optimized: bool):
        def make():
            torch.manual_seed(0)
            model, _ = small_gpt(dropout=0.1)
            if not optimized:
                return model
            return remat.optimize(model, budget_bytes=2**30, example_inputs=inputs, quiet=True, solver="equal_spacing")
        return make

    _same(lightning_run(net(True), batches), lightning_run(net(False), batches))

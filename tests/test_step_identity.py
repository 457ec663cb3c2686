"""StepIdentity (graph_capture/step_identity.py) tells two traced steps apart wherever their
compiled steps would compute differently, and a compiled step bound to an equal module computes
that module's outputs and gradients (graph_capture/joint.py `CompiledStep.bound_to`)."""
import pytest
import torch
import torch.nn as nn

from remat.graph_capture.joint import ParameterMismatchError, bound_step, capture_training_step
from remat.graph_capture.step_identity import StepIdentity
from remat.pipeline import identified_trace, joint_info
from remat.runtime.partition import partition_with_plan
from remat.solver import get_solver


class Layer(nn.Module):
    def __init__(self, alpha: float = 1.0, constant: float = 1.0, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.alpha, self.constant = alpha, constant

    def forward(self, h):
        # `alpha` is a scalar of the graph's code, `constant` a tensor constant of it
        return torch.tanh(self.lin(h)) * self.alpha * torch.tensor([self.constant]) + h


def _identity(m: nn.Module, x: torch.Tensor) -> StepIdentity:
    _, identity = identified_trace(m, (x,), {}, quiet=True)
    assert identity is not None
    return identity


def test_equal_layers_are_one_step_and_every_difference_that_changes_it_tells_them_apart():
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    base = _identity(Layer(), x)
    assert _identity(Layer(), x) == base  # other parameter values, the same function of them
    assert _identity(Layer(alpha=2.0), x) != base  # a Python scalar the TrainingGraph does not record
    assert _identity(Layer(constant=3.0), x) != base  # a tensor constant's value
    assert _identity(Layer(), x.clone().requires_grad_()) != base  # a gradient to the input too
    assert _identity(Layer(), torch.randn(4, 8).t().contiguous().t()) != base  # other strides
    assert _identity(Layer().double(), x.double()) != base
    assert _identity(Layer().train(False), x) == base  # no mode-dependent op: the same step
    drop = nn.Sequential(Layer(), nn.Dropout(0.1))
    assert _identity(drop, x) != _identity(drop.eval(), x)


def test_the_trace_graphs_of_two_layers_differing_in_a_scalar_are_alike():
    # why the identity compares code: the planner's graph does not see the scalar
    x = torch.randn(4, 8)
    a, _ = identified_trace(Layer(alpha=1.0), (x,), {}, quiet=True)
    b, _ = identified_trace(Layer(alpha=2.0), (x,), {}, quiet=True)
    assert a.fingerprint() == b.fingerprint()


def test_a_step_bound_to_an_equal_module_computes_its_outputs_and_gradients():
    torch.manual_seed(0)
    first, second = Layer(), Layer()
    x = torch.randn(4, 8, requires_grad=True)
    with capture_training_step(first, (x,), {}) as captured:
        with captured.graph_work():
            info = joint_info(captured)
            plan = get_solver("keep_all")(info.graph, None)
            fw, bw = partition_with_plan(info, plan)
        step = captured.compile(fw, bw)
    bound = bound_step(step, second)
    (out,) = bound(x)
    out.sum().backward()
    got = (out.detach(), x.grad.clone(), second.lin.weight.grad.clone())
    x.grad = second.lin.weight.grad = None
    ref = second(x)
    ref.sum().backward()
    assert torch.equal(got[0], ref.detach())
    assert torch.equal(got[1], x.grad) and torch.equal(got[2], second.lin.weight.grad)
    assert first.lin.weight.grad is None  # the first module's parameters were not used
    with pytest.raises(ParameterMismatchError):
        bound_step(step, Layer(width=4))

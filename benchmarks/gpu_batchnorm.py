#!/usr/bin/env python
"""BatchNorm recomputed on CUDA (issue #27, item 3): is the CPU's rewrite (graph_capture/bn_replay.py)
bit-identical and its memory exact on the device too?

    python benchmarks/gpu_batchnorm.py --out DIR [--device cpu]

The rewrite runs on the CPU only (make_batch_norm_recomputable returns early on other devices: a
CUDA graph keeps every BatchNorm's output). This script applies it on the device anyway, for a
small fp32 CNN (conv, BatchNorm, ReLU, residual adds, pooling, a linear head) in training mode,
planned at equal spacing's lowest peak and at checkmate's smallest feasible budget so that
BatchNorm outputs are recomputed, and checks against the unmodified model on the same parameters,
buffers and batch: the loss, every gradient and the running statistics after the step (torch.equal;
cuDNN set deterministic), the measured peak against the plan's prediction. The same rows without
the rewrite (the graph as remat plans it on CUDA today) are the control the rewrite rows must equal
bit for bit; against eager (cuDNN's BatchNorm kernel, not the graph's) the error is reported.
Writes DIR/gpu_batchnorm.json and .txt; exit status 0 when every row with the rewrite is
bit-identical to the control and measured within 3% of predicted (eager's values are reported).
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.nn as nn

from gpu_common import Report, out_and_device


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


class SmallResNet(nn.Module):
    def __init__(self, c: int = 64, blocks: int = 4, classes: int = 10):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.blocks = nn.Sequential(*(Block(c) for _ in range(blocks)))
        self.head = nn.Linear(c, classes)

    def forward(self, x, y):
        h = self.blocks(torch.relu(self.bn(self.stem(x))))
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), y)


@contextlib.contextmanager
def rewrite_on_every_device(enabled: bool):
    """make_batch_norm_recomputable as on the CPU, whatever the device (the experiment)."""
    import remat.graph_capture.rewrites as rewrites
    original = rewrites.make_batch_norm_recomputable
    if enabled:
        rewrites.make_batch_norm_recomputable = lambda gm, device_type: original(gm, "cpu")
    try:
        yield
    finally:
        rewrites.make_batch_norm_recomputable = original


def _step(f, model, params, inputs, buffers0):
    model.load_state_dict(buffers0, strict=False)
    for p in params:
        p.grad = None
    loss = f(*inputs)
    loss.backward()
    out = [loss.detach().clone()] + [p.grad.clone() for p in params]
    return out, [b.clone() for b in model.buffers()]


def check(model, inputs, solver: str, rewrite: bool, log, control=None) -> tuple[dict, tuple]:
    """One row; `control`: the same solver's values without the rewrite (eager's BatchNorm is cuDNN's
    kernel, the graph's the native one: only against the control can the rewrite be bit-identical)."""
    import remat
    from remat.core.plan import LOWEST_PEAK
    from remat.solver import equal_spacing
    from remat.solver.checkmate import min_feasible_budget

    t0 = time.perf_counter()
    params = list(model.parameters())
    buffers0 = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    with rewrite_on_every_device(rewrite):
        g = remat.capture(model, inputs, quiet=True)
        bns = [n.name for n in g.nodes if n.op == "batch_norm.default"]
        budget = (min_feasible_budget(g) if solver == "checkmate"
                  else equal_spacing.solve(g, LOWEST_PEAK).predicted_peak_bytes)
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, solver=solver, quiet=True,
                             chunked_loss=False)
    recomputed = [n for n in opt.plan.recomputed if n in bns]
    ref, ref_buf = _step(model, model, params, inputs, buffers0)
    got, got_buf = _step(opt, model, params, inputs, buffers0)
    same = [torch.equal(a, b) for a, b in zip(ref, got)]
    err = max(float((a - b).abs().max()) for a, b in zip(ref, got))
    bufs_same = all(torch.equal(a, b) for a, b in zip(ref_buf, got_buf))
    model.load_state_dict(buffers0, strict=False)
    for p in params:
        p.grad = None
    measured = remat.measure_peak(lambda: opt(*inputs).backward(), resident=[model, *inputs])
    model.load_state_dict(buffers0, strict=False)
    pred = opt.plan.predicted_peak_bytes
    row = {"solver": solver, "rewrite": rewrite, "recomputable_batch_norms": len(bns),
           "recomputed_batch_norms": len(recomputed), "loss_equal": same[0], "grads_equal": all(same[1:]),
           "max_abs_err": err, "running_stats_equal": bufs_same, "budget_bytes": budget,
           "predicted_peak_bytes": pred, "measured_peak_bytes": measured, "measured_over_predicted": measured / pred,
           "seconds": time.perf_counter() - t0}
    if control is not None:
        c_vals, c_buf = control
        row["equal_to_control"] = (all(torch.equal(a, b) for a, b in zip(c_vals, got))
                                   and all(torch.equal(a, b) for a, b in zip(c_buf, got_buf)))
    row["pass"] = row.get("equal_to_control", True) and abs(measured / pred - 1) <= 0.03
    log(f"  {solver:13s} rewrite {str(rewrite):5s}: BatchNorms recomputable {len(bns)}, recomputed "
        f"{len(recomputed)}; loss/grads/running stats equal {same[0]}/{all(same[1:])}/{bufs_same} "
        f"(max err {err:.1e}); equal to the graph without the rewrite: {row.get('equal_to_control', '-')}; "
        f"peak measured {measured} predicted {pred} ({measured / pred:.4f}) "
        f"-> {'ok' if row['pass'] else 'FAIL'}")
    return row, (got, got_buf)


def main(argv=None) -> int:
    out, device = out_and_device(__doc__, argv)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    rep = Report()
    log = rep.log

    log(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}")
    log(f"command: python benchmarks/gpu_batchnorm.py {' '.join(argv or sys.argv[1:])}")
    torch.manual_seed(0)
    model = SmallResNet().to(device).train()
    inputs = (torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device))
    rows = []
    for solver in ("equal_spacing", "checkmate"):
        control_row, control = check(model, inputs, solver, False, log)
        rows += [control_row, check(model, inputs, solver, True, log, control)[0]]
    tried = [r for r in rows if r["rewrite"]]
    ok = all(r["pass"] for r in tried) and any(r["recomputed_batch_norms"] for r in tried)
    log(f"BatchNorm recompute on {device.type}: {'BIT-IDENTICAL, memory within 3%' if ok else 'FAILURES'}")
    rep.data = {"rows": rows, "all_pass": ok}
    rep.save(out, "gpu_batchnorm")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Dropout recomputed from its saved generator state on CUDA (graph_capture/rng_replay.py), checked
bit for bit on the device (issue #27, item 3). The CPU suite runs the same checks on the CPU
(tests/test_rng_replay.py); this runs them where CUDA's kernel and Philox generator are.

    python benchmarks/gpu_dropout.py --out DIR [--device cpu]

1. remat::dropout against CUDA native_dropout at the same generator state: the first computation's
   mask and output are eager's, a replay draws the same mask and leaves the generator where it was
   (fp32/bf16/fp16, several shapes);
2. a small GPT with dropout 0.1 (fp32) planned at its smallest feasible budget, so that dropouts are
   recomputed: loss, every gradient and the generator state after the step against the unmodified
   model (torch.equal), the measured peak against the plan's prediction;
3. dropout as people spell it (module, functional, torch.dropout) at equal spacing's lowest peak.
Writes DIR/gpu_dropout.json and .txt; exit status 0 only when every check is bit-identical.
"""
from __future__ import annotations

import sys
import time

import torch

from gpu_common import Report, out_and_device

SHAPES = [(7,), (1000,), (64, 33, 17), (4, 512, 1024)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def check_op(device: torch.device, log) -> list[dict]:
    from remat.graph_capture.rng_replay import dropout, rng_state

    rows = []
    for dtype in DTYPES:
        for shape in SHAPES:
            x = torch.randn(shape, device=device).to(dtype)
            start = _state(device)
            out_e, mask_e = torch.ops.aten.native_dropout.default(x, 0.3, True)
            after_e = _state(device)
            _set_state(start, device)
            s = rng_state(x)
            out_1, mask_1 = dropout(s, x, 0.3, False)
            after_1 = _state(device)
            out_r, mask_r = dropout(s, x, 0.3, True)
            row = {"dtype": str(dtype), "shape": list(shape),
                   "first_mask_is_eagers": torch.equal(mask_1, mask_e),
                   # on the CPU the output is not computed (nothing reads it)
                   "first_out_is_eagers": torch.equal(out_1, out_e) if device.type == "cuda" else None,
                   "generator_after_first_is_eagers": torch.equal(after_1, after_e),
                   "replay_mask_is_first": torch.equal(mask_r, mask_1),
                   "replay_leaves_generator": torch.equal(_state(device), after_1)}
            row["pass"] = all(v for k, v in row.items() if k not in ("dtype", "shape") and v is not None)
            rows.append(row)
            log(f"  op {str(dtype):15s} {str(list(shape)):16s} " + ("ok" if row["pass"] else f"FAIL {row}"))
    return rows


def _step(f, params, inputs, device, seed=123):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = f(*inputs)
    loss.backward()
    return [loss.detach().clone()] + [p.grad.clone() for p in params] + [_state(device).clone()]


def check_model(name: str, model, inputs, device, log, solver: str = "checkmate") -> dict:
    import remat
    from remat.core.plan import LOWEST_PEAK
    from remat.solver import equal_spacing
    from remat.solver.checkmate import min_feasible_budget

    t0 = time.perf_counter()
    g = remat.capture(model, inputs, quiet=True)
    drops = [n for n in g.nodes if n.op == "dropout.default"]
    budget = (min_feasible_budget(g) if solver == "checkmate"
              else equal_spacing.solve(g, LOWEST_PEAK).predicted_peak_bytes)
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, solver=solver, quiet=True,
                         chunked_loss=False)
    recomputed = [n for n in opt.plan.recomputed if g.node(n).op == "dropout.default"]
    params = list(model.parameters())
    ref = _step(model, params, inputs, device)
    got = _step(opt, params, inputs, device)
    same = [torch.equal(a, b) for a, b in zip(ref, got)]
    del ref, got
    for p in params:
        p.grad = None
    torch.manual_seed(123)
    measured = remat.measure_peak(lambda: opt(*inputs).backward(), resident=[model, *inputs])
    row = {"model": name, "solver": solver, "replayable_dropouts": len(drops), "recomputed_dropouts": len(recomputed),
           "loss_equal": same[0], "grads_equal": all(same[1:-1]), "generator_after_equal": same[-1],
           "budget_bytes": budget, "predicted_peak_bytes": opt.plan.predicted_peak_bytes, "measured_peak_bytes": measured,
           "measured_over_predicted": measured / opt.plan.predicted_peak_bytes, "seconds": time.perf_counter() - t0}
    # bit-identical whether or not a dropout was recomputed; a plan recomputing none replays nothing
    row["pass"] = all(same)
    row["replayed"] = bool(recomputed)
    verdict = ("ok" if recomputed else "ok, but no dropout recomputed: replay not exercised") if row["pass"] else "FAIL"
    log(f"  {name:28s} dropouts {len(drops)}, recomputed {len(recomputed)}; loss/grads/generator equal: "
        f"{same[0]}/{all(same[1:-1])}/{same[-1]}; peak measured {measured} predicted "
        f"{opt.plan.predicted_peak_bytes} ({row['measured_over_predicted']:.4f}) -> {verdict}")
    return row


class Spellings(torch.nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            if self.spelling == "module":
                h = self.drop(h)
            elif self.spelling == "functional":
                h = torch.nn.functional.dropout(h, 0.25, training=self.training)
            else:
                h = torch.dropout(h, 0.25, self.training)
            x = x + torch.tanh(h)
        return x.pow(2).mean()


def main(argv=None) -> int:
    out, device = out_and_device(__doc__, argv)
    rep = Report()
    log = rep.log

    log(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}")
    log(f"command: python benchmarks/gpu_dropout.py {' '.join(argv or sys.argv[1:])}")
    data: dict = {"op": check_op(device, log)}
    from remat.default_model import GPTConfig, default_inputs, default_model

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, block_size=128, n_embd=128, n_head=4, batch_size=8, dropout=0.1)
    model = default_model(cfg).to(device)
    inputs = tuple(t.to(device) for t in default_inputs(cfg))
    # equal spacing's lowest peak recomputes everything between its checkpoints, dropouts included
    # (checkmate's smallest budget recomputed none of this GPT's on the H200)
    data["models"] = [check_model("GPT, dropout 0.1", model, inputs, device, log, solver="equal_spacing")]
    for spelling in ("module", "functional", "tensor_method"):
        torch.manual_seed(0)
        m = Spellings(spelling).to(device)
        x = torch.randn(512, 256, device=device)
        data["models"].append(check_model(f"dropout spelled {spelling}", m, (x,), device, log, solver="equal_spacing"))
    data["all_pass"] = (all(r["pass"] for r in data["op"] + data["models"])
                        and any(r["replayed"] for r in data["models"]))
    log(f"dropout replay on {device.type}: {'ALL BIT-IDENTICAL' if data['all_pass'] else 'FAILURES'}")
    rep.data = data
    rep.save(out, "gpu_dropout")
    return 0 if data["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

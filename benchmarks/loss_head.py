"""The loss head chunked or not: how far below keep_all each model's step fits, and what it costs.

    python benchmarks/loss_head.py [--out benchmarks/results] [--skip-gpt]

Rows:
* Hugging Face decoders shaped like Llama-3.2-1B (vocab 128256, d 2048, tied) and Qwen2-1.5B
  (vocab 151936, d 1536, tied), 2 layers, bf16, batch 1, sequence 4096, built on the meta device and
  traced on fake tensors for device "cuda" (as `remat.plan` does), called with `labels=` (so they also
  return their logits, which their graph then holds);
* the default GPT of remat (2 layers, d 64, vocab 16384, T 256, batch 4, no dropout), real tensors
  on the CPU: at 40% of its eager peak `remat.optimize` (chunked_loss "auto") plans, trains one step,
  and is measured (profiler), with loss and gradients compared to eager (rtol 1e-5, atol 1e-6).

Columns: keep_all (the model's own head, nothing recomputed); the smallest feasible budget checkmate
finds with the model's own head ("before") and with the choice of heads ("after": the smaller of the
two heads' smallest budgets), as % of that keep_all; the extra FLOPs at 50% of keep_all before and
after: the plan's recomputations, plus for the chunked head the FLOPs its graph adds (the logits'
matmul again in the backward, and where the logits are also returned, the model's own linear and
its backward beside the op).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from remat.core.plan import InfeasibleBudgetError
from remat.machine_info import machine
from remat.solver import keep_all
from remat.solving import smallest_feasible, solve

DECODERS = {
    "llama3.2-1b x2": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", vocab_size=128256, hidden_size=2048,
                           intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
                           num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0, head_dim=64),
    "qwen2-1.5b x2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", vocab_size=151936, hidden_size=1536,
                          intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=2,
                          tie_word_embeddings=True),
}
SEQ = 4096
GiB = 2 ** 30


def _flops(g) -> int:
    return sum(n.flops for n in g.nodes)


def _at(g, budget: int):
    try:
        p = solve(g, budget, quiet=True)
    except InfeasibleBudgetError:
        return None
    return p


def _row(name: str, vocab: int, seq: int, plain, chunked) -> dict:
    keep = keep_all.solve(plain).predicted_peak_bytes
    before = smallest_feasible(plain, "checkmate")
    after_chunked = smallest_feasible(chunked, "checkmate")
    after = min(before, after_chunked)
    half = keep // 2
    added = _flops(chunked) - _flops(plain)
    pb, pc = _at(plain, half), _at(chunked, half)
    fb = "infeasible" if pb is None else f"{pb.extra_flops / 1e9:.1f} G"
    options = [(pb.extra_flops, "model's head") if pb is not None else None,
               (pc.extra_flops + added, "chunked") if pc is not None else None]
    options = [o for o in options if o is not None]
    fa = "infeasible" if not options else "{:.1f} G ({})".format(min(options)[0] / 1e9, min(options)[1])
    return dict(model=name, vocab=vocab, seq=seq, keep=keep, before=before, after=after, fb=fb, fa=fa,
                chunked_keep=keep_all.solve(chunked).predicted_peak_bytes, added=added)


def decoder_rows() -> list[dict]:
    import transformers

    from remat.graph_capture.fake_capture import capture_without_memory, planned_device

    rows = []
    for name, spec in DECODERS.items():
        spec = dict(spec)
        cls, cfg = getattr(transformers, spec.pop("cls")), getattr(transformers, spec.pop("cfg"))
        with torch.device("meta"):
            model = cls(cfg(max_position_embeddings=SEQ, **spec)).to(torch.bfloat16)
        model.train()
        ids = torch.empty(1, SEQ, dtype=torch.long, device="meta")
        kw = dict(input_ids=ids, labels=ids, use_cache=False)
        graphs = [capture_without_memory(model, (), kw, device=planned_device("cuda"), chunked_loss=c)
                  for c in (False, True)]
        rows.append(_row(name, spec["vocab_size"], SEQ, *graphs))
        print(f"  {name} done", file=sys.stderr, flush=True)
    return rows


def gpt_check() -> tuple[dict, str]:
    import remat
    from remat.default_model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=16384, block_size=256, dropout=0.0)
    model = GPT(cfg)
    idx, tg = torch.randint(0, 16384, (4, 256)), torch.randint(0, 16384, (4, 256))
    params = list(model.parameters())

    def fresh():
        for p in params:
            p.grad = None

    def run(m):
        loss = m(idx, tg)
        loss.backward()
        return loss

    fresh()
    eager_peak = remat.measure_peak(lambda: run(model), resident=[model, idx, tg])
    fresh()
    ref_loss = run(model).detach()
    ref = [p.grad.clone() for p in params]
    fresh()
    budget = int(0.4 * eager_peak)
    t0 = time.perf_counter()
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=(idx, tg), quiet=True)
    plan_s = time.perf_counter() - t0
    run(opt)
    fresh()
    peak = remat.measure_peak(lambda: run(opt), resident=[model, idx, tg])
    fresh()
    loss = run(opt).detach()
    ok = torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(p.grad, r, rtol=1e-5, atol=1e-6) for p, r in zip(params, ref))
    fresh()
    plain = remat.capture(model, (idx, tg), quiet=True)
    chunked = remat.capture(model, (idx, tg), quiet=True, chunked_loss=True)
    row = _row("default GPT x2 (cpu)", 16384, 256, plain, chunked)
    text = (f"default GPT (2 layers, d 64, vocab 16384, T 256, batch 4) on the CPU: eager peak "
            f"{eager_peak / 2**20:.2f} MiB; optimize at 40% ({budget / 2**20:.2f} MiB, chunked_loss='auto', "
            f"planned in {plan_s:.1f} s): head {opt.plan.details['loss_head']}, predicted "
            f"{opt.plan.predicted_peak_bytes / 2**20:.3f} MiB, measured {peak / 2**20:.3f} MiB "
            f"(measured == predicted: {peak == opt.plan.predicted_peak_bytes}, <= budget: {peak <= budget}); "
            f"loss and gradients allclose to eager (rtol 1e-5, atol 1e-6): {ok}")
    return row, text


def table(rows: list[dict]) -> str:
    out = ["| model | vocab | seq | keep_all | smallest feasible before | after | extra FLOPs at 50% before "
           "| after | chunked head: keep_all, FLOPs it adds |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r["keep"]
        out.append(f"| {r['model']} | {r['vocab']} | {r['seq']} | {k / GiB:.3f} GiB | "
                   f"{r['before'] / GiB:.3f} GiB ({100 * r['before'] / k:.1f}%) | "
                   f"{r['after'] / GiB:.3f} GiB ({100 * r['after'] / k:.1f}%) | {r['fb']} | {r['fa']} | "
                   f"{100 * r['chunked_keep'] / k:.1f}%, {r['added'] / 1e9:.1f} G |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-gpt", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = decoder_rows()
    notes = []
    if not a.skip_gpt:
        row, text = gpt_check()
        rows.append(row)
        notes.append(text)
    report = "\n".join(["# `python benchmarks/loss_head.py`", f"machine: {machine()}", "", table(rows), "", *notes])
    print(report)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_head.txt").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

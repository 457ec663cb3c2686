"""Issue #3: what the fused flash-attention op does to the default model's training graph.

    python benchmarks/attention_memory.py [--seq 256 512] [--time-limit 30]

For each sequence length, the default GPT is captured four ways:

  explicit  off    explicit softmax(QK^T * scale)V, not fused (what the model computes as written)
  explicit  exact  the same chain fused into remat's flash op (attention dropout 0)
  sdpa      exact  scaled_dot_product_attention fused into the op (attention dropout 0)
  explicit  exact  attention dropout 0.1 (the default model as it is): not fused, dropout is kept
  explicit  all    attention dropout 0.1, fused with the op's hashed dropout

Printed per variant: the largest value a node keeps and the largest workspace, against one fp32
(B, H, S, S) tensor; keep_all's peak; equal_spacing's lowest peak; checkmate's smallest feasible
budget (all simulated, bytes in MiB).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from remat.api import capture
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.machine_info import MiB, machine
from remat.solver import get_solver
from remat.core.plan import LOWEST_PEAK
from remat.solver.checkmate import min_feasible_budget

VARIANTS = [("explicit", "off", 0.0), ("explicit", "exact", 0.0), ("sdpa", "exact", 0.0),
            ("explicit", "exact", 0.1), ("explicit", "all", 0.1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    lines = [f"machine: {machine()}",
             f"{'seq':>5} {'attention':<9} {'fused':<5} {'pdrop':>5} {'nodes':>5} {'max kept':>9} {'max ws':>8} {'SxS':>7} "
             f"{'keep_all':>9} {'es lowest':>9} {'cm min':>8}"]
    rows = []
    for seq in a.seq:
        for attention, fused, pdrop in VARIANTS:
            cfg = GPTConfig(block_size=seq, attention=attention, attn_dropout=pdrop)
            g = capture(default_model(cfg), default_inputs(cfg), fused_attention=fused)
            s2 = cfg.batch_size * cfg.n_head * seq * seq * 4
            row = {"seq": seq, "attention": attention, "fused_attention": fused, "attn_dropout": pdrop,
                   "nodes": len(g.nodes),
                   "max_kept": max(n.out_bytes + n.kept_bytes for n in g.nodes),
                   "max_workspace": max(n.workspace_bytes for n in g.nodes), "sxs": s2,
                   "keep_all": get_solver("keep_all")(g, None).predicted_peak_bytes,
                   "equal_spacing_lowest": get_solver("equal_spacing")(g, LOWEST_PEAK).predicted_peak_bytes,
                   "checkmate_min": min_feasible_budget(g, time_limit_s=a.time_limit)}
            rows.append(row)
            lines.append(f"{seq:>5} {attention:<9} {fused:<5} {pdrop:>5.1f} {row['nodes']:>5} {row['max_kept'] / MiB:>9.2f} "
                         f"{row['max_workspace'] / MiB:>8.2f} {s2 / MiB:>7.2f} {row['keep_all'] / MiB:>9.2f} "
                         f"{row['equal_spacing_lowest'] / MiB:>9.2f} {row['checkmate_min'] / MiB:>8.2f}")
            print(lines[-1] if len(lines) > 2 else "\n".join(lines), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_memory_cpu.txt").write_text("\n".join(lines) + "\n")
    (out / "attention_memory_cpu.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

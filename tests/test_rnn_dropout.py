"""Stacked RNNs with dropout between their layers (nn.LSTM, nn.GRU, nn.RNN with num_layers > 1 and
dropout > 0), trained through remat: the loss and every gradient equal eager's, from the same seed.

PyTorch's RNN decompositions, which AOTAutograd traces, dropped that dropout (compat/torch_private.py
`rnn_dropout_between_layers` says how), so remat's module computed another function than the
model's: these steps differed from eager's in the loss itself."""
from __future__ import annotations

import pytest
import torch

import remat

V, W, B, S = 32, 8, 2, 3


class StackedRNN(torch.nn.Module):
    def __init__(self, kind: str, batch_first: bool, bidirectional: bool):
        super().__init__()
        rnn = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[kind]
        self.emb = torch.nn.Embedding(V, W)
        self.rnn = rnn(W, W, num_layers=3, dropout=0.3, batch_first=batch_first, bidirectional=bidirectional)
        self.head = torch.nn.Linear(W * (2 if bidirectional else 1), V)
        self.batch_first = batch_first

    def forward(self, ids, labels):
        h, _ = self.rnn(self.emb(ids if self.batch_first else ids.t()))
        h = h if self.batch_first else h.transpose(0, 1)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


# (kind, batch_first, bidirectional, solver), each planned at its smallest feasible budget: equal_spacing's
# lowest-peak plans recompute 19-29% of these steps, found in seconds (checkmate's took 29 s on the
# plain RNN's at five time steps). Three time steps: the trace of an unrolled RNN grows with them
# (five: 15 s for the bidirectional ones, three: 9 s)
CASES = [("lstm", True, False, "equal_spacing"), ("lstm", False, True, "equal_spacing"),
         ("gru", True, True, "equal_spacing"), ("rnn", False, False, "equal_spacing")]


@pytest.mark.parametrize("kind,batch_first,bidirectional,solver", CASES,
                         ids=["lstm", "lstm-seq-first-bidirectional", "gru-bidirectional", "rnn-seq-first"])
def test_stacked_rnn_dropout_trains_as_eager(kind, batch_first, bidirectional, solver):
    torch.manual_seed(0)
    model = StackedRNN(kind, batch_first, bidirectional).double().train()
    ids = torch.randint(0, V, (B, S))
    params = list(model.parameters())

    def step(module):
        for p in params:
            p.grad = None
        torch.manual_seed(7)
        loss = module(ids, ids)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in params]

    eager = step(model)
    dropout, model.rnn.dropout = model.rnn.dropout, 0.0
    assert not torch.equal(step(model)[0], eager[0])  # the dropout changes this step's loss
    model.rnn.dropout = dropout
    # (a plan that recomputes covers what keep_all's would: the same traced step, dropout included)
    with pytest.raises(remat.InfeasibleBudgetError) as refused:  # the smallest feasible budget: it recomputes
        remat.optimize(model, example_inputs=(ids, ids), budget_bytes=1, solver=solver, quiet=True)
    planned = remat.optimize(model, example_inputs=(ids, ids), budget_bytes=refused.value.min_feasible_bytes,
                             solver=solver, quiet=True)
    assert planned.plan.extra_cost > 0
    for got, want in zip(step(planned), eager):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)

"""Training loops of the frameworks people use, run on a model and on its remat module alike, so the
tests (tests/test_frameworks.py) and the benchmark (benchmarks/trainer_check.py) compare the two.

* `trainer_run`: Hugging Face's Trainer with default TrainingArguments (unused columns removed,
  `num_items_in_batch` passed to the model, which accepts loss kwargs) over a dataset of token lists
  of different lengths, padded per batch by a data collator (DataCollatorWithPadding for sequence
  classification, DataCollatorForLanguageModeling for causal LMs) to a multiple of 8, with an extra
  `idx` column the model does not take;
* `accelerate_run`: `accelerate.Accelerator().prepare(model, optimizer, dataloader)` and its
  `backward`;
* `lightning_run`: a LightningModule whose `training_step` calls the module, under
  `lightning.Trainer(max_steps=...)` on the CPU.

Each returns the losses of its steps and the final parameters. Tiny models, built in code; nothing
is downloaded.
"""
from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable

import torch
import torch.nn as nn

from tests.hf_models import VOCAB, hf_model

__all__ = ["tokenizer", "token_dataset", "hf_pair", "example_batch", "trainer_run", "accelerate_run",
           "lightning_run", "MAX_LEN"]

MAX_LEN = 16  # longest row of the datasets (padded: 8 or 16 tokens per batch)


def tokenizer():
    """A word-level tokenizer over VOCAB ids (its only use here: padding, for the data collators)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
                                  pad_token="[PAD]", unk_token="[UNK]")
    tok.model_max_length = MAX_LEN
    return tok


def token_dataset(kind: str, rows: int = 64, seed: int = 0) -> list[dict]:
    """`rows` examples of 3 to MAX_LEN tokens: {"input_ids", "idx"} (+ "labels", a class, for "bert")."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        n = int(torch.randint(3, MAX_LEN + 1, (1,), generator=g))
        row = {"input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist(), "idx": i}
        if kind == "bert":
            row["labels"] = int(torch.randint(0, 3, (1,), generator=g))
        out.append(row)
    return out


def _collator(kind: str):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    if kind == "bert":
        return DataCollatorWithPadding(tokenizer(), pad_to_multiple_of=8)
    return DataCollatorForLanguageModeling(tokenizer(), mlm=False, pad_to_multiple_of=8)


def hf_pair(kind: str, dropout: float = 0.1) -> tuple[nn.Module, nn.Module]:
    """Two copies of the tiny `kind` model ("llama" or "bert"), positions for MAX_LEN tokens.
    The decoder's key/value cache is off (`config.use_cache = False`): remat cannot return it."""
    model = hf_model(kind, dropout=dropout, seq=MAX_LEN)
    model.config.use_cache = False
    return model, copy.deepcopy(model)


def example_batch(kind: str, batch: int) -> dict:
    """A collated batch of the largest shape the datasets give (batch x MAX_LEN), the columns the
    model takes: what to plan for."""
    rows = [r for r in token_dataset(kind, rows=256) if len(r["input_ids"]) == MAX_LEN][:batch]
    out = _collator(kind)([{k: v for k, v in r.items() if k != "idx"} for r in rows])
    return dict(out)


def trainer_run(module: nn.Module, kind: str, *, steps: int = 8, batch: int = 4, accumulation: int = 1,
                seed: int = 0) -> tuple[list[float], list[torch.Tensor]]:
    """`steps` optimizer steps of Hugging Face's Trainer on `module`, default TrainingArguments but
    for the batch size, gradient accumulation and what a test must switch off (reporting, saving,
    the progress bar). Returns the logged loss of every step and the final parameters."""
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps,
                                 gradient_accumulation_steps=accumulation, logging_steps=1, report_to=[],
                                 save_strategy="no", disable_tqdm=True, seed=seed, use_cpu=True,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=module, args=args, train_dataset=token_dataset(kind),
                          data_collator=_collator(kind))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in module.parameters()]


def _plain_batches(kind: str, batch: int, steps: int) -> list[dict]:
    rows = token_dataset(kind)
    collate = _collator(kind)
    out = []
    for s in range(steps):
        chunk = rows[(s * batch) % len(rows):][:batch]
        out.append(dict(collate([{k: v for k, v in r.items() if k != "idx"} for r in chunk])))
    return out


def accelerate_run(module: nn.Module, kind: str, *, steps: int = 6, batch: int = 4,
                   seed: int = 0) -> tuple[list[float], list[torch.Tensor]]:
    """`steps` steps of a loop prepared by accelerate (model, AdamW, dataloader), on the CPU."""
    from accelerate import Accelerator

    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    optim = torch.optim.AdamW(module.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_plain_batches(kind, batch, steps), batch_size=None, shuffle=False)
    prepared, optim, loader = accelerator.prepare(module, optim, loader)
    losses = []
    for b in loader:
        loss = prepared(**b).loss
        accelerator.backward(loss)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in module.parameters()]


def lightning_run(make_net: Callable[[], nn.Module], batches: list[tuple], *,
                  seed: int = 0) -> tuple[list[float], list[torch.Tensor]]:
    """A LightningModule holding `make_net()` (called inside it, so the net is its submodule) whose
    training_step returns `net(*batch)`, trained by `lightning.Trainer(max_steps=len(batches))`."""
    import lightning as L

    losses: list[float] = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            loss = self.net(*batch)
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(seed)
    module = Module()
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    return losses, [p.detach().clone() for p in module.parameters()]

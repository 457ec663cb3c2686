"""Tiny Hugging Face models (random weights, configs built in code, nothing downloaded) and the
batches people train them on: some rows padded, `attention_mask` marking the padding, `labels=` so
the model computes its own loss. Used by tests/test_huggingface.py and benchmarks/huggingface.py.

What the calls pass, as users must: `use_cache=False` for the decoders (LLaMA, GPT-2, T5), whose
key/value cache remat cannot return; padded label positions are -100 (ignored by the loss). ViT
takes images, which have no padding: it is called with `pixel_values` and `labels` only.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["HF_MODELS", "hf_model", "hf_batch", "hf_step"]

HF_MODELS = ("llama", "gpt2", "bert", "t5", "vit")
VOCAB, BATCH, SEQ = 128, 4, 32


def hf_model(name: str, dropout: float = 0.1, seed: int = 0, *, width: int = 64, layers: int = 2,
             seq: int = SEQ, image: int = 32, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny `name` model (one of HF_MODELS) in train mode, with dropout `dropout` everywhere it
    has dropout (LLaMA: on the attention probabilities only): hidden size `width`, 4 heads, MLP
    2 x width, `layers` blocks (T5: layers // 2 in the encoder and in the decoder), positions for
    `seq` tokens, ViT: `image` x `image` pictures in 4 x 4 patches; `vocab` tokens. "qwen2" (not in
    HF_MODELS: built for the loss-head tests) is a Qwen2 causal LM with tied embeddings."""
    import transformers as tf

    torch.manual_seed(seed)
    w, ff, n = width, 2 * width, layers
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=w, intermediate_size=ff, num_hidden_layers=n,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                             attention_dropout=dropout)
        model = tf.LlamaForCausalLM(cfg)
    elif name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=w, n_layer=n, n_head=4, n_positions=seq, resid_pdrop=dropout,
                            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "qwen2":
        cfg = tf.Qwen2Config(vocab_size=vocab, hidden_size=w, intermediate_size=ff, num_hidden_layers=n,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                             attention_dropout=dropout, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=w, intermediate_size=ff, num_hidden_layers=n,
                            num_attention_heads=4, max_position_embeddings=seq, num_labels=3,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        model = tf.BertForSequenceClassification(cfg)
    elif name == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=w, d_kv=w // 4, d_ff=ff, num_layers=max(1, n // 2),
                          num_decoder_layers=max(1, n // 2),
                          num_heads=4, dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0)
        model = tf.T5ForConditionalGeneration(cfg)
    elif name == "vit":
        cfg = tf.ViTConfig(image_size=image, patch_size=4, num_channels=3, hidden_size=w, num_hidden_layers=n,
                           num_attention_heads=4, intermediate_size=ff, num_labels=3, hidden_dropout_prob=dropout,
                           attention_probs_dropout_prob=dropout)
        model = tf.ViTForImageClassification(cfg)
    else:
        raise ValueError(f"unknown model {name!r}; one of {HF_MODELS}")
    return model.train()


def hf_batch(name: str, seed: int = 1, *, batch: int = BATCH, seq: int = SEQ, image: int = 32,
             vocab: int = VOCAB) -> dict:
    """The keyword arguments of one training call of `batch` (>= 4) rows of `seq` tokens (ViT:
    `image` x `image` pictures): rows 1 and 3 padded at the end (row 3 by half the sequence),
    `attention_mask` 0 there, labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return dict(pixel_values=torch.randn(batch, 3, image, image, generator=g),
                    labels=torch.randint(0, 3, (batch,), generator=g))
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, -5:] = 0
    mask[3, seq // 2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    if name in ("llama", "gpt2", "qwen2"):
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    if name == "bert":
        return dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, (batch,), generator=g))
    if name == "t5":
        labels = torch.randint(1, vocab, (batch, seq // 2), generator=g)
        labels[0, -3:] = -100
        return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    raise ValueError(f"unknown model {name!r}; one of {HF_MODELS}")


def hf_step(module: torch.nn.Module, batch: dict) -> Callable[[], torch.Tensor]:
    """One training step: out = module(**batch); out.loss.backward(); returns the loss."""

    def step():
        loss = module(**batch).loss
        loss.backward()
        return loss

    return step

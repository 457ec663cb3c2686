"""Small configurations of Hugging Face models that no other benchmark or test plans, for
`benchmarks/certificates.py --more`: the solver's plans and certificates off the models it was
tuned on. Decoders and encoders: 4 layers (BART: 2 + 2), width 128, batch 8 of 128 tokens (one row
padded); vision: batch 8 of 64 x 64 pictures, 10 classes, Hugging Face's own implementations
(torchvision's C ops do not load beside the CPU torch).

    m, kwargs = more_model("regnet")   # the model in train mode, and one training call's kwargs
"""
from __future__ import annotations

import torch

__all__ = ["more_model", "MORE_MODELS", "TEXT_MODELS", "VISION_MODELS"]

TEXT_MODELS = ("mistral", "phi", "opt", "bart", "roberta", "distilbert")
VISION_MODELS = ("convnext", "hf_resnet18", "mobilenet_v2", "regnet", "deit")
MORE_MODELS = TEXT_MODELS + VISION_MODELS
BATCH, SEQ, VOCAB, WIDTH = 8, 128, 128, 128


def _text_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -5:] = 0
    return ids, mask, g


def _text(name: str):
    import transformers as tf

    ids, mask, g = _text_batch()
    lm = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                  max_position_embeddings=SEQ)
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(num_hidden_layers=4, num_key_value_heads=2, **common)), lm
    if name == "phi":
        return tf.PhiForCausalLM(tf.PhiConfig(num_hidden_layers=4, **common)), lm
    if name == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=2 * WIDTH, num_hidden_layers=4,
                                              num_attention_heads=4, max_position_embeddings=SEQ,
                                              word_embed_proj_dim=WIDTH)), lm
    if name == "bart":
        cfg = tf.BartConfig(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
                            max_position_embeddings=SEQ)
        labels = torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)
        return tf.BartForConditionalGeneration(cfg), dict(input_ids=ids, attention_mask=mask, labels=labels,
                                                          use_cache=False)
    if name == "roberta":
        cfg = tf.RobertaConfig(**{**common, "max_position_embeddings": SEQ + 2}, num_hidden_layers=4)
        return tf.RobertaForMaskedLM(cfg), dict(input_ids=ids, attention_mask=mask, labels=ids)
    if name == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=VOCAB, dim=WIDTH, hidden_dim=2 * WIDTH, n_layers=4, n_heads=4,
                                  max_position_embeddings=SEQ)
        return tf.DistilBertForSequenceClassification(cfg), dict(input_ids=ids, attention_mask=mask,
                                                                 labels=torch.randint(0, 2, (BATCH,), generator=g))
    raise ValueError(name)


def _vision(name: str):
    import transformers as tf

    g = torch.Generator().manual_seed(1)
    batch = dict(pixel_values=torch.randn(BATCH, 3, 64, 64, generator=g),
                 labels=torch.randint(0, 10, (BATCH,), generator=g))
    if name == "convnext":
        cfg = tf.ConvNextConfig(num_labels=10, depths=[2, 2, 4, 2], hidden_sizes=[32, 64, 128, 256])
        return tf.ConvNextForImageClassification(cfg), batch
    if name == "hf_resnet18":
        cfg = tf.ResNetConfig(num_labels=10, depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], layer_type="basic")
        return tf.ResNetForImageClassification(cfg), batch
    if name == "mobilenet_v2":
        return tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(num_labels=10, image_size=64)), batch
    if name == "regnet":
        return tf.RegNetForImageClassification(tf.RegNetConfig(num_labels=10)), batch
    if name == "deit":
        cfg = tf.DeiTConfig(image_size=64, patch_size=8, hidden_size=WIDTH, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=2 * WIDTH, num_labels=10)
        return tf.DeiTForImageClassification(cfg), batch
    raise ValueError(name)


def more_model(name: str, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """`name` (one of MORE_MODELS) in train mode with its weights drawn from `seed`, and the
    keyword arguments of one training call."""
    if name not in MORE_MODELS:
        raise ValueError(f"unknown model {name!r}; one of {MORE_MODELS}")
    torch.manual_seed(seed)
    model, kwargs = _vision(name) if name in VISION_MODELS else _text(name)
    return model.train(), kwargs

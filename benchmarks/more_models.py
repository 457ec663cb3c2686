"""Small configurations of Hugging Face models that no other benchmark or test plans, for
`benchmarks/certificates.py --more`: the solver's plans and certificates off the models it was
tuned on. Decoders and encoders: 4 layers (BART: 2 + 2), width 128, batch 8 of 128 tokens (one row
padded); vision: batch 8 of 64 x 64 pictures, 10 classes, Hugging Face's own implementations
(torchvision's C ops do not load beside the CPU torch). THIRD_MODELS (`--third`) were added after
the solver's changes for the first two sets, to check it again on models it was not tuned on,
FOURTH_MODELS (`--fourth`) after those for the third, and FIFTH_MODELS (`--fifth`) after those for the
fourth.

    m, kwargs = more_model("regnet")   # the model in train mode, and one training call's kwargs
"""
from __future__ import annotations

import torch

__all__ = ["more_model", "MORE_MODELS", "TEXT_MODELS", "VISION_MODELS", "THIRD_MODELS", "FOURTH_MODELS", "FIFTH_MODELS"]

TEXT_MODELS = ("mistral", "phi", "opt", "bart", "roberta", "distilbert",
               "gpt_neo", "falcon", "bloom", "gptj", "stablelm", "gemma", "starcoder2", "electra", "albert", "deberta_v2")
VISION_MODELS = ("convnext", "hf_resnet18", "mobilenet_v2", "regnet", "deit",
                 "swin", "efficientnet", "mobilevit", "beit", "segformer")
MORE_MODELS = TEXT_MODELS + VISION_MODELS
# decoders with QK-norm (Qwen3), non-parametric norms (OLMo), fused projections (Phi-3), scaled
# residuals (Granite), multi-query (GPT-BigCode), mixed-in rotary (CodeGen), mixture of experts
# (Mixtral); encoders with relative position bias shared by the layers (MPNet), encoder-decoders
# (Pegasus, mT5); vision transformers with layer scale (DINOv2), attention biases and BatchNorm
# (LeViT), convolutional attention (CvT), SwinV2's scaled cosine attention; ConvNeXt-V2's global
# response norm, PoolFormer, the bottleneck ResNet-50
THIRD_MODELS = ("qwen3", "olmo", "phi3", "granite", "gpt_bigcode", "codegen", "mixtral", "xlm_roberta", "mpnet",
                "pegasus", "mt5", "dinov2", "convnextv2", "poolformer", "cvt", "swinv2", "hf_resnet50", "levit")
# encoder-decoders with a relative position bias per layer (UMT5: over 1,000 nodes at 3 + 3 layers, beyond the
# whole step's relaxation), local attention in the encoder (LongT5), pre-norm (mBART) and MarianMT; decoders
# with squared-ReLU MLPs and LayerNorm1P (Nemotron), sliding and global layers with QK-norm (Gemma-3), a
# mixture of experts with QK-norm (OLMoE); an encoder with decoupled embeddings (RemBERT)
FOURTH_MODELS = ("umt5", "longt5", "mbart", "marian", "nemotron", "gemma3", "olmoe", "rembert")
# multi-head latent attention with a mixture of experts (DeepSeek-V3), shared experts (Qwen2-MoE), a
# selective state space's chunked scan (Mamba2), an encoder with alternating global and local layers
# (ModernBERT), Gemma as an encoder-decoder (T5Gemma); a hierarchical vision transformer with mask units
# (Hiera), spatial-reduction attention (PVTv2), ResNet with weight-standardised convolutions and group
# norm (BiT). (LED's step cannot be traced whole, `.item()` on its global-attention mask: it is planned
# block by block, remat/blockwise.py.)
FIFTH_MODELS = ("deepseek_v3", "qwen2_moe", "mamba2", "modernbert", "t5gemma", "hiera", "pvt_v2", "bit")
BATCH, SEQ, VOCAB, WIDTH = 8, 128, 128, 128


def _text_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -5:] = 0
    return ids, mask, g


def _text_calls() -> tuple[dict, dict, dict, torch.Generator]:
    """One training call's kwargs for a causal LM, a masked LM and an encoder-decoder (labels half
    as long), and the generator, to draw more from."""
    ids, mask, g = _text_batch()
    lm = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    mlm = dict(input_ids=ids, attention_mask=mask, labels=ids)
    seq2seq = dict(input_ids=ids, attention_mask=mask, labels=torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g),
                   use_cache=False)
    return lm, mlm, seq2seq, g


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
    return _more_text(name, common, lm)


def _more_text(name: str, common: dict, lm: dict):
    """The second set: decoders with local attention (GPT-Neo), ALiBi (BLOOM), parallel blocks
    (Falcon, GPT-J), partial rotary (StableLM), multi-query (Gemma); encoders with factorised
    embeddings (ELECTRA), one layer's weights shared by all (ALBERT), disentangled attention
    (DeBERTa-v2)."""
    import transformers as tf

    mlm = dict(input_ids=lm["input_ids"], attention_mask=lm["attention_mask"], labels=lm["input_ids"])
    encoder = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=4, num_attention_heads=4,
                   intermediate_size=2 * WIDTH, max_position_embeddings=SEQ)
    build = {
        "gpt_neo": lambda: tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, num_layers=4, num_heads=4, attention_types=[[["global", "local"], 2]],
            window_size=32, max_position_embeddings=SEQ)),
        "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=4,
                                                               num_attention_heads=4)),
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=4, n_head=4)),
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=VOCAB, n_embd=WIDTH, n_layer=4, n_head=4, rotary_dim=16,
                                                         n_positions=SEQ)),
        "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(num_hidden_layers=4, num_key_value_heads=2, **common)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(num_hidden_layers=4, num_key_value_heads=1, head_dim=32,
                                                           **common)),
        "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(num_hidden_layers=4, num_key_value_heads=2,
                                                                           **common)),
        "electra": lambda: tf.ElectraForMaskedLM(tf.ElectraConfig(embedding_size=64, **encoder)),
        "albert": lambda: tf.AlbertForMaskedLM(tf.AlbertConfig(embedding_size=64, **encoder)),
        "deberta_v2": lambda: tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(**encoder)),
    }
    if name not in build:
        raise ValueError(name)
    return build[name](), (mlm if name in ("electra", "albert", "deberta_v2") else lm)


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
    # the second set: shifted windows (Swin), depthwise blocks with squeeze-excitation (EfficientNet-B0),
    # convolutions and attention mixed (MobileViT), relative position bias per layer (BEiT), a
    # hierarchical transformer (SegFormer)
    if name == "swin":
        cfg = tf.SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=4,
                            num_labels=10)
        return tf.SwinForImageClassification(cfg), batch
    if name == "efficientnet":  # B0's widths (the config's default hidden_dim is B7's)
        cfg = tf.EfficientNetConfig(image_size=64, num_labels=10, width_coefficient=1.0, depth_coefficient=1.0,
                                    hidden_dim=1280)
        return tf.EfficientNetForImageClassification(cfg), batch
    if name == "mobilevit":
        return tf.MobileViTForImageClassification(tf.MobileViTConfig(image_size=64, num_labels=10)), batch
    if name == "beit":
        cfg = tf.BeitConfig(image_size=64, patch_size=8, hidden_size=WIDTH, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=2 * WIDTH, num_labels=10, use_relative_position_bias=True)
        return tf.BeitForImageClassification(cfg), batch
    if name == "segformer":
        return tf.SegformerForImageClassification(tf.SegformerConfig(image_size=64, num_labels=10)), batch
    raise ValueError(name)


def _third(name: str):
    import transformers as tf

    lm, mlm, seq2seq, g = _text_calls()
    pictures = dict(pixel_values=torch.randn(BATCH, 3, 64, 64, generator=g),
                    labels=torch.randint(0, 10, (BATCH,), generator=g))
    common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                  max_position_embeddings=SEQ, num_hidden_layers=4)
    encoder = {**common, "max_position_embeddings": SEQ + 2}
    stages = dict(num_labels=10, depths=[2, 2, 4, 2], hidden_sizes=[32, 64, 128, 256])
    build = {
        "qwen3": lambda: (tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=32, **common)), lm),
        "olmo": lambda: (tf.OlmoForCausalLM(tf.OlmoConfig(**common)), lm),
        "phi3": lambda: (tf.Phi3ForCausalLM(tf.Phi3Config(pad_token_id=0, **common)), lm),
        "granite": lambda: (tf.GraniteForCausalLM(tf.GraniteConfig(**common)), lm),
        "gpt_bigcode": lambda: (tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=WIDTH, n_layer=4,
                                                                             n_head=4, n_positions=SEQ)), lm),
        "codegen": lambda: (tf.CodeGenForCausalLM(tf.CodeGenConfig(vocab_size=VOCAB, n_embd=WIDTH, n_layer=4, n_head=4,
                                                                   n_positions=SEQ, rotary_dim=16)), lm),
        "mixtral": lambda: (tf.MixtralForCausalLM(tf.MixtralConfig(**{**common, "num_hidden_layers": 2},
                                                                   num_local_experts=4, num_experts_per_tok=2,
                                                                   num_key_value_heads=2)), lm),
        "xlm_roberta": lambda: (tf.XLMRobertaForMaskedLM(tf.XLMRobertaConfig(**encoder)), mlm),
        "mpnet": lambda: (tf.MPNetForMaskedLM(tf.MPNetConfig(**encoder)), mlm),
        "pegasus": lambda: (tf.PegasusForConditionalGeneration(tf.PegasusConfig(
            vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
            max_position_embeddings=SEQ)), seq2seq),
        "mt5": lambda: (tf.MT5ForConditionalGeneration(tf.MT5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=32,
                                                                    d_ff=2 * WIDTH, num_layers=2, num_heads=4)), seq2seq),
        "dinov2": lambda: (tf.Dinov2ForImageClassification(tf.Dinov2Config(
            image_size=64, patch_size=8, hidden_size=WIDTH, num_hidden_layers=4, num_attention_heads=4,
            num_labels=10)), pictures),
        "convnextv2": lambda: (tf.ConvNextV2ForImageClassification(tf.ConvNextV2Config(**stages)), pictures),
        "poolformer": lambda: (tf.PoolFormerForImageClassification(tf.PoolFormerConfig(**stages)), pictures),
        "cvt": lambda: (tf.CvtForImageClassification(tf.CvtConfig(num_labels=10, embed_dim=[32, 64, 128], depth=[1, 2, 4],
                                                                   num_heads=[1, 2, 4])), pictures),
        "swinv2": lambda: (tf.Swinv2ForImageClassification(tf.Swinv2Config(
            image_size=64, patch_size=4, embed_dim=32, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=4,
            num_labels=10)), pictures),
        "hf_resnet50": lambda: (tf.ResNetForImageClassification(tf.ResNetConfig(num_labels=10)), pictures),
        "levit": lambda: (tf.LevitForImageClassification(tf.LevitConfig(image_size=64, num_labels=10)), pictures),
    }
    return build[name]()


def _fourth(name: str):
    import transformers as tf

    lm, mlm, seq2seq, g = _text_calls()
    common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                  max_position_embeddings=SEQ + 2, num_hidden_layers=4)
    t5 = dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=32, d_ff=2 * WIDTH, num_layers=3, num_decoder_layers=3, num_heads=4,
              decoder_start_token_id=0, pad_token_id=0)
    bart = dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
                max_position_embeddings=SEQ + 2, pad_token_id=1, decoder_start_token_id=2)
    build = {
        "umt5": lambda: (tf.UMT5ForConditionalGeneration(tf.UMT5Config(**t5)), seq2seq),
        "longt5": lambda: (tf.LongT5ForConditionalGeneration(tf.LongT5Config(**t5, local_radius=16,
                                                                             encoder_attention_type="local")), seq2seq),
        "mbart": lambda: (tf.MBartForConditionalGeneration(tf.MBartConfig(**bart)), seq2seq),
        "marian": lambda: (tf.MarianMTModel(tf.MarianConfig(**bart)), seq2seq),
        "nemotron": lambda: (tf.NemotronForCausalLM(tf.NemotronConfig(**common, num_key_value_heads=2)), lm),
        "gemma3": lambda: (tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=32,
                                                                    sliding_window=32)), lm),
        "olmoe": lambda: (tf.OlmoeForCausalLM(tf.OlmoeConfig(**{**common, "num_hidden_layers": 2}, num_experts=4,
                                                             num_experts_per_tok=2)), lm),
        "rembert": lambda: (tf.RemBertForMaskedLM(tf.RemBertConfig(**common, input_embedding_size=64,
                                                                   output_embedding_size=64)), mlm),
    }
    return build[name]()


def _fifth(name: str):
    import transformers as tf

    lm, mlm, seq2seq, g = _text_calls()
    pictures = dict(pixel_values=torch.randn(BATCH, 3, 64, 64, generator=g),
                    labels=torch.randint(0, 10, (BATCH,), generator=g))
    common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                  max_position_embeddings=SEQ + 2, num_hidden_layers=4)
    gemma = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, num_hidden_layers=2, max_position_embeddings=SEQ + 2)
    build = {
        "deepseek_v3": lambda: (tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3}, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_key_value_heads=4)), lm),
        "qwen2_moe": lambda: (tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3}, num_key_value_heads=2, moe_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=128)), lm),
        "mamba2": lambda: (tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=4,
                                                                num_heads=8, head_dim=32, state_size=16, n_groups=1,
                                                                chunk_size=32)), lm),
        "modernbert": lambda: (tf.ModernBertForMaskedLM(tf.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4, num_hidden_layers=4,
            max_position_embeddings=SEQ, global_attn_every_n_layers=2, local_attention=32, pad_token_id=0)), mlm),
        "t5gemma": lambda: (tf.T5GemmaForConditionalGeneration(tf.T5GemmaConfig(
            encoder=tf.T5GemmaModuleConfig(**gemma), decoder=tf.T5GemmaModuleConfig(**gemma), vocab_size=VOCAB)), seq2seq),
        "hiera": lambda: (tf.HieraForImageClassification(tf.HieraConfig(
            image_size=[64, 64], patch_size=[4, 4], patch_stride=[2, 2], patch_padding=[1, 1], embed_dim=32,
            depths=[1, 2, 2, 1], num_heads=[1, 2, 4, 8], query_stride=[2, 2], masked_unit_size=[8, 8], num_labels=10)),
            pictures),
        "pvt_v2": lambda: (tf.PvtV2ForImageClassification(tf.PvtV2Config(
            image_size=64, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_attention_heads=[1, 2, 4, 8],
            num_labels=10)), pictures),
        "bit": lambda: (tf.BitForImageClassification(tf.BitConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                                                   depths=[1, 1, 2, 1], num_groups=8, num_labels=10)), pictures),
    }
    return build[name]()


def more_model(name: str, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """`name` (one of MORE_MODELS, THIRD_MODELS, FOURTH_MODELS or FIFTH_MODELS) in train mode with its
    weights drawn from `seed`, and the keyword arguments of one training call."""
    known = MORE_MODELS + THIRD_MODELS + FOURTH_MODELS + FIFTH_MODELS
    if name not in known:
        raise ValueError(f"unknown model {name!r}; one of {known}")
    torch.manual_seed(seed)
    if name in FIFTH_MODELS:
        model, kwargs = _fifth(name)
    elif name in FOURTH_MODELS:
        model, kwargs = _fourth(name)
    elif name in THIRD_MODELS:
        model, kwargs = _third(name)
    else:
        model, kwargs = _vision(name) if name in VISION_MODELS else _text(name)
    return model.train(), kwargs

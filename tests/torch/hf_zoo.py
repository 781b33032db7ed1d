"""A zoo of tiny config-initialised Hugging Face architectures (hidden size 16, 2 layers,
vocabulary 97; no weights are downloaded) with their batches and losses, for the
engine's per-example checks against a loop of batch-of-one passes (test_hf_zoo.py).

Each entry of :data:`ZOO` is ``(kind, class name, build)``: ``build(tf)`` returns the
model from the ``transformers`` module ``tf``; ``kind`` picks the inputs and the loss:

* ``causal``: right-padded token ids, labels the ids (-100 on padding), shifted loss;
* ``mlm``: about a third of the real tokens masked, labels -100 elsewhere, unshifted;
* ``cls``: token ids and a class out of 3;
* ``image``: 3x16x16 pixels and a class out of 3;
* ``audio``: 400 raw samples (``input_values``) and a class out of 3;
* ``features``: 8 mel bins x 16 frames (``input_features``) and a class out of 3;
* ``seq2seq``: source ids, decoder ids (labels shifted right), unshifted loss;
* ``seq2seq_audio``: ``features``' inputs and a decoder as ``seq2seq``'s.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from hf_models import MASK_ID, VOCAB, B, T, pad_every_other

from privlearn.torch.losses import per_sequence_cross_entropy

H = 16  # hidden size
_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _decoder_cfg(**kw):
    return dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=32, bos_token_id=0,
                eos_token_id=0, pad_token_id=0, **kw)


def _bert2bert(tf):
    """transformers' generic EncoderDecoderModel: a BertModel encoder and a BertLMHeadModel
    decoder with cross-attention."""
    bert = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=32, pad_token_id=1, **_DROP)
    config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(
        tf.BertConfig(**bert), tf.BertConfig(**bert, is_decoder=True, add_cross_attention=True))
    config.decoder_start_token_id, config.pad_token_id = 2, 1
    return tf.EncoderDecoderModel(config=config)


def _wav2vec2_bert(tf):
    """transformers' SpeechEncoderDecoderModel: a Wav2Vec2 encoder (SpecAugment off) and a
    BertLMHeadModel decoder with cross-attention."""
    encoder = _wav2vec2(tf, 0.0).config
    decoder = tf.BertConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=32, pad_token_id=1, is_decoder=True,
                            add_cross_attention=True, **_DROP)
    config = tf.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 2, 1
    return tf.SpeechEncoderDecoderModel(config=config)


def _bert_like(**kw):
    return dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=40, **_DROP, **kw)


def _wav2vec2(tf, mask_time_prob: float):
    return tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=mask_time_prob, mask_time_length=2,
        classifier_proj_size=8, num_labels=3))


ZOO = {
    "opt": ("causal", "OPTForCausalLM", lambda tf: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, ffn_dim=32,
        num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=H,
        dropout=0.0, attention_dropout=0.0, layerdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=1))),
    "gpt_neo": ("causal", "GPTNeoForCausalLM", lambda tf: tf.GPTNeoForCausalLM(
        tf.GPTNeoConfig(vocab_size=VOCAB, hidden_size=H, num_layers=2, num_heads=2,
                        attention_types=[[["global", "local"], 1]], window_size=4,
                        intermediate_size=32, max_position_embeddings=32,
                        embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
                        bos_token_id=0, eos_token_id=0))),
    "gpt_neox": ("causal", "GPTNeoXForCausalLM", lambda tf: tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(**_decoder_cfg(rotary_pct=0.5, use_parallel_residual=True,
                                        hidden_dropout=0.0, attention_dropout=0.0)))),
    "bloom": ("causal", "BloomForCausalLM", lambda tf: tf.BloomForCausalLM(tf.BloomConfig(
        vocab_size=VOCAB, hidden_size=H, n_layer=2, n_head=2, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0))),
    "falcon": ("causal", "FalconForCausalLM", lambda tf: tf.FalconForCausalLM(
        tf.FalconConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2,
                        num_attention_heads=2, num_kv_heads=1, new_decoder_architecture=True,
                        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0))),
    "falcon_alibi": ("causal", "FalconForCausalLM", lambda tf: tf.FalconForCausalLM(
        tf.FalconConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2,
                        num_attention_heads=2, multi_query=True, alibi=True, parallel_attn=True,
                        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0))),
    "mistral": ("causal", "MistralForCausalLM", lambda tf: tf.MistralForCausalLM(
        tf.MistralConfig(**_decoder_cfg(num_key_value_heads=1, sliding_window=4,
                                        head_dim=8)))),
    "qwen2": ("causal", "Qwen2ForCausalLM", lambda tf: tf.Qwen2ForCausalLM(
        tf.Qwen2Config(**_decoder_cfg(num_key_value_heads=1, tie_word_embeddings=True)))),
    "gemma": ("causal", "GemmaForCausalLM", lambda tf: tf.GemmaForCausalLM(
        tf.GemmaConfig(**_decoder_cfg(num_key_value_heads=1, head_dim=8)))),
    "gemma2": ("causal", "Gemma2ForCausalLM", lambda tf: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(**_decoder_cfg(num_key_value_heads=1, head_dim=8, sliding_window=6,
                                       final_logit_softcapping=30.0,
                                       attn_logit_softcapping=50.0)))),
    "phi": ("causal", "PhiForCausalLM", lambda tf: tf.PhiForCausalLM(tf.PhiConfig(
        **_decoder_cfg(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                       attention_dropout=0.0, qk_layernorm=True)))),
    "phi3": ("causal", "Phi3ForCausalLM", lambda tf: tf.Phi3ForCausalLM(tf.Phi3Config(
        **_decoder_cfg(num_key_value_heads=1, resid_pdrop=0.0, embd_pdrop=0.0,
                       attention_dropout=0.0)))),
    "stablelm": ("causal", "StableLmForCausalLM", lambda tf: tf.StableLmForCausalLM(
        tf.StableLmConfig(**_decoder_cfg(num_key_value_heads=1, qk_layernorm=True,
                                         partial_rotary_factor=0.5, hidden_dropout=0.0,
                                         attention_dropout=0.0)))),
    "mpt": ("causal", "MptForCausalLM", lambda tf: tf.MptForCausalLM(tf.MptConfig(
        d_model=H, n_heads=2, n_layers=2, expansion_ratio=2, max_seq_len=32,
        vocab_size=VOCAB, resid_pdrop=0.0, emb_pdrop=0.0,
        attn_config={"alibi": True, "attn_pdrop": 0}))),
    "mixtral": ("causal", "MixtralForCausalLM", lambda tf: tf.MixtralForCausalLM(
        tf.MixtralConfig(**_decoder_cfg(num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, head_dim=8,
                                        experts_implementation="eager")))),
    "gptj": ("causal", "GPTJForCausalLM", lambda tf: tf.GPTJForCausalLM(tf.GPTJConfig(
        vocab_size=VOCAB, n_embd=H, n_layer=2, n_head=2, rotary_dim=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))),
    "gpt_bigcode": ("causal", "GPTBigCodeForCausalLM", lambda tf: tf.GPTBigCodeForCausalLM(
        tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=H, n_layer=2, n_head=2, multi_query=True,
                            n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0))),
    "gemma3": ("causal", "Gemma3ForCausalLM", lambda tf: tf.Gemma3ForCausalLM(
        tf.Gemma3TextConfig(**_decoder_cfg(num_key_value_heads=1, head_dim=8,
                                           sliding_window=6)))),
    "qwen3": ("causal", "Qwen3ForCausalLM", lambda tf: tf.Qwen3ForCausalLM(
        tf.Qwen3Config(**_decoder_cfg(num_key_value_heads=1, head_dim=8)))),
    "electra_mlm": ("mlm", "ElectraForMaskedLM", lambda tf: tf.ElectraForMaskedLM(
        tf.ElectraConfig(**_bert_like(embedding_size=8)))),
    "electra_cls": ("cls", "ElectraForSequenceClassification",
                    lambda tf: tf.ElectraForSequenceClassification(
                        tf.ElectraConfig(**_bert_like(embedding_size=8, num_labels=3)))),
    "deberta_v2_mlm": ("mlm", "DebertaV2ForMaskedLM", lambda tf: tf.DebertaV2ForMaskedLM(
        tf.DebertaV2Config(**_bert_like(relative_attention=True, position_buckets=8,
                                        max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                                        position_biased_input=False)))),
    "deberta_v2_cls": ("cls", "DebertaV2ForSequenceClassification",
                       lambda tf: tf.DebertaV2ForSequenceClassification(tf.DebertaV2Config(
                           **_bert_like(relative_attention=True, position_buckets=8,
                                        max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                                        pooler_dropout=0.0, num_labels=3)))),
    "xlm_roberta_mlm": ("mlm", "XLMRobertaForMaskedLM", lambda tf: tf.XLMRobertaForMaskedLM(
        tf.XLMRobertaConfig(**_bert_like()))),
    "mobilebert_mlm": ("mlm", "MobileBertForMaskedLM", lambda tf: tf.MobileBertForMaskedLM(
        tf.MobileBertConfig(**_bert_like(embedding_size=8, intra_bottleneck_size=8,
                                         true_hidden_size=8, num_feedforward_networks=2)))),
    "convbert_mlm": ("mlm", "ConvBertForMaskedLM", lambda tf: tf.ConvBertForMaskedLM(
        tf.ConvBertConfig(**_bert_like(embedding_size=16, conv_kernel_size=3,
                                       head_ratio=2, num_groups=2)))),
    "deit": ("image", "DeiTForImageClassification", lambda tf: tf.DeiTForImageClassification(
        tf.DeiTConfig(image_size=16, patch_size=8, hidden_size=H, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=32, num_labels=3, **_DROP))),
    "dinov2": ("image", "Dinov2ForImageClassification",
               lambda tf: tf.Dinov2ForImageClassification(tf.Dinov2Config(
                   image_size=16, patch_size=8, hidden_size=H, num_hidden_layers=2,
                   num_attention_heads=2, mlp_ratio=2, layerscale_value=0.5,
                   drop_path_rate=0.0, num_labels=3, **_DROP))),
    "clip_vision": ("image", "CLIPForImageClassification",
                    lambda tf: tf.CLIPForImageClassification(tf.CLIPConfig(
                        text_config=dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2),
                        vision_config=dict(image_size=16, patch_size=8, hidden_size=H,
                                           intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2),
                        num_labels=3))),
    "beit": ("image", "BeitForImageClassification", lambda tf: tf.BeitForImageClassification(
        tf.BeitConfig(image_size=16, patch_size=8, hidden_size=H, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=32, use_relative_position_bias=True,
                      layer_scale_init_value=0.5, drop_path_rate=0.0, num_labels=3, **_DROP))),
    "swin": ("image", "SwinForImageClassification", lambda tf: tf.SwinForImageClassification(
        tf.SwinConfig(image_size=16, patch_size=2, embed_dim=8, depths=[2, 1],
                      num_heads=[2, 2], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=3))),
    "convnext": ("image", "ConvNextForImageClassification",
                 lambda tf: tf.ConvNextForImageClassification(tf.ConvNextConfig(
                     num_channels=3, patch_size=4, hidden_sizes=[8, 16], depths=[1, 1],
                     num_stages=2, drop_path_rate=0.0, layer_scale_init_value=0.5, num_labels=3))),
    "wav2vec2": ("audio", "Wav2Vec2ForSequenceClassification", lambda tf: _wav2vec2(tf, 0.0)),
    # SpecAugment on, as Wav2Vec2Config has it by default
    "wav2vec2_specaugment": ("audio", "Wav2Vec2ForSequenceClassification",
                             lambda tf: _wav2vec2(tf, 0.05)),
    "whisper_enc": ("features", "WhisperForAudioClassification",
                    lambda tf: tf.WhisperForAudioClassification(tf.WhisperConfig(
                        vocab_size=VOCAB, num_mel_bins=8, d_model=H, encoder_layers=2,
                        encoder_attention_heads=2, decoder_layers=1, decoder_attention_heads=2,
                        encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        encoder_layerdrop=0.0, classifier_proj_size=8, num_labels=3))),
    "bart": ("seq2seq", "BartForConditionalGeneration",
             lambda tf: tf.BartForConditionalGeneration(tf.BartConfig(
                 vocab_size=VOCAB, d_model=H, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                 decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                 decoder_layerdrop=0.0, scale_embedding=True, pad_token_id=1, bos_token_id=0,
                 eos_token_id=2,
                 decoder_start_token_id=2))),
    # learned positions offset by 2 (as BART's), pre-norm layers, the language id wrapped
    # to the front of the decoder's inputs
    "mbart": ("seq2seq", "MBartForConditionalGeneration",
              lambda tf: tf.MBartForConditionalGeneration(tf.MBartConfig(
                  vocab_size=VOCAB, d_model=H, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                  decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
                  attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                  decoder_layerdrop=0.0, scale_embedding=True, pad_token_id=1,
                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))),
    # sinusoidal positions (not trained), a final logits bias buffer
    "marian": ("seq2seq", "MarianMTModel", lambda tf: tf.MarianMTModel(tf.MarianConfig(
        vocab_size=VOCAB, d_model=H, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        pad_token_id=1, eos_token_id=2, decoder_start_token_id=1))),
    "whisper": ("seq2seq_audio", "WhisperForConditionalGeneration",
                lambda tf: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
                    vocab_size=VOCAB, num_mel_bins=8, d_model=H, encoder_layers=2,
                    encoder_attention_heads=2, decoder_layers=2, decoder_attention_heads=2,
                    encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
                    max_target_positions=16, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    decoder_start_token_id=1))),
    "bert2bert": ("seq2seq", "EncoderDecoderModel", _bert2bert),
    "wav2vec2_bert": ("seq2seq_wave", "SpeechEncoderDecoderModel", _wav2vec2_bert),
    "t5": ("seq2seq", "T5ForConditionalGeneration", lambda tf: tf.T5ForConditionalGeneration(
        tf.T5Config(vocab_size=VOCAB, d_model=H, d_kv=8, d_ff=32, num_layers=2,
                    num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                    relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
                    eos_token_id=1, decoder_start_token_id=0))),
}

#: LoRA (peft) on models of the zoo: the target modules' names in each (the adapters
#: alone train: T5's relative attention bias and BART's positions stay frozen)
LORA = {"mistral_lora": ("mistral", ["q_proj", "v_proj", "o_proj"]),
        "gpt_neox_lora": ("gpt_neox", ["query_key_value", "dense"]),
        "phi3_lora": ("phi3", ["qkv_proj", "gate_up_proj"]),
        "t5_lora": ("t5", ["q", "v"]),
        "bart_lora": ("bart", ["q_proj", "v_proj"]),
        # fc1 and fc2 run on each example's tokens flattened into rows of their own
        "opt_lora": ("opt", ["q_proj", "v_proj", "fc1", "fc2"])}


#: models with the tables they compute once for the whole batch frozen
#: (what the refusal of the trainable ones advises): ``variant -> (model, frozen names)``
FROZEN = {"bart_frozen_positions": ("bart", "embed_positions"),
          "t5_frozen_bias": ("t5", "relative_attention_bias"),
          "beit_frozen_bias": ("beit", "relative_position_bias"),
          # and its attention's query, key and value run on windows, (B * windows, ...)
          "swin_frozen_bias": ("swin", "relative_position_bias_table")}


def base_of(name: str) -> str:
    return LORA[name][0] if name in LORA else FROZEN[name][0] if name in FROZEN else name


def kind(name: str) -> str:
    return ZOO[base_of(name)][0]


def build(name: str, dtype=torch.float64, seed: int = 0):
    """The zoo's model ``name`` (skipping the test where the installed transformers lacks
    its class), initialised from ``seed``, with non-trivial norm weights and biases, in
    ``dtype`` and training mode."""
    import pytest

    tf = pytest.importorskip("transformers")
    base = base_of(name)
    cls = ZOO[base][1]
    if not hasattr(tf, cls):
        pytest.skip(f"transformers {tf.__version__} has no {cls}")
    torch.manual_seed(seed)
    model = ZOO[base][2](tf)
    with torch.no_grad():  # norms, biases and layer scales off their initial values
        for n, p in model.named_parameters():
            low = n.lower()
            if p.dim() <= 1 or "norm" in low or "scale" in low or "bias" in low:
                p.add_(0.1 * torch.randn_like(p))
    if name in LORA:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=LORA[name][1], lora_dropout=0.0))
        with torch.no_grad():  # LoRA B starts at zero: move it so every factor matters
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    if name in FROZEN:
        for n, p in model.named_parameters():
            if FROZEN[name][1] in n:
                p.requires_grad_(False)
    model = model.to(dtype)
    model.train()
    return model


def make_batch(name: str, b: int = B, t: int = T, seed: int = 1, dtype=torch.float64):
    """``(inputs, labels)`` of ``b`` examples for the zoo's model ``name``."""
    g = torch.Generator().manual_seed(seed)
    k = kind(name)
    if k == "image":
        return ({"pixel_values": torch.randn(b, 3, 16, 16, generator=g, dtype=dtype)},
                torch.randint(0, 3, (b,), generator=g))
    if k == "audio":
        return ({"input_values": torch.randn(b, 400, generator=g, dtype=dtype)},
                torch.randint(0, 3, (b,), generator=g))
    if k == "seq2seq_audio":
        target = torch.randint(3, VOCAB - 1, (b, t - 2), generator=g)
        dec = torch.cat([torch.full((b, 1), 1), target[:, :-1]], dim=1)
        return ({"input_features": torch.randn(b, 8, 16, generator=g, dtype=dtype),
                 "decoder_input_ids": dec}, target)
    if k == "seq2seq_wave":
        target = torch.randint(3, VOCAB - 1, (b, t - 2), generator=g)
        dec = torch.cat([torch.full((b, 1), 2), target[:, :-1]], dim=1)
        return ({"input_values": torch.randn(b, 400, generator=g, dtype=dtype),
                 "decoder_input_ids": dec}, target)
    if k == "features":
        return ({"input_features": torch.randn(b, 8, 16, generator=g, dtype=dtype)},
                torch.randint(0, 3, (b,), generator=g))
    ids = torch.randint(3, VOCAB - 1, (b, t), generator=g)
    mask = pad_every_other(ids)
    if k == "cls":
        return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (b,), generator=g)
    if k == "mlm":
        picked = (torch.rand(b, t, generator=g) < 0.35) & (mask == 1)
        picked[:, 0] |= mask[:, 0] == 1
        labels = ids.masked_fill(~picked, -100)
        return {"input_ids": ids.masked_fill(picked, MASK_ID), "attention_mask": mask}, labels
    if k == "seq2seq":
        target = torch.randint(3, VOCAB - 1, (b, t - 2), generator=g)
        dec = torch.cat([torch.full((b, 1), 2), target[:, :-1]], dim=1)
        return ({"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, target)
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


def loss_of(name: str, out, labels, reduction: str = "mean"):
    logits = out.logits
    if logits.dim() == 3:
        return per_sequence_cross_entropy(logits, labels, shift=kind(name) == "causal",
                                          reduction=reduction)
    return F.cross_entropy(logits.float() if logits.dtype in (torch.bfloat16, torch.float16)
                           else logits, labels, reduction=reduction)


def naive_grads(oracle, name, model, inputs, labels, autocast=None):
    """Per-example gradients ``(B, P)`` (float64) by the batch-of-one loop on a copy."""
    model = copy.deepcopy(model)

    def loss(i):
        return loss_of(name, model(**{k: v[i:i + 1] for k, v in inputs.items()}),
                       labels[i:i + 1])

    return oracle.grads(loss, labels.shape[0], oracle.trainable(model), autocast=autocast)

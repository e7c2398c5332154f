"""More of the model families people train, beyond ``tiny_models.MODELS``, from tiny Hugging
Face configs (nothing downloaded; float64): decoder LMs of the Llama line (Qwen2, Qwen3,
Mistral, Gemma 1/2/3, Phi-3, StableLM, Granite, Cohere, Starcoder2) and of the GPT line
(GPT-Neo, GPT-J, GPT-NeoX, GPT-BigCode, OPT, BLOOM, Phi, Falcon, whose linear layers compute
``x @ self.weight.T``), mixtures of experts (Qwen2-MoE with its shared expert, OLMoE,
Qwen3-MoE, GPT-OSS, Llama 4 with one matrix per expert, DeepSeek-V3 with its latent
attention), state-space and recurrent models (Mamba, Mamba 2: weights read through views,
``W @ x``; Jamba and Zamba, hybrids of attention and Mamba; RWKV), encoders (RoBERTa,
DeBERTa-v2, ModernBERT, XLNet, whose projections are ``einsum``s, DistilBERT, ELECTRA, ALBERT,
whose one layer is shared by every block), encoder-decoders (BART, Pegasus, whose sinusoidal
positions are a frozen parameter, mT5, Whisper on log-mel features) and vision models (DeiT,
DINOv2, Swin, SegFormer, ConvNeXt, RegNet, EfficientNet, whose convolutions are padded
"same", ResNet). Some tie their embeddings (Gemma, Cohere, OPT, BLOOM, ...), as the library
builds them by default.

``TABLE`` maps each name to its config; ``case(name)`` is a ``tiny_models.Case`` cut at its
blocks: the middle block for 2 stages, the quarter points for 4."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tiny_models as tm
import torch
import user_models as um
from torch import nn
from torch.nn import functional as fn

V, S, C = tm.VOCAB, tm.SEQ, tm.CLASSES
DEC = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
           num_attention_heads=2, max_position_embeddings=2 * S)
GQA = dict(DEC, num_key_value_heads=1)
ENC = dict(vocab_size=V, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
           intermediate_size=32, max_position_embeddings=2 * S + 2, hidden_dropout_prob=0.0,
           attention_probs_dropout_prob=0.0)
VIS = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=4,
           num_attention_heads=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
GPT = dict(vocab_size=V, n_embd=16, n_layer=4, n_head=2, n_positions=2 * S, resid_pdrop=0.0,
           embd_pdrop=0.0, attn_pdrop=0.0)
NO_DROP = dict(hidden_dropout=0.0, attention_dropout=0.0)
BART = dict(vocab_size=V, d_model=16, encoder_layers=4, decoder_layers=4,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=2 * S, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0)
MOE = dict(GQA, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
           tie_word_embeddings=False)

Batch = Callable[[int, int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
MELS, FRAMES = 8, 16
SAMPLES = 400
"""A clip's raw samples (the speech encoders' convolutions take 320 per frame)."""
"""Whisper's log-mel features: bins and frames (twice its encoder's positions)."""


def speech(step: int, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Log-mel features and the decoder's tokens, the target its next tokens."""
    gen = torch.Generator().manual_seed(800 + step)
    feats = torch.randn(n, MELS, FRAMES, generator=gen, dtype=torch.float64)
    dec = torch.randint(0, V, (n, S + 1), generator=gen)
    return (feats, dec[:, :-1]), dec[:, 1:]


def waveforms(step: int, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Raw audio of ``SAMPLES`` samples, a class per clip."""
    gen = torch.Generator().manual_seed(900 + step)
    x = torch.randn(n, SAMPLES, generator=gen, dtype=torch.float64)
    return (x,), torch.randint(0, C, (n,), generator=gen)


KINDS: dict[str, tuple[str, tuple[str, ...], dict[str, Any], Batch, Callable[..., Any]]] = {
    "lm": ("ForCausalLM", ("input_ids",), {"use_cache": False}, tm.lm, um.lm_loss),
    "classes": ("ForSequenceClassification", ("input_ids",), {}, tm.classes_of_tokens,
                fn.cross_entropy),
    "images": ("ForImageClassification", ("pixel_values",), {}, tm.images, fn.cross_entropy),
    "seq2seq": ("ForConditionalGeneration", ("input_ids", "decoder_input_ids"),
                {"use_cache": False}, tm.seq2seq, um.lm_loss),
    "speech2text": ("ForConditionalGeneration", ("input_features", "decoder_input_ids"),
                    {"use_cache": False}, speech, um.lm_loss),
    "audio": ("ForSequenceClassification", ("input_values",), {}, waveforms, fn.cross_entropy),
}
"""Kind of model -> (class suffix, its positional inputs, fixed keywords, batch, loss)."""


def big_images(step: int, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Images of 32 x 32, for the models that downsample four times."""
    gen = torch.Generator().manual_seed(600 + step)
    x = torch.randn(n, 3, 32, 32, generator=gen, dtype=torch.float64)
    return (x,), torch.randint(0, C, (n,), generator=gen)


AUDIO = dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
             conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
             attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
             final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, classifier_proj_size=8)
"""A speech encoder's: no layer drop nor time masking (random in training)."""
TABLE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2", "lm", dict(GQA, tie_word_embeddings=False)),
    "qwen3": ("Qwen3", "lm", dict(GQA, head_dim=8, tie_word_embeddings=False)),
    "mistral": ("Mistral", "lm", dict(GQA, tie_word_embeddings=False)),
    "gemma": ("Gemma", "lm", dict(GQA, head_dim=8)),
    "gemma2": ("Gemma2", "lm", dict(GQA, head_dim=8)),
    "gemma3": ("Gemma3Text/Gemma3", "lm", dict(GQA, head_dim=8, sliding_window=4,
                                               layer_types=["sliding_attention",
                                                            "full_attention"] * 2)),
    "phi3": ("Phi3", "lm", dict(GQA, pad_token_id=0, tie_word_embeddings=False)),
    "stablelm": ("StableLm", "lm", dict(GQA, tie_word_embeddings=False)),
    "granite": ("Granite", "lm", dict(GQA, tie_word_embeddings=False)),
    "cohere": ("Cohere", "lm", dict(GQA, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "starcoder2": ("Starcoder2", "lm", dict(GQA, residual_dropout=0.0, embedding_dropout=0.0,
                                            attention_dropout=0.0, tie_word_embeddings=False)),
    "phi": ("Phi", "lm", dict(DEC, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                              tie_word_embeddings=False)),
    "falcon": ("Falcon", "lm", dict(vocab_size=V, hidden_size=16, num_hidden_layers=4,
                                    num_attention_heads=2, **NO_DROP)),
    "gpt-neo": ("GPTNeo", "lm", dict(vocab_size=V, hidden_size=16, num_layers=4, num_heads=2,
                                     attention_types=[[["global", "local"], 2]], window_size=4,
                                     max_position_embeddings=2 * S, embed_dropout=0.0,
                                     attention_dropout=0.0, resid_dropout=0.0)),
    "gpt-j": ("GPTJ", "lm", dict(GPT, rotary_dim=4, tie_word_embeddings=False)),
    "gpt-neox": ("GPTNeoX", "lm", dict(DEC, tie_word_embeddings=False, **NO_DROP)),
    "gpt-bigcode": ("GPTBigCode", "lm", GPT),
    "opt": ("OPT", "lm", dict(vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=4,
                              num_attention_heads=2, max_position_embeddings=2 * S,
                              word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0)),
    "bloom": ("Bloom", "lm", dict(vocab_size=V, hidden_size=16, n_layer=4, n_head=2,
                                  **NO_DROP)),
    "qwen2-moe": ("Qwen2Moe", "lm", dict(MOE, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16)),
    "olmoe": ("Olmoe", "lm", MOE),
    "qwen3-moe": ("Qwen3Moe", "lm", dict(MOE, head_dim=8, moe_intermediate_size=16)),
    "gpt-oss": ("GptOss", "lm", dict(MOE, head_dim=8, num_local_experts=4, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"] * 2)),
    "llama4": ("Llama4Text/Llama4", "lm", dict(  # experts: bmm(x, self.gate_up_proj)
        MOE, head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=32,
        interleave_moe_layer_step=1, attn_temperature_tuning=False)),
    "deepseek-v3": ("DeepseekV3", "lm", dict(  # latent attention: as many kv heads as heads
        MOE, num_key_value_heads=2, moe_intermediate_size=16, n_routed_experts=4,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)),
    "jamba": ("Jamba", "lm", dict(  # attention, Mamba and experts in alternating layers
        GQA, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
        mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
        router_aux_loss_coef=0.0, tie_word_embeddings=False)),
    "zamba": ("Zamba", "lm", dict(  # per-head weights broadcast over the batch
        GQA, num_key_value_heads=2, attention_hidden_size=32, attn_layer_period=2,
        attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4,
        n_mamba_heads=1, use_mamba_kernels=False, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, tie_word_embeddings=False)),
    "rwkv": ("Rwkv", "lm", dict(vocab_size=V, context_length=2 * S, hidden_size=16,
                                num_hidden_layers=4, attention_hidden_size=16,
                                intermediate_size=32, tie_word_embeddings=False)),
    "mamba": ("Mamba", "lm", dict(vocab_size=V, hidden_size=16, state_size=4,
                                  num_hidden_layers=4, expand=2, conv_kernel=2)),
    "mamba2": ("Mamba2", "lm", dict(vocab_size=V, hidden_size=16, state_size=4,
                                    num_hidden_layers=4, expand=2, conv_kernel=2, num_heads=4,
                                    head_dim=8, n_groups=1, chunk_size=4)),
    "roberta": ("Roberta", "classes", ENC),
    "xlnet": ("XLNet", "classes", dict(vocab_size=V, d_model=16, n_layer=4, n_head=2,  # einsum
                                       d_inner=32, dropout=0.0, summary_last_dropout=0.0,
                                       pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "deberta-v2": ("DebertaV2", "classes", dict(ENC, pooler_dropout=0.0)),
    "modernbert": ("ModernBert", "classes", dict(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, max_position_embeddings=2 * S, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, cls_token_id=0, sep_token_id=0, global_attn_every_n_layers=2,
        local_attention=4, reference_compile=False)),
    "electra": ("Electra", "classes", dict(ENC, embedding_size=16)),
    "albert": ("Albert", "classes", dict(ENC, embedding_size=8, classifier_dropout_prob=0.0)),
    "distilbert": ("DistilBert", "classes", dict(vocab_size=V, dim=16, n_layers=4, n_heads=2,
                                                 hidden_dim=32, max_position_embeddings=2 * S,
                                                 dropout=0.0, attention_dropout=0.0,
                                                 seq_classif_dropout=0.0)),
    "bart": ("Bart", "seq2seq", BART),
    "pegasus": ("Pegasus", "seq2seq", BART),  # sinusoidal positions: a frozen parameter
    "wav2vec2": ("Wav2Vec2", "audio", AUDIO),  # weight-normed positional convolution
    "hubert": ("Hubert", "audio", AUDIO),
    "whisper": ("Whisper", "speech2text", dict(
        vocab_size=V, num_mel_bins=MELS, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, d_model=16, max_source_positions=FRAMES // 2,
        max_target_positions=2 * S, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None)),
    "mt5": ("MT5", "seq2seq", dict(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=4,
                                   num_decoder_layers=4, num_heads=2, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0,
                                   tie_word_embeddings=False)),
    "deit": ("DeiT", "images", dict(VIS, intermediate_size=32)),
    "dinov2": ("Dinov2", "images", dict(VIS, mlp_ratio=2)),
    "swin": ("Swin", "images", dict(image_size=32, patch_size=2, num_channels=3, embed_dim=8,
                                    depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 2], window_size=2,
                                    drop_path_rate=0.0, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)),
    "convnext": ("ConvNext", "images", dict(num_channels=3, hidden_sizes=[8, 16, 16, 16],
                                            depths=[1, 1, 1, 1], drop_path_rate=0.0)),
    "segformer": ("Segformer", "images", dict(
        num_channels=3, num_encoder_blocks=4, depths=[1, 1, 1, 1], sr_ratios=[2, 2, 1, 1],
        hidden_sizes=[8, 16, 16, 16], num_attention_heads=[1, 2, 2, 2], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, drop_path_rate=0.0, decoder_hidden_size=16)),
    "regnet": ("RegNet", "images", dict(num_channels=3, embedding_size=8, groups_width=8,
                                        hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1])),
    "efficientnet": ("EfficientNet", "images", dict(  # convolutions padded "same"
        num_channels=3, image_size=32, width_coefficient=1.0, depth_coefficient=0.25,
        hidden_dim=1280, dropout_rate=0.0, drop_connect_rate=0.0, initializer_range=0.2)),
    "resnet": ("ResNet", "images", dict(num_channels=3, embedding_size=8, layer_type="basic",
                                        hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1])),
}
"""Name -> (Hugging Face model prefix, kind, config keywords); the prefix is ``config/model``
where they differ (``Llama4Text/Llama4``: a ``Llama4TextConfig`` builds a
``Llama4ForCausalLM``)."""

FLOAT32_INSIDE = {"mamba", "mamba2"}
"""Models that compute in float32 whatever their parameters' dtype (Mamba's state-space scan
casts to float32, and its logits come out float32): trained in another order than one
device, they agree to float32's rounding, not float64's."""


def rtol(name: str) -> float:
    """The relative error within which the family ``name`` trains like one device."""
    return 1e-6 if name in FLOAT32_INSIDE else 1e-9


GROUPED_EXPERTS = {"qwen2-moe", "olmoe", "qwen3-moe", "gpt-oss", "deepseek-v3", "jamba"}
"""Mixtures of experts in Hugging Face's default ``grouped_mm`` form (one process runs their
float64 reference as ``batched_mm``)."""
BIG_IMAGES = {"swin", "convnext", "resnet", "segformer", "regnet", "efficientnet"}
HYBRID_LAYERS = {"jamba", "zamba"}
"""Models whose layers are of two types (attention, Mamba): cut at the same indices."""
UNUSED = {"xlnet": ("mask_emb", "r_s_bias", "seg_embed")}
"""Parameters the forward never reads (no token types here, no masked positions): frozen, as
a fine-tune would leave them, so every trained parameter has a gradient to compare."""
SHARED_LAYERS = {"albert": ("model.albert.encoder", "model.albert.pooler", "model.classifier")}
"""Models whose one block serves every layer: cut around it (embeddings, blocks, head)."""


def builder(name: str) -> Callable[[], nn.Module]:
    """The model ``name`` as ``inputs -> logits``, in float64."""
    prefix, kind, kw = TABLE[name]

    def build() -> nn.Module:
        import transformers

        suffix, names, fixed, _, _ = KINDS[kind]
        extra = {"num_labels": C} if kind in ("classes", "images", "audio") else {}
        config_prefix, _, model_prefix = prefix.partition("/")
        cfg = getattr(transformers, f"{config_prefix}Config")(**kw, **extra)
        model = getattr(transformers, f"{model_prefix or config_prefix}{suffix}")(cfg)
        for key, p in model.named_parameters():
            if any(part in key for part in UNUSED.get(name, ())):
                p.requires_grad_(False)
        return tm.Logits(model, *names, **fixed).double()

    return build


def layer_list(model: nn.Module) -> str:
    """The name of the model's first list of at least 4 blocks of one type."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 4 \
                and len({type(m) for m in mod}) == 1:
            return name
    raise LookupError(f"{type(model).__name__} has no list of blocks")


def case(name: str) -> tm.Case:
    """Model ``name`` as a ``tiny_models.Case`` cut at its blocks."""
    build = builder(name)
    _, kind, _ = TABLE[name]
    _, _, _, batch, loss = KINDS[kind]
    batch = big_images if name in BIG_IMAGES else batch
    eager = tm.batched_experts if name in GROUPED_EXPERTS else (lambda model: None)
    if name in SHARED_LAYERS:
        points = SHARED_LAYERS[name]
        return tm.Case(build, batch, loss, points[:1], points, eager)
    base = "model.model.layers" if name in HYBRID_LAYERS else layer_list(build())
    quarters = tuple(f"{base}.{i}" for i in (1, 2, 3))
    return tm.Case(build, batch, loss, quarters[1:2], quarters, eager)


def register(names: tuple[str, ...]) -> None:
    """Add the families ``names`` to ``tiny_models.MODELS`` (as ``test_wgrad_models`` and the
    benchmarks look models up there)."""
    tm.MODELS.update((name, case(name)) for name in names if name not in tm.MODELS)

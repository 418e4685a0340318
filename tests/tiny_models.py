"""Tiny random-init checkpoints of every family, written by transformers' save_pretrained.

transformers is the oracle here and in the tests only. Each config keeps its family's
quirks at a small size: Llama 3 rope scaling, Qwen2 qkv bias with tied embeddings,
Qwen3 qk-norm, Gemma's decoupled head_dim, Gemma 2's softcaps and a sliding window
shorter than the test sequence, Gemma 3's local/global layers with two rope bases.
"""
import os

import torch

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             initializer_range=0.15)  # larger than the default 0.02, so softcaps and norms saturate


def hf_config(family):
    import transformers as tf
    if family == "llama":  # Llama 3.x: rope_scaling type llama3, untied
        return tf.LlamaConfig(**SMALL, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16), tie_word_embeddings=False)
    if family == "tinyllama":  # TinyLlama quirks: 32 heads / 4 kv heads ratio, eps 1e-5, untied
        return tf.LlamaConfig(**{**SMALL, "num_attention_heads": 8, "num_key_value_heads": 1},
                              rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**SMALL, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True)
    if family == "gemma":
        return tf.GemmaConfig(**SMALL, head_dim=24)
    if family == "gemma2":
        return tf.Gemma2Config(**SMALL, head_dim=24, sliding_window=8, query_pre_attn_scalar=20,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 3}, head_dim=24, sliding_window=8,
                                   query_pre_attn_scalar=20,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1000000.0}})
    raise KeyError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]


def hf_model(family, seed=0):
    import transformers as tf
    torch.manual_seed(seed)
    cfg = hf_config(family)
    cfg._attn_implementation = "eager"  # the exact reference (sdpa drops Gemma 2's softcap)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    # Random init leaves norms at 1 (or 0 for Gemma's 1+w); perturb them so they are tested.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_tiny(family, folder, seed=0, sharded=False):
    """Save a tiny random model of `family` to `folder`; returns the transformers model."""
    model = hf_model(family, seed)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB" if sharded else "5GB")
    return model


def make_run_folder(folder, family="llama", seed=0, chat_template=True):
    """A complete tiny model folder (weights + tokenizer) that train.py can run on."""
    import transformers as tf

    from tests.tiny_tokenizer import CHATML, make_test_tokenizer
    make_test_tokenizer(folder, chat_template=CHATML if chat_template else None)
    with open(os.path.join(folder, "tokenizer.json")) as f:
        vocab = len(__import__("json").load(f)["model"]["vocab"])
    torch.manual_seed(seed)
    cfg = hf_config(family)
    cfg.vocab_size = max(vocab, 400)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    model = tf.AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(folder, safe_serialization=True)
    return folder

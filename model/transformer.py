"""One decoder-only transformer for the Llama, Qwen2/3 and Gemma 1/2/3 families.

References: Llama (Touvron et al. 2023), Qwen2/Qwen3 technical reports, Gemma 1/2/3
reports, and Hugging Face transformers' modeling_{llama,qwen2,qwen3,gemma,gemma2,gemma3}.py,
whose parameter names this module keeps so that checkpoints load without renaming.

Families differ only through `ModelConfig` fields (norm_offset, norm_cast,
embed_scale, act, qkv_bias, qk_norm, sandwich_norm, attn_scale, attn_softcap,
final_softcap, sliding_window, layer_types, tie_embeddings). Nothing here reads a
family name.

Packed sequences: `forward` takes `position_ids` [B, T] (restarting at 0 for every
document) and `doc_ids` [B, T] (the document index of every token). A query attends
only to earlier keys of the same document (and, on sliding layers, within the window).
Every token can see itself, so no softmax row is ever fully masked: padding is given a
document id of its own and never produces NaN.
"""
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from kernels.geglu import geglu
from kernels.references import (fused_linear_cross_entropy_reference, geglu_reference, rms_norm_reference,
                                rope_reference, swiglu_reference)
from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope
from kernels.swiglu import swiglu
from model.config import ModelConfig
from model.lora import LoRAConfig, fusable, lora_mlp, lora_projections, make_glu, make_linear


class Ops:
    """The numerical building blocks, Triton or pure torch. Chosen once, when the model is built."""

    def __init__(self, use_kernels: bool, fused_lora: bool = True):
        self.use_kernels = use_kernels
        self.fused_lora = fused_lora  # projections through model/lora.py's fused autograd Functions
        self.rms_norm = rms_norm if use_kernels else rms_norm_reference
        self.rope = apply_rope if use_kernels else rope_reference
        self.swiglu = swiglu if use_kernels else swiglu_reference
        self.geglu = geglu if use_kernels else geglu_reference
        self.linear_cross_entropy = (fused_linear_cross_entropy if use_kernels
                                     else fused_linear_cross_entropy_reference)


class RMSNorm(nn.Module):
    def __init__(self, dim, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.offset, self.cast, self.ops = cfg.rms_eps, cfg.norm_offset, cfg.norm_cast, ops

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, eps=self.eps, offset=self.offset, cast=self.cast)


# ----------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig, layer_type: str, device) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for one layer type, with llama3 / linear scaling."""
    d = cfg.head_dim
    local = layer_type == "sliding" and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    sc = None if local else cfg.rope_scaling  # Gemma 3's local layers are never scaled
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / sc["factor"]
    # llama3: leave high frequencies, divide low ones by `factor`, interpolate in between.
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(position_ids, inv_freq, dtype):
    """cos, sin [B, T, head_dim] for any positions (HF layout: the half-frequencies repeated)."""
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, D/2), fp32 like the reference
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ----------------------------------------------------------------------------- attention

def attention_mask(doc_ids, window):
    """Boolean [B, 1, T, T]: causal, same document, and (if window) distance < window."""
    T = doc_ids.shape[1]
    i = torch.arange(T, device=doc_ids.device)
    keep = i[None, :] <= i[:, None]  # (T, T) causal
    if window is not None:
        keep = keep & (i[:, None] - i[None, :] < window)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (keep & same_doc)[:, None]


def flex_block_mask(doc_ids, window):
    """The same mask as `attention_mask`, as a FlexAttention BlockMask: O(T) memory, and blocks
    that are fully masked (other documents, outside the window) are skipped, not computed."""
    B, T = doc_ids.shape

    def keep(b, h, q, kv):
        ok = (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv])
        return ok & (q - kv < window) if window is not None else ok

    return create_block_mask(keep, B, None, T, T, device=doc_ids.device)


# FlexAttention is fast only when compiled: one fused kernel for any mask and score_mod.
_flex_attention = torch.compile(flex_attention, dynamic=False)

# SDPA backends in the order tried (the first that supports the inputs runs). torch 2.11 picks
# cuDNN first on H100, whose every call with a mask costs about 2.7 ms of CPU time (measured,
# docs/perf-notes.md): padded batches ran 2x slower with it. Flash takes plain causal attention,
# memory-efficient attention a dense mask. (On full 2048-token causal rows flash and cuDNN measured
# within 20% of each other, either way depending on model and run: docs/benchmarks.md, section 7.)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                 SDPBackend.MATH]


def attend(q, k, v, mask, scale, softcap):
    """Softmax attention. q (B, Hq, T, D); k, v (B, Hk, T, D).

    mask: None (plain causal), a bool (B, 1, T, T) tensor, or a FlexAttention BlockMask (GPU).
    SDPA is used wherever it is exact. Softcapping (Gemma 2) is a non-linearity on the scores
    that SDPA cannot express (transformers' sdpa path silently drops it; this one never does),
    so those scores are computed explicitly.
    """
    if isinstance(mask, BlockMask):
        return _flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    if softcap is None and mask is None:
        with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]  # the kernels that take a mask do not take grouped kv heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if softcap is None:
        with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, T, T)
    s = softcap * torch.tanh(s / softcap)
    if mask is None:
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: Ops, lora: LoRAConfig | None):
        super().__init__()
        H, nh, nkv, d = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = make_linear(H, nh * d, cfg.qkv_bias, "q_proj", lora)
        self.k_proj = make_linear(H, nkv * d, cfg.qkv_bias, "k_proj", lora)
        self.v_proj = make_linear(H, nkv * d, cfg.qkv_bias, "v_proj", lora)
        self.o_proj = make_linear(nh * d, H, cfg.o_bias, "o_proj", lora)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg, ops)
            self.k_norm = RMSNorm(d, cfg, ops)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else d ** -0.5
        self.softcap = cfg.attn_softcap
        self.ops = ops

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        fused = self.ops.fused_lora and fusable(qkv + (self.o_proj,))
        q, k, v = lora_projections(x, qkv) if fused else (p(x) for p in qkv)
        q = q.view(B, T, self.nh, self.d)
        k = k.view(B, T, self.nkv, self.d)
        v = v.view(B, T, self.nkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope(q, k, cos, sin)  # (B, T, nh, d), (B, T, nkv, d)
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale, self.softcap)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.d)
        return lora_projections(y, (self.o_proj,))[0] if fused else self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, lora: LoRAConfig | None):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = make_linear(H, I, cfg.mlp_bias, "gate_proj", lora)
        self.up_proj = make_linear(H, I, cfg.mlp_bias, "up_proj", lora)
        self.down_proj = make_linear(I, H, cfg.mlp_bias, "down_proj", lora)
        self.act = cfg.act
        self.ops = ops
        self.glu = make_glu(cfg.act, ops.use_kernels)  # forward/backward pair for the fused path

    def forward(self, x):
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if self.ops.fused_lora and fusable(projs):
            return lora_mlp(x, projs, self.glu)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act == "silu":
            h = self.ops.swiglu(gate, up)
        else:
            h = self.ops.geglu(gate, up, approximate="tanh" if self.act == "gelu_tanh" else "none")
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: Ops, lora: LoRAConfig | None):
        super().__init__()
        H = cfg.hidden_size
        self.layer_type = cfg.layer_types[layer_idx]
        self.self_attn = Attention(cfg, layer_idx, ops, lora)
        self.mlp = MLP(cfg, ops, lora)
        self.input_layernorm = RMSNorm(H, cfg, ops)
        self.post_attention_layernorm = RMSNorm(H, cfg, ops)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:  # Gemma 2/3: post_attention_layernorm normalizes the attention output
            self.pre_feedforward_layernorm = RMSNorm(H, cfg, ops)
            self.post_feedforward_layernorm = RMSNorm(H, cfg, ops)

    def forward(self, x, cos, sin, mask):
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside Transformer so parameter names match HF checkpoints."""

    def __init__(self, cfg: ModelConfig, ops: Ops, lora: LoRAConfig | None):
        super().__init__()
        # As in the reference, the pad token's row receives no gradient (when embeddings are trained).
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, lora) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg, ops)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None = None, use_kernels: bool = False,
                 fused_lora: bool = True):
        super().__init__()
        self.config = cfg
        self.lora_config = lora  # written into adapter_config.json by model/adapters.py
        self.ops = Ops(use_kernels, fused_lora)
        self.model = Backbone(cfg, self.ops, lora)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False  # recompute each layer in backward
        self.offload_activations = False  # with checkpointing: keep layer inputs in pinned CPU memory

    def hidden_states(self, input_ids, position_ids=None, doc_ids=None):
        """Final-norm hidden states (B, T, H)."""
        cfg = self.config
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=dev).expand(B, T)
        x = self.model.embed_tokens(input_ids)  # (B, T, H)
        if cfg.embed_scale != 1.0:  # Gemma; rounded to the activation dtype as in the reference
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        tables, masks = {}, {}
        for t in set(cfg.layer_types):
            tables[t] = rope_cos_sin(position_ids, rope_inv_freq(cfg, t, dev), x.dtype)
            window = cfg.sliding_window if t == "sliding" and cfg.sliding_window is not None else None
            window = window if window is not None and window < T else None
            docs = doc_ids if doc_ids is not None else torch.zeros_like(input_ids)
            # FlexAttention for document/window masks on GPU. Not with a softcap: a softcap score_mod
            # inside gradient checkpointing fails to trace in torch 2.11 ("FX to symbolically trace a
            # dynamo-optimized function"); those layers take the explicit path below. Retry with a newer torch.
            # FlexAttention's compiled kernel works in blocks of 128 tokens: other lengths (padded
            # batches) take SDPA with a dense mask, O(T^2) bools but no O(T^2) scores.
            if (x.is_cuda and cfg.attn_softcap is None and T % 128 == 0
                    and (doc_ids is not None or window is not None)):
                masks[t] = flex_block_mask(docs, window)
            elif doc_ids is None and window is None:
                masks[t] = None  # plain causal: SDPA's fast (flash) path
            else:
                masks[t] = attention_mask(docs, window)
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        if recompute and not x.requires_grad:
            # The reentrant checkpoint builds a graph only for a layer whose input requires grad.
            x.requires_grad_()
        for layer in self.model.layers:
            cos, sin = tables[layer.layer_type]
            args = (x, cos, sin, masks[layer.layer_type])
            if recompute:
                # Reentrant: it saves a layer's inputs once. The non-reentrant checkpoint puts every
                # tensor saved inside the layer (about 40) through Python hooks, which cost ~35 ms of
                # CPU per TinyLlama step (docs/perf-notes.md): this loop is CPU-bound at batch 4.
                with torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda) if self.offload_activations else nullcontext():
                    x = checkpoint(layer, *args, use_reentrant=True)
            else:
                x = layer(*args)
        return self.model.norm(x)

    def forward(self, input_ids, position_ids=None, doc_ids=None, targets=None, num_targets=None,
                ignore_index=-100):
        """Logits (B, T, V) when `targets` is None.

        With `targets` (B, T), already shifted (targets[b, t] is the token that position t
        predicts; `ignore_index` where nothing is predicted), returns the loss
        Σ token losses / num_targets without materializing the logits. `num_targets`
        defaults to the count in this batch; the training loop passes the count of the
        whole optimizer step so that micro-batches are weighted by tokens.
        """
        h = self.hidden_states(input_ids, position_ids, doc_ids)
        cfg = self.config
        if targets is None:
            logits = self.lm_head(h)
            if cfg.final_softcap is not None:
                logits = cfg.final_softcap * torch.tanh(logits / cfg.final_softcap)
            return logits
        return self.ops.linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), self.lm_head.weight, targets.reshape(-1),
            ignore_index=ignore_index, softcap=cfg.final_softcap, reduction="mean", num_targets=num_targets)

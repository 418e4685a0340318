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
document id of its own and never produces NaN. On a GPU in fp16/bf16 the documents run through
flash attention's variable-length kernels (`Documents`, `DocumentMask`); elsewhere through a dense
boolean mask. Softcapped attention (Gemma 2) runs, with the kernels, through kernels/softcap_attention.py,
which reads each query's first visible key (`KeyRange`) instead of a mask.
"""
import math
from contextlib import nullcontext
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from kernels.references import (
    KeyRange,
    fused_linear_cross_entropy_reference,
    geglu_reference,
    key_range,
    rms_norm_and_residual_reference,
    rms_norm_reference,
    rope_qkv_reference,
    rope_reference,
    softcap_attention_reference,
    swiglu_reference,
)
from model.config import ModelConfig
from model.dora_scales import LayerScales
from model.lora import (
    GLU,
    DoRAOps,
    LoRAConfig,
    affine_forward,
    autograd_backward,
    base_sq_norms,
    compute_dtype,
    fusable,
    givable,
    lora_mlp,
    lora_projections,
    make_linear,
    output_slices,
    pack_adapters_,
    pack_weights_,
    projected,
)
from model.offload import ActivationOffload
from model.stacked import stacked, stacked_projections


class Ops:
    """The numerical building blocks, Triton or pure torch. Chosen once, when the model is built;
    the Triton kernels are imported only for a model that uses them."""

    def __init__(self, use_kernels: bool, fused_lora: bool = True):
        self.use_kernels = use_kernels
        self.fused_lora = fused_lora  # projections through model/lora.py's fused autograd Functions
        # a decoding step's kernels (`decode_attend`, `Transformer.decode_layers`)
        self.rope_into_cache = self.decode_attention = self.add_rms_norm = None
        self.fused_decode = None  # a decoding step's layers in five launches each (model/decode.py)
        self.softcap_attention = None  # softcapped attention without a (T, T) tensor (`Transformer.layer_mask`)
        self.merge_table = None  # the merged weights of every adapter in one launch (`MergedAdapters`)
        self.sample_tokens = None  # a rollout's draw of each row's token in two launches (`GroupSampler`)
        self.adapter_grads = None  # the MLP adapters' s dY B and dB from one read of [dG | dU] (`GLU`)
        self.glu_terms = None  # where the MLP adapters' products join the activation's kernels (`GLU.lowrank`)
        if use_kernels:
            from kernels.adapter_grads import adapter_grads
            from kernels.add_rms_norm import add_rms_norm
            from kernels.decode_attention import decode_attention
            from kernels.dora_backward import dora_backward
            from kernels.dora_norm import MergeTable, NormsTable, dora_norms
            from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
            from kernels.geglu import geglu, geglu_backward, geglu_forward
            from kernels.glu import terms_pay
            from kernels.rms_norm import rms_norm, rms_norm_and_residual
            from kernels.rope import apply_rope, apply_rope_qkv
            from kernels.rope_cache import rope_into_cache
            from kernels.sample import sample_tokens
            from kernels.softcap_attention import softcap_attention
            from kernels.swiglu import swiglu, swiglu_backward, swiglu_forward
            self.rms_norm, self.rope, self.swiglu, self.geglu = rms_norm, apply_rope, swiglu, geglu
            self.rope_qkv = apply_rope_qkv
            self.linear_cross_entropy = fused_linear_cross_entropy
            self.rope_into_cache, self.decode_attention = rope_into_cache, decode_attention
            self.add_rms_norm = add_rms_norm
            self.rms_norm_and_residual = rms_norm_and_residual
            self._glu_pairs = {"silu": (swiglu_forward, swiglu_backward), "gelu": (geglu_forward, geglu_backward)}
            self.adapter_grads = adapter_grads
            self.glu_terms = terms_pay
            self.dora = DoRAOps(dora_backward, dora_norms, NormsTable)
            self.softcap_attention = softcap_attention
            self.merge_table = MergeTable
            self.sample_tokens = sample_tokens
            from model.decode import FusedDecode
            self.fused_decode = FusedDecode()
        else:
            self.rms_norm, self.rope, self.swiglu, self.geglu = (rms_norm_reference, rope_reference,
                                                                 swiglu_reference, geglu_reference)
            self.rope_qkv = rope_qkv_reference
            self.linear_cross_entropy = fused_linear_cross_entropy_reference
            self.rms_norm_and_residual = rms_norm_and_residual_reference
            self.dora = DoRAOps()

    def glu(self, act: str) -> GLU:
        """The gated activation of ModelConfig.act ("silu": SwiGLU; "gelu_tanh", "gelu": GeGLU): the
        kernels' forward/backward pair (backward in place), or the torch reference and its autograd."""
        kw = {} if act == "silu" else {"approximate": "tanh" if act == "gelu_tanh" else "none"}
        function = partial(self.swiglu if act == "silu" else self.geglu, **kw)
        if not self.use_kernels:
            return GLU(function, partial(affine_forward, function), partial(autograd_backward, function), inplace=False)
        forward, backward = self._glu_pairs["silu" if act == "silu" else "gelu"]
        return GLU(function, partial(forward, **kw), partial(backward, inplace=True, write_h=True, **kw), inplace=True,
                   adapter_grads=self.adapter_grads, lowrank=self.glu_terms)


class RMSNorm(nn.Module):
    def __init__(self, dim, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.offset, self.cast, self.ops = cfg.rms_eps, cfg.norm_offset, cfg.norm_cast, ops

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, eps=self.eps, offset=self.offset, cast=self.cast)

    def with_residual(self, x):
        """(this norm of x, x) for a layer's input, which feeds both the norm and the residual stream: with the
        kernels, x's two gradients are summed inside the norm's backward kernel, not by an add of autograd's."""
        return self.ops.rms_norm_and_residual(x, self.weight, eps=self.eps, offset=self.offset, cast=self.cast)

    def after_add(self, x, r, before=None):
        """(x + r, this norm of x + r) in one kernel, without gradients (a decoding step, `decode_layers`). before:
        the RMSNorm that r passes first (Gemma 2/3's post norms: x + before(r)), in the same kernel."""
        return self.ops.add_rms_norm(x, r, self.weight, eps=self.eps, offset=self.offset, cast=self.cast,
                                     r_weight=None if before is None else before.weight)


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

def attention_mask(T, window, device, doc_ids=None, start=0):
    """Boolean [B or 1, 1, T, start + T] for T queries at positions start..start+T-1 against every
    key so far: causal, same document (doc_ids (B, T); None: one document per row), and (if
    window) distance < window. With start > 0 (decoding after a KV cache) doc_ids must be None."""
    q = torch.arange(start, start + T, device=device)
    k = torch.arange(start + T, device=device)
    keep = k[None, :] <= q[:, None]  # (T, S) causal
    if window is not None:
        keep = keep & (q[:, None] - k[None, :] < window)
    if doc_ids is None:
        return keep[None, None]  # (1, 1, T, S): the same for every row
    assert start == 0, "a KV cache keeps no document ids: decode one document per row"
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (keep & same_doc)[:, None]


class Documents(NamedTuple):
    """The documents of a batch for flash attention's variable-length kernels: the rows (B, T) are
    flattened to B*T tokens, and document i holds tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1."""
    cu_seqlens: torch.Tensor  # int32 (n + 1,): 0, each later document's start, B*T (repeated: empty documents)
    max_len: int  # no document is longer; it sizes the kernels' grid

    def to(self, device):
        return Documents(self.cu_seqlens.to(device, non_blocking=True), self.max_len)


def documents(doc_ids, bucket=False) -> Documents:
    """The Documents of doc_ids (B, T), on doc_ids' device (for a GPU tensor: one host sync). A document
    starts at every row and wherever doc_ids changes along a row. bucket: the count of documents is
    padded with empty ones up to a power of two, and max_len rounded up to one (at most T), so that
    one CUDA graph (step.py) serves every batch of the same bucket."""
    B, T = doc_ids.shape
    start = torch.ones(B, T, dtype=torch.bool, device=doc_ids.device)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = start.flatten().nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([B * T])])
    longest = int((cu[1:] - cu[:-1]).max())
    if bucket:
        n = len(starts)
        cu = torch.cat([cu, cu.new_full(((1 << (n - 1).bit_length()) - n,), B * T)])
        longest = min(T, 1 << (longest - 1).bit_length())
    return Documents(cu.to(torch.int32), longest)


class DocumentMask(NamedTuple):
    """Causal attention within each document (and, with a window, to the last `window` tokens),
    run by flash attention's variable-length kernels: no mask tensor, no compilation."""
    documents: Documents
    window: int | None


class _VarlenAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale + causal/document/window mask) v, per document, through PyTorch's flash
    attention kernels for variable-length sequences (aten._flash_attention_forward / _backward with
    cu_seqlens, Dao 2023 "FlashAttention-2"). q (N, Hq, D); k, v (N, Hk, D), Hk dividing Hq (grouped
    kv heads are native); fp16 or bf16. The kernels' logsumexp is saved, and backward recomputes
    the scores from q and k: no (T, T) tensor ever exists.
    The two aten ops are private. torch.nn.attention.varlen.varlen_attn (torch 2.13) is their public
    form, with a causal window and the logsumexp; this class can go once the project's torch floor has it
    and the GPU tests of packed attention (tests/test_gpu_model.py) pass through it."""

    @staticmethod
    def forward(ctx, q, k, v, documents, scale, window):
        out, lse, rng, unused = _varlen_forward(q, k, v, documents, scale, window)
        ctx.save_for_backward(q, k, v, out, lse, rng, unused)
        ctx.documents, ctx.scale, ctx.window = documents, scale, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng, unused = ctx.saved_tensors
        assert dout.dtype == q.dtype, f"gradient of the attention output: expected {q.dtype}, got {dout.dtype}"
        dq, dk, dv = _varlen_backward(ctx.documents, ctx.scale, ctx.window, rng, unused, dout, q, k, v, out, lse)
        assert dq.dtype == dk.dtype == dv.dtype == q.dtype, (dq.dtype, dk.dtype, dv.dtype)
        return dq, dk, dv, None, None, None


def _varlen_forward(q, k, v, documents, scale, window):
    """(out, lse, rng, unused) of flash attention's variable-length forward (see `_VarlenAttention`)."""
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, (q.dtype, k.dtype, v.dtype)
    cu, n = documents.cu_seqlens, documents.max_len
    left = None if window is None else window - 1  # keys at most window - 1 positions back
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale, window_size_left=left)
    return out, lse, rng, unused


def _varlen_backward(documents, scale, window, rng, unused, dout, q, k, v, out, lse):
    """(dq, dk, dv) of flash attention's variable-length backward, from `_varlen_forward`'s outputs."""
    cu, n = documents.cu_seqlens, documents.max_len
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out, lse, cu, cu, n, n, 0.0, True, rng, unused, scale=scale,
        window_size_left=None if window is None else window - 1)


def varlen_supported(device, dtype, head_dim):
    """Whether flash attention's variable-length kernels take these inputs: an Ampere or newer NVIDIA
    GPU, fp16/bf16, head_dim a multiple of 8 up to 256."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device) >= (8, 0))


# SDPA backends in order of preference (the first that supports the inputs runs). Plain causal
# rows: cuDNN's attention kernels first, faster than flash's on Hopper (docs/perf-notes.md, "the
# attention backend under graphs"). A dense mask: memory-efficient attention first (cuDNN with a
# mask is slower, and flash takes no mask).
CAUSAL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def _tokens(t):
    """(B, heads, T, D) as the (B·T, heads, D) rows of flash attention's variable-length kernels (a view where t's
    layout is (B, T, heads, D), as the projections give it)."""
    B, H, T, D = t.shape
    return t.transpose(1, 2).reshape(B * T, H, D)


def attend(q, k, v, mask, scale, softcap):
    """Softmax attention. q (B, Hq, T, D); k, v (B, Hk, S, D), S >= T (S > T after a KV cache).

    mask: None (plain causal, S = T), a bool (B or 1, 1, T, S) tensor, or a DocumentMask (GPU, fp16/bf16).
    SDPA is used wherever it is exact. Softcapping (Gemma 2) is a non-linearity on the scores
    that SDPA cannot express (transformers' sdpa path silently drops it; this one never does),
    so here those scores are computed explicitly; with the kernels, training and scoring take the
    flash kernel instead (a KeyRange mask, `Attention.forward`).
    """
    if isinstance(mask, DocumentMask):
        B, Hq, T, D = q.shape
        y = _VarlenAttention.apply(*map(_tokens, (q, k, v)), mask.documents, scale, mask.window)
        return y.view(B, T, Hq, D).transpose(1, 2)
    if softcap is not None:
        return softcap_attention_reference(q, k, v, mask, scale, softcap)
    if mask is None:
        with sdpa_kernel(CAUSAL_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    B, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    if mask is not None and T == 1:
        # One query a row (a decoding step): the rep query heads that read one kv head (heads h*rep to h*rep +
        # rep - 1 read head h) become rep query rows of that head, under the row's mask broadcast over them, so
        # k and v are read as they are.
        q = q.reshape(B, Hq // rep, rep, D)
    else:  # the kernels that take a mask do not take grouped kv heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    with sdpa_kernel(MASKED_BACKENDS, set_priority=True):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return y.reshape(B, Hq, T, D)


class _KeptAttention(torch.autograd.Function):
    """Attention in the recompute of a checkpointed layer whose first run kept its output and log-sum-exp
    (`kept_attention`): forward gives that output back without running the kernel again, backward runs the
    kernel's backward on it. The checkpoint recomputes q, k and v bit for bit, so the gradients are those of the
    path that recomputes the attention. backward_fn(dout, q, k, v, out, lse) -> (dq, dk, dv)."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, backward_fn):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_fn = backward_fn
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        assert dout.dtype == q.dtype, f"gradient of the attention output: expected {q.dtype}, got {dout.dtype}"
        dq, dk, dv = ctx.backward_fn(dout, q, k, v, out, lse)
        assert dq.dtype == dk.dtype == dv.dtype == q.dtype, (dq.dtype, dk.dtype, dv.dtype)
        return dq, dk, dv, None, None, None


def _cudnn_backward(seed, offset, scale, dout, q, k, v, out, lse):
    # No attention bias: None reaches the kernel as an undefined tensor below autograd's dispatch (autograd's own
    # entry refuses None for this argument, and a zero bias selects a slower kernel).
    T, S = q.shape[2], k.shape[2]
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, None, None, T, S, 0.0, True, scale=scale)


def _cpu_backward(scale, dout, q, k, v, out, lse):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True,
                                                                               scale=scale)


def _with_lse(q, k, v, mask, scale, softcap):
    """(out, lse, backward_fn) of the attention that `attend` computes, from a kernel that returns the log-sum-exp:
    documents (q, k, v flattened to tokens, as `attend` gives them) through the variable-length kernels, plain
    causal rows through cuDNN's kernels where they take the inputs (SDPA with CAUSAL_BACKENDS picks them first) or
    the CPU's flash kernel, which SDPA picks there; the same kernels as `attend`'s, so the same output. None for
    softcapped scores, other masks, and where cuDNN's kernels do not take the inputs."""
    if softcap is not None:
        return None
    if isinstance(mask, DocumentMask):
        out, lse, *rest = _varlen_forward(q, k, v, mask.documents, scale, mask.window)
        return out, lse, partial(_varlen_backward, mask.documents, scale, mask.window, *rest)
    if mask is not None:
        return None
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, partial(_cpu_backward, scale)
    if not (q.is_cuda and torch.backends.cuda.can_use_cudnn_attention(
            torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True))):
        return None
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, lse, partial(_cudnn_backward, seed, offset, scale)


def kept_attention(q, k, v, mask, scale, softcap, store, key, offload):
    """`attend` in a checkpointed layer whose attention output is kept for the recompute (plain causal rows or
    documents). The first run (no gradients) computes the output and log-sum-exp (`_with_lse`), hands both to
    the activation offload, with which they travel like the layer's input (model/offload.py), and notes them in
    the layer's store under `key`; the recompute takes them back and runs only the backward (`_KeptAttention`):
    attention's forward runs once a step, not twice. None where no kernel here returns the log-sum-exp (the
    caller then attends as always, and its recompute too)."""
    B, Hq, T, D = q.shape
    varlen = isinstance(mask, DocumentMask)
    if varlen:
        q, k, v = map(_tokens, (q, k, v))  # as in `attend`
    if not torch.is_grad_enabled():
        kept = _with_lse(q, k, v, mask, scale, softcap)
        if kept is None:
            return None
        y, lse, backward = kept
        store[key] = (*offload.keep(y, lse), backward)
    elif key in store:
        y, lse, backward = store.pop(key)
        y = _KeptAttention.apply(q, k, v, offload.take(y), offload.take(lse), backward)
    else:
        return None
    return y.view(B, T, Hq, D).transpose(1, 2) if varlen else y


# A checkpointed layer hands tensors to the activation offload only where its forward does at least this many FLOPs
# for each byte it copies to the host (its input's and theirs), so that the copies run under the layer's work. Below
# it the copies outlast a GPU's forward and slow the step more than the recompute they save (the measurements behind
# the value: dev/benchmarks-history.md, section 36). On a CPU the copies are memcpys, and the rule does not apply.
KEPT_FLOPS_PER_BYTE = 6000


def copies_hidden(cfg: ModelConfig, seqlen, copied):
    """Whether a layer's forward at `seqlen` tokens a row does at least KEPT_FLOPS_PER_BYTE FLOPs a token for each of
    the `copied` bytes a token that it copies to the host: its projections' GEMMs, and causal attention over
    seqlen / 2 keys on average."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    work = 2 * cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size) + 2 * seqlen * q
    return work >= KEPT_FLOPS_PER_BYTE * copied


class Keep(NamedTuple):
    """What a checkpointed layer's first run hands to the activation offload for its recompute: its attention's output
    and log-sum-exp (`kept_attention`); with `output` o's output too, the residual stream after attention
    (`kept_output`), and with `projections` q | k | v's output as well, so that the recompute runs no GEMM of their
    bases either."""
    offload: ActivationOffload
    output: bool
    projections: bool


def given_output(projs, store, offload):
    """In a checkpointed layer's recompute, the output of `projs` that its first run kept (`keep_output`), taken back
    from the activation offload; else None."""
    key = (projs[0], "output")
    return offload.take(store.pop(key)) if torch.is_grad_enabled() and key in store else None


def keep_output(y, projs, store, offload):
    """In a checkpointed layer's first run (no gradients), hand the output y of `projs` (`projected`) to the
    activation offload for the recompute, whose Function takes it back as given (`given_output`)."""
    store[projs[0], "output"] = offload.keep(y)[0]


def kept_output(y, o_proj, store, dora_ops, residual, offload):
    """o's output with the residual added, (B, T, H), in a checkpointed layer that keeps it for the recompute (on the
    fused path, where `givable` holds): the first run (no gradients) computes it and hands it to the activation
    offload; the recompute takes it back and gives it to o's Function, which then runs only what backward needs
    (`lora_projections`' given). The values are the first run's, which the recompute would compute bit for bit."""
    out = projected(y, (o_proj,), store, dora_ops, residual, given_output((o_proj,), store, offload))
    if not torch.is_grad_enabled():
        keep_output(out, (o_proj,), store, offload)
    return out


class DecodeMask(NamedTuple):
    """What a decoding step's row sees of a static KV cache (model/generate.py, `KVCache.mask`): the slots from
    first[b] (None: 0) up to at[0], the new token's, and within `window` slots of it (None: all)."""
    first: torch.Tensor | None  # int64 (B,)
    at: torch.Tensor  # int64 (1,)
    window: int | None


def decode_attend(ops, q, k, v, cos, sin, cache, mask: DecodeMask, scale, softcap, qk_norm=None):
    """A decoding step's attention (one query a row into a static cache) on the kernels' path: one kernel rotates
    q and k and writes k and v into the cache slot, one attends over the cache where it lies. The general path
    (`attend`) launches far more for one token: the cache's index_copy_ writes, strided copies of q, k, v and y,
    and SDPA's conversion of the boolean mask to an additive one with its fills. q (B, 1, nh, d), k, v (B, 1, nkv,
    d), views of the projections; returns y (B, 1, nh * d). qk_norm: the (q_norm, k_norm) RMSNorms of each head,
    applied by the rotating kernel where their weights have q's dtype, else before it."""
    kw = {}
    if qk_norm is not None:
        q_norm, k_norm = qk_norm
        if q_norm.weight.dtype == k_norm.weight.dtype == q.dtype:
            kw = dict(qk_norm=(q_norm.weight, k_norm.weight), eps=q_norm.eps, offset=q_norm.offset, cast=q_norm.cast)
        else:
            q, k = q_norm(q), k_norm(k)
    q = ops.rope_into_cache(q, k, v, cos, sin, cache.k, cache.v, mask.at, **kw)
    y = ops.decode_attention(q, cache.k, cache.v, mask.first, mask.at, scale, mask.window, softcap)
    return y.view(q.shape[0], 1, -1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, lora: LoRAConfig | None):
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

    def forward(self, x, cos, sin, mask, cache=None, store=None, residual=None, keep=None):
        """x (B, T, H). cache: this layer's `LayerCache` (model/generate.py) or None; with one, the
        keys and values of x are appended to it and the queries attend to all it holds. store: DoRA's
        scales kept for a checkpointed layer's recompute (`_checkpointed`). residual: (B, T, H) added to the
        output (on the fused path, by o's base GEMM, or with DoRA by the op that scales o's output). keep: in a
        checkpointed layer, what the activation offload keeps for the recompute (`Keep`): the attention's output,
        and o's and q | k | v's where the attention's is kept."""
        B, T, _ = x.shape
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        fused = self.ops.fused_lora and fusable(qkv + (self.o_proj,))
        # q | k | v's output: kept for the recompute, where o's is (`keep_output` below), and given there
        keep_qkv = fused and keep is not None and keep.projections and givable(qkv, x)
        # q | k | v split and q, k rotated by one Function, whose backward writes their gradients into one tensor
        # where autograd's split would concatenate three (kernels/rope.py): where the gradient is taken
        rotated = fused and torch.is_grad_enabled() and not self.qk_norm and not isinstance(mask, DecodeMask)
        if fused:
            given = given_output(qkv, store, keep.offload) if keep_qkv else None
            qkv_out = projected(x, qkv, store, self.ops.dora, given=given)
            q, k, v = (self.ops.rope_qkv(qkv_out, self.nh, self.nkv, cos, sin) if rotated else
                       output_slices(qkv_out, qkv))
            if torch.is_grad_enabled() or not keep_qkv:
                del qkv_out  # the attention runs without it
        else:  # one GEMM each way where q, k, v all train (full fine-tuning), else one projection at a time
            q, k, v = stacked_projections(x, qkv) if self.ops.fused_lora and stacked(qkv) else \
                (project(p, x, self.ops.fused_lora) for p in qkv)
        q = q.view(B, T, self.nh, self.d)  # fused and not rotated: column slices of one (B, T, q | k | v) tensor
        k = k.view(B, T, self.nkv, self.d)
        # Attention saves v for backward: a copy of it, not a slice, lets the q | k | v tensor go after RoPE (rotated:
        # the Function's v is that copy). Without a graph (decoding) nothing keeps v, and the cache copies the slice.
        v = (v.contiguous() if torch.is_grad_enabled() else v).view(B, T, self.nkv, self.d)
        if isinstance(mask, DecodeMask):  # RoPE, the cache write (and the q/k norms) in one kernel
            qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
            y = decode_attend(self.ops, q, k, v, cos, sin, cache, mask, self.scale, self.softcap, qk_norm)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if not rotated:
                q, k = self.ops.rope(q, k, cos, sin)  # (B, T, nh, d), (B, T, nkv, d)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, d)
            if cache is not None:
                k, v = cache.update(k, v)  # (B, nkv, S, d): the cached positions, then these
            y = None if keep is None else kept_attention(q, k, v, mask, self.scale, self.softcap, store, self,
                                                         keep.offload)
            keep_o = y is not None and keep.output  # o's output travels where the attention's does
            if y is None and isinstance(mask, KeyRange):
                y = self.ops.softcap_attention(q, k, v, mask, self.scale, self.softcap)  # (B, nh, T, d)
            elif y is None:
                y = attend(q, k, v, mask, self.scale, self.softcap)
            y = y.transpose(1, 2).reshape(B, T, self.nh * self.d)
            if fused and keep_o and givable((self.o_proj,), y, residual):
                out = kept_output(y, self.o_proj, store, self.ops.dora, residual, keep.offload)
                if keep_qkv and not torch.is_grad_enabled():  # and q | k | v's where o's does
                    keep_output(qkv_out, qkv, store, keep.offload)
                return out
        if fused:
            return lora_projections(y, (self.o_proj,), store, self.ops.dora, residual)[0]
        y = project(self.o_proj, y, self.ops.fused_lora)
        return y if residual is None else residual + y


def project(p, x, fused):
    """p(x). A projection that trains its weight (full fine-tuning) runs as a `stacked_projections` of one where
    the ops are fused: its dW then sums every token (kernels/token_sum_layouts.py), where plain autograd's may not."""
    return stacked_projections(x, (p,))[0] if fused and stacked((p,)) else p(x)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, lora: LoRAConfig | None):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = make_linear(H, I, cfg.mlp_bias, "gate_proj", lora)
        self.up_proj = make_linear(H, I, cfg.mlp_bias, "up_proj", lora)
        self.down_proj = make_linear(I, H, cfg.mlp_bias, "down_proj", lora)
        self.ops = ops
        self.glu = ops.glu(cfg.act)

    def forward(self, x, output=True, store=None, residual=None):
        """output=False: the caller reads only the graph (a checkpointed layer's recompute), so the fused
        path skips the down projection's GEMM and returns zeros in its place (see `lora_mlp`). store,
        residual: as for Attention."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if self.ops.fused_lora and fusable(projs):
            return lora_mlp(x, projs, self.glu, output, store, self.ops.dora, residual)
        fused = self.ops.fused_lora
        h = self.glu.function(project(self.gate_proj, x, fused), project(self.up_proj, x, fused))
        y = project(self.down_proj, h, fused)
        return y if residual is None else residual + y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, ops: Ops, lora: LoRAConfig | None):
        super().__init__()
        H = cfg.hidden_size
        self.layer_type = layer_type  # "full" or "sliding"
        self.self_attn = Attention(cfg, ops, lora)
        self.mlp = MLP(cfg, ops, lora)
        self.input_layernorm = RMSNorm(H, cfg, ops)
        self.post_attention_layernorm = RMSNorm(H, cfg, ops)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:  # Gemma 2/3: post_attention_layernorm normalizes the attention output
            self.pre_feedforward_layernorm = RMSNorm(H, cfg, ops)
            self.post_feedforward_layernorm = RMSNorm(H, cfg, ops)

    def forward(self, x, cos, sin, mask, cache=None, graph_only=False, store=None, keep=None):
        """graph_only: the output's values are not read, only its graph (the recompute of a checkpointed
        layer), so the MLP may skip its last GEMM. Not with sandwich norms: their norm saves the MLP output.
        store: a dict of DoRA's scales, computed for all layers at once (model/dora_scales.py), which also keeps
        those computed in a checkpointed layer's first run for its recompute, and its attention's and projections'
        outputs (keep: what the activation offload carries, `Keep`)."""
        if self.sandwich:
            h, x = self.input_layernorm.with_residual(x)
            x = x + self.post_attention_layernorm(self.self_attn(h, cos, sin, mask, cache, store, keep=keep))
            h, x = self.pre_feedforward_layernorm.with_residual(x)
            return x + self.post_feedforward_layernorm(self.mlp(h, store=store))
        h, x = self.input_layernorm.with_residual(x)
        x = self.self_attn(h, cos, sin, mask, cache, store, residual=x, keep=keep)
        h, x = self.post_attention_layernorm.with_residual(x)
        return self.mlp(h, output=not graph_only, store=store, residual=x)


def _checkpointed(layer, store, keep, *args):
    """One layer under the reentrant checkpoint, which runs it twice: in forward without grad, where its
    output is the next layer's input, and in backward with grad, where backward reads only the graph and
    the tensors saved in it. That second run skips what only the output needs (`graph_only`). `store`, a
    dict, is one object for both runs (the checkpoint keeps its arguments that are not tensors as they
    are): the first run puts DoRA's scales in it, which depend on the weights alone, and the second reads
    them instead of computing them again; likewise the attention's and projections' outputs, with activation
    offload (`keep`: `Keep`)."""
    return layer(*args, graph_only=torch.is_grad_enabled(), store=store, keep=keep)


class Backbone(nn.Module):
    """Named `model` inside Transformer so parameter names match HF checkpoints."""

    def __init__(self, cfg: ModelConfig, ops: Ops, lora: LoRAConfig | None):
        super().__init__()
        # As in the reference, the pad token's row receives no gradient (when embeddings are trained).
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else None
        # Empty, like every weight here (the loader fills them): built on the meta device, nn.Embedding's own
        # random init would import torch._dynamo (seconds, once per process) inside the model's construction.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, ops, lora) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg, ops)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None = None, use_kernels: bool = False,
                 fused_lora: bool = True, gradient_checkpointing: bool = False, offload_activations: bool = False):
        super().__init__()
        self.config = cfg
        self.lora_config = lora  # written into adapter_config.json by model/adapters.py
        self.ops = Ops(use_kernels, fused_lora)
        self.model = Backbone(cfg, self.ops, lora)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = gradient_checkpointing  # recompute each layer in backward
        self.offload_activations = offload_activations  # with checkpointing: keep layer inputs in pinned CPU memory
        self.offload = ActivationOffload()  # its CPU buffers, made on first use and kept from step to step
        self.dora_scales = LayerScales()  # DoRA's scales of every layer in one launch a forward
        self.pack_weights_()

    def pack_weights_(self):
        """Store the base weights of q, k, v, and of gate, up, as one tensor per layer and group, so that each
        group is one GEMM (model/lora.py, `pack_weights_`), and their adapters' masters likewise (`pack_adapters_`).
        Loaders call it again once the weights are in, before an optimizer holds the LoRA weights."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
                pack_weights_(group)
                pack_adapters_(group)
        for group in self.projection_groups():  # DoRA's ‖W_r‖² before any step (and any CUDA graph capture)
            if any(p.dora and p.r for p in group) and not any(p.weight is not None and p.weight.is_meta for p in group):
                base_sq_norms(group)

    def projection_groups(self):
        """Each layer's projections grouped by the input they read: (q, k, v), (o,), (gate, up), (down,)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            yield from ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
                        (mlp.down_proj,))

    def varlen(self, device, dtype):
        """Whether document and window masks run as flash attention's variable-length kernels here
        (not with a softcap, which those kernels do not apply: see `attend`)."""
        return self.config.attn_softcap is None and varlen_supported(device, dtype, self.config.head_dim)

    def window(self, layer_type):
        """How many positions back a layer of this type attends (its own included); None: all of them."""
        return self.config.sliding_window if layer_type == "sliding" else None

    def layer_mask(self, layer_type, doc_ids, docs, shape, start, device, dtype, cached=False):
        """The attention mask of one layer type for input_ids of `shape` (B, T), in the form
        `attend` runs fastest. docs: the Documents of doc_ids where `varlen` holds, else None.
        cached: the keys and values go into a KV cache (generation keeps explicit softcapped scores)."""
        B, T = shape
        window = self.window(layer_type)
        window = window if window is not None and window < start + T else None  # None: it masks nothing
        if start > 0:  # queries after a KV cache's positions: an explicit mask
            return attention_mask(T, window, device, start=start)
        if self.config.attn_softcap is not None and self.ops.softcap_attention is not None and not cached:
            return key_range(shape, window, doc_ids, device)  # the flash kernel's O(T) bounds, no (T, T) mask
        if doc_ids is None and window is None:
            return None  # plain causal: SDPA's fastest kernels
        if self.varlen(device, dtype):  # documents and windows without an O(T^2) mask
            if docs is None:  # every row one document
                docs = Documents(torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device), T)
            return DocumentMask(docs, window)
        return attention_mask(T, window, device, doc_ids)  # CPU, fp32, softcap: SDPA or explicit, dense mask

    def hidden_states(self, input_ids, position_ids=None, doc_ids=None, cache=None, docs=None):
        """Final-norm hidden states (B, T, H).

        docs: `documents(doc_ids)` on the model's device, or None to compute them here when needed
        (a host sync; a CUDA graph's step passes them in, see step.py).

        cache: a `KVCache` (model/generate.py) holding the earlier positions of these rows, or None.
        With one, input_ids continue those positions (position_ids default to them) and their
        keys and values are appended to it; a static cache takes the positions from its device
        tensor and its mask (a CUDA-graphed decoding step)."""
        cfg = self.config
        B, T = input_ids.shape
        dev = input_ids.device
        start = cache.length if cache is not None else 0
        at = cache.at if cache is not None else None  # a static cache: positions and masks from its device tensor
        if position_ids is None:
            position_ids = (at if at is not None else torch.arange(start, start + T, device=dev)).expand(B, T)
        # Trained embeddings are fp32 (model/embeddings.py): the activations stay in the model's dtype.
        x = self.model.embed_tokens(input_ids).to(self.model.norm.weight.dtype)  # (B, T, H)
        if cfg.embed_scale != 1.0:  # Gemma; rounded to the activation dtype as in the reference
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if docs is None and doc_ids is not None and start == 0 and self.varlen(dev, x.dtype):
            docs = documents(doc_ids)
        # A decoding step (one token a row into a static cache, no gradients) with the kernels: a small model's step
        # costs its launches, so it takes its own attention (`decode_attend`) and, where it can, its own layer loop
        # (`decode_layers`).
        decoding = at is not None and T == 1 and self.ops.decode_attention is not None and not torch.is_grad_enabled()
        tables, masks = {}, {}
        for t in set(cfg.layer_types):
            tables[t] = rope_cos_sin(position_ids, rope_inv_freq(cfg, t, dev), x.dtype)
            masks[t] = (DecodeMask(cache.first, at, self.window(t)) if decoding else
                        cache.mask(self.window(t)) if at is not None else
                        self.layer_mask(t, doc_ids, docs, (B, T), start, dev, x.dtype, cache is not None))
        h = self.decode_layers(x, tables, masks, cache) if decoding else None
        if h is not None:
            return h
        # Recomputing a layer would append its keys and values to a cache a second time.
        recompute = self.gradient_checkpointing and torch.is_grad_enabled() and cache is None
        if recompute and not x.requires_grad:
            # The reentrant checkpoint builds a graph only for a layer whose input requires grad.
            x.requires_grad_()
        offload = self.offload if recompute and self.offload_activations else None
        if offload:
            offload.begin()
        # with offload, the layers' attention outputs (and o's, q | k | v's) travel with their inputs, where the host
        # has room
        kept = self.kept_tensors(B, T, x.dtype) if offload else ()
        keep = Keep(offload, output=len(kept) >= 3, projections=len(kept) == 4) if kept else None
        # DoRA's scales of all layers at once, each layer's in the store its (checkpointed) runs read
        stores = self.dora_scales(self.model.layers, self.ops, compute_dtype(x))
        for i, layer in enumerate(self.model.layers):
            cos, sin = tables[layer.layer_type]
            args = (x, cos, sin, masks[layer.layer_type])
            if recompute:
                # Reentrant: it saves a layer's inputs once, where the non-reentrant checkpoint puts
                # every tensor saved inside the layer through Python hooks, a CPU cost that a
                # CPU-bound step pays in full (docs/perf-notes.md, "reentrant checkpointing").
                with offload.hooks(x) if offload else nullcontext():
                    x = checkpoint(_checkpointed, layer, stores[i], keep, *args, use_reentrant=True)
            else:
                x = layer(*args, cache=None if cache is None else cache.layers[i], store=stores[i])
        if offload:
            offload.end()
        return self.model.norm(x)

    def reserve_offload(self, batch, seqlen):
        """The activation offload's pinned buffers for a (batch, seqlen) forward, made now (before a CUDA graph's
        capture: step.py); nothing without checkpointing and offload."""
        if self.gradient_checkpointing and self.offload_activations:
            weight = self.model.norm.weight
            self.offload.reserve(len(self.model.layers), batch * seqlen * self.config.hidden_size, weight.dtype,
                                 weight.is_cuda, self.kept_tensors(batch, seqlen, weight.dtype))

    def kept_tensors(self, batch, seqlen, dtype):
        """(numel, dtype) of each tensor that a checkpointed layer hands to the activation offload for its recompute,
        for a (batch, seqlen) forward, in the order it hands them over: its attention's output and log-sum-exp
        (`kept_attention`), then o's output and q | k | v's (`kept_output`, `keep_output`; on the fused path without
        DoRA, q | k | v's not with fp8 base GEMMs). All four, the first three, the attention's two, or none: as many
        as the host has room for beside the layer inputs (`ActivationOffload.room_for`) and, on a GPU, as many as a
        layer's forward hides the copies of (`KEPT_FLOPS_PER_BYTE`). None for softcapped attention, whose kernel
        returns no log-sum-exp, and on a GPU for inputs that flash attention's kernels do not take (fp32: no kernel
        here returns the log-sum-exp; the recompute then attends again)."""
        cfg, device, layers = self.config, self.model.norm.weight.device, len(self.model.layers)
        if cfg.attn_softcap is not None or not (device.type == "cpu" or self.varlen(device, dtype)):
            return ()
        tokens, heads, H = batch * seqlen, batch * seqlen * cfg.n_heads, cfg.hidden_size
        kept = [(heads * cfg.head_dim, dtype), (heads, torch.float32)]
        attn = self.model.layers[0].self_attn
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        if self.ops.fused_lora and fusable(qkv + (attn.o_proj,)) and not (attn.o_proj.dora and attn.o_proj.r):
            kept.append((tokens * H, dtype))
            # not under --fp8, whose forward GEMMs take about half the time the rule counts: there the fourth
            # tensor's copies outlast the forward (dev/benchmarks-history.md, section 36)
            if not any(p.dora and p.r for p in qkv) and attn.q_proj.fp8 is None:
                kept.append((tokens * sum(p.out_features for p in qkv), dtype))
        inputs = tokens * H * dtype.itemsize  # a layer's
        for n in range(len(kept), 1, -1):
            more = sum(numel * d.itemsize for numel, d in kept[:n])
            hidden = device.type == "cpu" or copies_hidden(cfg, seqlen, (inputs + more) / tokens)
            if hidden and self.offload.room_for(layers * more, layers * inputs):
                return tuple(kept[:n])
        return ()

    def decode_layers(self, x, tables, masks, cache):
        """The layers of a decoding step (`hidden_states`) with each residual add and the norm after it in one
        kernel (`RMSNorm.after_add`): a layer's post-attention norm (with sandwich norms, the attention output's
        norm, the add and the pre-MLP norm), then the next layer's input norm or the final norm (with sandwich
        norms after the MLP output's). A small model's step costs its launches (model/generate.py); the values are
        the layers' own. Where its weights allow, the layers run in five launches each instead (model/decode.py)."""
        fused = self.ops.fused_decode
        h = None if fused is None else fused(self, x, tables, masks, cache)  # None: it does not serve this step
        if h is not None:
            return h
        layers = self.model.layers
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            cos, sin = tables[layer.layer_type]
            a = layer.self_attn(h, cos, sin, masks[layer.layer_type], cache.layers[i])
            if layer.sandwich:
                x, h = layer.pre_feedforward_layernorm.after_add(x, a, before=layer.post_attention_layernorm)
            else:
                x, h = layer.post_attention_layernorm.after_add(x, a)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = norm.after_add(x, layer.mlp(h), before=layer.post_feedforward_layernorm if layer.sandwich else None)
        return h

    def logits(self, h):
        """Logits (..., V) of final-norm hidden states h (..., H), softcapped where the model is."""
        logits = F.linear(h, self.lm_head.weight.to(h.dtype))  # a trained lm_head is fp32
        c = self.config.final_softcap
        return logits if c is None else c * torch.tanh(logits / c)

    def forward(self, input_ids, position_ids=None, doc_ids=None, targets=None, num_targets=None,
                ignore_index=-100, cache=None, docs=None, reduction="mean", temperature=1.0):
        """Logits (B, T, V) when `targets` is None.

        With `targets` (B, T), already shifted (targets[b, t] is the token that position t
        predicts; `ignore_index` where nothing is predicted), returns the token losses without
        materializing the logits (the fused head), fp32: reduction "sum" gives Σ token losses,
        "mean" that sum / num_targets (default: the count in this batch), "none" the losses
        (B * T,), 0 where ignored (not with a trainable lm_head: see the kernel).
        cache, docs: see `hidden_states` (generation, model/generate.py; the training step).
        temperature: the losses are those of the logits divided by it, after the final softcap (as a sampler
        divides them: RL's log-probs). The kernel scales before it caps, and c·tanh(x/c)/T is the cap c/T of
        x/T, so it gets scale 1/T and softcap c/T.
        """
        h = self.hidden_states(input_ids, position_ids, doc_ids, cache, docs)
        if targets is None:
            return self.logits(h)
        c = self.config.final_softcap
        scale, softcap = None, c
        if temperature != 1.0:
            scale, softcap = 1.0 / temperature, None if c is None else c / temperature
        return self.ops.linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), self.lm_head.weight.to(h.dtype), targets.reshape(-1), ignore_index=ignore_index,
            softcap=softcap, scale=scale, reduction=reduction, num_targets=num_targets)

    def score(self, input_ids, position_ids, doc_ids, targets, ignore_index=-100, chunk_bytes=1 << 28):
        """(token_loss (B, T) fp32, hit (B, T) bool) for evaluation, without B×T×V logits.

        input_ids, position_ids, doc_ids: as for `forward` (position_ids, doc_ids may be None);
        targets (B, T), shifted as for `forward`.
        token_loss[b, t]: the cross-entropy of targets[b, t] (0 where it is ignore_index);
        hit[b, t]: whether the argmax of the logits is targets[b, t] (False where ignored).
        The logits are made for a chunk of rows at a time, as many as fit in `chunk_bytes` of
        fp32 (about 2000 rows at V = 32000, 260 at V = 256000), so memory is O(chunk × V), not
        O(B × T × V). The numbers equal cross-entropy and argmax over `forward`'s logits.
        """
        h = self.hidden_states(input_ids, position_ids, doc_ids)  # (B, T, H)
        B, T, _ = h.shape
        h, targets = h.reshape(B * T, -1), targets.reshape(-1)
        rows = max(1, chunk_bytes // (4 * self.config.vocab_size))
        losses, hits = [], []
        for i in range(0, B * T, rows):
            logits = self.logits(h[i:i + rows]).float()  # (rows, V)
            t = targets[i:i + rows]
            losses.append(F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none"))
            hits.append(logits.argmax(-1) == t)
            del logits  # freed before the next chunk's are made
        return torch.cat(losses).view(B, T), torch.cat(hits).view(B, T)

"""The pure-torch definition of every kernel in kernels/, and the argument checks the kernels share.

Each `*_reference` computes, operation for operation, what the Hugging Face model computes
(or, for the losses, the fp32 definition); the tests compare every kernel against its
reference, and the model runs the references when the kernels are off (`--no-kernels`, CPU).
This module imports torch only, so that those runs need no Triton.

    rms_norm_reference                     kernels/rms_norm.py
    add_rms_norm_reference                 kernels/add_rms_norm.py
    rope_reference, rope_qkv_reference     kernels/rope.py
    rope_into_cache_reference              kernels/rope_cache.py
    decode_attention_reference             kernels/decode_attention.py
    softcap_attention_reference            kernels/softcap_attention.py (and `key_range`, the masks it takes)
    swiglu_reference, geglu_reference      kernels/swiglu.py, kernels/geglu.py
    cross_entropy_reference                kernels/cross_entropy.py
    fused_linear_cross_entropy_reference   kernels/fused_linear_cross_entropy.py
    sample_tokens_reference                kernels/sample.py
    nf4_dequantize_reference               kernels/nf4_dequantize.py
    fp8_quantize_rows_reference            kernels/fp8_quantize.py
    fp8_quantize_tensor_reference          kernels/fp8_quantize_tensor.py
    nf4_to_fp8_reference                   kernels/nf4_to_fp8.py
    residual_lowrank_add_reference         kernels/residual_lowrank_add.py
    adamw_master_reference                 kernels/adamw_master.py
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what every kernel takes and returns


# ----------------------------------------------------------------------------- RMSNorm

CASTS = ("llama", "gemma")


def check_rms_norm_args(x, weight, cast):
    if cast not in CASTS:
        raise ValueError(f"cast={cast!r}; expected one of {CASTS} (HF LlamaRMSNorm or GemmaRMSNorm rounding)")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")


def rms_norm_reference(x, weight, eps=1e-6, offset=0.0, cast="llama"):
    """Pure torch, operation for operation as HF LlamaRMSNorm / GemmaRMSNorm."""
    check_rms_norm_args(x, weight, cast)
    xf = x.float()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast == "gemma":
        return (xhat * (offset + weight.float())).type_as(x)
    w = weight if offset == 0.0 else offset + weight
    return w * xhat.to(x.dtype)


def rms_norm_and_residual_reference(x, weight, eps=1e-6, offset=0.0, cast="llama"):
    """Pure torch: (rms_norm_reference(x), x); autograd sums x's two gradients."""
    return rms_norm_reference(x, weight, eps, offset, cast), x


def add_rms_norm_reference(x, r, weight, eps=1e-6, offset=0.0, cast="llama", r_weight=None):
    """Pure torch: (x + r, rms_norm_reference(x + r)); with r_weight, r is rms_norm_reference(r, r_weight) first."""
    if r_weight is not None:
        r = rms_norm_reference(r, r_weight, eps, offset, cast)
    s = x + r
    return s, rms_norm_reference(s, weight, eps, offset, cast)


# ----------------------------------------------------------------------------- RoPE

def check_rope_args(q, k, cos, sin):
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must be [B, T, H, D] with the same B, T, D; got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, _, D = q.shape
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[1:] != (T, D) or t.shape[0] not in (1, B):
            raise ValueError(f"{name} must be [B or 1, T, D] = [{B}, {T}, {D}], got {tuple(t.shape)}")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(q, k, cos, sin):
    """Pure torch, as HF: cos and sin cast to the input's dtype (HF's rotary module does it),
    then x * cos + rotate_half(x) * sin."""
    check_rope_args(q, k, cos, sin)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, D): broadcast over heads
    q_out = q * cos.to(q.dtype) + rotate_half(q) * sin.to(q.dtype)
    k_out = k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)
    return q_out, k_out


def qkv_heads(qkv, Hq, Hk):
    """q [B, T, Hq, D], k and v [B, T, Hk, D]: views of the column slices of qkv [B, T, (Hq + 2 Hk) D]."""
    B, T, width = qkv.shape
    D = width // (Hq + 2 * Hk)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    return q.view(B, T, Hq, D), k.view(B, T, Hk, D), v.view(B, T, Hk, D)


def check_rope_qkv_args(qkv, Hq, Hk, cos, sin):
    if qkv.dim() != 3 or qkv.shape[-1] % (Hq + 2 * Hk):
        raise ValueError(f"qkv must be [B, T, (Hq + 2 Hk) D] with Hq = {Hq}, Hk = {Hk}; got {tuple(qkv.shape)}")
    q, k, _ = qkv_heads(qkv, Hq, Hk)
    check_rope_args(q, k, cos, sin)


def rope_qkv_reference(qkv, Hq, Hk, cos, sin):
    """Pure torch: q, k, v as the column slices of qkv [B, T, (Hq + 2 Hk) D] (`qkv_heads`), q and k through
    `rope_reference`, v a contiguous copy [B, T, Hk, D]."""
    check_rope_qkv_args(qkv, Hq, Hk, cos, sin)
    q, k, v = qkv_heads(qkv, Hq, Hk)
    q, k = rope_reference(q, k, cos, sin)
    return q, k, v.contiguous()


# ----------------------------------------------------------------------------- a decoding step

def check_rope_into_cache_args(q, k, v, cos, sin, k_cache, v_cache, at, qk_norm=None, cast="llama"):
    check_rope_args(q, k, cos, sin)
    if qk_norm is not None:
        for name, w in zip(("q_norm", "k_norm"), qk_norm):
            check_rms_norm_args(q, w, cast)
            if w.dtype != q.dtype:
                raise ValueError(f"rope_into_cache: {name}'s weight must have q's dtype {q.dtype}, got {w.dtype}")
    B, T, Hk, D = k.shape
    if T != 1 or v.shape != k.shape:
        raise ValueError(f"one token a row: k and v must be [B, 1, Hk, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[:2] != (B, Hk) or k_cache.shape[3] != D:
        raise ValueError(f"the caches must be [B, Hk, S, D] = [{B}, {Hk}, S, {D}], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or at.shape != (1,) or at.dtype != torch.int64:
        raise ValueError("the caches must be contiguous and `at` one int64 slot")


def rope_into_cache_reference(q, k, v, cos, sin, k_cache, v_cache, at, qk_norm=None, eps=1e-6, offset=0.0,
                              cast="llama"):
    """Pure torch: q and k normalized with qk_norm's weights (where given), `rope_reference`, then k and v copied
    into the caches' slot at[0]; returns the rotated q."""
    check_rope_into_cache_args(q, k, v, cos, sin, k_cache, v_cache, at, qk_norm, cast)
    if qk_norm is not None:
        q, k = (rms_norm_reference(t, w, eps, offset, cast) for t, w in zip((q, k), qk_norm))
    q, k = rope_reference(q, k, cos, sin)
    k_cache.index_copy_(2, at, k.transpose(1, 2))
    v_cache.index_copy_(2, at, v.transpose(1, 2))
    return q


def check_decode_attention_args(q, k_cache, v_cache, first, at):
    B, T, Hq, D = q.shape
    if T != 1 or k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"q must be [B, 1, Hq, D] and the caches [B, Hk, S, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if Hq % k_cache.shape[1]:
        raise ValueError(f"{k_cache.shape[1]} kv heads do not divide {Hq} query heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or at.shape != (1,) or at.dtype != torch.int64:
        raise ValueError("the caches must be contiguous and `at` one int64 slot")
    if first is not None and (first.shape != (B,) or first.dtype != torch.int64):
        raise ValueError(f"first must be int64 [{B}], got {first.dtype} {tuple(first.shape)}")


def decode_attention_reference(q, k_cache, v_cache, first, at, scale, window=None, softcap=None):
    """Pure torch, in fp32 (float64 for float64 inputs): softmax(scale · q kᵀ, softcapped) v over the slots
    first[b] <= j <= at[0] (and at[0] - j < window), with grouped kv heads; q's dtype, shape [B, 1, Hq, D]."""
    check_decode_attention_args(q, k_cache, v_cache, first, at)
    B, _, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(dt).view(B, Hk, Hq // Hk, D)  # query heads h*rep .. h*rep + rep - 1 read kv head h
    s = (qg @ k_cache.to(dt).transpose(-1, -2)) * scale  # (B, Hk, rep, S)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    keys = torch.arange(S, device=q.device)
    keep = keys <= at  # (S,)
    if window is not None:
        keep = keep & (at - keys < window)
    lo = first[:, None] if first is not None else torch.zeros(B, 1, dtype=torch.long, device=q.device)
    keep = keep & (keys >= lo)  # (B, S)
    s = s.masked_fill(~keep[:, None, None], float("-inf"))
    y = torch.softmax(s, dim=-1) @ v_cache.to(dt)  # (B, Hk, rep, D)
    return y.reshape(B, 1, Hq, D).to(q.dtype)


# ----------------------------------------------------------------------------- a decoding step's GEMMs

def check_decode_linear_args(x, weight, bias, residual):
    M, K = x.shape
    if weight.dim() != 2 or weight.shape[1] != K or (residual is not None and residual.shape != (M, weight.shape[0])):
        raise ValueError(f"x must be [M, K], weight [N, K] and residual [M, N] (or None); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {None if residual is None else tuple(residual.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    tensors = [t for t in (x, weight, residual, bias) if t is not None]
    if M > 64 or len({t.dtype for t in tensors}) > 1:
        raise ValueError(f"at most 64 rows of one dtype; got {M} rows, {[str(t.dtype) for t in tensors]}")


def decode_linear_reference(x, weight, bias, residual):
    """Pure torch, as a layer adds its projection to the residual stream: residual + F.linear(x, weight, bias)
    (F.linear alone for residual None)."""
    check_decode_linear_args(x, weight, bias, residual)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def scaled_rows_reference(x, norm_weight, offset=0.0, blocks=1):
    """Pure torch: (xs, ss) of rows x [M, K] for the RMSNorm of weight w that reads them next (kernels/decode_linear.py
    `Scaled`): xs = x ⊙ (offset + w) in fp32, rounded once to x's dtype; ss [blocks, M] fp32, the sums of x's squares
    over `blocks` blocks of its columns."""
    xf = x.float()
    xs = (xf * (offset + norm_weight.float())).to(x.dtype)
    return xs, torch.stack([part.pow(2).sum(1) for part in xf.tensor_split(blocks, dim=1)]).contiguous()


def check_norm_linear_args(x, norm_weight, weight, bias, cast):
    check_rms_norm_args(x, norm_weight, cast)
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"x must be [M, K], weight [N, K] and bias [N]; got {tuple(x.shape)}, {tuple(weight.shape)}, "
                         f"{None if bias is None else tuple(bias.shape)}")
    dtypes = {t.dtype for t in (x, norm_weight, weight) + (() if bias is None else (bias,))}
    if x.shape[0] > 64 or len(dtypes) > 1:
        raise ValueError(f"at most 64 rows of one dtype; got {x.shape[0]} rows, {sorted(map(str, dtypes))}")


def decode_swiglu_reference(x, norm_weight, weight, bias=None, eps=1e-6, offset=0.0, cast="llama", act="silu"):
    """Pure torch: act(G) ⊙ U of [G | U] = RMSNorm(x) Wᵀ + b, weight [2I, K] holding gate's rows, then up's; act
    "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU)."""
    check_norm_linear_args(x, norm_weight, weight, bias, cast)
    gate, up = F.linear(rms_norm_reference(x, norm_weight, eps, offset, cast), weight, bias).chunk(2, dim=-1)
    if act == "silu":
        return swiglu_reference(gate, up)
    return geglu_reference(gate, up, "tanh" if act == "gelu_tanh" else "none")


def sandwich_rows_reference(r, z, norm_weight, eps=1e-6, offset=0.0, cast="llama"):
    """Pure torch: r + RMSNorm(z), the residual add after a sublayer whose output z a sandwich norm of weight
    norm_weight normalizes (Gemma 2/3, as Gemma2DecoderLayer adds)."""
    return r + rms_norm_reference(z, norm_weight, eps, offset, cast)


def decode_qkv_reference(x, norm_weight, weight, bias, cos, sin, k_cache, v_cache, at, n_heads, eps=1e-6,
                         offset=0.0, cast="llama", qk_norm=None):
    """Pure torch: q | k | v = RMSNorm(x) Wᵀ + b for x [M, K] (weight's rows: n_heads q heads, then the caches' Hk
    k heads and Hk v heads), each q and k head normalized by RMSNorm with q_norm's and k_norm's weights where
    qk_norm = (q_norm's, k_norm's) (Qwen3; eps, offset and cast as x's), then `rope_into_cache_reference` with cos,
    sin [M, D]; returns the rotated q [M, Hq, D]."""
    check_norm_linear_args(x, norm_weight, weight, bias, cast)
    M, Hk, D = x.shape[0], k_cache.shape[1], k_cache.shape[3]
    qkv = F.linear(rms_norm_reference(x, norm_weight, eps, offset, cast), weight, bias)
    q, k, v = (t.view(M, 1, -1, D) for t in qkv.split([n_heads * D, Hk * D, Hk * D], dim=-1))
    if qk_norm is not None:
        q, k = (rms_norm_reference(t, w, eps, offset, cast) for t, w in zip((q, k), qk_norm, strict=True))
    return rope_into_cache_reference(q, k, v, cos[:, None], sin[:, None], k_cache, v_cache, at)[:, 0]


# ----------------------------------------------------------------------------- softcapped attention

def softcap_attention_reference(q, k, v, mask, scale, softcap):
    """Softcapped softmax attention with explicit scores (Gemma 2), as transformers' eager attention computes it:
    s = softcap · tanh(scale · q kᵀ / softcap), masked, softmax in fp32 rounded to q's dtype, then p v.
    q (B, Hq, T, D); k, v (B, Hk, S, D), Hk dividing Hq (query heads h·rep .. h·rep + rep - 1 read kv head h).
    mask: None (causal, S = T) or a bool tensor broadcasting to (B, 1, T, S), True where a key is visible.
    Every row must see a key (a row of -inf is NaN here). Returns (B, Hq, T, D) in q's dtype."""
    B, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    if mask is not None and T == 1:
        # One query a row (a decoding step): the rep query heads that read one kv head become rep query rows of
        # that head, under the row's mask broadcast over them, so k and v are read as they are.
        q = q.reshape(B, Hq // rep, rep, D)
    else:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, T, S), or (B, Hk, rep, S) for one query a row
    s = softcap * torch.tanh(s / softcap)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p @ v).reshape(B, Hq, T, D)


class KeyRange(NamedTuple):
    """Which keys each query sees, for the flash kernel (kernels/softcap_attention.py), in O(T) memory: query i of
    row b sees the keys lo[b, i] <= j <= i, and key j is seen by the queries j <= i <= hi[b, j]. It describes
    causal rows, each document of a packed row (a run of equal doc ids), and a sliding window."""
    lo: torch.Tensor  # int32 (B, T): the first key that query i sees, non-decreasing along a row
    hi: torch.Tensor  # int32 (B, T): the last query that sees key j, non-decreasing along a row


def key_range(shape, window=None, doc_ids=None, device=None) -> KeyRange:
    """The KeyRange of rows of shape (B, T): causal, within each document of doc_ids (B, T) (None: one document a
    row) and, with a window, to the last `window` keys (its own included). Device tensors only (no host sync: a
    CUDA graph captures it)."""
    B, T = shape
    i = torch.arange(T, device=device)
    if doc_ids is None:
        lo = torch.zeros(B, T, dtype=torch.long, device=device)
    else:  # a document starts at a row's first token and wherever the id changes: lo is its start
        new = torch.ones(B, T, dtype=torch.bool, device=device)
        new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        lo = torch.where(new, i, 0).cummax(dim=1).values
    if window is not None:
        lo = torch.maximum(lo, i - window + 1)
    # lo is non-decreasing, so the queries with lo[i] <= j are a prefix: the last of them is the last that sees j.
    hi = torch.searchsorted(lo, i.expand(B, T).contiguous(), right=True) - 1
    return KeyRange(lo.to(torch.int32), hi.to(torch.int32))


# ----------------------------------------------------------------------------- SwiGLU / GeGLU

GELU_APPROXIMATIONS = ("tanh", "none")


def check_glu_args(name, *tensors, approximate=None):
    """gate, up (and dh) of one shape and dtype; `approximate` is checked for GeGLU only."""
    if approximate is not None and approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"{name}: approximate={approximate!r}; expected one of {GELU_APPROXIMATIONS}")
    shape, dtype = tensors[0].shape, tensors[0].dtype
    assert dtype in DTYPES, f"{name}: inputs must be fp32/bf16/fp16, got {dtype}"
    for t in tensors[1:]:
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"{name}: gate, up (and dh) must share shape and dtype; got {tuple(shape)} {dtype} "
                             f"and {tuple(t.shape)} {t.dtype}")


def swiglu_reference(gate, up):
    """Pure torch, as HF LlamaMLP (in the inputs' dtype)."""
    return F.silu(gate) * up


def geglu_reference(gate, up, approximate="tanh"):
    """Pure torch, as HF GemmaMLP (in the inputs' dtype)."""
    check_glu_args("geglu", gate, up, approximate=approximate)
    return F.gelu(gate, approximate=approximate) * up


# ----------------------------------------------------------------------------- DoRA's backward

def check_dora_backward_args(dy, p, g, inv, out=None):
    """dY, P (and out) (N, C) of one dtype, g (C,) in it, inv (C,) in fp32."""
    assert p.dtype in DTYPES, f"dora_backward: P must be fp32/bf16/fp16, got {p.dtype}"
    assert p.dim() == 2 and dy.shape == p.shape and dy.dtype == p.dtype, \
        f"dora_backward: dY and P must share a 2-D shape and dtype; got {tuple(dy.shape)} {dy.dtype}, {tuple(p.shape)}"
    assert g.shape == inv.shape == p.shape[1:] and g.dtype == p.dtype and inv.dtype == torch.float32, \
        f"dora_backward: g ({p.shape[1]},) in {p.dtype} and inv ({p.shape[1]},) in fp32; got {g.dtype}, {inv.dtype}"
    assert out is None or (out.shape == p.shape and out.dtype == p.dtype), "dora_backward: out must be like P"


def dora_backward_reference(dy, p, g, inv, out=None):
    """(g ⊙ dY, Σ_n dY ⊙ P · inv) in torch: dP in dY's dtype (into `out` when given), dm in fp32. It also takes
    fp64 (gradcheck runs), which the kernel does not."""
    dm = (dy * p).sum(0, dtype=torch.float32).mul_(inv)
    return torch.mul(dy, g, out=out) if out is not None else dy * g, dm


# ----------------------------------------------------------------------------- LoRA's dY products

def check_adapter_grads_args(dyt, p, b, r, q_out):
    """dYᵀ (M·out, N) with unit stride along N, P (N, M·r), the block B (M·out, M·r) and q_out (M·r, N) or None, one
    dtype."""
    assert dyt.dtype in DTYPES, f"adapter_grads: dY must be fp32/bf16/fp16, got {dyt.dtype}"
    assert dyt.dim() == p.dim() == b.dim() == 2 and r > 0 and p.shape[1] % r == 0, \
        f"adapter_grads: 2-D dYᵀ, P, B and P's columns a multiple of r; got {tuple(dyt.shape)}, {tuple(p.shape)}, r={r}"
    members = p.shape[1] // r
    F, N = dyt.shape
    assert F % members == 0 and p.shape[0] == N and b.shape == (F, members * r), \
        f"adapter_grads: dYᵀ (M·out, N), P (N, M·r), B (M·out, M·r); got {tuple(dyt.shape)}, {tuple(p.shape)}, " \
        f"{tuple(b.shape)}"
    assert p.dtype == b.dtype == dyt.dtype, "adapter_grads: dYᵀ, P and B must share a dtype"
    assert N < 2 or dyt.stride(1) == 1, "adapter_grads: dYᵀ must have unit stride along N"
    assert p.stride(1) == 1 and b.stride(1) == 1, "adapter_grads: P and B with unit column stride"
    assert q_out is None or (q_out.shape == (members * r, N) and q_out.dtype == dyt.dtype and q_out.is_contiguous()), \
        f"adapter_grads: q_out (M·r, N) contiguous in dYᵀ's dtype, got {tuple(q_out.shape)} {q_out.dtype}"


def adapter_grads_reference(dyt, p, b, scale, r, q_out=None, amax=None):
    """`kernels.adapter_grads.adapter_grads` in torch: (dB_m = dY_mᵀ P_m stacked (M·out, r) in fp32, (s dY B)ᵀ in
    dyt's dtype, into q_out when given, and with amax dY's e4m3 copy `fp8_quantize_tensor_reference(dyt.t(), amax)`,
    else None). It also takes fp64, which the kernel does not."""
    members = p.shape[1] // r
    out = dyt.shape[0] // members
    acc = torch.float64 if dyt.dtype == torch.float64 else torch.float32
    d, pa = dyt.to(acc), p.to(acc)
    db = torch.cat([d[m * out:(m + 1) * out] @ pa[:, m * r:(m + 1) * r] for m in range(members)])
    q = b.t().to(acc) @ d * scale
    fp8 = None if amax is None else fp8_quantize_tensor_reference(dyt.t(), amax)
    return db, q.to(dyt.dtype) if q_out is None else q_out.copy_(q), fp8


# ----------------------------------------------------------------------------- an fp8 output's residual and adapter

def check_residual_lowrank_add_args(y, residual, p, b):
    N, C = y.shape
    k = p.shape[-1]
    if residual.shape != y.shape or p.shape != (N, k) or b.shape != (C, k):
        raise ValueError(f"residual_lowrank_add_: y and residual (N, C), p (N, k), b (C, k); got {tuple(y.shape)}, "
                         f"{tuple(residual.shape)}, {tuple(p.shape)}, {tuple(b.shape)}")
    if len({t.dtype for t in (y, residual, p, b)}) > 1 or len({t.device for t in (y, residual, p, b)}) > 1:
        raise ValueError("residual_lowrank_add_: y, residual, p and b must share one dtype and one device")
    if y.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("residual_lowrank_add_: y and residual need unit column strides")


def residual_lowrank_add_reference(y, residual, p, b):
    """y += residual + p bᵀ in place, in fp32 with one rounding, and returns y."""
    check_residual_lowrank_add_args(y, residual, p, b)
    return y.copy_(torch.addmm(y.float() + residual.float(), p.float(), b.float().t()))


# ----------------------------------------------------------------------------- DoRA's norms

def check_dora_norms_args(w, a, b, m, ends, dtype):
    """W (Σout, in) in fp32/bf16/fp16; A (Σr, in), B (Σout, R), m (Σout,) in fp32, contiguous; `ends` the members'
    last rows + 1, at most three, the last Σout, each member R rows of A."""
    out_features, in_features = w.shape
    assert w.dtype in DTYPES and dtype in DTYPES, f"dora_norms: W and g must be fp32/bf16/fp16, got {w.dtype}, {dtype}"
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in (w, a, b, m)[1:]) and w.is_contiguous(), \
        "dora_norms: A, B and m must be contiguous fp32, W contiguous"
    assert a.shape == (len(ends) * b.shape[1], in_features) and b.shape[0] == out_features == m.shape[0], \
        f"dora_norms: shapes W {tuple(w.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)}, m {tuple(m.shape)} disagree"
    assert 1 <= len(ends) <= 3 and ends[-1] == out_features and list(ends) == sorted(ends), \
        f"dora_norms: one to three members ending at Σout, got ends {list(ends)}"


def dora_norms_reference(w, a, b, m, ends, scale, dtype):
    """(g, inv) of `kernels.dora_norm.dora_norms` in torch: the norms of W + s·B_blk·A, each member's rows of B with
    its own rows of A, in fp32 (fp64 for fp64 inputs)."""
    acc = torch.promote_types(w.dtype, torch.float32)
    r, starts = b.shape[1], [0, *ends[:-1]]
    delta = torch.cat([b[s:e].to(acc) @ a[j * r:(j + 1) * r].to(acc) for j, (s, e) in enumerate(zip(starts, ends))])
    inv = torch.linalg.vector_norm(w.to(acc) + scale * delta, dim=1).reciprocal()
    return (m.to(acc) * inv).to(dtype), inv


def check_merge_args(w, a, b, m, view, out):
    """W (out, in) contiguous in out's dtype (fp32/bf16/fp16) and on its device; A (r, in) and B (out, r) contiguous
    fp32, or both None; m (out,) fp32 or None; `view` (out, in) contiguous rows of `out`."""
    out_features, in_features = w.shape
    assert out.dtype in DTYPES and w.dtype == out.dtype and w.device == out.device and w.is_contiguous(), \
        f"merge: W must be contiguous in the output's dtype (fp32/bf16/fp16), got {w.dtype} for {out.dtype}"
    assert (a is None) == (b is None), "merge: A and B come together"
    assert all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in (a, b, m)), \
        "merge: A, B and m must be contiguous fp32"
    assert a is None or (a.shape[1] == in_features and b.shape == (out_features, a.shape[0])), \
        f"merge: shapes W {tuple(w.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)} disagree"
    assert m is None or m.shape == (out_features,), f"merge: m {tuple(m.shape)} for {out_features} rows"
    start = view.data_ptr() - out.data_ptr()
    assert view.shape == w.shape and view.is_contiguous() and view.dtype == out.dtype and 0 <= start and \
        start + view.numel() * view.element_size() <= out.numel() * out.element_size(), \
        "merge: each member's view is (out, in) contiguous rows of the output"


def merged_weight_reference(w, a, b, m, scale, dtype):
    """`kernels.dora_norm.MergeTable`'s W' of one member in torch: W + s·B·A (with m: each row scaled to
    m / ‖W + s·B·A‖), in fp32 (fp64 for fp64 inputs), returned in `dtype`."""
    acc = torch.promote_types(w.dtype, torch.float32)
    merged = w.to(acc) if a is None else w.to(acc) + scale * (b.to(acc) @ a.to(acc))
    if m is not None:
        merged = merged * (m.to(acc) / torch.linalg.vector_norm(merged, dim=1))[:, None]
    return merged.to(dtype)


# ----------------------------------------------------------------------------- cross-entropy

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class LossOptions:
    """The numerics shared by cross_entropy and fused_linear_cross_entropy."""
    ignore_index: int
    softcap: float | None
    scale: float | None
    reduction: str


def check_loss_args(logits_or_hidden, targets, opts: LossOptions, name: str):
    if opts.reduction not in REDUCTIONS:
        raise ValueError(f"reduction={opts.reduction!r}; expected one of {REDUCTIONS}")
    if opts.softcap is not None and not opts.softcap > 0:
        raise ValueError(f"softcap={opts.softcap}; expected a positive number, or None for no cap")
    if logits_or_hidden.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits_or_hidden.shape[0]:
        raise ValueError(f"{name} must be [N, *] and targets [N]; got {tuple(logits_or_hidden.shape)} and "
                         f"{tuple(targets.shape)}. Flatten batch and time first: x.reshape(-1, x.shape[-1]).")
    assert logits_or_hidden.dtype in DTYPES, f"{name} must be fp32/bf16/fp16, got {logits_or_hidden.dtype}"
    assert targets.dtype == torch.int64, f"targets must be int64, got {targets.dtype}"


def reduce_losses(losses, targets, num_targets, opts: LossOptions):
    """(loss, denominator) from per-row fp32 losses [N]: the losses themselves ("none"), their sum
    ("sum"), or their sum / denominator ("mean"). The denominator is max(num_targets, 1), where
    num_targets defaults to the non-ignored targets; it is a python float, or an fp32 0-dim device
    tensor (counted on the device: never a host sync). It is 1.0 unless the reduction is "mean"."""
    denominator = 1.0
    if opts.reduction == "mean":
        if num_targets is None:
            num_targets = (targets != opts.ignore_index).sum()
        if isinstance(num_targets, torch.Tensor):
            denominator = num_targets.to(device=targets.device, dtype=torch.float32).clamp(min=1.0)
        else:
            denominator = float(max(num_targets, 1))
    if opts.reduction == "none":
        return losses, denominator
    total = losses.sum()
    return (total / denominator if opts.reduction == "mean" else total), denominator


def cross_entropy_reference(logits, targets, *, ignore_index=-100, softcap=None, scale=None, reduction="mean",
                            num_targets=None):
    """Pure torch, fp32 math: the definition the kernel is tested against."""
    opts = LossOptions(ignore_index, softcap, scale, reduction)
    check_loss_args(logits, targets, opts, "logits")
    z = logits.float()
    if scale is not None:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    losses = F.cross_entropy(z, targets, ignore_index=ignore_index, reduction="none")  # (N,)
    return reduce_losses(losses, targets, num_targets, opts)[0]


# ----------------------------------------------------------------------------- sampling a decoding step's tokens

def check_sample_args(logits, temperature, noise):
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: the argmax), got {temperature}")
    if (noise is None) != (temperature == 0):
        raise ValueError("noise E ~ Exp(1) [B, V] must be given at a temperature > 0, and only then; "
                         f"got temperature {temperature} and noise {None if noise is None else tuple(noise.shape)}")
    if noise is not None and noise.shape != logits.shape:
        raise ValueError(f"noise must be [B, V] = {list(logits.shape)}, got {list(noise.shape)}")


def sample_tokens_reference(logits, temperature, noise=None):
    """(tokens (B,), logps (B,) float64): the float64 definition of kernels/sample.py. z = logits / T (T = 1 at
    temperature 0); token = argmax(z - log noise), or argmax(z) at temperature 0; logp = log_softmax(z) there."""
    check_sample_args(logits, temperature, noise)
    z = logits.double() / (temperature or 1.0)
    tokens = (z if noise is None else z - noise.double().log()).argmax(-1)
    return tokens, torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0]


# ----------------------------------------------------------------------------- fused linear cross-entropy

def check_linear_loss_args(hidden, weight, bias, targets, opts: LossOptions):
    check_loss_args(hidden, targets, opts, "hidden")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[1] = {hidden.shape[1]}; "
                         f"got {tuple(weight.shape)}")
    assert weight.dtype == hidden.dtype, f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}"
    if bias is not None:
        assert bias.shape == (weight.shape[0],), f"bias must be [V], got {tuple(bias.shape)}"
        assert bias.dtype == hidden.dtype, f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}"


def fused_linear_cross_entropy_reference(hidden, weight, targets, *, bias=None, ignore_index=-100, softcap=None,
                                         scale=None, reduction="mean", num_targets=None):
    """Pure torch: logits in the compute dtype, then the fp32 cross-entropy reference. On a CPU only the rows with a
    target take logits: a row without one has loss 0 and no gradient either way, and there the head's matmul is a
    large part of a small model's step, most of whose rows are often a prompt's. Elsewhere (a GPU with the kernels
    off, whose step a CUDA graph may capture) every row does, since which rows have a target depends on the data."""
    check_linear_loss_args(hidden, weight, bias, targets, LossOptions(ignore_index, softcap, scale, reduction))
    rows, n, keep = None, len(targets), targets != ignore_index
    if hidden.device.type == "cpu" and not bool(keep.all()):
        rows = keep.nonzero().squeeze(1)
        hidden, targets = hidden[rows], targets[rows]
    logits = F.linear(hidden, weight, bias)  # (rows, V)
    loss = cross_entropy_reference(logits, targets, ignore_index=ignore_index, softcap=softcap, scale=scale,
                                   reduction=reduction, num_targets=num_targets)
    if rows is None or reduction != "none":
        return loss
    return loss.new_zeros(n).index_put((rows,), loss)  # (N,): 0 where a row has no target


# ----------------------------------------------------------------------------- NF4 dequantization

# The 16 NF4 levels, quantiles of N(0, 1) scaled to [-1, 1] (Dettmers et al. 2023), as bitsandbytes lists them
# (`functional.get_4bit_type("nf4")`); code i is the level NF4_LEVELS[i].
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
NF4_BLOCK = 64  # weight values per absmax scale
NF4_ABSMAX_BLOCK = 256  # absmax codes per fp32 scale (double quantization)


class NF4Data(NamedTuple):
    """An NF4 weight of n values with double-quantized absmax scales, in bitsandbytes' layout
    (`quantize_4bit(..., blocksize=64, compress_statistics=True, quant_type="nf4")`)."""
    packed: torch.Tensor  # (ceil(n/2), ...) uint8: value 2j in the high nibble of byte j, value 2j+1 in the low
    absmax: torch.Tensor  # (ceil(n/64),) uint8: each 64-value block's scale, as a code of absmax_code
    absmax_scale: torch.Tensor  # (ceil(n/64/256),) fp32: the scale of each 256 absmax codes
    absmax_offset: torch.Tensor  # () fp32: the mean the absmax scales were centred on before quantization
    absmax_code: torch.Tensor  # (256,) fp32: the levels of the absmax codes (bitsandbytes' signed dynamic map)


def check_nf4_args(q: NF4Data, numel):
    n_blocks = -(-numel // NF4_BLOCK)
    expected = {"packed": (torch.uint8, numel - numel // 2), "absmax": (torch.uint8, n_blocks),
                "absmax_scale": (torch.float32, -(-n_blocks // NF4_ABSMAX_BLOCK)), "absmax_offset": (torch.float32, 1),
                "absmax_code": (torch.float32, 256)}
    for name, (dtype, count) in expected.items():
        t = getattr(q, name)
        if t.dtype != dtype or t.numel() != count or t.device != q.packed.device:
            raise ValueError(f"NF4 dequantize: {name} must be {count} {dtype} values on {q.packed.device} for a "
                             f"weight of {numel} values; got {t.numel()} {t.dtype} on {t.device}")


def nf4_block_absmax(q: NF4Data):
    """Each 64-value block's absmax scale a_b = D[c_b] · s_{b // 256} + o, fp32, as bitsandbytes computes it."""
    scale = q.absmax_scale.repeat_interleave(NF4_ABSMAX_BLOCK)[:len(q.absmax)]
    return q.absmax_code[q.absmax.long()] * scale + q.absmax_offset


def nf4_dequantize_reference(q: NF4Data, shape, dtype):
    """Pure torch, operation for operation as bitsandbytes' `dequantize_4bit`: the absmax scales in fp32
    (code times scale, then plus offset), each value's level times its scale in fp32, one rounding to `dtype`."""
    numel = math.prod(shape)
    check_nf4_args(q, numel)
    absmax = nf4_block_absmax(q)  # (n_blocks,)
    packed = q.packed.reshape(-1)
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1)[:numel].long()
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=packed.device)
    values = levels[codes] * absmax.repeat_interleave(NF4_BLOCK)[:numel]
    return values.to(dtype).reshape(shape)


# ----------------------------------------------------------------------------- FP8 (e4m3) quantization

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value: 1.75 · 2^8


def fp8_scale(amax):
    """The fp32 scale s = amax / 448 that maps values of magnitude up to amax onto e4m3's range, x ≈ s · e4m3(x / s);
    1 where s would be below fp32's smallest normal 2^-126 (an all-zero row, or one so small that 1 / s would
    overflow: e4m3 rounds it to zeros either way, and 1 never divides by zero)."""
    amax = amax.float()  # the quotient in fp64, then rounded once: IEEE's fp32 division on every device (CUDA's
    # tensor / scalar multiplies by the reciprocal, one ulp off the kernels' `div_rn`)
    s = (amax.double() / E4M3_MAX).float()
    return torch.where(s >= 2.0**-126, s, torch.ones_like(s))


def fp8_reciprocal(scale):
    """1 / scale in fp32, rounded once (the fp64 quotient rounded to fp32 is the correctly rounded fp32 one): the
    factor the kernels multiply by, one division per row instead of one per value."""
    return (1.0 / scale.double()).float()


def to_e4m3(x):
    """x (fp32) to e4m3fn, nearest even, saturating: a magnitude past 448 gives ±448, as the kernels store it (torch's
    own cast gives NaN from 464 on)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def fp8_quantize_rows_reference(x):
    """(q, s): each row of x [M, K] (any strides, fp32/bf16/fp16) quantized to e4m3 with its own scale,
    s_m = fp8_scale(max_k |x_mk|) (M,) fp32 and q = e4m3(x_m · (1 / s_m)) (M, K) contiguous, rounded to nearest
    even; the product and the reciprocal in fp32, as the kernel computes them."""
    assert x.dim() == 2 and x.dtype in DTYPES, f"fp8 quantize: x must be 2-D fp32/bf16/fp16, got {x.shape} {x.dtype}"
    xf = x.float()
    s = fp8_scale(xf.abs().amax(dim=1)) if x.shape[1] else torch.ones(len(x), device=x.device)
    return to_e4m3(xf * fp8_reciprocal(s)[:, None]).contiguous(), s


def fp8_quantize_tensor_reference(x, amax=None):
    """(q, s): all of x [M, K] (any strides, fp32/bf16/fp16) quantized to e4m3 with one scale,
    fp8_scale(max_mk |x_mk|) given once per row, s (M,) fp32, and q = e4m3(x · (1 / s)) (M, K) contiguous, rounded
    to nearest even; the product and the reciprocal in fp32, as the kernel computes them. amax: max |x| where the
    caller has it (0-d), used as given."""
    assert x.dim() == 2 and x.dtype in DTYPES, f"fp8 quantize: x must be 2-D fp32/bf16/fp16, got {x.shape} {x.dtype}"
    xf = x.float()
    if not x.numel():
        s = torch.ones((), device=x.device)
    else:
        s = fp8_scale(xf.abs().amax() if amax is None else amax)
    return to_e4m3(xf * fp8_reciprocal(s)).contiguous(), s.expand(len(x)).contiguous()


def nf4_to_fp8_reference(q: NF4Data, shape, scale, transposed=False):
    """W [R, K] of `q` (as nf4_dequantize_reference gives it in fp32) quantized to e4m3 with the given fp32 scales:
    e4m3(W_rk · (1 / scale_r)) [R, K], or transposed: e4m3(W_rk · (1 / scale_k)) stored as Wᵀ [K, R], contiguous;
    the product and the reciprocal in fp32, as the kernel computes them."""
    w = nf4_dequantize_reference(q, shape, torch.float32)
    if transposed:
        return to_e4m3(w * fp8_reciprocal(scale)[None, :]).t().contiguous()
    return to_e4m3(w * fp8_reciprocal(scale)[:, None])


# ----------------------------------------------------------------------------- AdamW over fp32 masters

@torch.no_grad()
def adamw_master_reference(master, exp_avg, exp_avg_sq, grad, weight, factor, found_inf, coefs, *, lr, weight_decay,
                           betas, eps):
    """kernels/adamw_master.py's step, in place, operation for operation in fp32 (its docstring has the math)."""
    if found_inf.item():
        return
    g = grad.float() * factor
    master.sub_(lr * weight_decay * master)
    exp_avg.mul_(betas[0]).add_((1 - betas[0]) * g)
    exp_avg_sq.mul_(betas[1]).add_((1 - betas[1]) * g * g)
    master.sub_(coefs[0] * exp_avg / (exp_avg_sq.sqrt() / coefs[1] + eps))
    weight.copy_(master)

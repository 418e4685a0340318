"""A decoding step's MLP input: RMSNorm in the prologue of the gate | up GEMM and SwiGLU in its epilogue, so that
the norm's output and G, U never leave the program: one launch where a norm, a GEMM and an activation ran.

References: kernels/decode_linear.py (the skinny GEMM, its split-K and its norm prologue); kernels/rms_norm.py
(the norm, rounded as it rounds); kernels/swiglu.py (the activation, operation for operation); Hugging Face
LlamaMLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))` after `post_attention_layernorm`).

For rows x [M, K] (the residual stream after the attention's add), W [2I, K] holding gate's rows, then up's (the
layout `pack_weights_` stores), and each program's BLOCK_N columns n of G and the same columns of U (two dots,
one x tile):

    x̂ = RMSNorm(x)                                  each program computes the rms of the M rows itself
    G = round(x̂ W[n]ᵀ + b[n]),  U = round(x̂ W[I + n]ᵀ + b[I + n])      fp32 sums (split-K as in decode_linear)
    H = round(G σ(G) U)

G and U are rounded to x's dtype as the GEMM's output is before the activation reads it. Given x's `Scaled` rows
(written by the o projection's launch, kernels/decode_linear.py), the loop multiplies xs as it is, and the sums are
scaled by rstd (from ss) before the bias: G = round(rstd · xs W[n]ᵀ + b[n]). Forward only.

Reference: kernels.references.decode_swiglu_reference.
"""
import triton
import triton.language as tl

from kernels.decode_linear import (
    NUM_WARPS,
    Workspace,
    _after_previous,
    _norm_stats,
    _normed_pair,
    _prefetch_rows,
    _scaled_pair,
    _sum_pair,
    block_m,
    dot_constexprs,
    launch_config,
    num_stages,
    pdl_constexprs,
    program_columns,
    scaled_args,
    scaled_input,
)
from kernels.references import DTYPES, check_norm_linear_args

WIDE = 1 << 24  # weight elements (gate's and up's) from which a program takes 64 columns of each, not 32: the wider
# tiles stream a 7-8B model's gate | up faster, a 0.5B model's slower (dev/perf-notes.md)


@triton.jit
def _decode_swiglu_kernel(
    x_ptr, nw_ptr, w_ptr, b_ptr, h_ptr,  # x [M, K]; nw [K]; w [2N, K]; b [2N]; h [M, N]: contiguous
    ss_ptr,  # a `Scaled` x's sums of squares [T, M] fp32 (NORMALIZE False)
    ws_ptr, count_ptr,  # fp32 [SPLIT, 2 · tiles, BLOCK_M, BLOCK_N]; int32 [tiles], zeros
    M, N, K, K_CHUNK, T, eps, offset,
    NORMALIZE: tl.constexpr, T_STEPS: tl.constexpr,
    GEMMA_CAST: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    if PDL:  # the weight rows on their way to L2 while the previous kernel runs
        _prefetch_rows(w_ptr, cols, cols < N, K, k_lo, k_hi, BLOCK_K)
        _prefetch_rows(w_ptr, N + cols, cols < N, K, k_lo, k_hi, BLOCK_K)
    _after_previous(PDL)
    stats = _norm_stats(x_ptr, ss_ptr, rows, M, K, T, eps, NORMALIZE, BLOCK_M, BLOCK_K, T_STEPS)
    acc_g, acc_u = _normed_pair(x_ptr, nw_ptr, w_ptr, rows, M, K, k_lo, k_hi, stats, offset, cols, N + cols, cols < N,
                                NORMALIZE, GEMMA_CAST, DTYPE, OPERAND, PRECISION,
                                BLOCK_M, BLOCK_N, BLOCK_K)
    acc_g, acc_u, last = _sum_pair(acc_g, acc_u, ws_ptr, count_ptr, tile, split, SPLIT, BLOCK_M, BLOCK_N)
    if last:
        acc_g, acc_u = _scaled_pair(acc_g, acc_u, stats, K, eps, NORMALIZE)
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def decode_swiglu(x, norm_weight, weight, bias, workspace: Workspace, eps=1e-6, offset=0.0, cast="llama",
                  block_n: int | None = None):
    """H = silu(G) ⊙ U, [G | U] = RMSNorm(x) Wᵀ + b: x [M, K] (M <= 64), norm_weight [K] (offset and cast as in
    kernels/rms_norm.py), weight [2I, K] (gate's rows, then up's), bias [2I] or None, one dtype; a new [M, I]
    tensor. x may be a `Scaled` (kernels/decode_linear.py) of the rows for this norm, which the kernel multiplies as
    they are. workspace: the split-K buffers (kernels/decode_linear.py). block_n: a program's columns of G and of U
    (default: by the weight's size, `program_columns` from WIDE elements). No gradients."""
    scaled, x = x, scaled_input(x)
    check_norm_linear_args(x, norm_weight, weight, bias, cast)
    assert x.dtype in DTYPES, f"decode_swiglu: fp32/bf16/fp16, got {x.dtype}"
    if weight.shape[0] % 2:
        raise ValueError(f"decode_swiglu: weight must hold gate's rows and up's, an even count; got {weight.shape[0]}")
    M, K = x.shape
    N = weight.shape[0] // 2
    block_n = block_n or program_columns(weight, WIDE)
    x, weight = x.contiguous(), weight.contiguous()
    h = x.new_empty(M, N)
    tiles = triton.cdiv(N, block_n)
    split, chunk, block_k = launch_config(tiles, K, x)
    bm = block_m(M)
    ws, counts = workspace.get(split * 2 * tiles * bm * block_n if split > 1 else 0, tiles, x.device)
    ss, T, constexprs = scaled_args(scaled, ws)
    _decode_swiglu_kernel[(tiles, split)](
        x, norm_weight, weight, weight if bias is None else bias, h, ss, ws, counts, M, N, K, chunk, T, eps, offset,
        **constexprs, GEMMA_CAST=cast == "gemma", HAS_BIAS=bias is not None, SPLIT=split, **dot_constexprs(x),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, **pdl_constexprs(x), num_warps=NUM_WARPS,
        num_stages=num_stages((bm + 2 * block_n) * block_k, x))
    assert h.dtype == x.dtype, f"decode_swiglu: h must be {x.dtype}, got {h.dtype}"
    return h

"""A decoding step's MLP input: RMSNorm in the prologue of the gate | up GEMM and SwiGLU (or GeGLU) in its epilogue,
so that the norm's output and G, U never leave the program: one launch where a norm, a GEMM and an activation ran.

References: kernels/decode_linear.py (the skinny GEMM, its split-K and its norm prologue); kernels/rms_norm.py
(the norm, rounded as it rounds); kernels/swiglu.py and kernels/geglu.py (the activations, operation for
operation); Hugging Face LlamaMLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))` after
`post_attention_layernorm`), Gemma2DecoderLayer (the sandwich norms around each sublayer).

For rows x [M, K] (the residual stream after the attention's add), W [2I, K] holding gate's rows, then up's (the
layout `pack_weights_` stores), and each program's BLOCK_N columns n of G and the same columns of U (two dots,
one x tile):

    x̂ = RMSNorm(x)                                  each program computes the rms of the M rows itself
    G = round(x̂ W[n]ᵀ + b[n]),  U = round(x̂ W[I + n]ᵀ + b[I + n])      fp32 sums (split-K as in decode_linear)
    H = round(act(G) U)                             act: silu (G σ(G)), or gelu (tanh-approximate or erf)

G and U are rounded to x's dtype as the GEMM's output is before the activation reads it. Given x's `Scaled` rows
(written by the o projection's launch, kernels/decode_linear.py), the loop multiplies xs as it is, and the sums are
scaled by rstd (from ss) before the bias: G = round(rstd · xs W[n]ᵀ + b[n]). With sandwich norms (Gemma 2/3) the
attention's add comes after its own norm, so x arrives as a `Sandwich`: the residual stream r and o's output z
(its `Scaled` rows for post_attention_layernorm), x = round(r + round(rstd_z · zs)) computed in the prologue's rms
pass and in each tile of the loop, and written once (program (0, 0)) for the add after the MLP. Forward only.

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
    _sandwich_rstd,
    _scaled_pair,
    _sum_pair,
    block_m,
    dot_constexprs,
    input_args,
    launch_config,
    num_stages,
    pdl_constexprs,
    program_columns,
    scaled_input,
)
from kernels.geglu import _gelu_and_grad
from kernels.references import DTYPES, check_norm_linear_args

WIDE = 1 << 24  # weight elements (gate's and up's) from which a program takes 64 columns of each, not 32: the wider
# tiles stream a 7-8B model's gate | up faster, a 0.5B model's slower (dev/perf-notes.md)


@triton.jit
def _decode_swiglu_kernel(
    x_ptr, nw_ptr, w_ptr, b_ptr, h_ptr,  # x [M, K]; nw [K]; w [2N, K]; b [2N]; h [M, N]: contiguous
    ss_ptr,  # a `Scaled` x's sums of squares [T, M] fp32 (NORMALIZE False)
    zs_ptr, zss_ptr, xo_ptr,  # a `Sandwich`'s z rows [M, K], their sums of squares [TZ, M] fp32 and out [M, K]
    ws_ptr, count_ptr,  # fp32 [SPLIT, 2 · tiles, BLOCK_M, BLOCK_N]; int32 [tiles], zeros
    M, N, K, K_CHUNK, T, TZ, eps, offset,
    NORMALIZE: tl.constexpr, T_STEPS: tl.constexpr, SANDWICH: tl.constexpr, TZ_STEPS: tl.constexpr,
    GEMMA_CAST: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
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
    zrstd = _sandwich_rstd(zss_ptr, rows, M, K, TZ, eps, SANDWICH, BLOCK_M, TZ_STEPS)
    stats = _norm_stats(x_ptr, ss_ptr, zs_ptr, zrstd, xo_ptr, (tile == 0) & (split == 0), rows, M, K, T, eps,
                        NORMALIZE, SANDWICH, BLOCK_M, BLOCK_K, T_STEPS)
    acc_g, acc_u = _normed_pair(x_ptr, nw_ptr, w_ptr, zs_ptr, zrstd, rows, M, K, k_lo, k_hi, stats, offset, cols,
                                N + cols, cols < N, NORMALIZE, SANDWICH, GEMMA_CAST, DTYPE, OPERAND, PRECISION,
                                BLOCK_M, BLOCK_N, BLOCK_K)
    acc_g, acc_u, last = _sum_pair(acc_g, acc_u, ws_ptr, count_ptr, tile, split, SPLIT, BLOCK_M, BLOCK_N)
    if last:
        acc_g, acc_u = _scaled_pair(acc_g, acc_u, stats, K, eps, NORMALIZE)
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
        if ACT == "silu":
            h = g * tl.sigmoid(g) * u
        else:  # "gelu_tanh" or "gelu" (erf)
            h = _gelu_and_grad(g, ACT == "gelu_tanh")[0] * u
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def decode_swiglu(x, norm_weight, weight, bias, workspace: Workspace, eps=1e-6, offset=0.0, cast="llama",
                  block_n: int | None = None, act="silu"):
    """H = act(G) ⊙ U, [G | U] = RMSNorm(x) Wᵀ + b: x [M, K] (M <= 64), norm_weight [K] (offset and cast as in
    kernels/rms_norm.py), weight [2I, K] (gate's rows, then up's), bias [2I] or None, one dtype; a new [M, I]
    tensor; act "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU). x may be a `Scaled` (kernels/decode_linear.py) of
    the rows for this norm, which the kernel multiplies as they are, or a `Sandwich`, whose rows r + RMSNorm(z)
    the kernel normalizes and writes to its out. workspace: the split-K buffers (kernels/decode_linear.py).
    block_n: a program's columns of G and of U (default: by the weight's size, `program_columns` from WIDE
    elements). No gradients."""
    scaled, x = x, scaled_input(x)
    check_norm_linear_args(x, norm_weight, weight, bias, cast)
    assert x.dtype in DTYPES, f"decode_swiglu: fp32/bf16/fp16, got {x.dtype}"
    if act not in ("silu", "gelu_tanh", "gelu"):
        raise ValueError(f"decode_swiglu: act must be silu, gelu_tanh or gelu; got {act!r}")
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
    inputs, (T, TZ), constexprs = input_args(scaled, ws)
    _decode_swiglu_kernel[(tiles, split)](
        x, norm_weight, weight, weight if bias is None else bias, h, *inputs, ws, counts, M, N, K, chunk, T, TZ, eps,
        offset, **constexprs, GEMMA_CAST=cast == "gemma", HAS_BIAS=bias is not None, ACT=act, SPLIT=split,
        **dot_constexprs(x),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, **pdl_constexprs(x), num_warps=NUM_WARPS,
        num_stages=num_stages((bm + 2 * block_n) * block_k, x))
    assert h.dtype == x.dtype, f"decode_swiglu: h must be {x.dtype}, got {h.dtype}"
    return h

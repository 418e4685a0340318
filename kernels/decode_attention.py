"""Attention of one query a row over a static KV cache, read in place, on tensor cores: one Triton program per
(row, kv head), which takes all rep = Hq / Hk query heads of its kv head as the rows of its matrix products, so
each k and v is read once (grouped-query attention without repeating k and v).

References: Milakov & Gimelshein 2018 "Online normalizer calculation for softmax" and Dao et al.
2022 "FlashAttention" (the running max and sum); Dao 2023 "FlashAttention-2" (the probabilities rounded to the
inputs' dtype for their product with v); Gemma 2's attention logit softcapping; model/transformer.py's `attend`
(the path this replaces on a decoding step) and model/generate.py's `KVCache.mask` (which slots a row sees).

Row b's query at slot `at` sees the slots j with lo <= j <= at, lo = first[b] (its first slot that
holds its own tokens; 0 without `first`), raised to at - window + 1 on a sliding-window layer. For
the query heads Q (rep, D) of kv head h, over that head's K, V (slots, D), in fp32:

    S = scale · Q Kᵀ                       (rep, slots)   (with a softcap c: S = c · tanh(S / c))
    Y = softmax(S) V = Σ_j exp(S_:j - m) V_j / Σ_j exp(S_:j - m),   m = max_j S_:j (per query head)

The program walks the visible slots in blocks of BLOCK_S (`launch_config`) with the running max m, sum l and
accumulator: per block, S = Q Kᵀ and P V are tl.dot products of (BLOCK_REP, D) by (D, BLOCK_S) and (BLOCK_REP,
BLOCK_S) by (BLOCK_S, D), the rep query heads padded to BLOCK_REP >= 16 rows (the smallest M of a tensor-core
product; the padding rows' q is 0 and they are never stored). Slots outside [lo, at] get S = -inf.

Grid: B · Hk programs (32 for a rollout's 16 rows of Qwen2.5-0.5B with its 2 kv heads, on an H100's 132 SMs).
A decoding step's attention is bound by latency, not by bytes or products: a program's chain is the load of its
k and v tiles (issued together; 16 KiB each at D 64 for up to 128 slots), two tensor-core products, the softmax
update and the store, and a rollout's rows see tens to a few hundred slots, one to three blocks. Splitting the
slots over more programs (flash-decoding) shortens nothing of that chain at these lengths and adds a pass that
combines the parts; a row that sees thousands of slots walks them all, NUM_STAGES blocks in flight.

Rounding: q, k and v enter the products in their dtype (bf16/fp16: tensor-core products accumulated in fp32;
fp32: IEEE fp32 products, not tf32); P is rounded to that dtype before P V, as FlashAttention-2 and SDPA's
kernels do, while l sums the fp32 P; every elementwise value is fp32, and Y is rounded once, at the store.
`first` and `at` are device tensors, so a CUDA graph of the step replays at every position. On Hopper the launch
is a programmatic dependent one, as the decoding GEMMs' (kernels/decode_linear.py): the program waits for the
previous kernel before its first load. Forward only.

Reference: kernels.references.decode_attention_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.decode_linear import _after_previous, pdl_constexprs
from kernels.references import DTYPES, check_decode_attention_args
from kernels.softcap_attention import TL_DTYPES, _dot
from kernels.tanh import tanh

NUM_WARPS = 4
NUM_STAGES = 2  # k and v of the next block load while this one's products run


def launch_config(rep: int, D: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_REP, BLOCK_S, BLOCK_D): a program's products take its kv head's rep query heads padded to BLOCK_REP
    rows (at least 16, the smallest tensor-core M), and blocks of BLOCK_S slots whose k and v tiles hold 8192
    values each in bf16/fp16 (16 KiB: 128 slots at D 64, 64 at D 128, 32 at D 256) and 2048 in fp32, whose products
    run on the CUDA cores with their operands in registers (32 slots at D 64, 16 from D 128). NUM_STAGES of the
    tiles in shared memory stay far within sm_80's 163 KiB (tests/test_kernels_compile.py)."""
    block_d = max(16, triton.next_power_of_2(D))
    values = 2048 if dtype == torch.float32 else 8192
    return max(16, triton.next_power_of_2(rep)), max(16, min(128, values // block_d)), block_d


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [B, HK * REP, D] contiguous
    k_ptr, v_ptr,  # [B, HK, S, D] contiguous
    y_ptr,  # [B, HK * REP, D] contiguous
    first_ptr, at_ptr,  # int64 [B] (if HAS_FIRST), int64 [1]
    S, HK, window, scale, softcap,
    D: tl.constexpr,  # one compile per head size: the compiler knows a row of k's length and alignment, and vectorizes
    REP: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_REP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    _after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLOCK_REP)[:, None]  # the query heads of kv head h; rows from REP on are padding
    d = tl.arange(0, BLOCK_D)[None, :]
    q_offs = ((b * HK + h) * REP + r) * D + d  # (BLOCK_REP, BLOCK_D)
    q_mask = (r < REP) & (d < D)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)  # q, k, v stay in their dtype: the products' operands
    at = tl.load(at_ptr)
    lo = tl.load(first_ptr + b) if HAS_FIRST else at * 0
    if HAS_WINDOW:
        lo = tl.maximum(lo, at - window + 1)
    kv = (b * HK + h) * S * D
    m = tl.full([BLOCK_REP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_REP], tl.float32)  # noqa: E741 (the softmax's running sum, as the papers name it)
    acc = tl.zeros([BLOCK_REP, BLOCK_D], tl.float32)
    j = tl.arange(0, BLOCK_S)
    for start in range(lo, at + 1, BLOCK_S):  # every block holds a visible slot (its first): m is finite after it
        slots = start + j  # (BLOCK_S,)
        visible = slots <= at
        kv_offs = kv + slots[:, None] * D + d  # (BLOCK_S, BLOCK_D)
        kv_mask = visible[:, None] & (d < D)
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DTYPE, OPERAND, PRECISION) * scale  # (BLOCK_REP, BLOCK_S)
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + _dot(p, v, DTYPE, OPERAND, PRECISION)  # p rounded to DTYPE, as SDPA does
        m = m_new
    y = acc / l[:, None]
    tl.store(y_ptr + q_offs, y.to(y_ptr.dtype.element_ty), mask=q_mask)


def decode_attention(q, k_cache, v_cache, first, at, scale, window=None, softcap=None):
    """y [B, 1, Hq, D], q's dtype: q [B, 1, Hq, D] attending over k_cache, v_cache [B, Hk, S, D] at slot at[0]
    (int64 [1]), each row from its slot first[b] (int64 [B]; None: slot 0), within `window` slots (None: all)."""
    check_decode_attention_args(q, k_cache, v_cache, first, at)
    assert q.dtype in DTYPES and k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    B, _, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    y = torch.empty_like(q)
    if B > 0:
        rep = Hq // Hk
        block_rep, block_s, block_d = launch_config(rep, D, q.dtype)
        dtype = TL_DTYPES[q.dtype]
        _decode_attention_kernel[(B, Hk)](
            q, k_cache, v_cache, y, at if first is None else first, at, S, Hk,
            0 if window is None else window, scale, 1.0 if softcap is None else softcap,
            D=D, REP=rep, HAS_FIRST=first is not None, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
            BLOCK_REP=block_rep, BLOCK_S=block_s, BLOCK_D=block_d,
            DTYPE=dtype, OPERAND=dtype if q.is_cuda else tl.float32,  # fp32 in the interpreter: see `_dot`
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **pdl_constexprs(q), num_warps=NUM_WARPS,
            num_stages=NUM_STAGES)
    assert y.dtype == q.dtype, f"decode_attention: y must be {q.dtype}, got {y.dtype}"
    return y

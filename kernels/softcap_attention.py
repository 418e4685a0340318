"""Softcapped flash attention (Gemma 2), forward and backward: no (T, T) tensor is ever stored.

References: Dao 2023 "FlashAttention-2" (the online softmax, the saved log-sum-exp, the backward that
recomputes the scores per tile) and the Triton tutorial "Fused Attention"; Gemma 2's attention logit
softcapping; kernels.references.softcap_attention_reference (what transformers' eager attention does).

For query i and key j, in fp32, with c the softcap:

    z = scale · q_i · k_j;   t = tanh(z / c);   s = c · t       (s = -inf where j is not visible from i)
    p = softmax_j(s) = exp(s - L_i),   L_i = log Σ_j exp(s_j);   y_i = Σ_j p_ij v_j

Query i sees the keys lo_i <= j <= i (`KeyRange`: causal, within its document, within a window). The forward
walks the visible key tiles with a running max and sum and saves L. With dy the output's gradient:

    dv_j = Σ_i p_ij dy_i
    dp_ij = dy_i · v_j;   ds_ij = p_ij (dp_ij - D_i),   D_i = dy_i · y_i   (= Σ_j p_ij dp_ij)
    dz_ij = ds_ij (1 - t_ij²)                            since d(c tanh(z/c))/dz = 1 - tanh²
    dq_i = scale · Σ_j dz_ij k_j;   dk_j = scale · Σ_i dz_ij q_i

One backward kernel walks, for a tile of keys, every query tile that sees it (key j is seen by queries
j <= i <= hi_j), for all rep query heads of its kv head, and writes dk and dv (no atomics); a second walks,
for a tile of queries, its key tiles and writes dq. Both recompute p from q, k and L.

A row that sees no key (none occurs with causal rows, but the kernels guard it) gets y = 0, L = +inf, so its
p is 0 in backward and every gradient it sends is 0, never NaN.

Layout: the kernels read q, k, v, dy and write y, dq, dk, dv as (B, T, heads, D) tensors, token-major, which
is how the model's projections lay them out (its (B, heads, T, D) views are transposes of them): no copy.
Grouped kv heads are read in place. The tiles of q, k, v and dy feed tl.dot as they are loaded, and p and dz
are rounded to the inputs' dtype for theirs, as FlashAttention-2 does (bf16/fp16 tensor-core products accumulate
in fp32; fp32 inputs multiply in IEEE fp32, not tf32); every elementwise value is fp32, and each result is rounded
once, at its store. Block sizes are fixed per head size and dtype
(`launch_config`): no autotuning.
"""
import torch
import triton
import triton.language as tl

from kernels.references import KeyRange
from kernels.tanh import tanh

HALF = (torch.float16, torch.bfloat16)


def launch_config(D: int, dtype: torch.dtype, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) for head size D. A tile of each of q, k, v (and dy,
    backward) sits in shared memory per pipeline stage, and the backward's accumulators (dk and dv, or dq) in
    registers: the tiles shrink as D grows so that D 256 fits sm_80's 163 KiB (tests/test_kernels_compile.py)."""
    block_d = max(16, triton.next_power_of_2(D))
    if dtype not in HALF:  # fp32: twice the bytes a tile
        return 32, 32, 4, 1
    if block_d <= 64:
        return (64, 64, 4, 2) if backward else (128, 64, 4, 3)
    if block_d <= 128:
        return (64, 64, 8, 2) if backward else (128, 64, 8, 2)
    return (64, 32, 8, 1) if backward else (64, 32, 4, 2)


@triton.jit
def _dot(a, b, DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b in fp32 of operands rounded to DTYPE (the inputs' dtype), multiplied as OPERAND: DTYPE on a GPU, fp32
    in Triton's interpreter (CPU), whose tl.dot reads bf16 operands as integers (the raw 16 bits);
    test_interpreter_multiplies_bf16_as_integers in tests/test_softcap_attention.py says when that is fixed."""
    return tl.dot(a.to(DTYPE).to(OPERAND), b.to(DTYPE).to(OPERAND), input_precision=PRECISION)


@triton.jit
def _capped_scores(q, k, lo, rows, cols, scale, softcap, DTYPE: tl.constexpr, OPERAND: tl.constexpr,
                   PRECISION: tl.constexpr):
    """t = tanh(z / c) of the scores z = q kᵀ · scale (BLOCK_M, BLOCK_N), and which keys each query sees: those
    from its first visible key lo to itself."""
    z = _dot(q, tl.trans(k), DTYPE, OPERAND, PRECISION) * scale
    t = tanh(z / softcap)
    visible = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= rows[:, None])
    return t, visible


@triton.jit
def _probabilities(q, k, lse, lo, rows, cols, scale, softcap, DTYPE: tl.constexpr, OPERAND: tl.constexpr,
                   PRECISION: tl.constexpr):
    """p (BLOCK_M, BLOCK_N) from the saved log-sum-exp, 0 where a key is not visible, and t = tanh(z / c)."""
    t, visible = _capped_scores(q, k, lo, rows, cols, scale, softcap, DTYPE, OPERAND, PRECISION)
    p = tl.where(visible, tl.exp(softcap * t - lse[:, None]), 0.0)
    return p, t


@triton.jit
def _tile(b, positions, head, heads, d, T, D):
    """The offsets and mask of the (positions, D) tile of head `head` of row b in a (B, T, heads, D) tensor."""
    offs = ((b * T + positions[:, None]) * heads + head) * D + d[None, :]
    return offs, (positions[:, None] < T) & (d[None, :] < D)


@triton.jit
def _keys(k_ptr, v_ptr, b, cols, head, HK, d, T, D):
    """The k and v tiles of keys `cols` of kv head `head` of row b, and their offsets and mask."""
    offs, mask = _tile(b, cols, head, HK, d, T, D)
    return tl.load(k_ptr + offs, mask=mask, other=0.0), tl.load(v_ptr + offs, mask=mask, other=0.0), offs, mask


@triton.jit
def _query_block(lo_ptr, T, HQ, BLOCK_M: tl.constexpr):
    """A query program's row b, head h, first row m0 and rows, and the keys its queries see: from the block's first
    query's first visible key (lo is non-decreasing: it sees the furthest back) to its last query."""
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64) // HQ
    h = tl.program_id(1).to(tl.int64) % HQ
    rows = m0 + tl.arange(0, BLOCK_M)
    start = tl.load(lo_ptr + b * T + m0)
    end = tl.minimum(m0 + BLOCK_M, T)
    return b, h, rows, start, end


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, T, HQ, D), (B, T, HK, D), (B, T, HK, D), contiguous
    y_ptr, lse_ptr,  # (B, T, HQ, D); fp32 (B, T, HQ)
    lo_ptr,  # int32 (B, T)
    T, HQ, HK, D, scale, softcap,
    REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
):
    b, h, rows, start, end = _query_block(lo_ptr, T, HQ, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    q_offs, q_mask = _tile(b, rows, h, HQ, d, T, D)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    lo = tl.load(lo_ptr + b * T + rows, mask=rows < T, other=T)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + cols0
        k, v, _, _ = _keys(k_ptr, v_ptr, b, cols, h // REP, HK, d, T, D)
        t, visible = _capped_scores(q, k, lo, rows, cols, scale, softcap, DTYPE, OPERAND, PRECISION)
        s = tl.where(visible, softcap * t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: exp(-inf) = 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, v, DTYPE, OPERAND, PRECISION)
        m_i = m_new
    empty = l_i == 0.0
    y = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(y_ptr + q_offs, y.to(y_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + (b * T + rows) * HQ + h, lse, mask=rows < T)


@triton.jit
def _query_rows(q_ptr, dy_ptr, lse_ptr, delta_ptr, lo_ptr, b, h, rows, d, T, HQ, D):
    """The backward's tiles of query rows `rows` of head h: q and dy, their offsets and mask, and per row L, D and
    the first visible key (a row past T: L = +inf and no key, so it adds nothing)."""
    in_t = rows < T
    q_offs, q_mask = _tile(b, rows, h, HQ, d, T, D)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    dy = tl.load(dy_ptr + q_offs, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + (b * T + rows) * HQ + h, mask=in_t, other=float("inf"))
    delta = tl.load(delta_ptr + (b * T + rows) * HQ + h, mask=in_t, other=0.0)
    lo = tl.load(lo_ptr + b * T + rows, mask=in_t, other=T)
    return q, dy, lse, delta, lo, q_offs, q_mask


@triton.jit
def _backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, dy_ptr,  # as in the forward; dy like q
    lse_ptr, delta_ptr,  # fp32 (B, T, HQ): L and D = rowsum(dy ⊙ y)
    lo_ptr, hi_ptr,  # int32 (B, T)
    dk_ptr, dv_ptr,  # like k, v
    T, HQ, HK, D, scale, softcap,
    REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1).to(tl.int64) // HK
    hk = tl.program_id(1).to(tl.int64) % HK
    cols = n0 + tl.arange(0, BLOCK_N)
    rows0 = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    k, v, kv_offs, kv_mask = _keys(k_ptr, v_ptr, b, cols, hk, HK, d, T, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    end = tl.load(hi_ptr + b * T + tl.minimum(n0 + BLOCK_N, T) - 1) + 1  # hi is non-decreasing: the last key's
    for r in range(REP):
        h = hk * REP + r
        for m0 in range(n0, end, BLOCK_M):  # a query before n0 sees none of these keys
            rows = m0 + rows0
            q, dy, lse, delta, lo, _, _ = _query_rows(q_ptr, dy_ptr, lse_ptr, delta_ptr, lo_ptr, b, h, rows, d, T,
                                                      HQ, D)
            p, t = _probabilities(q, k, lse, lo, rows, cols, scale, softcap, DTYPE, OPERAND, PRECISION)
            dv += _dot(tl.trans(p), dy, DTYPE, OPERAND, PRECISION)
            dp = _dot(dy, tl.trans(v), DTYPE, OPERAND, PRECISION)
            dz = p * (dp - delta[:, None]) * (1.0 - t * t)
            dk += _dot(tl.trans(dz), q, DTYPE, OPERAND, PRECISION)
    tl.store(dk_ptr + kv_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, dy_ptr, lse_ptr, delta_ptr, lo_ptr,  # as in _backward_dkdv_kernel
    dq_ptr,  # like q
    T, HQ, HK, D, scale, softcap,
    REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
):
    b, h, rows, start, end = _query_block(lo_ptr, T, HQ, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    q, dy, lse, delta, lo, q_offs, q_mask = _query_rows(q_ptr, dy_ptr, lse_ptr, delta_ptr, lo_ptr, b, h, rows, d, T,
                                                        HQ, D)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + cols0
        k, v, _, _ = _keys(k_ptr, v_ptr, b, cols, h // REP, HK, d, T, D)
        p, t = _probabilities(q, k, lse, lo, rows, cols, scale, softcap, DTYPE, OPERAND, PRECISION)
        dp = _dot(dy, tl.trans(v), DTYPE, OPERAND, PRECISION)
        dz = p * (dp - delta[:, None]) * (1.0 - t * t)
        dq += _dot(dz, k, DTYPE, OPERAND, PRECISION)
    tl.store(dq_ptr + q_offs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


def _token_major(x):
    """(B, T, heads, D) contiguous from a (B, heads, T, D) tensor: a view where x is a transpose of one."""
    return x.transpose(1, 2).contiguous()


TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _constexprs(x, rep, backward):
    """The constexprs and launch options for inputs like x (B, T, heads, D)."""
    D, dtype = x.shape[-1], TL_DTYPES[x.dtype]
    block_m, block_n, num_warps, num_stages = launch_config(D, x.dtype, backward)
    return dict(REP=rep, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), DTYPE=dtype,
                OPERAND=dtype if x.is_cuda else tl.float32, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                num_warps=num_warps, num_stages=num_stages)


def check_softcap_attention_args(q, k, v, keys: KeyRange, softcap):
    B, Hq, T, D = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"q must be (B, Hq, T, D) and k, v (B, Hk, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if Hq % k.shape[1]:
        raise ValueError(f"{k.shape[1]} kv heads do not divide {Hq} query heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, *HALF):
        raise ValueError(f"q, k, v must share one dtype of fp32, fp16, bf16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if D > 256:
        raise ValueError(f"head_dim {D} is over the kernel's 256")
    if keys.lo.shape != (B, T) or keys.hi.shape != (B, T) or keys.lo.dtype != torch.int32 \
            or keys.hi.dtype != torch.int32:
        raise ValueError(f"the KeyRange must hold int32 (B, T) = ({B}, {T}) tensors (kernels.references.key_range)")
    if softcap is None or softcap <= 0:
        raise ValueError(f"softcap must be a positive number, got {softcap}")


class _SoftcapAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keys, scale, softcap):
        assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
        B, Hq, T, D = q.shape
        Hk = k.shape[1]
        q, k, v = _token_major(q), _token_major(k), _token_major(v)
        lo, hi = keys.lo.contiguous(), keys.hi.contiguous()
        y = torch.empty_like(q)  # (B, T, Hq, D)
        lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
        c = _constexprs(q, Hq // Hk, backward=False)
        _forward_kernel[(triton.cdiv(T, c["BLOCK_M"]), B * Hq)](q, k, v, y, lse, lo, T, Hq, Hk, D, scale, softcap, **c)
        ctx.save_for_backward(q, k, v, y, lse, lo, hi)
        ctx.scale, ctx.softcap = scale, softcap
        assert y.dtype == q.dtype, f"softcap_attention: y must be {q.dtype}, got {y.dtype}"
        return y.transpose(1, 2)  # (B, Hq, T, D)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, lo, hi = ctx.saved_tensors
        assert dy.dtype == q.dtype, f"softcap_attention: dy must be {q.dtype}, got {dy.dtype}"
        B, T, Hq, D = q.shape
        Hk = k.shape[2]
        dy = _token_major(dy)
        delta = (dy.float() * y.float()).sum(-1)  # (B, T, Hq): D_i = dy_i · y_i
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        c = _constexprs(q, Hq // Hk, backward=True)
        args = (T, Hq, Hk, D, ctx.scale, ctx.softcap)
        _backward_dkdv_kernel[(triton.cdiv(T, c["BLOCK_N"]), B * Hk)](q, k, v, dy, lse, delta, lo, hi, dk, dv,
                                                                       *args, **c)
        _backward_dq_kernel[(triton.cdiv(T, c["BLOCK_M"]), B * Hq)](q, k, v, dy, lse, delta, lo, dq, *args, **c)
        assert dq.dtype == dk.dtype == dv.dtype == q.dtype, (dq.dtype, dk.dtype, dv.dtype)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None


def softcap_attention(q, k, v, keys: KeyRange, scale, softcap):
    """softmax(softcap · tanh(scale · q kᵀ / softcap), over the keys `keys` lets each query see) v: q (B, Hq, T, D),
    k, v (B, Hk, T, D) with Hk dividing Hq, one dtype (fp32, fp16, bf16), D <= 256; keys from
    kernels.references.key_range. Returns (B, Hq, T, D) in q's dtype (a transpose of a (B, T, Hq, D) tensor)."""
    check_softcap_attention_args(q, k, v, keys, softcap)
    return _SoftcapAttention.apply(q, k, v, keys, float(scale), float(softcap))

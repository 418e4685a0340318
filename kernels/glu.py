"""The launchers SwiGLU and GeGLU share: one elementwise Triton program per BLOCK elements of
gate and up, the forward writing h, the backward writing dgate and dup.

A GLU kernel takes (gate_ptr, up_ptr, scale_ptr, bias_ptr, h_ptr, amax_ptr, n, n_cols, terms, ...) forward and
(dh_ptr, gate_ptr, up_ptr, scale_ptr, bias_ptr, dgate_ptr, dup_ptr, amax_ptr, n, n_cols, terms, dh_term, ...)
backward, plus its own constexprs, AFFINE, HAS_BIAS, AMAX, the low-rank ones (`terms_args`) and BLOCK; `tile`
places a program's elements, `load_gate_up` reads gate and up for both and `load_dh` dh backward. With
inplace=True the backward writes dgate over gate and dup over up, each element being read before it
is overwritten: for fused callers (the LoRA MLP) that own gate and up and are done with them.

Per-row affine (DoRA's scaling of the MLP's gate and up, model/lora.py): with `scale` (2 · rows,)
and optionally `bias` (2 · rows,) for gate and up of shape (rows, n_cols), the activation reads

    G = gate ⊙ scale[:rows] + bias[:rows],   U = up ⊙ scale[rows:] + bias[rows:]     (per row)

in fp32 registers, in place of gate and up, and the backward returns dG and dU (the gradients with
respect to G and U, not to gate and up): new tensors, since the caller still reads gate and up.

write_h (backward): the kernel also stores h = act(G) * U over dh, each element after it is read, with the
forward's expression (the same bits): the LoRA MLP reads h after dh is spent (the down adapter's dA), and
would otherwise run the forward again over gate and up. The kernels take it as the constexpr WRITE_H.

amax: the largest |value| the call stores (h forward, dgate and dup backward), as the values are stored, into
a given 0-d tensor of their dtype: each program stores the largest of its tiles' (`block_amax`, constexpr AMAX),
one reduction over those follows. With --fp8 (model/fp8.py) the MLP's H and [dG | dU] take one e4m3 scale each from
their amax: this saves the pass over them that would find it.

Low-rank terms (the LoRA MLP's adapters, model/lora.py): for gate and up of shape (rows, n_cols), `terms` =
((L_gate, R_gate), (L_up, R_up)) with each L (rows, k) and R (n_cols, k), and backward's `dh_term` = (L_h, R_h)
likewise, the kernels read

    G = gate + L_gate R_gateᵀ,   U = up + L_up R_upᵀ,   dH = dh + L_h R_hᵀ        (Σ over k, in fp32 registers)

in place of gate, up and dh: the adapters' products s (X Aᵀ) Bᵀ and s (dY B) A, which would otherwise be added
into the full (rows, n_cols) tensors in a pass of their own (a read and a write of each) before the activation
reads them. Backward recomputes G and U from the same terms, with the forward's bits. A program then takes a
strip of BLOCK_C columns and, one after the other, up to STEPS tiles of BLOCK_R rows down it (constexpr TERMS), in
place of BLOCK consecutive elements, so that each term is a tensor-core product over k (`lowrank_term`); L and R
are small and read from L2. R's rows are the strip's columns, the same for every tile down it: the program reads
their first chunk of k (every rank up to MAX_BLOCK_K whole) once, before its loop (`strip_right`). The loop over the
tiles is software-pipelined (STAGES): the next tile's loads are in flight while this one's products and stores run,
which a program of one tile, waiting on L2 for L and R and on HBM for gate and up in turn, cannot do. gate's and
up's terms are not taken with the affine (they would belong before it).
"""
import torch
import triton
import triton.language as tl

from kernels.decode_linear import dot_constexprs
from kernels.softcap_attention import _dot

BLOCK = 1024
NUM_WARPS = 4
# With low-rank terms: a program's strip of BLOCK_C columns and up to STEPS tiles of BLOCK_R rows, pipelined in
# STAGES; the terms' k in chunks of up to MAX_BLOCK_K, one tensor-core product each (an adapter's rank 16 in one).
# 16 × 128 tiles, 8 a strip, are the fastest of those measured on an H200 at 7-8B and 0.5-1B MLP shapes
# (dev/benchmarks-history.md, section 36, "The activation's terms: R read once a strip, 16-row tiles"). Where the
# terms pay on an H100 (the same section, "The MLP adapters inside the activation" and "The activation's adapter
# terms as pipelined strips"; dev/perf-notes.md, "The adapters' terms below MIN_TERM_ELEMENTS"): gate of at least
# 2^24 elements, both of its dimensions multiples of ALIGN (a tile's rows then load as whole vectors); elsewhere the
# add pass beside the 1-d kernel is faster.
BLOCK_R, BLOCK_C, STEPS, STAGES, TILE_WARPS = 16, 128, 8, 3, 4
MAX_BLOCK_K = 64
# The pipelined loop holds the next tiles' L and R in shared memory: half-precision terms of k up to MAX_PIPELINED_K
# fit an sm_80's; others take the loop unpipelined (STAGES 1).
MAX_PIPELINED_K = 64
MIN_TERM_ELEMENTS, ALIGN = 1 << 24, 16


def terms_pay(gate):
    """Whether the low-rank terms belong inside the kernels for a gate like `gate` (module docstring): on a GPU where
    it is large enough and its dimensions are aligned, and always in Triton's interpreter (CPU), where the tests run
    them."""
    return not gate.is_cuda or (gate.numel() >= MIN_TERM_ELEMENTS and all(d % ALIGN == 0 for d in gate.shape))


@triton.jit
def tile_steps(n, n_cols, TERMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STEPS: tl.constexpr):
    """How many tiles the program takes: one block of BLOCK elements, or with TERMS its strip's row tiles (up to
    STEPS, fewer at the operands' last rows)."""
    if TERMS:
        first = (tl.program_id(0) // tl.cdiv(n_cols, BLOCK_C)) * STEPS
        return tl.minimum(STEPS, tl.cdiv(n // n_cols, BLOCK_R) - first)
    else:
        return 1


@triton.jit
def strip_cols(n_cols, BLOCK_C: tl.constexpr):
    """The columns of the program's strip (BLOCK_C,), with low-rank terms: the same for every tile down it."""
    return (tl.program_id(0) % tl.cdiv(n_cols, BLOCK_C)) * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def tile(step, n, n_cols, TERMS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
         STEPS: tl.constexpr):
    """(offs, mask, rows, cols) of the program's elements at its step-th tile: BLOCK consecutive ones (offs 1-d;
    rows and cols are offs, unused), or with TERMS the step-th BLOCK_R × BLOCK_C tile down its strip of the
    (n // n_cols, n_cols) operands (offs 2-d)."""
    if TERMS:
        rows = ((tl.program_id(0) // tl.cdiv(n_cols, BLOCK_C)) * STEPS + step) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = strip_cols(n_cols, BLOCK_C)
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        mask = (rows[:, None] < n // n_cols) & (cols[None, :] < n_cols)
        return offs, mask, rows, cols
    else:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        return offs, offs < n, offs, offs


@triton.jit
def term_right(term, cols, n_cols, chunk, BLOCK_K: tl.constexpr):
    """R[cols, c]ᵀ (BLOCK_K, BLOCK_C) for the chunk's c, zeros outside R: a term's right operand (`lowrank_term`)."""
    l_ptr, l_stride0, l_stride1, r_ptr, r_stride0, r_stride1, k = term
    c = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(r_ptr + cols[None, :] * r_stride0 + c[:, None] * r_stride1,
                   mask=(cols[None, :] < n_cols) & (c[:, None] < k), other=0.0)


@triton.jit
def strip_right(term, n_cols, TERM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """The term's first chunk of R over the program's strip of columns (`strip_cols`), read once for all its tiles; 0
    where the kernel takes no such term (a stand-in it never reads)."""
    if TERM:
        right = term_right(term, strip_cols(n_cols, BLOCK_C), n_cols, 0, BLOCK_K)
    else:
        right = 0
    return right


@triton.jit
def strip_rights(terms, n_cols, TERMS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """gate's and up's `strip_right` for terms = (gate's, up's); (0, 0) without them."""
    if TERMS:
        gate_term, up_term = terms
        rights = (strip_right(gate_term, n_cols, True, BLOCK_C, BLOCK_K),
                  strip_right(up_term, n_cols, True, BLOCK_C, BLOCK_K))
    else:
        rights = (0, 0)
    return rights


@triton.jit
def lowrank_term(term, right, rows, cols, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, DTYPE: tl.constexpr, OPERAND: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Σ_c L[rows, c] R[cols, c] (BLOCK_R, BLOCK_C) in fp32, for term = (L, its two strides, R, its two strides, k):
    one tensor-core product a chunk of BLOCK_K along k, K_CHUNKS of them (unrolled, so that the loop around stays
    one loop for the pipeliner), zeros outside L and R. right: R's first chunk over `cols` (`term_right`), read
    already; the further chunks are read here."""
    l_ptr, l_stride0, l_stride1, r_ptr, r_stride0, r_stride1, k = term
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for chunk in tl.static_range(K_CHUNKS):
        c = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        left = tl.load(l_ptr + rows[:, None] * l_stride0 + c[None, :] * l_stride1,
                       mask=(rows[:, None] < n_rows) & (c[None, :] < k), other=0.0)  # (BLOCK_R, BLOCK_K)
        if chunk == 0:
            acc += _dot(left, right, DTYPE, OPERAND, PRECISION)
        else:
            acc += _dot(left, term_right(term, cols, n_cols, chunk, BLOCK_K), DTYPE, OPERAND, PRECISION)
    return acc


@triton.jit
def load_gate_up(gate_ptr, up_ptr, scale_ptr, bias_ptr, terms, rights, offs, mask, rows, cols, n, n_cols,
                 AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr, TERMS: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, DTYPE: tl.constexpr,
                 OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    """(G, U) in fp32 at `offs`: gate and up as stored, or their per-row affine, or with TERMS gate + L_gate R_gateᵀ
    and up + L_up R_upᵀ on the program's tile, terms = (gate's, up's) (`lowrank_term`; see the module docstring),
    rights their `strip_rights`."""
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AFFINE:
        row = offs // n_cols
        n_rows = n // n_cols
        g = g * tl.load(scale_ptr + row, mask=mask, other=0.0).to(tl.float32)
        u = u * tl.load(scale_ptr + n_rows + row, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g = g + tl.load(bias_ptr + row, mask=mask, other=0.0).to(tl.float32)
            u = u + tl.load(bias_ptr + n_rows + row, mask=mask, other=0.0).to(tl.float32)
    if TERMS:
        gate_term, up_term = terms
        gate_right, up_right = rights
        g += lowrank_term(gate_term, gate_right, rows, cols, n // n_cols, n_cols, BLOCK_R, BLOCK_C, BLOCK_K,
                          K_CHUNKS, DTYPE, OPERAND, PRECISION)
        u += lowrank_term(up_term, up_right, rows, cols, n // n_cols, n_cols, BLOCK_R, BLOCK_C, BLOCK_K, K_CHUNKS,
                          DTYPE, OPERAND, PRECISION)
    return g, u


@triton.jit
def load_dh(dh_ptr, dh_term, dh_right, offs, mask, rows, cols, n, n_cols, DH_TERM: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr,
            DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    """dH in fp32 at `offs`: dh as stored, or with DH_TERM dh + L_h R_hᵀ on the program's tile (`lowrank_term`),
    dh_right its `strip_right`."""
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if DH_TERM:
        dh += lowrank_term(dh_term, dh_right, rows, cols, n // n_cols, n_cols, BLOCK_R, BLOCK_C, BLOCK_K, K_CHUNKS,
                           DTYPE, OPERAND, PRECISION)
    return dh


@triton.jit
def block_amax(stored, mask):
    """max |stored| over the masked block (1-d or a 2-d tile), in fp32 (exact: one of stored's values): a program's
    share of a call's amax, stored in the call's dtype after its last tile."""
    return tl.max(tl.ravel(tl.where(mask, tl.abs(stored.to(tl.float32)), 0.0)), axis=0)


def amax_args(like, programs, amax):
    """The kernels' (amax_ptr, AMAX): a (programs,) buffer for each program's block amax where `amax` (a 0-d
    tensor of like's dtype) is to be filled, else `like` as a stand-in pointer the kernel never reads."""
    if amax is None:
        return dict(amax_ptr=like, AMAX=False)
    assert amax.shape == () and amax.dtype == like.dtype and amax.device == like.device, \
        f"glu: amax must be a 0-d {like.dtype} tensor on {like.device}, got {tuple(amax.shape)} {amax.dtype}"
    return dict(amax_ptr=like.new_empty(programs), AMAX=True)


def reduce_amax(args, amax):
    """Fill `amax` with the largest of the programs' block amaxes (`amax_args`)."""
    if amax is not None:
        torch.amax(args["amax_ptr"], dim=0, out=amax)


def affine_args(gate, scale, bias):
    """The kernels' (scale, bias, n_cols, AFFINE, HAS_BIAS) for a per-row affine of (rows, n_cols) gate and up;
    without `scale`, gate stands in for the pointers the kernel never reads (n_cols: gate's last dimension, which
    the low-rank terms' tiles read)."""
    if scale is None:
        return dict(scale_ptr=gate, bias_ptr=gate, n_cols=gate.shape[-1] if gate.dim() else 1, AFFINE=False,
                    HAS_BIAS=False)
    rows = len(gate)
    assert gate.dim() == 2 and scale.shape == (2 * rows,) and scale.is_contiguous(), \
        f"glu: a per-row scale is ({2 * rows},) for gate and up of {rows} rows, got {tuple(scale.shape)}"
    assert bias is None or (bias.shape == scale.shape and bias.is_contiguous()), "glu: bias must match scale"
    return dict(scale_ptr=scale, bias_ptr=scale if bias is None else bias, n_cols=gate.shape[1], AFFINE=True,
                HAS_BIAS=bias is not None)


def _term(left, right, rows, n_cols, name):
    """A low-rank term as the kernels take it: (L, its strides, R, its strides, k), L (rows, k) and R (n_cols, k)."""
    k = left.shape[-1]
    assert left.shape == (rows, k) and right.shape == (n_cols, k), \
        f"glu: {name} must be L ({rows}, k) and R ({n_cols}, k), got {tuple(left.shape)} and {tuple(right.shape)}"
    return (left, left.stride(0), left.stride(1), right, right.stride(0), right.stride(1), k)


def terms_args(gate, scale, terms=None, dh_term=None, backward=False):
    """The kernels' low-rank arguments and their grid's size: `terms` = ((L_gate, R_gate), (L_up, R_up)),
    `dh_term` = (L_h, R_h) of dh (backward only), each None or given (see the module docstring). Without either,
    the 1-d blocks of BLOCK elements, one a program (the tile constexprs then unused). BLOCK_K and K_CHUNKS: of the
    terms' largest k (`rank_blocks`)."""
    n = gate.numel()
    args = dict(terms=None, TERMS=terms is not None or dh_term is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                BLOCK_K=16, K_CHUNKS=1, STEPS=1, STAGES=1, **dot_constexprs(gate))
    if backward:
        args.update(dh_term=None, GATE_UP_TERMS=terms is not None, DH_TERM=dh_term is not None)
    if not args["TERMS"]:
        return args, triton.cdiv(n, BLOCK)
    assert terms is None or scale is None, "glu: gate's and up's low-rank terms are not taken with a per-row affine"
    assert gate.dim() == 2, f"glu: low-rank terms need 2-d gate and up (rows, n_cols), got {tuple(gate.shape)}"
    rows, n_cols = gate.shape
    for t in (*(terms[0] + terms[1] if terms else ()), *(dh_term or ())):
        assert t.device == gate.device and t.dtype == gate.dtype, \
            f"glu: the low-rank terms must be {gate.dtype} on {gate.device}, got {t.dtype} on {t.device}"
    ks = []  # each term's k
    if terms is not None:
        args["terms"] = (_term(*terms[0], rows, n_cols, "the gate term"), _term(*terms[1], rows, n_cols, "the up term"))
        ks += [t[-1] for t in args["terms"]]
    if dh_term is not None:
        args["dh_term"] = _term(*dh_term, rows, n_cols, "the dh term")
        ks.append(args["dh_term"][-1])
    k = max(ks)
    block_k, chunks = rank_blocks(k)
    args.update(BLOCK_K=block_k, K_CHUNKS=chunks, STEPS=STEPS, STAGES=tile_stages(gate.dtype, k))
    return args, triton.cdiv(rows, BLOCK_R * STEPS) * triton.cdiv(n_cols, BLOCK_C)


def rank_blocks(k):
    """(BLOCK_K, K_CHUNKS) of `lowrank_term` for a term of rank k: k's next power of two from 16 (a tensor-core
    product's least k) to MAX_BLOCK_K, and the chunks of that many that cover k."""
    block_k = min(MAX_BLOCK_K, max(16, triton.next_power_of_2(k)))
    return block_k, triton.cdiv(k, block_k)


def tile_stages(dtype, k):
    """The pipeline's STAGES for terms of rank k in `dtype` (MAX_PIPELINED_K)."""
    return STAGES if dtype.itemsize == 2 and k <= MAX_PIPELINED_K else 1


def glu_forward(kernel, gate, up, scale=None, bias=None, amax=None, terms=None, **constexprs):
    """h = act(G) * U by `kernel`, a new contiguous tensor of gate's shape and dtype; G, U = gate, up, or their
    per-row affine by scale and bias, or gate and up with low-rank terms ((L_gate, R_gate), (L_up, R_up)) added
    (see the module docstring). amax: a 0-d tensor to fill with max |h|."""
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = h.numel()
    if n > 0:
        lowrank, programs = terms_args(gate, scale, terms)
        extra = amax_args(h, programs, amax)
        kernel[(programs,)](gate, up, h_ptr=h, n=n, **affine_args(gate, scale, bias), **extra, **lowrank,
                            **constexprs, BLOCK=BLOCK, num_warps=TILE_WARPS if lowrank["TERMS"] else NUM_WARPS)
        reduce_amax(extra, amax)
    elif amax is not None:
        amax.zero_()
    return h


def glu_backward(kernel, dh, gate, up, inplace, name, scale=None, bias=None, write_h=False, amax=None, terms=None,
                 dh_term=None, **constexprs):
    """(dG, dU) by `kernel`: gate and up themselves when inplace (and no scale), else new tensors, rows of one
    (2, ...) buffer, so that dG and dU lie one after the other. write_h: (dG, dU, h), h written over dh (over
    its contiguous copy when dh is strided). amax: a 0-d tensor to fill with the largest |dG| or |dU|. terms,
    dh_term: low-rank terms added to gate and up (as forward) and to dh (see the module docstring)."""
    dh = dh.contiguous()
    if inplace and scale is None:
        if not (gate.is_contiguous() and up.is_contiguous()):
            raise ValueError(f"{name}(inplace=True) needs contiguous gate and up to overwrite")
        dgate, dup = gate, up
    else:
        gate, up = gate.contiguous(), up.contiguous()
        dgate, dup = gate.new_empty((2, *gate.shape)).unbind(0)
    n = dh.numel()
    if n > 0:
        lowrank, programs = terms_args(gate, scale, terms, dh_term, backward=True)
        extra = amax_args(dgate, programs, amax)
        kernel[(programs,)](dh, gate, up, dgate_ptr=dgate, dup_ptr=dup, n=n, **affine_args(gate, scale, bias),
                            **extra, **lowrank, **constexprs, WRITE_H=write_h, BLOCK=BLOCK,
                            num_warps=TILE_WARPS if lowrank["TERMS"] else NUM_WARPS)
        reduce_amax(extra, amax)
    elif amax is not None:
        amax.zero_()
    return (dgate, dup, dh) if write_h else (dgate, dup)

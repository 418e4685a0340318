"""DoRA's column scales for a packed projection group (model/lora.py, `_dora_scales`), in one launch:

    V = W + s · B_blk · A                        (out, in), never written
    inv_o = 1 / ‖V_o‖   (fp32),   g_o = m_o · inv_o   (in the compute dtype)

for projections that share an input and are stored side by side: W [Σout, in] their base weights, A [Σr, in] their
stacked LoRA A (members of one rank R, member j's rows j·R … j·R + R - 1), B [Σout, R] their stacked B, m [Σout]
their stacked magnitudes, s the group's scale. B_blk is the block-diagonal (Σout, Σr) matrix that puts each member's
B in its own columns; output row o belongs to member (o ≥ end₀) + (o ≥ end₁) (at most three members: q, k, v).

Each program takes BLOCK_O output rows and walks `in` in BLOCK_I columns: it loads W's tile, computes s · B_blk A of
the tile with one dot (B_blk's tile built in registers from B and the row's member; tf32x3: three tf32 tensor-core
products that together carry fp32's precision, where a plain fp32 dot would run on the CUDA cores, over B_blk's
zeros too), and adds the squares of W + s · B_blk A to its rows' sums. No (out, in) temporary is written, and the
norm is the direct one (no cancellation in an expanded form). All math in fp32, g rounded once, at the store. This
replaces the half-dozen small torch ops of the expanded form (W Aᵀ, A Aᵀ, their combination, the row dot, rsqrt,
m · inv) with one launch a group.

References: Liu et al. 2024 "DoRA" (§4.3: the norm is a constant in backward); PEFT `tuners/lora/dora.py`
(`get_weight_norm`).
Reference: kernels.references.dora_norms_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import check_dora_norms_args

BLOCK_O = 16  # output rows a program: Σout / 16 programs (36 to 192 at the SmolLM2 shape)
NUM_WARPS = 4


@triton.jit
def _dora_norm_kernel(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr, inv_ptr, OUT, IN, R, SR, end0, end1, scale,
                      BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_mask = rows < OUT
    member = (rows >= end0).to(tl.int32) + (rows >= end1).to(tl.int32)
    ks = tl.arange(0, BLOCK_R)  # rows of the stacked A
    k_mask = ks < SR
    k_member = ks // R
    # B_blk's tile (BLOCK_O, BLOCK_R): B[o, k - member·R] where row o and A's row k belong to one member, else 0
    b_mask = row_mask[:, None] & k_mask[None, :] & (member[:, None] == k_member[None, :])
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * R + (ks - k_member * R)[None, :], mask=b_mask, other=0.0)
    b = b.to(tl.float32) * scale
    sq = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for start in range(0, IN, BLOCK_I):
        cols = start + tl.arange(0, BLOCK_I)
        col_mask = cols < IN
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * IN + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_ptr + ks[:, None].to(tl.int64) * IN + cols[None, :], mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        v = w + tl.dot(b, a, input_precision="tf32x3")  # (BLOCK_O, BLOCK_I): W + s · B_blk A, ~fp32 exact
        sq += tl.sum(v * v, axis=1)
    inv = 1.0 / tl.sqrt_rn(tl.where(row_mask, sq, 1.0))  # rows past the end: 1, not 1 / 0 (never stored)
    m = tl.load(m_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(inv_ptr + rows, inv, mask=row_mask)
    tl.store(g_ptr + rows, (m * inv).to(g_ptr.dtype.element_ty), mask=row_mask)


def dora_norms(w, a, b, m, ends, scale, dtype):
    """(g, inv) (Σout,): g = m / ‖W + s·B_blk·A‖ in `dtype`, inv = 1 / ‖W + s·B_blk·A‖ in fp32, for W (Σout, in) in
    fp32/bf16/fp16, the fp32 stacked A (Σr, in), B (Σout, R) and m (Σout,), and `ends` each member's last row + 1."""
    check_dora_norms_args(w, a, b, m, ends, dtype)
    out_features, in_features = w.shape
    end0, end1 = (list(ends[:-1]) + [out_features] * 2)[:2]
    g = torch.empty(out_features, dtype=dtype, device=w.device)
    inv = torch.empty(out_features, dtype=torch.float32, device=w.device)
    _dora_norm_kernel[(triton.cdiv(out_features, BLOCK_O),)](
        w, a, b, m, g, inv, out_features, in_features, b.shape[1], len(a), end0, end1, scale, BLOCK_O=BLOCK_O,
        **launch_config(len(a)), num_warps=NUM_WARPS)
    return g, inv


def launch_config(stacked_rank):
    """BLOCK_R: the stacked rank Σr as a power of two, at least 16 (the dot's smallest); BLOCK_I: A's tile (BLOCK_R,
    BLOCK_I) kept to 8192 values (64 a thread), 16 to 128 columns."""
    block_r = max(16, triton.next_power_of_2(stacked_rank))
    return dict(BLOCK_R=block_r, BLOCK_I=min(128, max(16, 8192 // block_r)))

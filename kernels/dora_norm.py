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

`NormsTable` does the same for many groups in one launch (every packed group of every layer: model/dora_scales.py):
each group's tensors are described by their addresses in a table on the device, and each program reads its group's
row from it. A group's launch reads about 1 MB and is latency-bound; one launch for all of them is not.

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
def _norm_rows(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr, inv_ptr, first, OUT, IN, R, SR, end0, end1, scale,
               BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    """g and inv of a group's output rows first … first + BLOCK_O - 1."""
    rows = first + tl.arange(0, BLOCK_O)
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


@triton.jit
def _dora_norm_kernel(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr, inv_ptr, OUT, IN, R, SR, end0, end1, scale,
                      BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    _norm_rows(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr, inv_ptr, tl.program_id(0) * BLOCK_O, OUT, IN, R, SR, end0, end1,
               scale, BLOCK_O, BLOCK_I, BLOCK_R)


@triton.jit
def _dora_norms_table_kernel(groups_ptr, blocks_ptr, scales_ptr, g_ptr, inv_ptr,
                             BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    """A program's group and first row from `blocks` (programs, 2); the group's row of `groups` (groups, 11): the
    addresses of its W (in g's dtype), A, B, m (fp32), then its first row in g and inv, OUT, IN, R, SR, end0, end1
    (`NormsTable`)."""
    block = blocks_ptr + tl.program_id(0) * 2
    group = tl.load(block)
    first = tl.load(block + 1)
    row = groups_ptr + group.to(tl.int64) * 11
    w_ptr = tl.load(row).to(tl.pointer_type(g_ptr.dtype.element_ty))
    a_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    b_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    offset = tl.load(row + 4)
    OUT = tl.load(row + 5).to(tl.int32)
    IN = tl.load(row + 6).to(tl.int32)
    R = tl.load(row + 7).to(tl.int32)
    SR = tl.load(row + 8).to(tl.int32)
    end0 = tl.load(row + 9).to(tl.int32)
    end1 = tl.load(row + 10).to(tl.int32)
    _norm_rows(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr + offset, inv_ptr + offset, first, OUT, IN, R, SR, end0, end1,
               tl.load(scales_ptr + group), BLOCK_O, BLOCK_I, BLOCK_R)


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


class NormsTable:
    """`dora_norms` of many groups in one launch. groups: (W, A, B, m, ends, scale) per group as for `dora_norms`,
    every W in one dtype, the dtype of g too. The launch reads the tensors at the addresses they have now: the caller
    builds a new table when any of them moves (model/dora_scales.py), and never inside a CUDA graph's capture (the
    table is copied from host memory)."""

    def __init__(self, groups):
        for w, a, b, m, ends, _ in groups:
            check_dora_norms_args(w, a, b, m, ends, w.dtype)
        w0 = groups[0][0]
        assert all(w.dtype == w0.dtype and w.device == w0.device for w, *_ in groups), \
            "dora_norms: one table's W share a dtype and a device"
        descriptors, blocks, offset = [], [], 0
        for n, (w, a, b, m, ends, _) in enumerate(groups):
            out_features, in_features = w.shape
            end0, end1 = (list(ends[:-1]) + [out_features] * 2)[:2]
            descriptors.append([w.data_ptr(), a.data_ptr(), b.data_ptr(), m.data_ptr(), offset, out_features,
                                in_features, b.shape[1], len(a), end0, end1])
            blocks += [[n, first] for first in range(0, out_features, BLOCK_O)]
            offset += out_features
        self.groups = torch.tensor(descriptors, dtype=torch.int64, device=w0.device)  # (groups, 11)
        self.blocks = torch.tensor(blocks, dtype=torch.int32, device=w0.device)  # (programs, 2): group, first row
        self.scales = torch.tensor([s for *_, s in groups], dtype=torch.float32, device=w0.device)
        self.sizes = [len(w) for w, *_ in groups]
        self.dtype = w0.dtype
        self.config = launch_config(max(len(a) for _, a, *_ in groups))

    def __call__(self):
        """[(g, inv)] a group, as `dora_norms` gives them (views of one g and one inv buffer)."""
        g = torch.empty(sum(self.sizes), dtype=self.dtype, device=self.groups.device)
        inv = torch.empty(sum(self.sizes), dtype=torch.float32, device=self.groups.device)
        _dora_norms_table_kernel[(len(self.blocks),)](self.groups, self.blocks, self.scales, g, inv, BLOCK_O=BLOCK_O,
                                                      **self.config, num_warps=NUM_WARPS)
        return list(zip(g.split(self.sizes), inv.split(self.sizes)))

"""DoRA's column scales for a packed projection group (model/lora.py, `_dora_scales`), in one launch:

    V = W + s · B_blk · A                        (out, in), never written
    inv_o = 1 / ‖V_o‖   (fp32),   g_o = m_o · inv_o   (in the compute dtype)

for projections that share an input and are stored side by side: W [Σout, in] their base weights, A [Σr, in] their
stacked LoRA A (members of one rank R, member j's rows j·R … j·R + R - 1), B [Σout, R] their stacked B, m [Σout]
their stacked magnitudes, s the group's scale. B_blk is the block-diagonal (Σout, Σr) matrix that puts each member's
B in its own columns; output row o belongs to member (o ≥ end₀) + (o ≥ end₁) (at most three members: q, k, v).

Each program takes BLOCK_O output rows of one member j (a member's last block is partial, never shared with the
next member) and walks `in` in BLOCK_I columns: it loads W's tile and computes W + s · B_j A_j of the tile with one
dot that takes W's tile as its accumulator (B_j's rows (BLOCK_O, R) held in registers, A_j's tile (R, BLOCK_I);
tf32x3: three tf32 tensor-core products that together carry fp32's precision, where a plain fp32 dot would run on
the CUDA cores), and adds its squares to the rows' sums. The dot's K is one member's rank, not the stacked Σr with
B_blk's zeros, and its M is BLOCK_O (32 or 64 rows, `launch_config`): each program reads A_j once for BLOCK_O rows
of W. No (out, in) temporary is written, and the norm is the direct one (no cancellation in an expanded form). All
math in fp32, g rounded once, at the store. This replaces the half-dozen small torch ops of the expanded form (W Aᵀ,
A Aᵀ, their combination, the row dot, rsqrt, m · inv) with one launch a group.

`NormsTable` does the same for many groups in one launch (every packed group of every layer: model/dora_scales.py):
each group's tensors are described by their addresses in a table on the device, and each program reads its group's
row from it: a step's norms are one launch, not one a group.

`MergeTable` runs the same body in its merge mode (`MERGE`) over a table of projections: each program stores its
tile W + s·B·A, rounded once to W's dtype, into the projection's rows of an output buffer, instead of summing its
squares; with DoRA's m, it sums them first and stores the tile scaled by m / ‖W + s·B·A‖ (`model.lora.merged_weight`
computes the same in torch). Every adapted projection's merged weight of a rollout is then one launch
(`model.lora.MergedAdapters`; two where DoRA's members and plain ones mix), where torch takes half a dozen ops and
an (out, in) fp32 temporary a projection. Both loops over `in` load W's next tile before the dot of the one they
have.

References: Liu et al. 2024 "DoRA" (§4.3: the norm is a constant in backward); PEFT `tuners/lora/dora.py`
(`get_weight_norm`).
References in torch: kernels.references.dora_norms_reference, kernels.references.merged_weight_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import check_dora_norms_args, check_merge_args

NUM_WARPS = 4


@triton.jit
def _rows(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr, inv_ptr, out_ptr, first, end, member, IN, R, scale, norms,
          MERGE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    """A group's output rows first … min(first + BLOCK_O, end) - 1, all of member `member` (its rows of A:
    member·R … member·R + R - 1). MERGE False: their g and inv (`norms` True). MERGE True: V = W + s·B·A of the rows
    stored into out (in its dtype, rounded once), scaled row by row by m ⊙ inv where `norms` (DoRA's merged weight),
    which then walks `in` twice: once for the norms, once for the stores."""
    rows = first + tl.arange(0, BLOCK_O)
    row_mask = rows < end
    ks = tl.arange(0, BLOCK_R)  # the member's rows of A, columns of B
    k_mask = ks < R
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * R + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                other=0.0)
    b = b.to(tl.float32) * scale  # (BLOCK_O, BLOCK_R)
    a_rows = a_ptr + (member * R + ks)[:, None].to(tl.int64) * IN
    w_rows = w_ptr + rows[:, None].to(tl.int64) * IN
    factor = tl.full((BLOCK_O,), 1.0, tl.float32)  # each row's scale of V: 1, or DoRA's m / ‖V‖
    if norms:
        sq = tl.zeros((BLOCK_O,), dtype=tl.float32)
        w = _w_tile(w_rows, row_mask, 0, IN, BLOCK_I)
        for start in range(0, IN, BLOCK_I):
            w_next = _w_tile(w_rows, row_mask, start + BLOCK_I, IN, BLOCK_I)
            v, _, _ = _tile(w, a_rows, b, k_mask, start, IN, BLOCK_I)
            sq += tl.sum(v * v, axis=1)
            w = w_next
        inv = 1.0 / tl.sqrt_rn(tl.where(row_mask, sq, 1.0))  # rows past the end: 1, not 1 / 0 (never stored)
        factor = tl.load(m_ptr + rows, mask=row_mask, other=0.0).to(tl.float32) * inv
        if not MERGE:
            tl.store(inv_ptr + rows, inv, mask=row_mask)
            tl.store(g_ptr + rows, factor.to(g_ptr.dtype.element_ty), mask=row_mask)
    if MERGE:
        out_rows = out_ptr + rows[:, None].to(tl.int64) * IN
        w = _w_tile(w_rows, row_mask, 0, IN, BLOCK_I)
        for start in range(0, IN, BLOCK_I):
            w_next = _w_tile(w_rows, row_mask, start + BLOCK_I, IN, BLOCK_I)
            v, cols, col_mask = _tile(w, a_rows, b, k_mask, start, IN, BLOCK_I)
            tl.store(out_rows + cols[None, :], (v * factor[:, None]).to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & col_mask[None, :])
            w = w_next


@triton.jit
def _w_tile(w_rows, row_mask, start, IN, BLOCK_I: tl.constexpr):
    """W's tile of columns start … start + BLOCK_I - 1, in W's dtype (0 past the last column: the loops load the
    tile after their last one, and read nothing there). Each loop loads the next tile before the dot of the one it
    has, so that a load is in flight while the dot runs: the kernel holds few programs an SM (its registers), so
    little else is (dev/perf-notes.md, "The merge's W a tile ahead")."""
    cols = start + tl.arange(0, BLOCK_I)
    return tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & (cols < IN)[None, :], other=0.0)


@triton.jit
def _tile(w, a_rows, b, k_mask, start, IN, BLOCK_I: tl.constexpr):
    """(V's tile of columns start … start + BLOCK_I - 1 in fp32, those columns, their mask): W's tile w plus B's rows
    (scaled) times A's tile, in one dot that takes W's tile as its accumulator."""
    cols = start + tl.arange(0, BLOCK_I)
    col_mask = cols < IN
    a = tl.load(a_rows + cols[None, :], mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    return tl.dot(b, a, acc=w.to(tl.float32), input_precision="tf32x3"), cols, col_mask  # (BLOCK_O, BLOCK_I): ~fp32


@triton.jit
def _dora_norm_kernel(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr, inv_ptr, OUT, IN, R, end0, end1, scale,
                      BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (row blocks of the largest member, members): program (i, j) takes member j's i-th BLOCK_O rows."""
    member = tl.program_id(1)
    begin = tl.where(member == 0, 0, tl.where(member == 1, end0, end1))
    end = tl.where(member == 0, end0, tl.where(member == 1, end1, OUT))
    first = begin + tl.program_id(0) * BLOCK_O
    if first < end:  # a smaller member's programs past its rows
        _rows(w_ptr, a_ptr, b_ptr, m_ptr, g_ptr, inv_ptr, g_ptr, first, end, member, IN, R, scale, True, False,
              BLOCK_O, BLOCK_I, BLOCK_R)


@triton.jit
def _table_program(groups_ptr, blocks_ptr, like_ptr):
    """A table program's group, first row, and its group's row of `groups` (groups, 10): the addresses of W (in
    like's dtype), A, B (fp32), m (fp32, or 0: none), then its first element of the output, OUT, IN, R, end0, end1.
    Returns (group, first, W, A, B, m's address, offset, IN, R, member, end): the program's rows lie within one
    member, which ends at `end`."""
    block = blocks_ptr + tl.program_id(0) * 2
    group = tl.load(block)
    first = tl.load(block + 1)
    row = groups_ptr + group.to(tl.int64) * 10
    w_ptr = tl.load(row).to(tl.pointer_type(like_ptr.dtype.element_ty))
    a_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    b_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    m_addr = tl.load(row + 3)
    offset = tl.load(row + 4)
    OUT = tl.load(row + 5).to(tl.int32)
    IN = tl.load(row + 6).to(tl.int32)
    R = tl.load(row + 7).to(tl.int32)
    end0 = tl.load(row + 8).to(tl.int32)
    end1 = tl.load(row + 9).to(tl.int32)
    member = (first >= end0).to(tl.int32) + (first >= end1).to(tl.int32)
    end = tl.where(member == 0, end0, tl.where(member == 1, end1, OUT))
    return group, first, w_ptr, a_ptr, b_ptr, m_addr, offset, IN, R, member, end


@triton.jit
def _dora_norms_table_kernel(groups_ptr, blocks_ptr, scales_ptr, g_ptr, inv_ptr,
                             BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    """g and inv of a program's rows (`_table_program`; W in g's dtype, the offset the group's first row in g and
    inv: `NormsTable`)."""
    group, first, w_ptr, a_ptr, b_ptr, m_addr, offset, IN, R, member, end = _table_program(groups_ptr, blocks_ptr,
                                                                                           g_ptr)
    _rows(w_ptr, a_ptr, b_ptr, m_addr.to(tl.pointer_type(tl.float32)), g_ptr + offset, inv_ptr + offset, g_ptr,
          first, end, member, IN, R, tl.load(scales_ptr + group), True, False, BLOCK_O, BLOCK_I, BLOCK_R)


@triton.jit
def _merge_table_kernel(groups_ptr, blocks_ptr, scales_ptr, out_ptr, DORA: tl.constexpr,
                        BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    """The merged rows of a program (`_table_program`; W and out in one dtype, the offset the group's first element
    in out: `MergeTable`), DoRA's (each row scaled by m / ‖V‖) where DORA, else plain. A constant, not a test of m's
    address: the norms' pass compiled into a plain merge takes the registers that keep W's next tile in flight."""
    group, first, w_ptr, a_ptr, b_ptr, m_addr, offset, IN, R, member, end = _table_program(groups_ptr, blocks_ptr,
                                                                                           out_ptr)
    _rows(w_ptr, a_ptr, b_ptr, m_addr.to(tl.pointer_type(tl.float32)), out_ptr, out_ptr, out_ptr + offset,
          first, end, member, IN, R, tl.load(scales_ptr + group), DORA, True, BLOCK_O, BLOCK_I, BLOCK_R)


def member_spans(ends):
    """(first row, last row + 1) of each member."""
    return list(zip([0, *ends[:-1]], ends))


def dora_norms(w, a, b, m, ends, scale, dtype):
    """(g, inv) (Σout,): g = m / ‖W + s·B_blk·A‖ in `dtype`, inv = 1 / ‖W + s·B_blk·A‖ in fp32, for W (Σout, in) in
    fp32/bf16/fp16, the fp32 stacked A (Σr, in), B (Σout, R) and m (Σout,), and `ends` each member's last row + 1."""
    check_dora_norms_args(w, a, b, m, ends, dtype)
    out_features, in_features = w.shape
    end0, end1 = (list(ends[:-1]) + [out_features] * 2)[:2]
    g = torch.empty(out_features, dtype=dtype, device=w.device)
    inv = torch.empty(out_features, dtype=torch.float32, device=w.device)
    config = launch_config(b.shape[1])
    rows = max(e - s for s, e in member_spans(ends))
    _dora_norm_kernel[(triton.cdiv(rows, config["BLOCK_O"]), len(ends))](
        w, a, b, m, g, inv, out_features, in_features, b.shape[1], end0, end1, scale, **config, num_warps=NUM_WARPS)
    return g, inv


def launch_config(rank):
    """BLOCK_R: the members' rank R as a power of two, at least 16 (the dot's smallest K). At R ≤ 16: 32 output rows
    a program and 128 columns of `in` a step, which stream W faster on an H100 than 64 × 32 (dev/perf-notes.md, "The
    merge's and DoRA's norms' tiles"). Past 16, where A's tile (BLOCK_R, BLOCK_I) and B's (BLOCK_O, BLOCK_R) grow:
    BLOCK_O 64 rows (the M of one warpgroup's MMA on sm_90), fewer for ranks over 128, where B's tile held in
    registers would spill; BLOCK_I 32 columns (the dot's (64, 32) output and W's tile, 16 values a thread), 16 from
    r = 64 on."""
    block_r = max(16, triton.next_power_of_2(rank))
    if block_r == 16:
        return dict(BLOCK_O=32, BLOCK_R=16, BLOCK_I=128)
    return dict(BLOCK_O=max(16, min(64, 8192 // block_r)), BLOCK_R=block_r, BLOCK_I=max(16, min(32, 1024 // block_r)))


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
        self.config = launch_config(max(b.shape[1] for _, _, b, *_ in groups))
        descriptors, blocks, offset = [], [], 0
        for n, (w, a, b, m, ends, _) in enumerate(groups):
            out_features, in_features = w.shape
            end0, end1 = (list(ends[:-1]) + [out_features] * 2)[:2]
            descriptors.append([w.data_ptr(), a.data_ptr(), b.data_ptr(), m.data_ptr(), offset, out_features,
                                in_features, b.shape[1], end0, end1])
            blocks += [[n, first] for begin, end in member_spans(ends)
                       for first in range(begin, end, self.config["BLOCK_O"])]
            offset += out_features
        self.groups = torch.tensor(descriptors, dtype=torch.int64, device=w0.device)  # (groups, 10)
        self.blocks = torch.tensor(blocks, dtype=torch.int32, device=w0.device)  # (programs, 2): group, first row
        self.scales = torch.tensor([s for *_, s in groups], dtype=torch.float32, device=w0.device)
        self.sizes = [len(w) for w, *_ in groups]
        self.dtype = w0.dtype

    def __call__(self):
        """[(g, inv)] a group, as `dora_norms` gives them (views of one g and one inv buffer)."""
        g = torch.empty(sum(self.sizes), dtype=self.dtype, device=self.groups.device)
        inv = torch.empty(sum(self.sizes), dtype=torch.float32, device=self.groups.device)
        _dora_norms_table_kernel[(len(self.blocks),)](self.groups, self.blocks, self.scales, g, inv, **self.config,
                                                      num_warps=NUM_WARPS)
        return list(zip(g.split(self.sizes), inv.split(self.sizes)))


class MergeTable:
    """The merged weights of many projections in one launch (two where DoRA's members and plain ones mix: the
    kernel is compiled for one or the other): W' = W + s·B·A, rounded once to W's dtype; with DoRA's m,
    each row scaled to m / ‖W + s·B·A‖ first (`model.lora.merged_weight`). members: (W, A, B, m, view, s) each, W
    (out, in) contiguous in `out`'s dtype, A (r, in) and B (out, r) fp32 (None: no adapter, W' = W), m (out,) fp32 or
    None, `view` the member's (out, in) rows of `out`, the one buffer every W' lies in. The launch reads the tensors
    at the addresses they have now: the caller builds a new table when any of them moves (`MergedAdapters`), and
    never inside a CUDA graph's capture (the table is copied from host memory)."""

    def __init__(self, out, members):
        for w, a, b, m, view, _ in members:
            check_merge_args(w, a, b, m, view, out)
        self.config = launch_config(max(len(a) if a is not None else 0 for _, a, *_ in members))
        descriptors, blocks = [], {False: [], True: []}  # the plain members' programs, DoRA's
        for n, (w, a, b, m, view, _) in enumerate(members):
            out_features, in_features = w.shape
            offset = (view.data_ptr() - out.data_ptr()) // out.element_size()
            rank = 0 if a is None else len(a)
            a, b = (w, w) if a is None else (a, b)  # rank 0: W's address stands for A's and B's, never read
            descriptors.append([w.data_ptr(), a.data_ptr(), b.data_ptr(), 0 if m is None else m.data_ptr(), offset,
                                out_features, in_features, rank, out_features, out_features])
            blocks[m is not None] += [[n, first] for first in range(0, out_features, self.config["BLOCK_O"])]
        self.groups = torch.tensor(descriptors, dtype=torch.int64, device=out.device)  # (members, 10)
        # (programs, 2): member, first row; one launch for the plain members, one for DoRA's (either may be none)
        self.blocks = {dora: torch.tensor(b, dtype=torch.int32, device=out.device) for dora, b in blocks.items() if b}
        self.scales = torch.tensor([s for *_, s in members], dtype=torch.float32, device=out.device)
        self.out = out

    def __call__(self):
        """Write every member's W' into its view of `out`."""
        for dora, blocks in self.blocks.items():
            _merge_table_kernel[(len(blocks),)](self.groups, blocks, self.scales, self.out, DORA=dora, **self.config,
                                                num_warps=NUM_WARPS)

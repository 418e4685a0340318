"""DoRA's backward through its column scaling Y = g ⊙ P + b (model/lora.py), in one pass over dY and P:

    dP = g ⊙ dY                          (N, C)
    dm = Σ_n dY ⊙ P · inv                (C,)    inv = 1 / ‖W + s·B·A‖, the norm a constant in backward

(dm is the magnitude's gradient: g = m · inv.) dY, P and dP share one layout, row-major (N, C) or the MLP's
transposed (C, N) storage, read through their strides (the JIT specializes the unit one, so the loads along the
contiguous dimension are 16-byte vectors). The grid is 2-D, one BLOCK_N × BLOCK_C tile a program and no loop: every
program's loads are in flight at once, and a step's shapes (N = 4096 tokens, C = 576 to 3072) give 576 to 3072
programs, enough bytes in flight to run at the memory's bandwidth. program_id(0) walks the blocks along the
contiguous dimension (column blocks of the row-major layout, row blocks of the transposed one), so programs launched
one after another read one stretch of memory (whole rows of the storage) rather than pieces a row apart, and a
column block's programs of the transposed layout finish together, early or late in the launch. Each program writes
its tile's dP and its partial sum of dY ⊙ P · inv over its rows (fp32) into a (cdiv(N, BLOCK_N), C) buffer, then
counts itself done on its column block's counter (after a barrier, so that all its threads' partials are stored:
one atomic add, acquire-release at GPU scope, so that they are visible to whichever program counts last). The last
program of a column block sums that block's partials in row-block order, SUM_ROWS at a time (one round at N = 4096
in both layouts), so dm is deterministic (the same order whichever program comes last), with no launch of its own.
All math in fp32; dP rounded once, at the store.

References: Liu et al. 2024 "DoRA" (§4.3, the norm a constant); PEFT `tuners/lora/dora.py`.
Reference: kernels.references.dora_backward_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import check_dora_backward_args

NUM_WARPS = 4


def launch_config(transposed):
    """(BLOCK_N, BLOCK_C, SUM_ROWS): 4096 elements a tile, long along the contiguous dimension. Row-major: 64 × 64,
    128 bytes of a row a tile row (a whole cache line; 64 divides 576, 960, 2048 ...: no half-empty column block);
    transposed: 256 × 16, 512 bytes of a storage row a tile column. The last program of a column block sums
    SUM_ROWS × BLOCK_C = 4096 partials a round."""
    return (256, 16, 256) if transposed else (64, 64, 64)


@triton.jit
def _dora_backward_kernel(dy_ptr, p_ptr, g_ptr, inv_ptr, dp_ptr, partial_ptr, count_ptr, dm_ptr, N, C, stride_n,
                          stride_c, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, SUM_ROWS: tl.constexpr,
                          TRANSPOSED: tl.constexpr):
    if TRANSPOSED:  # program_id(0) along the contiguous dimension: N here, C in the row-major layout
        row_block, col_block, row_blocks = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    else:
        row_block, col_block, row_blocks = tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = row_block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < C
    mask = (rows < N)[:, None] & col_mask[None, :]
    offs = rows[:, None] * stride_n + cols[None, :].to(tl.int64) * stride_c
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    inv = tl.load(inv_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(dp_ptr + offs, (dy * g[None, :]).to(dp_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + row_block.to(tl.int64) * C + cols, tl.sum(dy * p, axis=0) * inv, mask=col_mask)
    tl.debug_barrier()  # every thread's partial stored before the one atomic below releases them
    if tl.atomic_add(count_ptr + col_block, 1) == row_blocks - 1:  # the column block's last program
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for start in range(0, row_blocks, SUM_ROWS):
            blocks = start + tl.arange(0, SUM_ROWS)
            part = tl.load(partial_ptr + blocks[:, None].to(tl.int64) * C + cols[None, :],
                           mask=(blocks < row_blocks)[:, None] & col_mask[None, :], other=0.0,
                           cache_modifier=".cg")  # from L2, where the other programs' stores are
            acc += tl.sum(part, axis=0)
        tl.store(dm_ptr + cols, acc, mask=col_mask)


def dora_backward(dy, p, g, inv, out=None):
    """(dP, dm) = (g ⊙ dY, Σ_n dY ⊙ P · inv) for dY, P (N, C); g (C,) in their dtype, inv (C,) fp32. dP is written
    into `out` when given (it may be dY itself), else into a new tensor of P's layout; dm is fp32."""
    check_dora_backward_args(dy, p, g, inv, out)
    if dy.stride() != p.stride():
        dy = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device).copy_(dy)
    if out is None:
        out = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
    assert out.stride() == p.stride(), "dora_backward: out must have P's layout"
    N, C = p.shape
    transposed = p.stride(0) == 1 and C > 1
    block_n, block_c, sum_rows = launch_config(transposed)
    row_blocks, col_blocks = triton.cdiv(N, block_n), triton.cdiv(C, block_c)
    if N == 0 or C == 0:
        return out, torch.zeros(C, dtype=torch.float32, device=p.device)
    partial = torch.empty(row_blocks, C, dtype=torch.float32, device=p.device)
    count = torch.zeros(col_blocks, dtype=torch.int32, device=p.device)  # programs done, per column block
    dm = torch.empty(C, dtype=torch.float32, device=p.device)
    grid = (row_blocks, col_blocks) if transposed else (col_blocks, row_blocks)
    _dora_backward_kernel[grid](dy, p, g, inv, out, partial, count, dm, N, C, p.stride(0), p.stride(1),
                                BLOCK_N=block_n, BLOCK_C=block_c, SUM_ROWS=sum_rows, TRANSPOSED=transposed,
                                num_warps=NUM_WARPS)
    return out, dm

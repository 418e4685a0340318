"""Two LoRA gradients of a group of projections that read one input, from one read of their output's gradient:

    Q    = s dY B             (N, Σr)    member m's columns: s dY_m B_m   (B block-diagonal, as model/lora.py builds it)
    dB_m = dY_mᵀ P_m          (out, r)   P = s X Aᵀ (N, Σr), saved by forward

for M members of `out` output features and rank r each (gate and up of an MLP: M = 2, out = I), with dY stored
transposed, dYᵀ (M·out, N) with unit stride along N, as the MLP keeps [dG | dU] (model/lora.py). As two cuBLAS
GEMMs (three: dB is one a member) each of them reads all of dY, the widest tensor of a layer's backward (an (N, 2I)
tensor: 235 MB at Llama-3.1-8B's 2 × 2048 tokens); here it is read once.

A program takes BLOCK_T tokens and a run of BLOCK_F-feature tiles of one member. Each tile d = dYᵀ[tile, tokens]
(BLOCK_F, BLOCK_T) is loaded once and feeds two products on the tensor cores:

    d P_m[tokens]        (BLOCK_F, R)   the tile's dB over the program's tokens: a partial sum, stored in fp32
    dᵀ B_m[tile]         (BLOCK_T, R)   added to the program's Q, in fp32 registers

and at the end the program stores its Q times s (fp32). With `amax` (--fp8, model/fp8.py) the tile also leaves
dY's e4m3 copy for the base weights' input-gradient GEMM, the tensor-wise quantization of
kernels/fp8_quantize_tensor.py (one scale from max |dY|, which the activation's backward found): q8 = e4m3(d · 1 / s8)
stored [N, M·out] row-major, the layout that GEMM reads, so that [dG | dU] is read once for all three.

R is r padded to a power of two of at least 16 (what tl.dot takes), the padding loaded as zeros. The two
contractions run along different axes (dB's over tokens, Q's over features), so one of them must leave partial sums:
dB's, one (BLOCK_F, R) block a tile and token block, in all cdiv(N, BLOCK_T) · M · out · R fp32 (4R / BLOCK_T bytes
a dY element: 1/8 of dY's bytes at R 16 and BLOCK_T 256), and Q's, one (BLOCK_T, R) block a run of tiles. The
launcher sums each set along its partials' axis in a fixed order (torch.sum): the results do not depend on the
programs' order. dB stays fp32; Q is rounded once, into the caller's buffer.

Reference: kernels.references.adapter_grads_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.decode_linear import dot_constexprs
from kernels.fp8_quantize import MIN_SCALE, e4m3_bits, fp8_scale_and_reciprocal, hardware_e4m3
from kernels.references import E4M3, check_adapter_grads_args
from kernels.softcap_attention import _dot

# Where one read is faster than cuBLAS's GEMMs on an H100 (the measurements: dev/benchmarks-history.md, section 36,
# "gate | up's s dY B and dB from one read"): dY of at least 2^25 elements (below, the launches and the partial sums
# cost more than the read saves) and ranks up to 32 (above, the partial sums and the (BLOCK_T, R) accumulator do).
MIN_ELEMENTS, MAX_RANK = 1 << 25, 32
PROGRAMS_PER_SM = 4  # about two resident programs an SM (80 KB of shared memory each), two waves


def launch_config(dtype, quantize=False):
    """(BLOCK_F, BLOCK_T, num_warps, num_stages): a 64 × 256 tile of half-precision dY, 32 KB a pipeline stage, two
    stages (two programs fit an SM's shared memory; three stages leave room for one); fp32 tiles of the same bytes in
    one stage (fp32 runs on the GPU only when a model trains in fp32). With dY's e4m3 copy (`quantize`) 8 warps,
    whose tile transposes for the copy's store faster (dev/perf-notes.md, "q | k | v's gradient in one tensor, and
    dY's e4m3 copy from the one read")."""
    warps = 8 if quantize else 4
    return (64, 256, warps, 2) if dtype != torch.float32 else (32, 128, warps, 1)


def runs_per_member(tiles, token_blocks, members, programs):
    """How many runs of tiles each member's tiles are cut into, so that the launch has about `programs` programs
    (at least one tile a run)."""
    return max(1, min(tiles, triton.cdiv(programs, max(1, token_blocks) * members)))


@triton.jit
def _adapter_grads_kernel(dyt_ptr, p_ptr, b_ptr, db_ptr, q_ptr, amax_ptr, q8_ptr, s8_ptr, N, M, OUT, stride_dyt,
                          stride_p, stride_b, scale, runs, tiles_per_run, RANK: tl.constexpr, R: tl.constexpr,
                          BLOCK_F: tl.constexpr, BLOCK_T: tl.constexpr, DTYPE: tl.constexpr, OPERAND: tl.constexpr,
                          PRECISION: tl.constexpr, QUANTIZE: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                          MIN_SCALE: tl.constexpr):
    token_block, run = tl.program_id(0), tl.program_id(1)
    member, run_in_member = run // runs, run % runs
    tokens = token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < N
    if QUANTIZE:
        s8, r8 = fp8_scale_and_reciprocal(tl.load(amax_ptr).to(tl.float32), MIN_SCALE)
        if run == 0:
            tl.store(s8_ptr + tokens, tl.full((BLOCK_T,), 1.0, tl.float32) * s8, mask=token_mask)
    ranks = tl.arange(0, R)
    rank_mask = ranks < RANK
    columns = member * RANK + ranks  # the member's columns of P and of the block B
    p = tl.load(p_ptr + tokens[:, None].to(tl.int64) * stride_p + columns[None, :],
                mask=token_mask[:, None] & rank_mask[None, :], other=0.0)  # (BLOCK_T, R)
    q = tl.zeros((BLOCK_T, R), dtype=tl.float32)
    first = run_in_member * tiles_per_run
    last = tl.minimum(first + tiles_per_run, tl.cdiv(OUT, BLOCK_F))
    for tile in range(first, last):
        in_member = tile * BLOCK_F + tl.arange(0, BLOCK_F)
        feature_mask = in_member < OUT
        features = (member * OUT + in_member).to(tl.int64)
        d = tl.load(dyt_ptr + features[:, None] * stride_dyt + tokens[None, :],
                    mask=feature_mask[:, None] & token_mask[None, :], other=0.0)  # (BLOCK_F, BLOCK_T)
        if QUANTIZE:  # dY's e4m3 copy, [N, M·OUT] row-major
            tl.store(q8_ptr + tokens[None, :].to(tl.int64) * (M * OUT) + features[:, None],
                     e4m3_bits(d.to(tl.float32) * r8, HARDWARE_E4M3), mask=feature_mask[:, None] & token_mask[None, :])
        b = tl.load(b_ptr + features[:, None] * stride_b + columns[None, :],
                    mask=feature_mask[:, None] & rank_mask[None, :], other=0.0)  # (BLOCK_F, R)
        db = _dot(d, p, DTYPE, OPERAND, PRECISION)  # (BLOCK_F, R)
        tl.store(db_ptr + (token_block.to(tl.int64) * M * OUT + features[:, None]) * R + ranks[None, :], db,
                 mask=feature_mask[:, None])
        q += _dot(tl.trans(d), b, DTYPE, OPERAND, PRECISION)  # (BLOCK_T, R)
    # Q's partials (runs, M · R, N): this program's run, its member's R rows, its tokens
    rows = (run_in_member.to(tl.int64) * M + member) * R + ranks
    tl.store(q_ptr + rows[None, :] * N + tokens[:, None], q * scale, mask=token_mask[:, None])


def adapter_grads(dyt, p, b, scale, r, q_out=None, amax=None):
    """(dB, (s dY B)ᵀ, fp8) for dyt = dYᵀ (M·out, N) with unit stride along N, p = s X Aᵀ (N, M·r) and b the
    block-diagonal B (M·out, M·r), one half-precision or fp32 dtype: dB (M·out, r) fp32, the members' dB_m stacked,
    and (s dY B)ᵀ (M·r, N) in dyt's dtype, written into q_out when given. fp8: with amax = max |dY| (0-d, dyt's
    dtype), dY's tensor-wise e4m3 copy (q8 (N, M·out) contiguous, s8 (N,) fp32), as
    kernels/fp8_quantize_tensor.py's `fp8_quantize_tensor(dyt.t(), amax)` gives it; else None. None, with nothing
    written or allocated, where one read does not pay (`MIN_ELEMENTS`, `MAX_RANK`): the caller's GEMMs are as fast
    there."""
    check_adapter_grads_args(dyt, p, b, r, q_out)
    assert amax is None or (amax.shape == () and amax.dtype == dyt.dtype), (
        f"adapter_grads: amax must be 0-d {dyt.dtype}, got {None if amax is None else (tuple(amax.shape), amax.dtype)}")
    if dyt.is_cuda and (dyt.numel() < MIN_ELEMENTS or r > MAX_RANK):
        return None
    F, N = dyt.shape
    M = p.shape[1] // r
    if q_out is None:
        q_out = dyt.new_empty(M * r, N)
    out = F // M
    R = max(16, triton.next_power_of_2(r))
    block_f, block_t, warps, stages = launch_config(dyt.dtype, amax is not None)
    tiles, token_blocks = triton.cdiv(out, block_f), triton.cdiv(N, block_t)
    sms = torch.cuda.get_device_properties(dyt.device).multi_processor_count if dyt.is_cuda else 4
    runs = runs_per_member(tiles, token_blocks, M, PROGRAMS_PER_SM * sms)
    tiles_per_run = triton.cdiv(tiles, runs)
    db_partial = torch.empty(token_blocks, F, R, dtype=torch.float32, device=dyt.device)
    q_partial = torch.empty(runs, M * R, N, dtype=torch.float32, device=dyt.device)
    fp8 = None if amax is None else (torch.empty(N, F, dtype=E4M3, device=dyt.device),
                                     torch.empty(N, dtype=torch.float32, device=dyt.device))
    q8, s8 = (db_partial, db_partial) if fp8 is None else (fp8[0].view(torch.uint8), fp8[1])  # unread without amax
    if N > 0:
        _adapter_grads_kernel[(token_blocks, M * runs)](
            dyt, p, b, db_partial, q_partial, dyt if amax is None else amax, q8, s8, N, M, out, dyt.stride(0),
            p.stride(0), b.stride(0), scale, runs, tiles_per_run, RANK=r, R=R, BLOCK_F=block_f, BLOCK_T=block_t,
            **dot_constexprs(dyt), QUANTIZE=amax is not None, HARDWARE_E4M3=hardware_e4m3(dyt.device),
            MIN_SCALE=MIN_SCALE, num_warps=warps, num_stages=stages)
    db = db_partial.sum(0)[:, :r]
    q_out.view(M, r, N).copy_(q_partial.sum(0).view(M, R, N)[:, :r])
    return (db if R == r else db.contiguous()), q_out, fp8

"""A decoding step's skinny GEMM with the residual add in its epilogue: y = r + (x Wᵀ + b) for M <= 64 rows, each
weight read once. The o and down projections of `model/decode.py`'s layer (without r where a sandwich norm reads y
before the add: `Sandwich`).

References: the split-K GEMM of CUTLASS and of Triton's matmul tutorials (partial sums of K chunks, summed by the
last program to arrive: CUDA's "threadfence reduction" sample); model/transformer.py's `Attention.forward` and
`MLP.forward` (`residual + y`, the values this reproduces).

A decoding step multiplies a few rows (the rollout's M = 16) by a weight of N × K: reading the weight, and the chain
of its loads, is the cost. Each program owns BLOCK_N output columns and one chunk of K, and streams its (BLOCK_N,
BLOCK_K) tiles of W along K (rows contiguous along K: 16-byte vector loads); x's rows are padded to BLOCK_M = 16 for
tl.dot. Where the column tiles are too few to fill the GPU's SMs (WAVES waves of them), K is cut into SPLIT chunks
(`launch_config`):

    P_s = x[:, K_s] W[n, K_s]ᵀ                          (fp32, one program per column tile n and chunk s)
    y   = round(r + round(Σ_{s=0}^{SPLIT-1} P_s + b))    summed by the tile's last program to arrive, in the order
                                                        s = 0, 1, ...: the same sum at every launch (deterministic)

The partials go to a fp32 workspace; each program then adds one to its tile's arrival count (after a barrier, so
that the count's release covers every thread's stores), and the program that reads SPLIT - 1 sums the partials,
applies the epilogue and sets the count back to 0 for the next launch. y is rounded as torch rounds `r + y`: the
GEMM's output first, then the add. Forward only.

Where an RMSNorm reads y next (the MLP's norm after o, the next layer's input norm after down), the epilogue also
writes y's `Scaled` rows for it: y ⊙ (offset + w) and, per column tile, y's sums of squares. Each tile's last program
writes its own columns, so the norm's work is spread over the tiles as the GEMM's is, and the normalizing GEMM that
reads them (kernels/decode_swiglu.py, decode_qkv.py) multiplies them as they are and scales its fp32 sums by rstd
in its epilogue: no rstd pass over x after its wait, no normalization of x's tiles in its loop.

A decoding step is a chain of such launches, each a few µs, and on Hopper (sm_90 and later) they are launched with
programmatic dependent launch (`pdl_constexprs`; the CUDA Programming Guide's "Programmatic Dependent Launch and
Synchronization"): a launch may start while the one before it runs, its programs first ask L2 for their own weight
rows (`_prefetch_rows`), then wait for the previous kernel to finish with its writes visible
(`griddepcontrol.wait`, in `_after_previous`), and only then load or store anything. Every kernel that takes part
waits before it finishes, so each one's wait also covers the kernels before the previous one. The launch's gap and
the first weight loads overlap the kernel before it; the arithmetic and the values are the same as without it
(tests/test_kernels_compile.py checks in the PTX that no load or store comes before the wait).

Reference: kernels.references.decode_linear_reference.
"""
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.references import DTYPES, check_decode_linear_args
from kernels.rms_norm import _normalized
from kernels.softcap_attention import TL_DTYPES, _dot

NUM_WARPS = 4
NUM_STAGES = 4  # tiles of W in flight a program: its loads are the chain a skinny GEMM waits on
STAGE_BYTES = 160 * 1024  # at most these bytes of tiles in flight a program (`num_stages`)
WAVES = 1  # programs a launch, in waves of the device's SMs (`launch_config`): with more, K is cut finer, and the
# partials' round trip and sum cost more than the shorter chains of loads save (dev/perf-notes.md)
MAX_ROWS = 64  # rows a launch takes (BLOCK_M up to 64): a decoding step's, not a prefill's
WIDE = 1 << 23  # weight elements from which a program takes 64 output columns, not 32 (`program_columns`): the
# wider tiles stream a 7-8B model's o and down faster, a 0.5B model's no faster (dev/perf-notes.md)
RSTD_TILES = tl.constexpr(8)  # x's tiles whose loads `_rstd` issues together


@lru_cache
def _dependent_launch(index: int) -> bool:
    """Whether CUDA device `index` has programmatic dependent launch: an NVIDIA GPU of sm_90 or later (ROCm's torch
    reports its own GPUs' versions as capabilities, and has no griddepcontrol)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_constexprs(x) -> dict:
    """PDL (the kernel waits for the previous one with `_after_previous`) and the launch option launch_pdl, both on
    for a CUDA device with programmatic dependent launch, for a decoding kernel reading x."""
    on = x.is_cuda and _dependent_launch(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return dict(PDL=on, launch_pdl=on)


def program_columns(weight, wide: int) -> int:
    """Output columns a program of a decoding GEMM takes: 64 for a weight of at least `wide` elements, else 32."""
    return 64 if weight.numel() >= wide else 32


def block_m(M: int) -> int:
    """x's rows padded to a power of two of at least 16, what tl.dot takes."""
    return max(16, triton.next_power_of_2(M))


def num_stages(stage_elements: int, x) -> int:
    """The pipeline's depth for a launch whose one stage holds `stage_elements` elements of x's dtype (x's tile and
    the weight tiles of one BLOCK_K step): NUM_STAGES, fewer where those would pass STAGE_BYTES, at least 2. Triton
    keeps the stages in shared memory, and at the largest tiles (64 rows, a head of 256) four would pass even
    sm_90's 227 KiB; within STAGE_BYTES they fit sm_80's 163 KiB (tests/test_kernels_compile.py)."""
    return max(2, min(NUM_STAGES, STAGE_BYTES // (stage_elements * x.element_size())))


def launch_config(tiles: int, K: int, x) -> tuple[int, int, int]:
    """(SPLIT, K_CHUNK, BLOCK_K) for inputs like x: weight tiles of BLOCK_K 128 bf16/fp16 elements a row (256 bytes:
    16 bytes a thread), or 32 fp32 ones (a head of 256's tiles then fit sm_80's shared memory); K cut into SPLIT
    chunks of K_CHUNK (whole tiles) so that tiles × SPLIT programs make about WAVES waves of the device's SMs (132
    where there is no GPU, as on an H100), none empty."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    block_k = 32 if x.dtype == torch.float32 else 128
    blocks = triton.cdiv(K, block_k)
    want = max(1, min(blocks, triton.cdiv(WAVES * sms, tiles)))
    chunk = triton.cdiv(blocks, want) * block_k
    return triton.cdiv(K, chunk), chunk, block_k


class Workspace:
    """The fp32 partial sums and int32 arrival counts of the split-K decoding kernels, made on first use and grown
    when a launch needs more. Every launch leaves its counts at 0 (each tile's last program resets its own), so one
    workspace serves every launch of a stream in turn; a CUDA graph captured with it reads the same buffers. A
    grown workspace keeps its earlier buffers alive (`retired`): a graph captured before reads and resets those at
    each replay, and memory freed under it would be another tensor's."""

    def __init__(self):
        self.partials = self.counts = None
        self.retired = []

    def get(self, partials: int, tiles: int, device):
        """(partials, counts): at least `partials` fp32 and `tiles` int32 (zeros) on `device` ("cuda" is the current
        GPU: compared as the buffers' own device, "cuda:0", so that a request that fits keeps them)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.partials is None or self.partials.device != device or self.partials.numel() < partials:
            self._retire(self.partials)
            self.partials = torch.empty(max(partials, 1), dtype=torch.float32, device=device)
        if self.counts is None or self.counts.device != device or self.counts.numel() < tiles:
            self._retire(self.counts)
            self.counts = torch.zeros(max(tiles, 1), dtype=torch.int32, device=device)
        return self.partials, self.counts

    def _retire(self, buffer):
        if buffer is not None:
            self.retired.append(buffer)


class Scaled(NamedTuple):
    """Rows x [M, K] of the residual stream made ready for the RMSNorm in a GEMM's prologue by the kernel that wrote
    them: xs = round(x ⊙ (offset + w)) in x's dtype (w the norm's weight) and ss [T, M] fp32, the sums of x's
    squares over T blocks of columns, so that

        RMSNorm(x) Wᵀ = rstd ⊙ (xs Wᵀ),    rstd = rsqrt(Σ_t ss[t] / K + eps)    (per row)

    and the GEMM multiplies xs as it is and scales its fp32 sums once, in its epilogue (`_scaled_pair`), where it
    would compute rstd from x in its prologue and normalize each of x's tiles in its loop. One rounding of the
    normalized input (x ⊙ w) where the norm rounds x̂ and then x̂ ⊙ w (kernels/rms_norm.py): the same output within
    the GEMM's rounding."""
    xs: torch.Tensor
    ss: torch.Tensor


@triton.jit
def _prefetch_rows(w_ptr, n, n_mask, K, k_lo, k_hi, BLOCK_K: tl.constexpr):
    """Ask L2 for W[n, k_lo:k_hi] (rows n where n_mask), one prefetch a 128-byte line; the program goes on at once.
    (Lines outside the mask ask for W's first line instead.) L2 is the one cache that every SM reads through, so a
    prefetch cannot make a later load see an older value: values come only from the loads after the wait."""
    LINE: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K // LINE) * LINE
        ptrs = w_ptr + n[:, None] * K + ks[None, :]
        ptrs = tl.where(n_mask[:, None] & (ks[None, :] < k_hi), ptrs, w_ptr)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _after_previous(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL): wait until the previous kernel has finished and its writes are
    visible, then let the next launch start (its programs take the SMs' room left beside this kernel's). A kernel
    calls it before its first load or store."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _store_partial(acc, ws_ptr, slot, split, n_slots, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Write this program's (BLOCK_M, BLOCK_W) partial sum into the workspace at [split, slot]."""
    i = tl.arange(0, BLOCK_M)[:, None] * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    tl.store(ws_ptr + (split * n_slots + slot) * (BLOCK_M * BLOCK_W) + i, acc)


@triton.jit
def _arrive(count_ptr, tile, SPLIT: tl.constexpr):
    """Count this program in for its tile, after all its threads stored their partials; True for the last of the
    tile's SPLIT programs, which also sets the count back to 0."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT - 1
    tl.atomic_xchg(count_ptr + tile, 0, mask=last, sem="relaxed")
    return last


@triton.jit
def _sum_partials(ws_ptr, slot, n_slots, last, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Σ_s of the partials at [s, slot], in the order s = 0, 1, ... (read only by the last program: `last`),
    through L2 (.cg): the other programs wrote them."""
    i = tl.arange(0, BLOCK_M)[:, None] * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    mask = i < BLOCK_M * BLOCK_W * last.to(tl.int32)  # every element for the last program, none for the others
    for s in tl.static_range(SPLIT):
        total += tl.load(ws_ptr + (s * n_slots + slot) * (BLOCK_M * BLOCK_W) + i, mask=mask, other=0.0,
                         cache_modifier=".cg")
    return total


@triton.jit
def _sum_pair(acc1, acc2, ws_ptr, count_ptr, tile, split, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_W: tl.constexpr):
    """(acc1, acc2, last) for a program that holds two accumulators of one tile (q | k | v's two halves of a head,
    gate | up's gate and up columns): their sums over the tile's SPLIT chunks of K, held by the tile's last program
    (`last`), as `_store_partial`, `_arrive` and `_sum_partials` give them for one; the pair takes the workspace
    slots 2·tile and 2·tile + 1. Without a split, this program's own."""
    if SPLIT > 1:
        slots = 2 * tl.num_programs(0)
        _store_partial(acc1, ws_ptr, 2 * tile, split, slots, BLOCK_M, BLOCK_W)
        _store_partial(acc2, ws_ptr, 2 * tile + 1, split, slots, BLOCK_M, BLOCK_W)
        last = _arrive(count_ptr, tile, SPLIT)
        acc1 = _sum_partials(ws_ptr, 2 * tile, slots, last, SPLIT, BLOCK_M, BLOCK_W)
        acc2 = _sum_partials(ws_ptr, 2 * tile + 1, slots, last, SPLIT, BLOCK_M, BLOCK_W)
    else:
        last = True
    return acc1, acc2, last


@triton.jit
def _input_tile(x_ptr, zs_ptr, zrstd, rows, M, ks, k_hi, K, SANDWICH: tl.constexpr):
    """The (rows, ks) tile of a normalizing GEMM's input in fp32, 0 outside x and past k_hi: x's rows, or for a
    `Sandwich` (x_ptr its r, zs_ptr its z's xs, zrstd z's rstd) round(r + round(rstd_z · zs)), each term rounded
    to x's dtype where the layer rounds its norm's output and its residual add."""
    mask = (rows[:, None] < M) & (ks[None, :] < k_hi)
    offs = rows[:, None] * K + ks[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SANDWICH:
        zs = tl.load(zs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        post = (zs * zrstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (x + post).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _rstd(x_ptr, zs_ptr, zrstd, out_ptr, write, rows, M, K, eps, SANDWICH: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """rsqrt(mean(x²) + eps) of the input's rows [M, K] (BLOCK_M,), fp32 (`_input_tile`'s x): every program of a
    normalizing GEMM computes it for itself (M × K is a few KB), where a separate norm would cost a launch and a
    round trip of its output. RSTD_TILES tiles of x at a time, unrolled, their squares summed elementwise and across
    columns once at the end: their loads are then in flight together. (Summed across columns tile by tile in a
    rolled loop, each tile's load waited for the sum before it: a chain of round trips that the GEMM's weight
    loads, issued after, wait on.) For a `Sandwich`, the program that `write`s also stores the rows r + RMSNorm(z)
    at out_ptr: the residual stream's next rows, for the add after this sublayer."""
    sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    limit = tl.where(write, M, 0)  # the rows this program stores: all, or none
    for k0 in range(0, K, RSTD_TILES * BLOCK_K):
        for j in tl.static_range(RSTD_TILES):
            ks = k0 + j * BLOCK_K + tl.arange(0, BLOCK_K)
            x = _input_tile(x_ptr, zs_ptr, zrstd, rows, M, ks, K, K, SANDWICH)
            sq += x * x
            if SANDWICH:
                tl.store(out_ptr + rows[:, None] * K + ks[None, :], x.to(out_ptr.dtype.element_ty),
                         mask=(rows[:, None] < limit) & (ks[None, :] < K))
    return tl.rsqrt(tl.sum(sq, 1) / K + eps)


@triton.jit
def _sums_of_squares(ss_ptr, rows, M, T, BLOCK_M: tl.constexpr, T_STEPS: tl.constexpr):
    """A `Scaled`'s sums of squares ss [T, M] as a (32, BLOCK_M) fp32 tile, T_STEPS blocks of 32 of its rows added
    elementwise (unrolled: their loads in flight together); reduced over its 32 rows by the caller."""
    t = tl.arange(0, 32)
    sums = tl.zeros([32, BLOCK_M], tl.float32)
    for j in tl.static_range(T_STEPS):
        sums += tl.load(ss_ptr + (j * 32 + t[:, None]) * M + rows[None, :],
                        mask=(j * 32 + t[:, None] < T) & (rows[None, :] < M), other=0.0)
    return sums


@triton.jit
def _sandwich_rstd(zss_ptr, rows, M, K, TZ, eps, SANDWICH: tl.constexpr, BLOCK_M: tl.constexpr,
                   TZ_STEPS: tl.constexpr):
    """For a `Sandwich`: rsqrt(mean(z²) + eps) of its z's rows (BLOCK_M,) from z's `Scaled` sums of squares
    [TZ, M]; else ones (unread)."""
    if SANDWICH:
        return tl.rsqrt(tl.sum(_sums_of_squares(zss_ptr, rows, M, TZ, BLOCK_M, TZ_STEPS), 0) / K + eps)
    return tl.full([BLOCK_M], 1.0, tl.float32)


@triton.jit
def _norm_stats(x_ptr, ss_ptr, zs_ptr, zrstd, out_ptr, write, rows, M, K, T, eps, NORMALIZE: tl.constexpr,
                SANDWICH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, T_STEPS: tl.constexpr):
    """What a normalizing GEMM reads of its input's norm before its loop. NORMALIZE: rstd of the input's rows
    (BLOCK_M,) (`_rstd`, which also writes a `Sandwich`'s rows), which the loop normalizes x's tiles with. Else a
    `Scaled`'s sums of squares ss [T, M] as a (32, BLOCK_M) tile (`_sums_of_squares`), reduced only after the loop
    (`_scaled_pair`), so that the loop does not wait for them."""
    if NORMALIZE:
        stats = _rstd(x_ptr, zs_ptr, zrstd, out_ptr, write, rows, M, K, eps, SANDWICH, BLOCK_M, BLOCK_K)
    else:
        stats = _sums_of_squares(ss_ptr, rows, M, T, BLOCK_M, T_STEPS)
    return stats


@triton.jit
def _scaled_pair(acc1, acc2, stats, K, eps, NORMALIZE: tl.constexpr):
    """A normalizing GEMM's two fp32 sums, scaled by its rows' rstd = rsqrt(mean(x²) + eps) where its input was a
    `Scaled`'s rows (stats: `_norm_stats`' tile of their sums of squares); as they are where the loop normalized x."""
    if not NORMALIZE:
        rstd = tl.rsqrt(tl.sum(stats, 0) / K + eps)
        acc1 *= rstd[:, None]
        acc2 *= rstd[:, None]
    return acc1, acc2


class Sandwich(NamedTuple):
    """The input of a normalizing GEMM after a sublayer whose output z is normalized before its residual add (Gemma
    2/3's sandwich norms): the rows r + RMSNorm_post(z), from the residual stream r [M, K] and z's `Scaled` rows for
    the post norm (decode_linear's next_norm). The GEMM computes them tile by tile (`_input_tile`: round(r +
    round(rstd_z · zs))), normalizes them itself, and one of its programs writes them to out [M, K]: the residual
    stream after the sublayer, which the next add reads. The post norm's eps is the GEMM's own norm's (a model's
    norms share it)."""
    r: torch.Tensor
    z: Scaled
    out: torch.Tensor


def scaled_input(x):
    """A normalizing GEMM's input rows as a tensor: a `Scaled`'s xs (its ss checked against it), a `Sandwich`'s r
    (its z and out checked against it), or x itself."""
    if isinstance(x, Sandwich):
        r, (zs, _), out = x
        scaled_input(x.z)
        if zs.shape != r.shape or out.shape != r.shape or len({r.dtype, zs.dtype, out.dtype}) > 1 \
                or not out.is_contiguous():
            raise ValueError(f"Sandwich: z's rows and out (contiguous) must be r's {tuple(r.shape)} {r.dtype}; got "
                             f"{tuple(zs.shape)} {zs.dtype}, {tuple(out.shape)} {out.dtype}")
        return r
    if not isinstance(x, Scaled):
        return x
    xs, ss = x
    if ss.dim() != 2 or ss.shape[1] != xs.shape[0] or ss.dtype != torch.float32 or not ss.is_contiguous():
        raise ValueError(f"Scaled: ss must be contiguous fp32 [T, {xs.shape[0]}]; got {tuple(ss.shape)} {ss.dtype}")
    return xs


def input_args(x, workspace_partials) -> tuple:
    """A normalizing GEMM's arguments for its input x (past x's own pointer): ((ss, zs, zss, out), (T, TZ),
    constexprs). A `Scaled`: its sums of squares and their count of blocks, NORMALIZE False with its T_STEPS
    (`_norm_stats`). A plain x: NORMALIZE True (the kernel normalizes x's rows itself). A `Sandwich`: NORMALIZE and
    SANDWICH, its z's rows and sums of squares (TZ blocks, TZ_STEPS) and out. Pointers a mode does not read are
    the workspace's partials."""
    unread = workspace_partials
    if isinstance(x, Scaled):
        return ((x.ss, unread, unread, unread), (x.ss.shape[0], 0),
                dict(NORMALIZE=False, T_STEPS=triton.cdiv(x.ss.shape[0], 32), SANDWICH=False, TZ_STEPS=1))
    if isinstance(x, Sandwich):
        (zs, zss), out = x.z, x.out
        return ((unread, zs.contiguous(), zss, out), (0, zss.shape[0]),
                dict(NORMALIZE=True, T_STEPS=1, SANDWICH=True, TZ_STEPS=triton.cdiv(zss.shape[0], 32)))
    return (unread,) * 4, (0, 0), dict(NORMALIZE=True, T_STEPS=1, SANDWICH=False, TZ_STEPS=1)


@triton.jit
def _normed_tile(x_ptr, nw_ptr, zs_ptr, zrstd, rows, M, ks, k_hi, K, rstd, offset, SANDWICH: tl.constexpr,
                 GEMMA_CAST: tl.constexpr):
    """The (rows, ks) tile of RMSNorm(input) in x's dtype (the input: `_input_tile`'s), rounded as
    kernels/rms_norm.py rounds it (`_normalized`); 0 outside x and past k_hi."""
    x = _input_tile(x_ptr, zs_ptr, zrstd, rows, M, ks, k_hi, K, SANDWICH)
    w = tl.load(nw_ptr + ks, mask=ks < k_hi, other=0.0).to(tl.float32)
    return _normalized(x, w[None, :], rstd[:, None], offset, x_ptr, nw_ptr, GEMMA_CAST).to(x_ptr.dtype.element_ty)


@triton.jit
def _normed_pair(x_ptr, nw_ptr, w_ptr, zs_ptr, zrstd, rows, M, K, k_lo, k_hi, rstd, offset, n1, n2, n_mask,
                 NORMALIZE: tl.constexpr, SANDWICH: tl.constexpr, GEMMA_CAST: tl.constexpr, DTYPE: tl.constexpr,
                 OPERAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """RMSNorm(input) W[n1]ᵀ and RMSNorm(input) W[n2]ᵀ over K's chunk [k_lo, k_hi), fp32 (BLOCK_M, BLOCK_W) each:
    two blocks of W's rows (n_mask: those that exist) multiplied in one pass over the normalized tiles of the
    input (x's rows or a `Sandwich`'s, `_input_tile`; rstd: `_norm_stats`' with NORMALIZE). NORMALIZE False: x is a
    `Scaled`'s xs, multiplied as it is (`_scaled_pair` scales the sums)."""
    acc1 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if NORMALIZE:
            x = _normed_tile(x_ptr, nw_ptr, zs_ptr, zrstd, rows, M, ks, k_hi, K, rstd, offset, SANDWICH, GEMMA_CAST)
        else:
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_hi),
                        other=0.0)
        w_mask = n_mask[:, None] & (ks[None, :] < k_hi)
        w1 = tl.load(w_ptr + n1[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        w2 = tl.load(w_ptr + n2[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        acc1 += _dot(x, tl.trans(w1), DTYPE, OPERAND, PRECISION)
        acc2 += _dot(x, tl.trans(w2), DTYPE, OPERAND, PRECISION)
    return acc1, acc2


@triton.jit
def _decode_linear_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,  # x [M, K], w [N, K], b [N], r and y [M, N]: contiguous
    nw_ptr, xs_ptr, ss_ptr,  # the next norm's weight [N]; xs [M, N] and ss [tiles, M] fp32 (SCALE_NEXT)
    ws_ptr, count_ptr,  # fp32 [SPLIT, tiles, BLOCK_M, BLOCK_N]; int32 [tiles], zeros
    M, N, K, K_CHUNK, offset,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SCALE_NEXT: tl.constexpr, SPLIT: tl.constexpr,
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
    _after_previous(PDL)
    # the epilogue's inputs, loaded before the GEMM so that the tile's last program does not wait for them after it
    offs = rows[:, None] * N + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if SCALE_NEXT:
        nw = offset + tl.load(nw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_hi),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                    other=0.0)
        acc += _dot(x, tl.trans(w), DTYPE, OPERAND, PRECISION)
    if SPLIT > 1:
        _store_partial(acc, ws_ptr, tile, split, tl.num_programs(0), BLOCK_M, BLOCK_N)
        last = _arrive(count_ptr, tile, SPLIT)
        acc = _sum_partials(ws_ptr, tile, tl.num_programs(0), last, SPLIT, BLOCK_M, BLOCK_N)
    else:
        last = True
    if last:
        if HAS_BIAS:
            acc += b[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            out = (r + out.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, out, mask=mask)
        if SCALE_NEXT:  # the next norm's share of this tile: its columns' squares, and the rows times its weight
            out = tl.where(mask, out.to(tl.float32), 0.0)
            tl.store(ss_ptr + tile * M + rows, tl.sum(out * out, 1), mask=rows < M)
            tl.store(xs_ptr + offs, (out * nw[None, :]).to(xs_ptr.dtype.element_ty), mask=mask)


def dot_constexprs(x) -> dict:
    """DTYPE, OPERAND, PRECISION of kernels/softcap_attention.py's `_dot` for tiles of x's dtype: fp32 multiplied as
    fp32 (not TF32), as torch's reference multiplies it; fp32 operands in Triton's interpreter (CPU)."""
    dtype = TL_DTYPES[x.dtype]
    return dict(DTYPE=dtype, OPERAND=dtype if x.is_cuda else tl.float32,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32")


def decode_linear(x, weight, bias, residual, workspace: Workspace, block_n: int | None = None, next_norm=None):
    """residual + (x Wᵀ + b): x [M, K], weight [N, K], bias [N] or None, residual [M, N] or None (no add: a
    sublayer's output that a sandwich norm reads, `Sandwich`), one dtype, M <= 64; a new [M, N] tensor y.
    workspace: the split-K buffers (`Workspace`). With next_norm = (w [N], offset), the RMSNorm that reads y next:
    (y, `Scaled` of y for that norm). block_n: a program's output columns (default: by the weight's size,
    `program_columns`). No gradients."""
    check_decode_linear_args(x, weight, bias, residual)
    assert x.dtype in DTYPES, f"decode_linear: fp32/bf16/fp16, got {x.dtype}"
    M, K = x.shape
    N = weight.shape[0]
    block_n = block_n or program_columns(weight, WIDE)
    x, weight = x.contiguous(), weight.contiguous()
    y = x.new_empty(M, N)
    residual = y if residual is None else residual.contiguous()  # y: unread
    tiles = triton.cdiv(N, block_n)
    split, chunk, block_k = launch_config(tiles, K, x)
    bm = block_m(M)
    ws, counts = workspace.get(split * tiles * bm * block_n if split > 1 else 0, tiles, x.device)
    if next_norm is None:
        nw, offset, xs, ss = weight, 0.0, y, ws  # unread
    else:
        nw, offset = next_norm
        if nw.shape != (N,) or nw.dtype != x.dtype:
            raise ValueError(f"decode_linear: the next norm's weight must be [{N}] of {x.dtype}; got "
                             f"{tuple(nw.shape)}, {nw.dtype}")
        xs, ss = torch.empty_like(y), torch.empty(tiles, M, dtype=torch.float32, device=y.device)
    _decode_linear_kernel[(tiles, split)](
        x, weight, weight if bias is None else bias, residual, y, nw, xs, ss, ws, counts,
        M, N, K, chunk, offset, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not y,
        SCALE_NEXT=next_norm is not None, SPLIT=split,
        **dot_constexprs(x), BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, **pdl_constexprs(x),
        num_warps=NUM_WARPS, num_stages=num_stages((bm + block_n) * block_k, x))
    assert y.dtype == xs.dtype == x.dtype, f"decode_linear: y must be {x.dtype}, got {y.dtype}"
    return y if next_norm is None else (y, Scaled(xs, ss))

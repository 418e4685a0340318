"""A decoding step's draw of one token a row from its logits, with the token's log-probability, in two launches.

References: Gumbel 1954 and Maddison et al. 2014 "A* Sampling" (the Gumbel-max trick, of which the exponential
race is the same draw); Milakov & Gimelshein 2018 "Online normalizer calculation for softmax" (the running max
and sum); model/generate.py `sample_tokens` (the torch path this replaces where no top-k or top-p cut is set).

For a row of logits x (length V) in fp32, a temperature T > 0 and E_i ~ Exp(1) drawn per token by the caller:

    logp_i = x_i / T - LSE(x / T)
    token  = argmax_i p_i / E_i = argmax_i (x_i / T - log E_i)       the exponential race; LSE is a row's constant

The token is i with probability p_i: P(E_i / p_i < E_j / p_j for all j != i) = p_i, as the first of independent
exponential clocks of rates p_j to ring. At T = 0 the token is argmax_i x_i and logp is taken at T = 1. Ties go to
the lowest index, as torch.argmax takes the first.

Stage 1, a grid of (rows, chunks): a program reads one chunk of a row's logits (any float dtype) and of E (fp32),
a BLOCK of lanes at a time. Every lane keeps a running max m of z = x / T, a running sum d of exp(z - m), and its
best ratio r = exp(z_b - m) / E_b with its index b: the race's p_b / E_b up to the row's constant exp(m - LSE), as
the torch path compares exp(logp) / E. Each element needs one exp, of -|z - m|, and no log:

    z > m:   d <- d · exp(m - z) + 1,   r <- r · exp(m - z),   q = 1 / E,            m <- z
    else:    d <- d + exp(z - m),                               q = exp(z - m) / E
    q > r:   r <- q, b <- this index (strict: a lane keeps the first of equal ratios)

At T = 0 a lane's best is the first index of its max m. After the chunk the lanes are combined at the chunk's max
m_c: d_c = Σ_l d_l · exp(m_l - m_c), and the best of r_l · exp(m_l - m_c) (the lowest index among equals), stored
as its score s_c = m_c + log r_c = z_b - log E_b (at T = 0, s_c = m_c).

Stage 2, one program per row: LSE = M + log Σ_c d_c · exp(m_c - M) with M = max_c m_c, the token the index of the
best s_c (the lowest among equal scores), logp = x_token / T - LSE.

Why chunks: a rollout decodes few rows (16 for 2 prompts × 8 samples), and a program per row would leave most of
the GPU's SMs idle while each reads a whole row (V 151,936: 300 KB of bf16 logits, 600 KB of E). The chunk count
gives about two programs per SM (`launch_config`). The draw of E stays in torch (one exponential_ with the caller's
generator), so the same generator state gives the torch path's samples.

Reference: kernels.references.sample_tokens_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import DTYPES, check_sample_args

MAX_BLOCK = 2048  # the logits a program reads per step of its loop: 4 KB of bf16 and 8 KB of E
NUM_WARPS = 4  # 16 lanes a thread
ROWS_NUM_WARPS = 1  # stage 2 reads a few values a row
PROGRAMS_PER_SM = 2  # 16 rows of V 151,936 on an H100 (132 SMs): 15 chunks of 5 blocks, 240 programs in one wave
CPU_PROGRAMS = 8  # the interpreter runs programs one by one: any count works, and 8 splits a small row in chunks


@triton.jit
def _sample_chunks_kernel(
    logits_ptr, logits_row_stride,  # [B, V], last dim contiguous
    noise_ptr,  # E: fp32 [B, V] contiguous (read only if SAMPLE)
    max_ptr, sum_ptr, score_ptr, index_ptr,  # fp32, fp32, fp32, int32 [B, CHUNKS]
    V, chunk, inv_temperature,
    SAMPLE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    logits_ptr += row * logits_row_stride
    noise_ptr += row * V
    # m starts finite, so -|z - m| is never -inf + inf; a masked lane's z is -inf and adds exp(-inf) = 0.
    m = tl.full([BLOCK], -3.0e38, tl.float32)
    d = tl.zeros([BLOCK], tl.float32)
    r = tl.zeros([BLOCK], tl.float32)  # the best ratio, relative to m
    index = tl.zeros([BLOCK], tl.int32)  # a chunk of -inf logits alone reports index 0, as torch.argmax would
    start = c * chunk
    for offset in range(0, chunk, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(logits_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        z = x * inv_temperature
        up = z > m  # strict: a lane keeps the first index of its max
        t = tl.exp(-tl.abs(z - m))
        d = tl.where(up, d * t + 1.0, d + t)
        m = tl.where(up, z, m)
        better = up
        if SAMPLE:
            e = tl.load(noise_ptr + cols, mask=mask, other=1.0)
            r = tl.where(up, r * t, r)
            q = tl.where(up, 1.0, t) / e
            better = q > r
            r = tl.where(better, q, r)
        index = tl.where(better, cols, index)
    m_c = tl.max(m, 0)
    scale = tl.exp(m - m_c)
    if SAMPLE:
        ratio = r * scale
        r_c = tl.max(ratio, 0)
        index_c = tl.min(tl.where(ratio == r_c, index, V), 0)
        score_c = m_c + tl.log(r_c)
    else:
        index_c = tl.min(tl.where(m == m_c, index, V), 0)
        score_c = m_c
    out = row * tl.num_programs(1) + c
    tl.store(max_ptr + out, m_c)
    tl.store(sum_ptr + out, tl.sum(d * scale, 0))
    tl.store(score_ptr + out, score_c)
    tl.store(index_ptr + out, index_c)


@triton.jit
def _sample_rows_kernel(
    logits_ptr, logits_row_stride,
    max_ptr, sum_ptr, score_ptr, index_ptr,  # stage 1's [B, chunks]
    tokens_ptr, logps_ptr,  # int64 [B], fp32 [B]
    V, chunks, inv_temperature,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < chunks
    part = row * chunks + c
    m = tl.load(max_ptr + part, mask=mask, other=-3.0e38)
    d = tl.load(sum_ptr + part, mask=mask, other=0.0)
    best = tl.load(score_ptr + part, mask=mask, other=float("-inf"))
    index = tl.load(index_ptr + part, mask=mask, other=V)
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(d * tl.exp(m - m_row), 0))
    best_row = tl.max(best, 0)
    token = tl.min(tl.where(best == best_row, index, V), 0)
    x = tl.load(logits_ptr + row * logits_row_stride + token).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logps_ptr + row, x * inv_temperature - lse)


def launch_config(rows: int, V: int, programs: int, max_block: int = MAX_BLOCK) -> tuple[int, int, int]:
    """(BLOCK, chunk, chunks): a row in `chunks` chunks of `chunk` logits (a multiple of BLOCK; the last may be
    shorter), so that rows × chunks is about `programs` (never a chunk under one BLOCK)."""
    block = min(triton.next_power_of_2(V), max_block)
    blocks = triton.cdiv(V, block)
    chunks = max(1, min(blocks, triton.cdiv(programs, rows)))
    chunk = triton.cdiv(blocks, chunks) * block
    return block, chunk, triton.cdiv(V, chunk)


def sample_tokens(logits, temperature, noise=None, programs=None, max_block=MAX_BLOCK):
    """(tokens (B,) int64, logps (B,) fp32) from logits (B, V) (fp32, bf16 or fp16): the exponential race over
    noise (B, V) fp32, E ~ Exp(1) per token, at temperature > 0; the argmax at temperature 0 (noise None). See the
    module docstring. programs: how many stage-1 programs to aim for (default: two per SM on a GPU)."""
    check_sample_args(logits, temperature, noise)
    assert logits.dtype in DTYPES, f"sample_tokens: logits must be one of {DTYPES}, got {logits.dtype}"
    assert noise is None or noise.dtype == torch.float32, f"sample_tokens: noise must be float32, got {noise.dtype}"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logps = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return tokens, logps
    if programs is None:
        programs = (PROGRAMS_PER_SM * torch.cuda.get_device_properties(logits.device).multi_processor_count
                    if logits.is_cuda else CPU_PROGRAMS)
    block, chunk, chunks = launch_config(B, V, programs, max_block)
    parts = torch.empty((3, B, chunks), dtype=torch.float32, device=logits.device)  # max, sum, best score
    index = torch.empty((B, chunks), dtype=torch.int32, device=logits.device)
    inv_temperature = 1.0 / temperature if temperature > 0 else 1.0
    _sample_chunks_kernel[(B, chunks)](
        logits, logits.stride(0), parts if noise is None else noise.contiguous(), parts[0], parts[1], parts[2],
        index, V, chunk, inv_temperature, SAMPLE=noise is not None, BLOCK=block, num_warps=NUM_WARPS)
    _sample_rows_kernel[(B,)](
        logits, logits.stride(0), parts[0], parts[1], parts[2], index, tokens, logps, V, chunks, inv_temperature,
        BLOCK_C=triton.next_power_of_2(chunks), num_warps=ROWS_NUM_WARPS)
    assert tokens.dtype == torch.long and logps.dtype == torch.float32, (tokens.dtype, logps.dtype)
    return tokens, logps

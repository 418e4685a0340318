"""A decoding step's GEMMs with their fused prologues and epilogues (kernels/decode_linear.py, decode_swiglu.py,
decode_qkv.py) against their torch references: odd shapes, with and without bias, K split into chunks (summed by
the last program to arrive) and whole, Llama's and Gemma's norm roundings, the normalizing GEMMs' input as rows to
normalize or as the `Scaled` rows that the GEMM before writes; every launch leaves the workspace's arrival counts
at 0 for the next; Gemma 2/3's layers (GeGLU, the sandwich norms' `Sandwich` input, o and down without the add).
On CPU in Triton's interpreter; `-m gpu` at Qwen2.5-0.5B's, SmolLM2-135M's, Qwen3-0.6B's and Gemma 3 270M's
shapes."""
from itertools import product

import pytest
import torch

from kernels.decode_linear import Sandwich, Scaled, Workspace, decode_linear, launch_config
from kernels.decode_qkv import decode_qkv
from kernels.decode_swiglu import decode_swiglu
from kernels.references import (
    decode_linear_reference,
    decode_qkv_reference,
    decode_swiglu_reference,
    sandwich_rows_reference,
    scaled_rows_reference,
)
from model.transformer import rope_cos_sin
from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32 sums in another order than torch's GEMM, and one rounding where torch rounds between ops (and Triton's
# interpreter truncates to bf16): within a few ulps of the reference's output.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (6e-2, 3e-2), torch.float16: (8e-3, 8e-3)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def weights(rows, K, dtype, bias):
    w = (torch.randn(rows, K, device=DEVICE) / K ** 0.5).to(dtype)
    return w, (torch.randn(rows, device=DEVICE).to(dtype) if bias else None)


def test_a_grown_workspace_keeps_the_buffers_a_graph_may_hold():
    """Growing the workspace replaces its buffers but keeps the old ones alive: a graph captured with them reads
    them at every replay. A request that fits returns the same buffers."""
    ws = Workspace()
    partials, counts = ws.get(100, 4, torch.device(DEVICE))
    same = ws.get(50, 2, torch.device(DEVICE))
    assert same[0] is partials and same[1] is counts and ws.retired == []
    bigger, more = ws.get(1000, 40, torch.device(DEVICE))
    assert bigger.numel() == 1000 and more.numel() == 40 and not more.any()
    assert ws.retired[0] is partials and ws.retired[1] is counts


@pytest.mark.parametrize("hip, capability, on", [(None, (9, 0), True), (None, (10, 0), True), (None, (8, 0), False),
                                                 ("6.4", (9, 4), False)])
def test_dependent_launches_only_on_nvidia_hopper_and_later(monkeypatch, hip, capability, on):
    """Programmatic dependent launch (griddepcontrol) is on for NVIDIA GPUs of sm_90 and later only: not on
    Ampere, not under ROCm (whose torch reports gfx9 GPUs as capability 9.x), not for CPU tensors."""
    import kernels.decode_linear as dl
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    dl._dependent_launch.cache_clear()
    try:
        assert dl._dependent_launch(0) is on
    finally:
        dl._dependent_launch.cache_clear()
    assert dl.pdl_constexprs(torch.zeros(1)) == dict(PDL=False, launch_pdl=False)


def test_launch_config_splits_k_only_where_the_tiles_are_few():
    """Many column tiles: K whole; few: K in chunks of whole blocks, none empty, covering K."""
    x = torch.empty(0, dtype=torch.bfloat16)
    assert launch_config(300, 4096, x) == (1, 4096, 128)
    for tiles, K in ((28, 4864), (18, 896), (3, 300)):
        split, chunk, block_k = launch_config(tiles, K, x)
        assert split > 1 and chunk % block_k == 0 and (split - 1) * chunk < K <= split * chunk


def test_wide_weights_take_64_columns_a_program():
    """A decoding GEMM's programs take 64 output columns from a weight of WIDE elements on (decode_linear's 2^23,
    decode_swiglu's 2^24 of gate's and up's rows together), 32 below: Qwen2.5-0.5B's launches all take 32."""
    import kernels.decode_linear as dl
    import kernels.decode_swiglu as dsw
    for wide in (dl.WIDE, dsw.WIDE):
        assert dl.program_columns(torch.empty(wide // 1024, 1024, device="meta"), wide) == 64
        assert dl.program_columns(torch.empty(wide // 1024 - 1, 1024, device="meta"), wide) == 32
    assert (dl.WIDE, dsw.WIDE) == (1 << 23, 1 << 24)
    assert all(dl.program_columns(torch.empty(n, k, device="meta"), wide) == 32  # o, down; gate | up
               for n, k, wide in ((896, 896, dl.WIDE), (896, 4864, dl.WIDE), (9728, 896, dsw.WIDE)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, K, N, bias, block_n, add", [
    (3, 300, 70, True, None, True), (16, 64, 40, False, None, True), (1, 520, 33, False, None, True),
    (3, 300, 130, True, 64, True), (3, 300, 70, True, None, False)])
def test_decode_linear(dtype, M, K, N, bias, block_n, add):
    """residual + x Wᵀ + b; K = 300 and 520 run split, K = 64 whole; 64 columns a program as a wide weight's;
    without a residual (a sublayer's output before its sandwich norm), x Wᵀ + b alone."""
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    r = torch.randn(M, N, device=DEVICE).to(dtype) if add else None
    w, b = weights(N, K, dtype, bias)
    ws = Workspace()
    y = decode_linear(x, w, b, r, ws, block_n=block_n)
    assert y.dtype == dtype and not ws.counts.any()
    assert_close(y, decode_linear_reference(x, w, b, r), *TOL[dtype], name="y")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, K, N, offset", [(3, 300, 70, 0.0), (16, 64, 40, 1.0)])
def test_decode_linear_scales_its_rows_for_the_next_norm(dtype, M, K, N, offset):
    """With the next norm's weight, the launch also writes that norm's `Scaled` rows of its output y: y ⊙ (offset +
    w) rounded once, and y's sums of squares over its column tiles; y itself as without."""
    x, r = torch.randn(M, K, device=DEVICE).to(dtype), torch.randn(M, N, device=DEVICE).to(dtype)
    w, b = weights(N, K, dtype, True)
    nw = (1 + 0.1 * torch.randn(N, device=DEVICE)).to(dtype)
    ws = Workspace()
    y, (xs, ss) = decode_linear(x, w, b, r, ws, next_norm=(nw, offset))
    assert torch.equal(y, decode_linear(x, w, b, r, ws)) and not ws.counts.any()
    xs_want, ss_want = scaled_rows_reference(y, nw, offset)
    assert xs.dtype == dtype and ss.dtype == torch.float32 and ss.shape == (-(-N // 32), M)
    assert_close(xs, xs_want, *TOL[dtype], name="xs")
    assert_close(ss.sum(0), ss_want[0], 1e-5, 1e-5, name="ss")
    with pytest.raises(ValueError, match="next norm's weight"):
        decode_linear(x, w, b, r, ws, next_norm=(nw[1:], offset))
    w_gu, _ = weights(2 * 8, N, dtype, False)
    with pytest.raises(ValueError, match="ss must be contiguous fp32"):  # sums of squares for other rows
        decode_swiglu(Scaled(xs, ss[:, 1:].contiguous()), nw, w_gu, None, ws)


def normalizing_input(x, nw, offset, form, eps=1e-5, cast="llama"):
    """(a normalizing GEMM's input, the rows it stands for, a `Sandwich`'s out or None) for rows x: x itself; their
    `Scaled` form over 3 or 40 blocks of columns ("scaled-3", "scaled-40": more than 32, the kernels' sum of ss in
    several steps); or ("sandwich-3", "sandwich-40") a `Sandwich` of x as the residual stream and a sublayer output z
    whose `Scaled` rows over that many blocks are for a post norm of its own weight, standing for x + RMSNorm(z)."""
    if form == "rows":
        return x, x, None
    if form.startswith("scaled"):
        return Scaled(*scaled_rows_reference(x, nw, offset, blocks=int(form[7:]))), x, None
    z = torch.randn_like(x)
    post = (0.5 + 0.1 * torch.randn_like(nw.float())).to(x.dtype)
    out = torch.full_like(x, float("nan"))
    sandwich = Sandwich(x, Scaled(*scaled_rows_reference(z, post, offset, blocks=int(form[9:]))), out)
    return sandwich, sandwich_rows_reference(x, z, post, eps, offset, cast), out


def sandwich_rows(out, rows, dtype):
    """The rows that a normalizing GEMM's reference reads: for a `Sandwich` its out (written by one program), once
    checked (every row written, as the reference adds r + RMSNorm(z)), since the kernel normalizes exactly those rows
    (a rounding's ulp of difference from the reference's rows moves a GEMM output whose terms cancel by more than
    the tolerance in bf16); else the rows themselves."""
    if out is None:
        return rows
    assert not out.isnan().any(), "out: rows not written"
    assert_close(out, rows, *TOL[dtype], name="sandwich out")
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, K, N, bias, cast, offset, form, block_n, act", [
    (3, 300, 70, True, "llama", 0.0, "rows", None, "silu"),
    (3, 300, 70, True, "llama", 0.0, "scaled-40", None, "silu"),
    (16, 64, 40, False, "llama", 0.0, "rows", None, "silu"),
    (16, 64, 40, False, "llama", 0.0, "scaled-3", None, "silu"),
    (5, 200, 24, False, "gemma", 1.0, "rows", None, "gelu_tanh"),
    (5, 200, 24, False, "gemma", 1.0, "scaled-3", None, "gelu"),
    (3, 300, 100, True, "llama", 0.0, "scaled-40", 64, "silu"),
    (5, 200, 24, False, "gemma", 1.0, "sandwich-3", None, "gelu_tanh"),
    (3, 300, 70, True, "gemma", 1.0, "sandwich-40", 64, "gelu_tanh")])
def test_decode_swiglu(dtype, M, K, N, bias, cast, offset, form, block_n, act):
    """act(G) ⊙ U of RMSNorm(x) [W_gate; W_up]ᵀ + b (SwiGLU, GeGLU with either gelu), Llama's and Gemma's norm
    roundings, from x's rows, from their `Scaled` form, or from a `Sandwich` (Gemma 2/3's sandwich norms: the rows
    r + RMSNorm(z), also written to its out); 64 columns of G and of U a program, as a wide weight's."""
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, device=DEVICE)).to(dtype)
    w, b = weights(2 * N, K, dtype, bias)
    ws = Workspace()
    inputs, rows, out = normalizing_input(x, nw, offset, form, cast=cast)
    h = decode_swiglu(inputs, nw, w, b, ws, eps=1e-5, offset=offset, cast=cast, block_n=block_n, act=act)
    assert h.dtype == dtype and not ws.counts.any()
    rows = sandwich_rows(out, rows, dtype)
    assert_close(h, decode_swiglu_reference(rows, nw, w, b, 1e-5, offset, cast, act), *TOL[dtype], name="h")


def test_normalizing_gemms_refuse_a_bad_activation_or_sandwich():
    """An unknown activation, and a `Sandwich` whose z rows or out do not match its residual rows: one error line
    naming them, before the launch."""
    M, K, N = 3, 64, 8
    x, nw = torch.randn(M, K, device=DEVICE), torch.ones(K, device=DEVICE)
    w, _ = weights(2 * N, K, torch.float32, False)
    with pytest.raises(ValueError, match="act must be silu, gelu_tanh or gelu; got 'relu'"):
        decode_swiglu(x, nw, w, None, Workspace(), act="relu")
    z = Scaled(*scaled_rows_reference(torch.randn(M, K, device=DEVICE), nw))
    for bad in (Sandwich(x, Scaled(z.xs[:, 1:].contiguous(), z.ss), torch.empty_like(x)),
                Sandwich(x, z, torch.empty(M, K, device=DEVICE, dtype=torch.bfloat16)),
                Sandwich(x, z, torch.empty(K, M, device=DEVICE).t())):
        with pytest.raises(ValueError, match=r"Sandwich: z's rows and out \(contiguous\) must be r's \(3, 64\)"):
            decode_swiglu(bad, nw, w, None, Workspace())


def check_qkv(dtype, M, K, Hq, Hk, D, bias, S=9, slot=5, form="rows", qk_norm=False, cast="llama"):
    offset = 1.0 if cast == "gemma" else 0.0
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, device=DEVICE)).to(dtype)
    w, b = weights((Hq + 2 * Hk) * D, K, dtype, bias)
    heads = [(1 + 0.3 * torch.randn(D, device=DEVICE)).to(dtype) for _ in range(2)] if qk_norm else None
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D)
    cos, sin = (t[:, 0] for t in rope_cos_sin(torch.randint(0, 4096, (M, 1), device=DEVICE), inv_freq, dtype))
    at = torch.tensor([slot], device=DEVICE)
    caches = [torch.randn(M, Hk, S, D, device=DEVICE).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    ws = Workspace()
    inputs, rows, out = normalizing_input(x, nw, offset, form, cast=cast)
    q = decode_qkv(inputs, nw, w, b, cos, sin, *caches, at, Hq, ws, eps=1e-5, offset=offset, cast=cast,
                   qk_norm=heads)
    q_want = decode_qkv_reference(sandwich_rows(out, rows, dtype), nw, w, b, cos, sin, *want, at, Hq, eps=1e-5,
                                  offset=offset, cast=cast, qk_norm=heads)
    assert q.shape == (M, Hq, D) and q.dtype == dtype and not ws.counts.any()
    assert_close(q, q_want, *TOL[dtype], name="q")
    for name, c, c_want in zip(("k_cache", "v_cache"), caches, want):
        others = torch.arange(S, device=DEVICE) != slot
        assert torch.equal(c[:, :, others], c_want[:, :, others]), f"{name}: a slot other than `at` was written"
        assert_close(c[:, :, slot], c_want[:, :, slot], *TOL[dtype], name=name)


QKV_CASES = [(3, 300, 6, 2, 32, True, "rows", False), (3, 300, 6, 2, 32, True, "scaled-40", False),
             (5, 64, 4, 4, 48, False, "rows", False), (5, 64, 4, 4, 48, False, "scaled-3", False),
             (3, 300, 6, 2, 32, False, "scaled-40", True), (5, 64, 4, 4, 48, True, "rows", True)]


@pytest.mark.parametrize("dtype, M, K, Hq, Hk, D, bias, form, qk_norm",
                         [(dtype, *case) for dtype, case in product(DTYPES, QKV_CASES)
                          if not (dtype == torch.float32 and case[1] == 300 and not case[-1])],
                         ids=lambda v: str(v) if isinstance(v, torch.dtype) else None)
def test_decode_qkv(dtype, M, K, Hq, Hk, D, bias, form, qk_norm):
    """q rotated, k rotated and v into the cache slot `at` (no other slot written), of RMSNorm(x) Wᵀ + b: grouped
    and plain kv heads, a head of 48 (half a head not a power of two), split and whole K, from x's rows or from
    their `Scaled` form; with Qwen3's RMSNorm of each q and k head before RoPE (its own weights for q and k). In
    fp32 (BLOCK_K 32: four times the interpreter's K steps) split K runs once, with the head norms."""
    check_qkv(dtype, M, K, Hq, Hk, D, bias, form=form, qk_norm=qk_norm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, K, Hq, Hk, D, form, qk_norm", [(3, 200, 4, 1, 32, "sandwich-40", True),
                                                            (5, 64, 4, 2, 48, "sandwich-3", False)])
def test_decode_qkv_with_sandwich_norms(dtype, M, K, Hq, Hk, D, form, qk_norm):
    """Gemma's layers: Gemma's norm rounding, the input a `Sandwich` (the residual stream and the previous layer's
    down output before its post norm: rows r + RMSNorm(z), also written to its out), Gemma 3's head norms, split
    and whole K."""
    check_qkv(dtype, M, K, Hq, Hk, D, False, form=form, qk_norm=qk_norm, cast="gemma")


def test_decode_qkv_refuses_head_norms_of_another_size_or_dtype():
    """q_norm's and k_norm's weights must be one head's [D] in x's dtype: one error line naming both, before the
    launch."""
    M, K, Hq, Hk, D = 2, 64, 4, 2, 32
    x, nw = torch.randn(M, K, device=DEVICE), torch.ones(K, device=DEVICE)
    w, _ = weights((Hq + 2 * Hk) * D, K, torch.float32, False)
    cos = sin = torch.ones(M, D, device=DEVICE)
    caches = [torch.zeros(M, Hk, 4, D, device=DEVICE) for _ in range(2)]
    at = torch.tensor([1], device=DEVICE)
    for bad in ((torch.ones(D + 1, device=DEVICE), torch.ones(D, device=DEVICE)),
                (torch.ones(D, device=DEVICE), torch.ones(D, device=DEVICE, dtype=torch.bfloat16))):
        with pytest.raises(ValueError, match=r"q_norm's and k_norm's weights must be \[32\] of torch.float32"):
            decode_qkv(x, nw, w, None, cos, sin, *caches, at, Hq, Workspace(), qk_norm=bad)


SHAPES = {  # hidden, intermediate, q heads, kv heads, head_dim, qkv bias, q/k norms, Gemma (sandwich norms, GeGLU)
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, True, False, False),
    "smollm2-135m": (576, 1536, 9, 3, 64, False, False, False),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, False, True, False),
    "gemma-3-270m": (640, 2048, 4, 1, 256, False, True, True),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_gemms_at_model_shapes(shape):
    """The three kernels at a rollout's 16 rows and the model's shapes, bf16, against their references; gate | up
    also from the rows that o's launch writes, as a decoding layer chains them (its `Scaled` rows, or with Gemma's
    sandwich norms the residual stream and o's output without the add)."""
    H, inter, Hq, Hk, D, bias, qk_norm, gemma = SHAPES[shape]
    M, dtype = 16, torch.bfloat16
    cast, offset, act = ("gemma", 1.0, "gelu_tanh") if gemma else ("llama", 0.0, "silu")
    for form in ("rows", "sandwich-20" if gemma else "scaled-28"):
        check_qkv(dtype, M, H, Hq, Hk, D, bias, S=128, slot=100, form=form, qk_norm=qk_norm, cast=cast)
    ws = Workspace()
    x, nw = torch.randn(M, H, device=DEVICE).to(dtype), (1 + 0.1 * torch.randn(H, device=DEVICE)).to(dtype)
    w, _ = weights(2 * inter, H, dtype, False)
    h = decode_swiglu(x, nw, w, None, ws, offset=offset, cast=cast, act=act)
    assert_close(h, decode_swiglu_reference(x, nw, w, None, 1e-6, offset, cast, act), *TOL[dtype], name="h")
    y, r = torch.randn(M, Hq * D, device=DEVICE).to(dtype), torch.randn(M, H, device=DEVICE).to(dtype)
    w_o, _ = weights(H, Hq * D, dtype, False)
    if gemma:
        z, scaled = decode_linear(y, w_o, None, None, ws, next_norm=(nw, offset))
        out = torch.empty_like(r)
        h = decode_swiglu(Sandwich(r, scaled, out), nw, w, None, ws, offset=offset, cast=cast, act=act)
        x = sandwich_rows(out, sandwich_rows_reference(r, z, nw, 1e-6, offset, cast), dtype)
    else:
        x, scaled = decode_linear(y, w_o, None, r, ws, next_norm=(nw, offset))
        h = decode_swiglu(scaled, nw, w, None, ws)
    assert_close(h, decode_swiglu_reference(x, nw, w, None, 1e-6, offset, cast, act), *TOL[dtype],
                 name="h from o's rows")
    for K in (Hq * D, inter):  # o, down
        y, r = torch.randn(M, K, device=DEVICE).to(dtype), torch.randn(M, H, device=DEVICE).to(dtype)
        w, _ = weights(H, K, dtype, False)
        r = None if gemma else r
        assert_close(decode_linear(y, w, None, r, ws), decode_linear_reference(y, w, None, r), *TOL[dtype], name="y")
    assert not ws.counts.any()

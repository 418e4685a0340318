"""A decoding step's kernels against their references: `rope_into_cache` bit-equal to the rope kernel and the
cache's index_copy_ writes it replaces, and with Qwen3's and Gemma 3's head norms; `decode_attention` against a
float64 reference, for grouped and plain kv heads, heads of 16 to 256, odd cache lengths, visible slots over a
block, left-padded rows, sliding windows and softcaps; `add_rms_norm` bit-equal to the add and the rms_norm kernel,
and with the sandwich norm of its r. On CPU in Triton's interpreter, and on a GPU where there is one."""
import pytest
import torch

from kernels.add_rms_norm import add_rms_norm
from kernels.decode_attention import decode_attention
from kernels.references import add_rms_norm_reference, decode_attention_reference, rope_into_cache_reference
from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope
from kernels.rope_cache import rope_into_cache
from model.transformer import rope_cos_sin
from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The kernel rounds y once, from fp32: within an ulp or two of the float64 result (relative to max |y|).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Hq, Hk, D", [(3, 6, 2, 16), (2, 4, 4, 80), (1, 8, 1, 32)])
def test_rope_into_cache_equals_rope_and_index_copy(dtype, B, Hq, Hk, D):
    """q, k, v as column slices of one packed q | k | v projection (read in place): the rotated q, and the cache
    slot's k and v, equal bit for bit the rope kernel's output and its copies into the cache; no other slot is
    written."""
    S, slot = 11, 7
    qkv = torch.randn(B, 1, (Hq + 2 * Hk) * D, device=DEVICE).to(dtype)
    q, k, v = (t.view(B, 1, -1, D) for t in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D)
    cos, sin = rope_cos_sin(torch.randint(0, 4096, (B, 1), device=DEVICE), inv_freq, dtype)
    at = torch.tensor([slot], device=DEVICE)
    caches = [torch.randn(B, Hk, S, D, device=DEVICE).to(dtype) for _ in range(2)]
    want_k, want_v = caches[0].clone(), caches[1].clone()
    q_want, k_rot = apply_rope(q, k, cos, sin)
    want_k.index_copy_(2, at, k_rot.transpose(1, 2))
    want_v.index_copy_(2, at, v.transpose(1, 2))
    q_out = rope_into_cache(q, k, v, cos, sin, *caches, at)
    assert q_out.shape == q.shape and q_out.dtype == dtype
    assert torch.equal(q_out, q_want)
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Hq, Hk, D, cast, offset", [(3, 6, 2, 80, "llama", 0.0), (2, 4, 1, 256, "gemma", 1.0)],
                         ids=["qwen3-odd-head", "gemma3"])
def test_rope_into_cache_with_head_norms(dtype, B, Hq, Hk, D, cast, offset):
    """With qk_norm (Qwen3's and Gemma 3's q_norm and k_norm), q and k read in place from one packed projection are
    normalized per head, then rotated and written: equal, within a rounding of the norm's output, to the rms_norm
    kernel on each head followed by the rope kernel, and to the float64 reference (heads far from unit scale);
    weights of another dtype are refused before the launch."""
    S, slot = 11, 7
    qkv = (30 * torch.randn(B, 1, (Hq + 2 * Hk) * D, device=DEVICE)).to(dtype)
    q, k, v = (t.view(B, 1, -1, D) for t in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    qn, kn = (torch.randn(D, device=DEVICE).to(dtype) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D)
    cos, sin = rope_cos_sin(torch.randint(0, 4096, (B, 1), device=DEVICE), inv_freq, dtype)
    at = torch.tensor([slot], device=DEVICE)
    caches = [torch.zeros(B, Hk, S, D, device=DEVICE).to(dtype) for _ in range(2)]
    q_out = rope_into_cache(q, k, v, cos, sin, *caches, at, qk_norm=(qn, kn), eps=1e-6, offset=offset, cast=cast)
    q_want, k_want = apply_rope(rms_norm(q, qn, 1e-6, offset, cast), rms_norm(k, kn, 1e-6, offset, cast), cos, sin)
    ulp = torch.finfo(dtype).eps  # the head's sum of squares in two halves, where rms_norm sums it whole
    for name, got, want in (("q", q_out, q_want), ("k", caches[0][:, :, slot][:, None], k_want)):
        assert_close(got, want, atol=4 * ulp * want.abs().max().item(), rtol=4 * ulp, name=name)
    assert torch.equal(caches[1][:, :, slot], v[:, 0]) and not caches[0][:, :, :slot].any()
    ref_caches = [torch.zeros(B, Hk, S, D, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    want = rope_into_cache_reference(*(t.double() for t in (q, k, v, cos, sin)), *ref_caches, at,
                                     qk_norm=(qn.double(), kn.double()), eps=1e-6, offset=offset, cast=cast)
    rtol = RTOL[dtype] * 4
    assert_close(q_out, want, atol=rtol * want.abs().max().item(), rtol=rtol, name="q (float64)")
    with pytest.raises(ValueError, match="q_norm's weight must have q's dtype"):
        rope_into_cache(q, k, v, cos, sin, *caches, at, qk_norm=(qn.double(), kn), cast=cast)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Hq, Hk, D, S, at", [
    (3, 6, 2, 16, 37, 33), (2, 4, 4, 80, 9, 8), (2, 8, 1, 32, 70, 69),
    (2, 14, 2, 64, 140, 133),  # Qwen2.5-0.5B's heads (rep 7): 134 visible slots, over a block of 128
    (2, 3, 3, 128, 70, 66),  # plain kv heads (rep 1) of 128: over a block of 64
    (2, 16, 2, 96, 70, 69),  # rep 8, an odd head (padded to 128): over a block of 64
    (2, 6, 2, 256, 40, 37),  # Gemma's widest head (rep 3): over a block of 32
], ids=["rep3-D16", "rep1-D80", "rep8-D32", "rep7-D64", "rep1-D128", "rep8-D96", "rep3-D256"])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 3.0), (35, 3.0)],
                         ids=["plain", "window", "softcap", "window-over-a-block-softcap"])
def test_decode_attention(dtype, B, Hq, Hk, D, S, at, window, softcap):
    """Grouped (rep 3, 7, 8) and plain kv heads, heads of 16 to 256 (80 and 96 padded), odd cache lengths, visible
    slots over a block boundary, rows left-padded to different first slots (one that sees only its own token),
    slots after `at` filled with junk that must stay hidden, against float64."""
    q = torch.randn(B, 1, Hq, D, device=DEVICE).to(dtype)
    k, v = (torch.randn(B, Hk, S, D, device=DEVICE).to(dtype) for _ in range(2))
    first = torch.tensor([0, at, 3][:B], device=DEVICE)
    at = torch.tensor([at], device=DEVICE)
    scale = D ** -0.5
    for rows in (first, None):
        y = decode_attention(q, k, v, rows, at, scale, window, softcap)
        want = decode_attention_reference(q.double(), k.double(), v.double(), rows, at, scale, window, softcap)
        assert y.dtype == dtype and y.shape == q.shape
        rtol = RTOL[dtype]
        assert_close(y, want, atol=rtol * want.abs().max().item(), rtol=rtol, name=f"y (first={rows is not None})")


@pytest.mark.parametrize("Hq, Hk", [(14, 2), (4, 4)])
def test_decode_attention_of_no_rows(Hq, Hk):
    """A batch of no rows launches nothing and gives an empty y of q's shape."""
    q, k = torch.randn(0, 1, Hq, 64, device=DEVICE), torch.randn(0, Hk, 9, 64, device=DEVICE)
    y = decode_attention(q, k, k, torch.zeros(0, dtype=torch.long, device=DEVICE), torch.tensor([3], device=DEVICE),
                         0.125)
    assert y.shape == q.shape and y.dtype == q.dtype


def test_decode_attention_refuses_a_cache_of_another_shape():
    q, k = torch.randn(2, 1, 6, 16), torch.randn(2, 4, 9, 16)
    with pytest.raises(ValueError, match="kv heads do not divide"):
        decode_attention(q, k, k, None, torch.tensor([3]), 0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 1, 64), (3, 1, 200), (2, 5, 33)])
@pytest.mark.parametrize("cast, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_add_rms_norm_equals_add_then_rms_norm(dtype, shape, cast, offset):
    """The residual sum and its norm equal bit for bit torch's add (rounded to the dtype) followed by the rms_norm
    kernel, and the float64 reference within the dtype's rounding; the residual r a strided view."""
    x = torch.randn(shape, device=DEVICE).to(dtype)
    r = torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE).to(dtype)[..., ::2]
    w = torch.randn(shape[-1], device=DEVICE).to(dtype)
    s, y = add_rms_norm(x, r, w, eps=1e-6, offset=offset, cast=cast)
    if DEVICE == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(s, x + r)
    else:  # Triton's interpreter rounds fp32 to bf16 toward zero, where torch and the GPU round to nearest
        assert_close(s, x + r, atol=0, rtol=2 ** -7, name="s")
    assert torch.equal(y, rms_norm(s, w, eps=1e-6, offset=offset, cast=cast))
    want = add_rms_norm_reference(x.double(), r.double(), w.double(), 1e-6, offset, cast)[1]
    rtol = RTOL[dtype] * 2  # the norm rounds twice under cast="llama"
    assert_close(y, want, atol=rtol * want.abs().max().item(), rtol=rtol, name="y")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 1, 64), (3, 1, 200)])
@pytest.mark.parametrize("cast, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_add_rms_norm_normalizes_r_first(dtype, shape, cast, offset):
    """With r_weight (sandwich norms: x + norm_r(r), then the next norm), s and y equal the rms_norm kernel on r,
    torch's add and the rms_norm kernel on the sum (bit for bit in Triton's interpreter in fp32 and fp16, within
    a rounding elsewhere), and the float64 reference within the dtype's rounding; r a strided view, its scale far
    from 1 (the norm must not be skipped)."""
    x = torch.randn(shape, device=DEVICE).to(dtype)
    r = (40 * torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE)).to(dtype)[..., ::2]
    w, rw = (torch.randn(shape[-1], device=DEVICE).to(dtype) for _ in range(2))
    s, y = add_rms_norm(x, r, w, eps=1e-6, offset=offset, cast=cast, r_weight=rw)
    z = rms_norm(r, rw, eps=1e-6, offset=offset, cast=cast)
    y_of_s = rms_norm(s, w, eps=1e-6, offset=offset, cast=cast)
    if DEVICE == "cpu" and dtype != torch.bfloat16:
        assert torch.equal(s, x + z) and torch.equal(y, y_of_s)
    else:  # the interpreter rounds fp32 to bf16 toward zero, where torch rounds to nearest; on the GPU the compiler
        # may contract the sums of squares or the add into FMAs otherwise than in the separate kernels
        ulp = torch.finfo(dtype).eps
        for name, got, want in (("s", s, x + z), ("y", y, y_of_s)):
            assert_close(got, want, atol=2 * ulp * want.abs().max().item(), rtol=2 * ulp, name=name)
    want_s, want = add_rms_norm_reference(x.double(), r.double(), w.double(), 1e-6, offset, cast, r_weight=rw.double())
    rtol = RTOL[dtype] * 4  # z, s and y are each rounded (twice for each norm under cast="llama")
    assert_close(s, want_s, atol=rtol * want_s.abs().max().item(), rtol=rtol, name="s")
    assert_close(y, want, atol=rtol * want.abs().max().item(), rtol=rtol, name="y")


def test_add_rms_norm_refuses_an_r_norm_that_changes_the_dtype():
    """Under cast="llama" an fp32 weight would make r's norm fp32 for bf16 rows: one error line, no launch."""
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="give r_weight in torch.bfloat16"):
        add_rms_norm(x, x, torch.ones(8, dtype=torch.bfloat16), r_weight=torch.ones(8))

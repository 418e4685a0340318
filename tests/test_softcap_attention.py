"""The softcapped flash attention kernel (kernels/softcap_attention.py): its output and q, k, v gradients against a
float64 reference with explicit scores and a dense mask, for causal rows, sliding windows and packed documents,
grouped kv heads, head sizes that are not powers of two; rows that see no key; the KeyRange the kernel reads
against the dense mask it replaces. On CPU in Triton's interpreter; the Gemma-2-9B shape on a GPU."""
import pytest
import torch
import triton
import triton.language as tl

from kernels.references import KeyRange, key_range, softcap_attention_reference
from kernels.softcap_attention import softcap_attention
from model.transformer import attention_mask
from tests.helpers import interpreter, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ‖kernel − float64‖ / ‖float64‖: p and dz are rounded to the inputs' dtype before their products, as in
# FlashAttention-2, so the half-precision errors are a few units of that dtype's rounding.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DOCS = [[13, 20, 7], [40]]  # the documents' lengths in each row: three, and one


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def doc_ids(lengths, T, device=DEVICE):
    """(B, T) ids: row b holds documents of lengths[b], then padding as a document of its own."""
    rows = []
    for row in lengths:
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(row)] + [torch.full((T - sum(row),), len(row))])
        rows.append(ids[:T])
    return torch.stack(rows).to(device)


def check(dtype, B, Hq, Hk, T, D, window, doc, scale=0.3, softcap=5.0):
    """The kernel against float64 explicit scores under attention_mask's dense mask, one upstream gradient."""
    q = torch.randn(B, Hq, T, D, device=DEVICE).to(dtype).requires_grad_()
    k, v = (torch.randn(B, Hk, T, D, device=DEVICE).to(dtype).requires_grad_() for _ in range(2))
    y = softcap_attention(q, k, v, key_range((B, T), window, doc, DEVICE), scale, softcap)
    assert y.dtype == dtype and y.shape == (B, Hq, T, D)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (q, k, v), dy)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    y_ref = softcap_attention_reference(*ref, attention_mask(T, window, DEVICE, doc), scale, softcap)
    ref_grads = torch.autograd.grad(y_ref, ref, dy.double())
    for name, got, want in zip(("y", "dq", "dk", "dv"), (y, *grads), (y_ref, *ref_grads)):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert rel_err(got, want) < TOL[dtype], (name, rel_err(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window, docs", [(None, False), (7, False), (None, True), (9, True)],
                         ids=["causal", "window", "documents", "documents+window"])
def test_softcap_attention(dtype, window, docs):
    """Grouped kv heads (rep 2), a head of 16, 40 tokens: a partial last tile of queries and keys."""
    T = 40
    check(dtype, 2, 4, 2, T, 16, window, doc_ids(DOCS, T) if docs else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_attention_wide_heads(dtype):
    """A head of 64 (one tile of several warps' rows), four query heads on one kv head, documents and a window."""
    T = 48
    check(dtype, 2, 4, 1, T, 64, 11, doc_ids([[30, 18], [5, 43]], T))


def test_softcap_attention_head_not_a_power_of_two():
    """Gemma 2's tiny test models have heads of 24: the tiles are 32 wide, the rest masked."""
    check(torch.float32, 1, 2, 2, 33, 24, None, None, scale=20 ** -0.5, softcap=50.0)


def test_softcap_attention_rows_that_see_nothing():
    """Queries that see no key (lo > i; the model's masks never make one) give y = 0 and send no gradient,
    never NaN; the other rows equal the reference over the keys they see."""
    B, Hq, Hk, T, D, empty = 1, 2, 1, 20, 16, 3
    i = torch.arange(T, device=DEVICE)
    lo = torch.maximum(i - 4, torch.full_like(i, empty))[None]  # queries 0..2 see nothing, the rest a window
    hi = torch.searchsorted(lo, i[None].contiguous(), right=True) - 1
    keys = KeyRange(lo.int(), hi.int())
    q = torch.randn(B, Hq, T, D, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, Hk, T, D, device=DEVICE, requires_grad=True) for _ in range(2))
    y = softcap_attention(q, k, v, keys, 0.25, 5.0)
    dy = torch.randn_like(y)
    dq, dk, dv = torch.autograd.grad(y, (q, k, v), dy)
    assert torch.isfinite(torch.cat([t.flatten() for t in (y, dq, dk, dv)])).all()
    assert not y[:, :, :empty].any() and not dq[:, :, :empty].any()
    seen = (i[None, :] >= lo[0, empty:, None]) & (i[None, :] <= i[empty:, None])  # (T - empty, T)
    ref = [t.detach().double().requires_grad_() for t in (q[:, :, empty:], k, v)]
    y_ref = softcap_attention_reference(*ref, seen, 0.25, 5.0)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(y_ref, ref, dy[:, :, empty:].double())
    for name, got, want in (("y", y[:, :, empty:], y_ref), ("dq", dq[:, :, empty:], dq_ref), ("dk", dk, dk_ref),
                            ("dv", dv, dv_ref)):
        assert rel_err(got, want) < 1e-5, name


@pytest.mark.parametrize("window", [None, 1, 5, 64])
@pytest.mark.parametrize("docs", [False, True])
def test_key_range_is_the_dense_mask(window, docs):
    """lo and hi describe attention_mask's visible pairs exactly: query i sees key j iff lo_i <= j <= i, iff
    j <= i <= hi_j."""
    T = 40
    doc = doc_ids(DOCS, T) if docs else None
    keys = key_range((2, T), window, doc, DEVICE)
    dense = attention_mask(T, window, DEVICE, doc).expand(2, 1, T, T)[:, 0]  # (B, T, T)
    i = torch.arange(T, device=DEVICE)
    by_query = (i[None, None, :] >= keys.lo[:, :, None]) & (i[None, None, :] <= i[None, :, None])
    by_key = (i[None, :, None] >= i[None, None, :]) & (i[None, :, None] <= keys.hi[:, None, :])
    assert keys.lo.dtype == keys.hi.dtype == torch.int32
    assert torch.equal(by_query, dense) and torch.equal(by_key, dense)


def test_softcap_attention_refuses_bad_arguments():
    q = torch.randn(1, 3, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="2 kv heads do not divide 3 query heads"):
        softcap_attention(q, k, k, key_range((1, 8)), 0.25, 5.0)
    with pytest.raises(ValueError, match="KeyRange must hold int32"):
        softcap_attention(q[:, :2], k, k, key_range((2, 8)), 0.25, 5.0)


@triton.jit
def _bf16_dot_kernel(a_ptr, b_ptr, c_ptr):
    i = tl.arange(0, 16)
    offs = i[:, None] * 16 + i[None, :]
    tl.store(c_ptr + offs, tl.dot(tl.load(a_ptr + offs), tl.load(b_ptr + offs)))


@pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="shows what the interpreter (CPU tests) computes")
def test_interpreter_multiplies_bf16_as_integers():
    """Triton's interpreter gives a wrong tl.dot of bf16 tiles, so the kernel multiplies fp32 copies there
    (`_dot`). When this fails the interpreter is fixed, and `_dot`'s OPERAND can go."""
    a, b = (torch.randn(16, 16).bfloat16() for _ in range(2))
    c = torch.empty(16, 16)
    _bf16_dot_kernel[(1,)](a, b, c)
    assert rel_err(c, a.float() @ b.float()) > 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 4096, 1000])
@pytest.mark.parametrize("docs", [False, True])
def test_softcap_attention_gemma2_9b_shape(window, docs):
    """Gemma-2-9B's attention in bf16 (16 query heads on 8 kv heads of 256, softcap 50, scale 224^-1/2), two rows
    of 2048: its global layers (no window; 4096 masks nothing at 2048), a window shorter than the rows, and
    packed documents."""
    T = 2048
    doc = doc_ids([[700, 900, 448], [2048]], T) if docs else None
    check(torch.bfloat16, 2, 16, 8, T, 256, window, doc, scale=224 ** -0.5, softcap=50.0)


@interpreter
def test_gemma2_through_the_kernel_equals_explicit_scores(tmp_path):
    """A tiny Gemma 2 (softcap 5, window 8 on its sliding layer, heads of 24) trained on packed rows: with the
    kernels its layers attend through the flash kernel (a KeyRange, no (T, T) mask) and give the loss and LoRA
    gradients of the torch references' explicit scores."""
    from model import LoRAConfig, load_model
    from model.lora import lora_parameters
    from tests.helpers import randomize_lora_b
    from tests.tiny_models import save_tiny
    save_tiny("gemma2", str(tmp_path))
    B, T = 2, 24
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (B, T))
    doc = doc_ids([[9, 10, 5], [24]], T, "cpu")
    pos = torch.cat([torch.arange(n) for n in (9, 10, 5, 24)]).view(B, T)
    targets = torch.randint(0, 256, (B, T))
    out = {}
    for kernels in (False, True):
        model, _ = load_model(str(tmp_path), lora=LoRAConfig(r=4, alpha=8), use_kernels=kernels, lora_seed=1)
        randomize_lora_b(model)
        masks = [model.layer_mask(t, doc, None, (B, T), 0, torch.device("cpu"), torch.float32) for t in
                 ("full", "sliding")]
        assert all(isinstance(m, KeyRange) for m in masks) == kernels
        loss = model(ids, pos, doc, targets=targets)
        loss.backward()
        out[kernels] = loss.detach(), {n: p.grad for n, p in lora_parameters(model)}
    assert rel_err(out[True][0], out[False][0]) < 1e-6
    for n, g in out[False][1].items():
        assert rel_err(out[True][1][n], g) < 1e-5, n

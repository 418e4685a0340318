"""Every kernel against its pure-torch reference: outputs, and input/weight gradients from
one random upstream gradient pushed through both. On CPU the kernels run in Triton's
interpreter (tests/conftest.py); `pytest -m gpu` repeats the checks at realistic sizes."""
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels.fused_linear_cross_entropy as flce_module
from kernels.adapter_grads import MAX_RANK, MIN_ELEMENTS, adapter_grads
from kernels.cross_entropy import cross_entropy
from kernels.dora_backward import dora_backward
from kernels.dora_norm import MergeTable, NormsTable, dora_norms
from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from kernels.geglu import geglu, geglu_backward, geglu_forward
from kernels.references import (
    adapter_grads_reference,
    cross_entropy_reference,
    dora_backward_reference,
    dora_norms_reference,
    fp8_quantize_tensor_reference,
    fused_linear_cross_entropy_reference,
    geglu_reference,
    merged_weight_reference,
    residual_lowrank_add_reference,
    rms_norm_and_residual_reference,
    rms_norm_reference,
    rope_qkv_reference,
    rope_reference,
    swiglu_reference,
)
from kernels.residual_lowrank_add import residual_lowrank_add_
from kernels.rms_norm import rms_norm, rms_norm_and_residual
from kernels.rope import apply_rope, apply_rope_qkv
from kernels.swiglu import swiglu, swiglu_backward, swiglu_forward
from model.lora import affine_forward, autograd_backward
from model.transformer import rope_cos_sin
from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# relative tolerance per dtype; the absolute tolerance is this times the largest |expected|.
# bf16 and fp16: a few ulps (the kernels round once where torch rounds at every op).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(actual, expected, dtype, name, scale=1.0):
    rtol = RTOL[dtype] * scale
    atol = rtol * expected.detach().abs().max().item() if expected.numel() else 0.0
    # Values below the dtype's smallest normal are spaced smallest_normal * eps apart (fp16: 6e-8;
    # e.g. the gradients of a mean over 4096 tokens): two roundings may differ by a few of those.
    fi = torch.finfo(dtype)
    atol = max(atol, 4 * fi.smallest_normal * fi.eps)
    assert_close(actual, expected, atol=atol, rtol=rtol, name=name)


def leaves(*tensors):
    """Two independent leaf copies of every tensor: one for the kernel, one for the reference."""
    return ([t.detach().clone().requires_grad_() for t in tensors],
            [t.detach().clone().requires_grad_() for t in tensors])


# ----------------------------------------------------------------------------- cross-entropy

def make_targets(N, V, ignore_index, device):
    targets = torch.randint(0, V, (N,), device=device)
    targets[torch.rand(N, device=device) < 0.25] = ignore_index
    if N > 1:
        targets[0] = ignore_index  # at least one ignored row, at least one counted row
        targets[1] = torch.randint(0, V, ()).item()
    return targets


def check_cross_entropy(device, dtype, N, V, softcap=None, scale=None, reduction="mean", num_targets=None,
                        ignore_index=-100, layout="contiguous"):
    if layout == "contiguous":
        base = torch.randn(N, V, device=device) * 4
        def view(t):
            return t
    elif layout == "row_strided":  # e.g. a slice of a wider buffer
        base = torch.randn(N, V + 37, device=device) * 4
        def view(t):
            return t[:, :V]
    else:  # "transposed": the vocab dim is strided
        base = torch.randn(V, N, device=device) * 4
        def view(t):
            return t.t()
    (x,), (x_ref,) = leaves(base.to(dtype))
    targets = make_targets(N, V, ignore_index, device)
    kw = dict(ignore_index=ignore_index, softcap=softcap, scale=scale, reduction=reduction, num_targets=num_targets)
    loss = cross_entropy(view(x), targets, **kw)
    ref = cross_entropy_reference(view(x_ref), targets, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    close(loss, ref, torch.float32, "loss", scale=10)
    grad_loss = torch.randn_like(ref)
    loss.backward(grad_loss)
    ref.backward(grad_loss)
    assert x.grad.dtype == dtype
    close(x.grad, x_ref.grad, dtype, "dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, V", [(21, 32000), (8, 151936), (3, 262144), (5, 4099)])
def test_cross_entropy(dtype, N, V):
    # 151936 and 262144 span several 32768-wide chunks (online logsumexp), the last one partial
    check_cross_entropy(DEVICE, dtype, N, V)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap, scale", [(30.0, None), (None, 0.5), (30.0, 2.0), (5.0, None)])
def test_cross_entropy_softcap_scale(dtype, softcap, scale):
    check_cross_entropy(DEVICE, dtype, 6, 40000, softcap=softcap, scale=scale)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_reduction(dtype, reduction):
    check_cross_entropy(DEVICE, dtype, 9, 5000, reduction=reduction, softcap=20.0)


@pytest.mark.parametrize("num_targets", [37, torch.tensor(37), torch.tensor(0)])
def test_cross_entropy_caller_num_targets(num_targets):
    check_cross_entropy(DEVICE, torch.float32, 7, 3000, num_targets=num_targets)


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_non_contiguous(dtype, layout):
    check_cross_entropy(DEVICE, dtype, 5, 33000, layout=layout)


def test_cross_entropy_custom_ignore_index():
    # 7 is a real token id here: rows with target 7 must be ignored, -100 has no meaning
    check_cross_entropy(DEVICE, torch.float32, 8, 1000, ignore_index=7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [0, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_zero_targets(dtype, N, reduction):
    x = (torch.randn(N, 1000, device=DEVICE) * 4).to(dtype).requires_grad_()
    targets = torch.full((N,), -100, device=DEVICE)
    loss = cross_entropy(x, targets, reduction=reduction, softcap=30.0)
    assert loss.dtype == torch.float32 and loss.item() == 0.0
    loss.backward(torch.tensor(3.0, device=DEVICE))
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert torch.isfinite(x.grad).all() and (x.grad == 0).all()


def test_cross_entropy_no_grad_skips_gradient():
    x = torch.randn(4, 500, device=DEVICE, requires_grad=True)
    targets = make_targets(4, 500, -100, DEVICE)
    with torch.no_grad():
        loss = cross_entropy(x, targets)
    assert loss.grad_fn is None
    close(loss, cross_entropy_reference(x, targets), torch.float32, "loss", scale=10)


def test_cross_entropy_retained_graph_backward_twice():
    # the backward recomputes the gradient from the saved logits and lse: a second backward
    # through a retained graph gives the same gradient again (once an in-place buffer, it was refused)
    x = torch.randn(3, 100, device=DEVICE, requires_grad=True)
    loss = cross_entropy(x, torch.tensor([1, 2, 3], device=DEVICE))
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    x_ref = x.detach().clone().requires_grad_()
    cross_entropy_reference(x_ref, torch.tensor([1, 2, 3], device=DEVICE)).backward()
    close(first, x_ref.grad, torch.float32, "grad")
    close(x.grad, 2 * first, torch.float32, "grad after two backward passes")


# ----------------------------------------------------------------------------- fused linear cross-entropy

def linear_cross_entropy_float64(hidden, weight, targets, *, bias=None, softcap=None, reduction="mean",
                                 num_targets=None, ignore_index=-100):
    """The definition in float64. A reference in the kernel's dtype is no oracle for fp16 gradients: its
    logit gradients (~1 / (num_targets * V), 2e-9 at 2048 tokens and V = 256k) underflow in fp16."""
    z = F.linear(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    losses = F.cross_entropy(z, targets, ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return losses
    n = (targets != ignore_index).sum() if num_targets is None else num_targets
    return losses.sum() / (max(float(n), 1.0) if reduction == "mean" else 1.0)


def check_fused_linear_cross_entropy(device, dtype, N, H, V, chunk_rows=None, bias=False, train_weight=True,
                                     softcap=None, reduction="mean", grad_scale=None, num_targets=None,
                                     monkeypatch=None):
    if chunk_rows is not None:  # force several chunks, the last one partial
        for name in ("MAX_CHUNK_BYTES", "MAX_CHUNK_BYTES_TRAINABLE_W"):
            monkeypatch.setattr(flce_module, name, chunk_rows * V * torch.finfo(dtype).bits // 8)
        assert flce_module.chunk_rows(N, V, torch.finfo(dtype).bits // 8, train_weight) == chunk_rows
    tensors = [torch.randn(N, H, device=device).to(dtype), (torch.randn(V, H, device=device) / H**0.5).to(dtype)]
    if bias:
        tensors.append(torch.randn(V, device=device).to(dtype))
    ours, _ = leaves(*tensors)
    refs = [t.detach().double().requires_grad_() for t in tensors]  # the same (rounded) inputs, in float64
    for t in ours[1:] + refs[1:]:
        t.requires_grad_(train_weight)
    targets = make_targets(N, V, -100, device)
    kw = dict(softcap=softcap, reduction=reduction, num_targets=num_targets)
    loss = fused_linear_cross_entropy(ours[0], ours[1], targets, bias=ours[2] if bias else None, **kw)
    ref = linear_cross_entropy_float64(refs[0], refs[1], targets, bias=refs[2] if bias else None, **kw)
    assert loss.dtype == torch.float32
    close(loss, ref, dtype, "loss")
    grad_loss = torch.randn_like(loss) if grad_scale is None else torch.full_like(loss, grad_scale)
    loss.backward(grad_loss)
    ref.backward(grad_loss.double())
    names = ["dhidden", "dweight", "dbias"]
    for name, a, b in zip(names, ours, refs):
        if not b.requires_grad:
            assert a.grad is None, name
            continue
        assert a.grad.dtype == dtype, name
        assert torch.isfinite(a.grad).all(), f"{name} is not finite"
        close(a.grad, b.grad, dtype, name, scale=2)


class ChunkRecorder:
    """torch.nn.functional for the fused loss's module, whose `linear` (a chunk's logits) first checks that no
    earlier chunk's logits are still alive."""

    def __init__(self):
        self.chunks = []

    def __getattr__(self, name):
        return getattr(F, name)

    def linear(self, *args, **kwargs):
        assert all(r() is None for r in self.chunks), "an earlier chunk's logits are alive while the next are made"
        logits = F.linear(*args, **kwargs)
        self.chunks.append(weakref.ref(logits))
        return logits


def test_fused_linear_cross_entropy_holds_one_chunk_of_logits(monkeypatch):
    """Each chunk's logits are freed before the next chunk's are made: the loss holds one chunk at a time, as
    memory.logits_bytes counts it (an assignment alone would keep the old chunk until the new one exists)."""
    recorder = ChunkRecorder()
    monkeypatch.setattr(flce_module, "F", recorder)
    check_fused_linear_cross_entropy(DEVICE, torch.float32, 19, 16, 300, chunk_rows=4, monkeypatch=monkeypatch)
    assert len(recorder.chunks) == 5


@pytest.mark.parametrize("V, N, rows", [
    (49152, 4096, 682),  # SmolLM2: 64 MiB of bf16 logits
    (32000, 8192, 1048),  # TinyLlama: 64 MiB
    (151936, 8192, 512),  # Qwen2.5: 64 MiB would be 220 rows; at least 512
    (256000, 8192, 512),  # Gemma 2: 512 rows, 250 MiB, under the 256 MiB cap
    (32000, 300, 300),  # fewer tokens than a chunk: one chunk
])
def test_fused_linear_cross_entropy_chunk_rows(V, N, rows):
    """The chunk of logits: CHUNK_BYTES, at least MIN_CHUNK_ROWS rows, at most MAX_CHUNK_BYTES (bf16, frozen W)."""
    assert flce_module.chunk_rows(N, V, 2, need_dw=False) == rows
    assert flce_module.chunk_rows(N, 512 * 2**20, 2, need_dw=False) == 1  # a row above the cap: one row a chunk


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_cross_entropy(dtype, monkeypatch):
    check_fused_linear_cross_entropy(DEVICE, dtype, 19, 48, 3001, chunk_rows=4, bias=True, monkeypatch=monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_cross_entropy_softcap_frozen_weight(dtype, monkeypatch):
    check_fused_linear_cross_entropy(DEVICE, dtype, 13, 32, 2000, chunk_rows=5, train_weight=False, softcap=30.0,
                                     monkeypatch=monkeypatch)


@pytest.mark.parametrize("reduction, num_targets", [("sum", None), ("mean", 50), ("mean", torch.tensor(50)),
                                                     ("none", None)])
def test_fused_linear_cross_entropy_reductions(reduction, num_targets, monkeypatch):
    check_fused_linear_cross_entropy(DEVICE, torch.float32, 11, 24, 1500, chunk_rows=3, reduction=reduction,
                                     num_targets=num_targets, train_weight=reduction != "none",
                                     monkeypatch=monkeypatch)


def test_fused_linear_cross_entropy_fp16_loss_scale(monkeypatch):
    # grad_output = 65536 (fp16 loss scaling): scaled in fp32, then cast, so right and finite
    check_fused_linear_cross_entropy(DEVICE, torch.float16, 17, 32, 2500, chunk_rows=6, grad_scale=65536.0,
                                     monkeypatch=monkeypatch)


def test_fused_linear_cross_entropy_fp16_unreduced_sums_stay_finite():
    # 64 tokens, one target, large coherent hidden states: the unreduced dW row sums to about
    # -64 * 2000, past fp16's 65504. Scaled in fp32 by 65536 / 2**20 (a step-wide token count)
    # before the cast it is about -8000; cast first it would be -inf.
    N, H, V = 64, 32, 500
    hidden = (2000 * torch.randn(H, device=DEVICE).sign() + torch.randn(N, H, device=DEVICE)).half()
    weight = (torch.randn(V, H, device=DEVICE) * 1e-3).half()
    targets = torch.full((N,), 3, device=DEVICE)
    (h, w), (h_ref, w_ref) = leaves(hidden, weight)
    loss = fused_linear_cross_entropy(h, w, targets, num_targets=2**20)
    ref = fused_linear_cross_entropy_reference(h_ref, w_ref, targets, num_targets=2**20)
    loss.backward(torch.tensor(65536.0, device=DEVICE))
    ref.backward(torch.tensor(65536.0, device=DEVICE))
    assert w_ref.grad.abs().max() > 4000 and torch.isfinite(w_ref.grad).all()
    assert torch.isfinite(w.grad).all(), "dweight overflowed: scale in fp32 before casting to fp16"
    close(w.grad, w_ref.grad, torch.float16, "dweight", scale=2)
    close(h.grad, h_ref.grad, torch.float16, "dhidden", scale=2)


def test_fused_linear_cross_entropy_none_with_trainable_weight_is_refused():
    h, w = torch.randn(4, 8, device=DEVICE), torch.randn(50, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="reduction='none'"):
        fused_linear_cross_entropy(h, w, torch.tensor([1, 2, 3, 4], device=DEVICE), reduction="none")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [0, 6])
@pytest.mark.parametrize("fn", [fused_linear_cross_entropy, fused_linear_cross_entropy_reference],
                         ids=["kernel", "reference"])
def test_fused_linear_cross_entropy_zero_targets(dtype, N, fn):
    h = torch.randn(N, 16, device=DEVICE).to(dtype).requires_grad_()
    w = torch.randn(300, 16, device=DEVICE).to(dtype).requires_grad_()
    loss = fn(h, w, torch.full((N,), -100, device=DEVICE), softcap=30.0)
    assert loss.item() == 0.0
    loss.backward()
    for name, t in (("dhidden", h), ("dweight", w)):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype, name
        assert torch.isfinite(t.grad).all() and (t.grad == 0).all(), name


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_on_cpu_takes_logits_of_the_target_rows_only(reduction, monkeypatch):
    """The CPU reference multiplies only the rows with a target by the head; its losses and the gradients of the
    hidden states and of a trainable head equal those from every row's logits (0 and none where there is no
    target)."""
    h = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=reduction != "none")  # "none" with a trainable head is refused
    targets = make_targets(9, 300, -100, "cpu")
    rows = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: rows.append(len(x)) or linear(x, *a))
    loss = fused_linear_cross_entropy_reference(h, w, targets, softcap=30.0, reduction=reduction)
    assert rows == [int((targets != -100).sum())] and rows[0] < 9
    monkeypatch.setattr(F, "linear", linear)
    dy = torch.randn(loss.shape)
    grads = torch.autograd.grad(loss, [t for t in (h, w) if t.requires_grad], dy)
    expected = cross_entropy_reference(F.linear(h, w), targets, softcap=30.0, reduction=reduction)
    for a, e in zip((loss, *grads), (expected, *torch.autograd.grad(expected, [t for t in (h, w) if t.requires_grad],
                                                                     dy))):
        close(a, e, torch.float32, "loss or gradient")
    if reduction == "none":
        assert (loss[targets == -100] == 0).all()


def test_fused_linear_cross_entropy_no_grad_skips_gradient():
    h, w = torch.randn(5, 16, device=DEVICE, requires_grad=True), torch.randn(300, 16, device=DEVICE)
    targets = make_targets(5, 300, -100, DEVICE)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, targets)
    assert loss.grad_fn is None
    close(loss, fused_linear_cross_entropy_reference(h, w, targets), torch.float32, "loss", scale=10)


# ----------------------------------------------------------------------------- RMSNorm

def check_rms_norm(device, dtype, shape, cast, offset, w_dtype=None):
    H = shape[-1]
    x = torch.randn(shape, device=device).to(dtype)
    w = (torch.randn(H, device=device) * 0.5 + (1.0 if offset == 0.0 else 0.0)).to(w_dtype or dtype)
    (x1, w1), (x2, w2) = leaves(x, w)
    y = rms_norm(x1, w1, eps=1e-6, offset=offset, cast=cast)
    ref = rms_norm_reference(x2, w2, eps=1e-6, offset=offset, cast=cast)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    close(y, ref, dtype, "y")  # x's dtype: the llama cast rounds xhat to it
    dy = torch.randn_like(ref)
    y.backward(dy)
    ref.backward(dy)
    assert x1.grad.dtype == x.dtype and w1.grad.dtype == w.dtype
    close(x1.grad, x2.grad, dtype, "dx", scale=2)
    close(w1.grad, w2.grad, dtype, "dw", scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 41, 96), (2, 3, 2304)])
@pytest.mark.parametrize("cast, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm(dtype, shape, cast, offset):
    check_rms_norm(DEVICE, dtype, shape, cast, offset)


@pytest.mark.parametrize("cast, offset", [("llama", 1.0), ("gemma", 0.0)])
def test_rms_norm_other_offsets(cast, offset):
    check_rms_norm(DEVICE, torch.bfloat16, (5, 200), cast, offset)


def test_rms_norm_fp32_weight_bf16_input():
    # llama cast promotes to the weight's dtype, as HF's `weight * x.to(input_dtype)` does
    check_rms_norm(DEVICE, torch.bfloat16, (4, 7, 64), "llama", 0.0, w_dtype=torch.float32)


@pytest.mark.parametrize("cast, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm_rounds_like_hf(cast, offset):
    # HF's intermediate roundings are emulated: nearly every element bit-identical (a few
    # differ through rsqrt's last bit). Without the emulation about a quarter differ.
    # fp16 here: Triton 3.9's interpreter truncates fp32 -> bf16 (no rounding), so bf16 is checked on GPU.
    check_rms_norm_bits(DEVICE, torch.float16, (64, 2304), cast, offset)


def check_rms_norm_bits(device, dtype, shape, cast, offset):
    x = torch.randn(shape, device=device).to(dtype)
    w = (torch.randn(shape[-1], device=device) * 0.5 + 1.0 - offset).to(dtype)
    y = rms_norm(x, w, offset=offset, cast=cast)
    ref = rms_norm_reference(x, w, offset=offset, cast=cast)
    identical = (y == ref).float().mean().item()
    assert identical > 0.99, f"only {identical:.1%} of elements are bit-identical to HF"


@pytest.mark.parametrize("cast, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_rms_norm_frozen_weight(cast, offset):
    # a frozen weight (LoRA) skips the dW partial sums; dx is unchanged
    x = torch.randn(3, 37, 96, device=DEVICE)
    w = torch.randn(96, device=DEVICE)
    (x1,), (x2,) = leaves(x)
    dy = torch.randn_like(x)
    rms_norm(x1, w, offset=offset, cast=cast).backward(dy)
    rms_norm_reference(x2, w, offset=offset, cast=cast).backward(dy)
    assert w.grad is None
    close(x1.grad, x2.grad, torch.float32, "dx", scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast, offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("used", ["both", "norm", "residual"])
def test_rms_norm_and_residual(dtype, cast, offset, used):
    """(norm of x, x) from one Function: x's two gradients, the norm's and the residual stream's (here a strided
    one), summed in the norm's backward kernel, equal autograd's sum of the reference's; one unused gradient (None)
    leaves the other. fp32: dx equal to the norm kernel's dx plus dres, bit for bit in Triton's interpreter, within a
    rounding on the GPU (where the compiler may contract the add into an FMA)."""
    x = torch.randn(3, 37, 96, device=DEVICE).to(dtype)
    w = (torch.randn(96, device=DEVICE) * 0.5 + 1.0 - offset).to(dtype)
    (x1, w1), (x2, w2) = leaves(x, w)
    y, r = rms_norm_and_residual(x1, w1, offset=offset, cast=cast)
    ref_y, ref_r = rms_norm_and_residual_reference(x2, w2, offset=offset, cast=cast)
    assert torch.equal(r, x) and r.data_ptr() == x1.data_ptr()
    close(y, ref_y, dtype, "y")
    dy = torch.randn_like(ref_y)
    dres = torch.randn(3, 37, 128, device=DEVICE).to(dtype)[..., 5:101]  # rows 128 apart
    outs = {"both": ((y, r), (ref_y, ref_r), (dy, dres)), "norm": ((y,), (ref_y,), (dy,)),
            "residual": ((r,), (ref_r,), (dres,))}[used]
    torch.autograd.backward(outs[0], outs[2])
    torch.autograd.backward(outs[1], outs[2])
    assert x1.grad.dtype == dtype
    close(x1.grad, x2.grad, dtype, "dx", scale=2)
    if used == "residual":
        assert w1.grad is None and torch.equal(x1.grad, dres)
    else:
        close(w1.grad, w2.grad, dtype, "dw", scale=2)
    if used == "both" and dtype == torch.float32:
        (x3,), _ = leaves(x)
        rms_norm(x3, w, offset=offset, cast=cast).backward(dy)
        want = x3.grad + dres
        if DEVICE == "cpu":
            assert torch.equal(x1.grad, want)
        else:
            ulp = torch.finfo(dtype).eps
            torch.testing.assert_close(x1.grad, want, atol=2 * ulp * want.abs().max().item(), rtol=2 * ulp)


def test_rms_norm_non_contiguous():
    x = torch.randn(6, 5, 130, device=DEVICE)[:, :, 1:129]  # (6, 5, 128), row stride 130
    w = torch.randn(128, device=DEVICE)
    close(rms_norm(x, w), rms_norm_reference(x, w), torch.float32, "y")


# ----------------------------------------------------------------------------- RoPE

def check_rope(device, dtype, B, T, Hq, Hk, D, cs_dtype=torch.float32, packed=False, transposed=False,
               random_tables=False, columns=False):
    if packed:  # two documents per row, positions restart at 0
        position_ids = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).expand(1, T).to(device)
    else:
        position_ids = torch.randint(0, 4096, (B, T), device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device).float() / D)
    cos, sin = rope_cos_sin(position_ids, inv_freq, torch.float32)
    cos, sin = (cos * 1.1).to(cs_dtype), (sin * 1.1).to(cs_dtype)  # an attention scaling, as HF's rotary applies
    if random_tables:  # halves that differ: the kernel must pair each half of x with its own half of cos/sin
        cos, sin = torch.randn_like(cos), torch.randn_like(sin)
    if transposed:  # [B, H, T, D] storage seen as [B, T, H, D]
        q = torch.randn(B, Hq, T, D, device=device).to(dtype).transpose(1, 2)
        k = torch.randn(B, Hk, T, D, device=device).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, T, Hq, D, device=device).to(dtype)
        k = torch.randn(B, T, Hk, D, device=device).to(dtype)
    (q1, k1), (q2, k2) = leaves(q, k)
    if columns:  # q, k as column slices of one [B, T, q | k | v] projection output: read in place by the kernel
        qkv = torch.cat([q1.detach().flatten(2), k1.detach().flatten(2), torch.randn_like(k1).flatten(2)], -1)
        qkv.requires_grad_()
        q_view, k_view, _ = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q1, k1 = q_view.view(B, T, Hq, D), k_view.view(B, T, Hk, D)
        assert not q1.is_contiguous() and q1.stride(1) == (Hq + 2 * Hk) * D
    out = apply_rope(q1, k1, cos, sin)
    ref = rope_reference(q2, k2, cos, sin)
    dq, dk = torch.randn_like(ref[0]), torch.randn_like(ref[1])
    for name, a, b in (("q_out", out[0], ref[0]), ("k_out", out[1], ref[1])):
        assert a.dtype == dtype and a.shape == b.shape, name
        close(a, b, dtype, name)
    torch.autograd.backward(out, (dq, dk))
    torch.autograd.backward(ref, (dq, dk))
    dq_got, dk_got = (q1.grad, k1.grad) if not columns else (
        g.reshape(t.shape) for g, t in zip(qkv.grad.split([Hq * D, Hk * D, Hk * D], dim=-1), (q2, k2)))
    close(dq_got, q2.grad, dtype, "dq")
    close(dk_got, k2.grad, dtype, "dk")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, Hq, Hk, D", [(2, 7, 4, 2, 64), (1, 5, 8, 4, 256), (3, 3, 6, 1, 80)])
def test_rope(dtype, B, T, Hq, Hk, D):
    check_rope(DEVICE, dtype, B, T, Hq, Hk, D)


def test_rope_packed_positions_broadcast_cos_bf16_tables():
    # cos/sin [1, T, D] broadcast over a batch of 3
    check_rope(DEVICE, torch.bfloat16, 3, 12, 4, 2, 32, cs_dtype=torch.bfloat16, packed=True)


def test_rope_non_contiguous():
    check_rope(DEVICE, torch.float32, 2, 6, 4, 2, 64, transposed=True)


@pytest.mark.parametrize("B", [1, 3])
def test_rope_columns_of_a_packed_projection(B):
    check_rope(DEVICE, torch.float32, B, 6, 4, 2, 32, columns=True)


def test_rope_general_tables():
    check_rope(DEVICE, torch.float32, 2, 5, 4, 2, 64, random_tables=True)


def check_rope_qkv(device, dtype, B, T, Hq, Hk, D):
    """apply_rope_qkv against the split, `rope_reference` and v's copy, values and d(q | k | v), in float64 for the
    reference; dv must come back bit for bit in v's columns."""
    position_ids = torch.randint(0, 4096, (B, T), device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device).float() / D)
    cos, sin = rope_cos_sin(position_ids, inv_freq, torch.float32)
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, device=device).to(dtype).requires_grad_()
    ref_qkv = qkv.detach().double().requires_grad_()
    out = apply_rope_qkv(qkv, Hq, Hk, cos, sin)
    ref = rope_qkv_reference(ref_qkv, Hq, Hk, cos.double(), sin.double())
    grads = [torch.randn_like(r).to(dtype) for r in ref]
    for name, a, b in zip(("q", "k", "v"), out, ref):
        assert a.dtype == dtype and a.shape == b.shape and a.is_contiguous(), name
        close(a, b.to(dtype), dtype, name)
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, [g.double() for g in grads])
    assert qkv.grad.dtype == dtype and qkv.grad.shape == qkv.shape
    close(qkv.grad, ref_qkv.grad.to(dtype), dtype, "d(q | k | v)")
    assert torch.equal(qkv.grad[..., (Hq + Hk) * D:], grads[2].flatten(2)), "dv must be copied as it came"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, Hq, Hk, D", [(2, 7, 4, 2, 64), (1, 5, 6, 1, 80), (3, 4, 4, 4, 32)])
def test_rope_qkv(dtype, B, T, Hq, Hk, D):
    check_rope_qkv(DEVICE, dtype, B, T, Hq, Hk, D)


def test_rope_qkv_rejects_a_width_the_heads_do_not_divide():
    cos = sin = torch.ones(1, 3, 8)
    with pytest.raises(ValueError, match=r"qkv must be \[B, T, \(Hq \+ 2 Hk\) D\]"):
        apply_rope_qkv(torch.randn(1, 3, 30), 2, 1, cos, sin)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_rope_qkv_at_llama_8b_heads(dtype):
    check_rope_qkv("cuda", dtype, 2, 257, 32, 8, 128)


# ----------------------------------------------------------------------------- SwiGLU / GeGLU

ACTIVATIONS = {
    "swiglu": (swiglu, swiglu_reference, swiglu_forward, swiglu_backward),
    "geglu_tanh": (lambda g, u: geglu(g, u, "tanh"), lambda g, u: geglu_reference(g, u, "tanh"),
                   lambda g, u, **kw: geglu_forward(g, u, "tanh", **kw),
                   lambda dh, g, u, **kw: geglu_backward(dh, g, u, "tanh", **kw)),
    "geglu_erf": (lambda g, u: geglu(g, u, "none"), lambda g, u: geglu_reference(g, u, "none"),
                  lambda g, u, **kw: geglu_forward(g, u, "none", **kw),
                  lambda dh, g, u, **kw: geglu_backward(dh, g, u, "none", **kw)),
}


def check_activation(device, dtype, shape, act, non_contiguous=False):
    fn, reference, _, _ = ACTIVATIONS[act]
    gate = (torch.randn(shape, device=device) * 3).to(dtype)
    up = torch.randn(shape, device=device).to(dtype)
    (g1, u1), (g2, u2) = leaves(gate, up)
    view = (lambda t: t.transpose(0, -1)) if non_contiguous else (lambda t: t)
    h = fn(view(g1), view(u1))
    ref = reference(view(g2), view(u2))
    assert h.dtype == dtype and h.shape == ref.shape
    close(h, ref, dtype, "h")
    dh = torch.randn_like(ref)
    h.backward(dh)
    ref.backward(dh)
    close(g1.grad, g2.grad, dtype, "dgate", scale=2)
    close(u1.grad, u2.grad, dtype, "dup")


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 423, 37), (1, 2, 4096)])
def test_activation(act, dtype, shape):
    check_activation(DEVICE, dtype, shape, act)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_activation_non_contiguous(act):
    check_activation(DEVICE, torch.float32, (5, 7, 11), act, non_contiguous=True)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_activation_low_level_inplace(act):
    _, reference, forward, backward = ACTIVATIONS[act]
    gate, up, dh = (torch.randn(4, 300, device=DEVICE) for _ in range(3))
    g_ref, u_ref = gate.clone().requires_grad_(), up.clone().requires_grad_()
    reference(g_ref, u_ref).backward(dh)
    close(forward(gate, up), reference(gate, up), torch.float32, "h")
    dgate, dup = backward(dh, gate, up, inplace=True)
    assert dgate.data_ptr() == gate.data_ptr() and dup.data_ptr() == up.data_ptr()
    close(dgate, g_ref.grad, torch.float32, "dgate")
    close(dup, u_ref.grad, torch.float32, "dup")


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [False, True])
def test_activation_backward_writes_h(act, dtype, affine):
    """write_h: the backward also writes h over dh, equal to the forward's h bit for bit (the LoRA MLP reads it for
    the down adapter's dA in place of a second forward), with dG and dU those of the backward without it."""
    _, _, forward, backward = ACTIVATIONS[act]
    rows, n = 19, 67
    gate = (torch.randn(rows, n, device=DEVICE) * 3).to(dtype)
    up, dh = (torch.randn(rows, n, device=DEVICE).to(dtype) for _ in range(2))
    kw = dict(scale=(torch.rand(2 * rows, device=DEVICE) + 0.5).to(dtype),
              bias=torch.randn(2 * rows, device=DEVICE).to(dtype)) if affine else {}
    expected_h = forward(gate, up, **kw)
    expected = backward(dh, gate, up, **kw)
    spent = dh.clone()
    dgate, dup, h = backward(spent, gate.clone(), up.clone(), inplace=True, write_h=True, **kw)
    assert h.data_ptr() == spent.data_ptr()
    assert torch.equal(h, expected_h)
    assert torch.equal(dgate, expected[0]) and torch.equal(dup, expected[1])


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,affine", [(19, 67, False), (3, 1024, True), (1, 1, False), (0, 5, False)])
def test_activation_amax(act, dtype, rows, n, affine):
    """amax: the forward's max |h| and the backward's largest |dG| or |dU|, as stored, exactly (the fp8 path takes
    the MLP's one e4m3 scale of H and of [dG | dU] from them), with the values they store unchanged: one program's
    block and a partial one, exactly one program, one value, and none (amax 0). The largest value sits in the last
    program's block, where a program that skipped its store would miss it."""
    _, _, forward, backward = ACTIVATIONS[act]
    gate = (torch.randn(rows, n, device=DEVICE) * 3).to(dtype)
    up, dh = (torch.randn(rows, n, device=DEVICE).to(dtype) for _ in range(2))
    if gate.numel():
        up.view(-1)[-1], dh.view(-1)[-1] = 50.0, 50.0
    kw = dict(scale=(torch.rand(2 * rows, device=DEVICE) + 0.5).to(dtype),
              bias=torch.randn(2 * rows, device=DEVICE).to(dtype)) if affine else {}
    amax = torch.full((), -1.0, dtype=dtype, device=DEVICE)
    h = forward(gate, up, **kw, amax=amax)
    assert torch.equal(h, forward(gate, up, **kw))
    assert torch.equal(amax, h.abs().amax() if h.numel() else torch.zeros_like(amax))
    dgate, dup, h2 = backward(dh.clone(), gate.clone(), up.clone(), inplace=not affine, write_h=True, **kw,
                              amax=amax)
    expected = backward(dh, gate, up, **kw)
    assert torch.equal(dgate, expected[0]) and torch.equal(dup, expected[1]) and torch.equal(h2, h)
    largest = torch.maximum(dgate.abs().amax(), dup.abs().amax()) if h.numel() else torch.zeros_like(amax)
    assert torch.equal(amax, largest)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_activation_per_row_affine(act, dtype, has_bias):
    """With a per-row scale and bias (DoRA's G = g ⊙ P + b of the MLP's gate and up, stored as (rows, N)), the
    kernels' h and (dG, dU) equal the torch reference's on the affine G, U, and the backward leaves gate and up
    (the P that DoRA's backward still reads) as they were, even when asked to work in place."""
    _, reference, forward, backward = ACTIVATIONS[act]
    rows, n = 37, 129
    gate = (torch.randn(rows, n, device=DEVICE) * 3).to(dtype)
    up, dh = (torch.randn(rows, n, device=DEVICE).to(dtype) for _ in range(2))
    scale = (torch.rand(2 * rows, device=DEVICE) + 0.5).to(dtype)
    bias = torch.randn(2 * rows, device=DEVICE).to(dtype) if has_bias else None
    kept = gate.clone(), up.clone()
    close(forward(gate, up, scale=scale, bias=bias), affine_forward(reference, gate, up, scale, bias), dtype, "h",
          scale=2)
    dgate, dup = backward(dh, gate, up, inplace=True, scale=scale, bias=bias)
    ref_dgate, ref_dup, _ = autograd_backward(reference, dh, gate, up, scale, bias)
    close(dgate, ref_dgate, dtype, "dG", scale=4)
    close(dup, ref_dup, dtype, "dU", scale=2)
    assert torch.equal(gate, kept[0]) and torch.equal(up, kept[1])


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,k_h", [(37, 129, 20, 5), (70, 33, 48, 16), (1, 1, 1, 1), (33, 300, 0, 0),
                                         (290, 40, 80, 16)])
def test_activation_lowrank_terms(act, dtype, rows, n, k, k_h):
    """Low-rank terms (the LoRA MLP's adapters): h, dG, dU from gate + L_g R_gᵀ, up + L_u R_uᵀ and dh + L_h R_hᵀ
    equal the reference on those sums computed in float64, with L and R strided or not, k from 80 (two chunks) down
    to zero, odd shapes and partial tiles, and more rows than a program's strip takes; the backward's h (over dh) is
    the forward's to the bit, and the amaxes are those of what is stored."""
    _, reference, forward, backward = ACTIVATIONS[act]
    gen = torch.Generator().manual_seed(rows * n + k)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)
    gate, up, dh = rand(rows, n, scale=2), rand(rows, n), rand(rows, n)
    terms = (rand(rows, k, scale=0.5), rand(k, n, scale=0.5).t()), (rand(rows, k, scale=0.5), rand(n, k, scale=0.5))
    dh_term = rand(k_h, rows, scale=0.5).t(), rand(n, k_h, scale=0.5)
    # the reference: the sums in float64 from the same operands, the activation in fp32
    g_ref, u_ref = (x.double().addmm(left.double(), right.double().t()).float().requires_grad_()
                    for x, (left, right) in zip((gate, up), terms))
    h_ref = reference(g_ref, u_ref)
    h_ref.backward(dh.double().addmm(dh_term[0].double(), dh_term[1].double().t()).float())
    amax = torch.full((), -1.0, dtype=dtype, device=DEVICE)
    h = forward(gate, up, amax=amax, terms=terms)
    close(h, h_ref, dtype, "h", scale=2)
    assert torch.equal(amax, h.abs().amax())
    dgate, dup, h2 = backward(dh.clone(), gate.clone(), up.clone(), inplace=True, write_h=True, amax=amax,
                              terms=terms, dh_term=dh_term)
    close(dgate, g_ref.grad, dtype, "dG", scale=4)
    close(dup, u_ref.grad, dtype, "dU", scale=2)
    assert torch.equal(h2, h)
    assert torch.equal(amax, torch.maximum(dgate.abs().amax(), dup.abs().amax()))


def test_activation_lowrank_terms_need_2d_operands_and_no_affine():
    gate = torch.randn(4, 8, device=DEVICE)
    term = torch.randn(4, 2, device=DEVICE), torch.randn(8, 2, device=DEVICE)
    with pytest.raises(AssertionError, match="2-d gate"):
        swiglu_forward(gate.view(2, 2, 8), gate.view(2, 2, 8), terms=(term, term))
    with pytest.raises(AssertionError, match="per-row affine"):
        swiglu_forward(gate, gate, scale=torch.ones(8, device=DEVICE), terms=(term, term))
    with pytest.raises(AssertionError, match=r"the up term must be L \(4, k\)"):
        swiglu_forward(gate, gate, terms=(term, (term[0][:3], term[1])))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C,transposed", [(1, 7, False), (300, 45, False), (4100, 7, False), (517, 200, True),
                                           (129, 1, True), (0, 5, False)])
def test_dora_backward(dtype, N, C, transposed):
    """DoRA's one-pass backward: g ⊙ dY and Σ_n dY ⊙ P · inv equal the torch reference's, row-major and in the
    MLP's transposed layout (dY given in another layout is read in P's), out of place and over dY."""
    def make(*shape):
        t = torch.randn(*shape, device=DEVICE).to(dtype)
        return t.t().contiguous().t() if transposed else t
    p, dy = make(N, C), make(N, C)
    g = (torch.rand(C, device=DEVICE) + 0.5).to(dtype)
    inv = torch.rand(C, device=DEVICE) + 0.1
    ref_dp, _ = dora_backward_reference(dy, p, g, inv)
    _, ref_dm = dora_backward_reference(dy.float(), p.float(), g.float(), inv)  # the kernel sums dY ⊙ P in fp32
    dp, dm = dora_backward(dy.contiguous(), p, g, inv)
    assert dp.stride() == p.stride() and dm.dtype == torch.float32
    close(dp, ref_dp, dtype, "dP")
    close(dm, ref_dm, torch.float32, "dm", scale=10)
    out, dm2 = dora_backward(dy, p, g, inv, out=dy)
    assert out.data_ptr() == dy.data_ptr() and torch.equal(dm2, dm)
    close(dy, ref_dp, dtype, "dP in place")


def check_adapter_grads(device, dtype, members, out, N, r, scale=0.5):
    """The LoRA dY products from one read (kernels/adapter_grads.py) against the fp64 reference: dB in fp32, s dY B
    in the buffer's last rows in the inputs' dtype, dY's rows untouched; a second launch gives the same bits, and
    so does one that allocates s dY B itself; one given dY's amax also gives dY's e4m3 copy, bit for bit the
    tensor-wise quantization's, with the same dB and s dY B."""
    rows = torch.randn(members * (out + r), N, device=device).to(dtype)  # the MLP's [dG | dU | spare rows]
    dyt, q_out = rows[:members * out], rows[members * out:]
    p = torch.randn(N, members * r, device=device).to(dtype)
    b = torch.zeros(members * out, members * r, device=device, dtype=dtype)
    for m in range(members):
        b[m * out:(m + 1) * out, m * r:(m + 1) * r] = torch.randn(out, r, device=device).to(dtype)
    kept, q_kept = dyt.clone(), q_out.clone()
    result = adapter_grads(dyt, p, b, scale, r, q_out)
    if result is None:  # on a GPU, where one read does not pay: nothing written
        assert dyt.is_cuda and (dyt.numel() < MIN_ELEMENTS or r > MAX_RANK) and torch.equal(q_out, q_kept)
        return
    db, q, fp8 = result
    assert fp8 is None
    db_ref, q_ref, _ = adapter_grads_reference(dyt.double(), p.double(), b.double(), scale, r)
    assert q is q_out, "s dY B not written into the given rows"
    assert db.dtype == torch.float32 and db.shape == (members * out, r) and db.is_contiguous()
    close(db.double(), db_ref, torch.float32, "dB", scale=10)
    close(q_out.double(), q_ref.to(dtype).double(), dtype, "s dY B", scale=2)
    assert torch.equal(dyt, kept), "dY was written"
    q_first = q_out.clone()
    db2, _, _ = adapter_grads(dyt, p, b, scale, r, q_out)
    assert torch.equal(db2, db) and torch.equal(q_out, q_first), "two launches differ"
    db3, q3, _ = adapter_grads(dyt, p, b, scale, r)
    assert torch.equal(db3, db) and torch.equal(q3, q_first), "the launch that allocates s dY B differs"
    amax = dyt.abs().amax() if N else dyt.new_zeros(())
    db4, q4, (q8, s8) = adapter_grads(dyt, p, b, scale, r, amax=amax)
    assert torch.equal(db4, db) and torch.equal(q4, q_first), "quantizing dY moved dB or s dY B"
    q8_ref, s8_ref = fp8_quantize_tensor_reference(dyt.t(), amax)
    assert q8.shape == (N, members * out) and q8.is_contiguous() and s8.shape == (N,) and s8.dtype == torch.float32
    assert torch.equal(q8.view(torch.uint8), q8_ref.view(torch.uint8)) and torch.equal(s8, s8_ref), "dY's e4m3 copy"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("members,out,N,r", [(2, 128, 300, 16), (2, 80, 257, 4), (1, 40, 17, 8), (3, 70, 129, 16),
                                             (2, 64, 513, 32), (2, 96, 0, 16)])
def test_adapter_grads(dtype, members, out, N, r):
    """s dY B and dB_m = dY_mᵀ P_m from one read of dYᵀ: gate/up-like groups, widths that leave a partial feature
    tile (80, 70), token counts that leave a partial token block, ranks padded to the dot's 16 (4, 8), a lone
    member and three, and no tokens (dB zero)."""
    check_adapter_grads(DEVICE, dtype, members, out, N, r)


def check_residual_lowrank_add(device, dtype, N, C, k, spare):
    """y += residual + p bᵀ for y the first C columns of an (N, C + spare) buffer, against fp64: the kernel in place
    (the spare columns untouched) and the reference."""
    buffer = torch.randn(N, C + spare, device=device).to(dtype)
    y, r = buffer[:, :C], torch.randn(N, C, device=device).to(dtype)
    p, b = torch.randn(N, k, device=device).to(dtype), (torch.randn(C, k, device=device) / k ** 0.5).to(dtype)
    expected = y.double() + r.double() + p.double() @ b.double().t()
    spare_before, ref = buffer[:, C:].clone(), y.clone()
    assert residual_lowrank_add_(y, r, p, b) is y
    close(y, expected, dtype, "y + residual + p bᵀ")
    assert torch.equal(buffer[:, C:], spare_before), "columns beyond y were written"
    close(residual_lowrank_add_reference(ref, r, p, b), expected, dtype, "the reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,C,k,spare", [(37, 70, 16, 0), (1, 300, 5, 8), (130, 129, 80, 3), (65, 256, 48, 0),
                                         (0, 64, 16, 0)])
def test_residual_lowrank_add(dtype, N, C, k, spare):
    """An fp8 output's residual and adapter product in one pass: partial row and column tiles (37 × 70, 130 × 129),
    one token, ranks padded to the dot's 16 (5) or over two chunks of 64 (80), row strides wider than the row
    (spare columns), and no tokens."""
    check_residual_lowrank_add(DEVICE, dtype, N, C, k, spare)


def test_residual_lowrank_add_refuses_mismatched_arguments():
    y = torch.zeros(4, 8)
    for args, match in (((y, torch.zeros(4, 9), torch.zeros(4, 2), torch.zeros(8, 2)), "residual"),
                        ((y, torch.zeros(4, 8), torch.zeros(4, 2), torch.zeros(8, 3)), "p"),
                        ((y, torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 2), torch.zeros(8, 2)), "dtype"),
                        ((y, torch.zeros(8, 4).t(), torch.zeros(4, 2), torch.zeros(8, 2)), "unit column")):
        for fn in (residual_lowrank_add_, residual_lowrank_add_reference):
            with pytest.raises(ValueError, match=match):
                fn(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ends,r,in_features", [((40, 56, 72), 4, 50), ((24, 48), 16, 37), ((33,), 8, 300),
                                                ((20, 30, 45), 24, 19), ((70, 100, 130), 4, 65), ((75,), 136, 40)])
def test_dora_norms(dtype, ends, r, in_features):
    """DoRA's scales of a packed group in one launch: 1 / ‖W + s·B_blk·A‖ and m times it equal the fp64 norms of
    each member's merged rows, for q/k/v-, gate/up- and lone-projection groups, members shorter than a program's
    rows and longer (70: a whole block and a partial one), `in` over several column tiles with a partial last one,
    ranks padded to the dot's K (4, 24), and a rank over 128 (fewer rows a program)."""
    out_features = ends[-1]
    w = torch.randn(out_features, in_features, device=DEVICE).to(dtype)
    a = torch.randn(len(ends) * r, in_features, device=DEVICE)
    b = torch.randn(out_features, r, device=DEVICE)
    m = torch.rand(out_features, device=DEVICE) + 0.5
    g, inv = dora_norms(w, a, b, m, list(ends), 0.3, dtype)
    ref_g, ref_inv = dora_norms_reference(w.double(), a.double(), b.double(), m.double(), list(ends), 0.3,
                                          torch.float64)
    assert g.dtype == dtype and inv.dtype == torch.float32
    close(inv.double(), ref_inv, torch.float32, "inv")
    close(g, ref_g.to(dtype), dtype, "g")
    member_rows = [torch.arange(s, e) for s, e in zip((0, *ends[:-1]), ends)]
    direct = torch.cat([(w[rows].double() + 0.3 * b[rows].double() @ a[j * r:(j + 1) * r].double()).norm(dim=1)
                        for j, rows in enumerate(member_rows)])
    close(ref_inv, 1 / direct, torch.float32, "reference inv")


def check_dora_norms_table(dtype, shapes):
    """`NormsTable`: the scales of every group in one launch equal each group's own launch (`dora_norms`) and the fp64
    reference; a second call reads the tensors' new values in place (an optimizer's update)."""
    groups = []
    for ends, r, in_features in shapes:
        out_features = ends[-1]
        groups.append((torch.randn(out_features, in_features, device=DEVICE).to(dtype),
                       torch.randn(len(ends) * r, in_features, device=DEVICE),
                       torch.randn(out_features, r, device=DEVICE),
                       torch.rand(out_features, device=DEVICE) + 0.5, list(ends), 0.1 + r / 64))
    table = NormsTable(groups)
    for _ in range(2):
        for group, (g, inv) in zip(groups, table()):
            own_g, own_inv = dora_norms(*group, dtype)
            ref_g, ref_inv = dora_norms_reference(*(t.double() for t in group[:4]), *group[4:], torch.float64)
            assert g.dtype == dtype and inv.dtype == torch.float32 and g.shape == inv.shape == own_g.shape
            close(inv, own_inv, torch.float32, "inv against the group's launch")
            close(g, own_g, dtype, "g against the group's launch")
            close(inv.double(), ref_inv, torch.float32, "inv")
            close(g, ref_g.to(dtype), dtype, "g")
        for _, a, b, m, _, _ in groups:
            a.mul_(0.5), b.add_(1.0), m.mul_(2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dora_norms_table(dtype):
    """Groups of three, two and one members, of different ranks and widths in one table: the tiles fit the largest
    rank, the smaller ranks' columns of B and rows of A past their own are masked, and each program's rows stay
    within one member (70 rows: a whole block and a partial one); with ranks up to 16 alone, the tiles of those
    ranks."""
    check_dora_norms_table(dtype, [((40, 56, 72), 4, 50), ((24, 48), 16, 37), ((33,), 8, 300), ((20, 30, 45), 24, 19),
                                   ((70, 100, 130), 4, 65)])
    # ranks up to 16 only: launch_config's tiles of 32 rows and 128 columns a step
    check_dora_norms_table(dtype, [((40, 56, 72), 4, 50), ((24, 48), 16, 300), ((70, 100, 130), 8, 65)])



def check_merge_table(dtype, groups):
    """`MergeTable`: each member's W' in its view of the one output buffer equals the fp64 W + s·B·A (DoRA: its rows
    scaled to m / ‖W + s·B·A‖) rounded to the dtype, to the dtype's tolerance; a second launch reads the tensors'
    new values in place (an optimizer's update) and writes into the same buffer. groups: (outs, rank, in, dora) a
    group, its members' W packed one after the other as `pack_weights_` stores them and, where every member has an
    adapter, their A, B and m stacked as `pack_adapters_` stores them; rank 0: the members have no adapter."""
    out = torch.empty(sum(sum(outs) * i for outs, _, i, _ in groups), dtype=dtype, device=DEVICE)
    members, start = [], 0
    for outs, r, in_features, dora in groups:
        w = torch.randn(sum(outs), in_features, device=DEVICE).to(dtype)
        a = torch.randn(len(outs) * r, in_features, device=DEVICE)
        b = torch.randn(sum(outs), r, device=DEVICE)
        m = torch.rand(sum(outs), device=DEVICE) + 0.5
        first = 0
        for j, rows in enumerate(outs):
            span = slice(first, first + rows)
            view = out[start:start + rows * in_features].view(rows, in_features)
            members.append((w[span], a[j * r:(j + 1) * r] if r else None, b[span] if r else None,
                            m[span] if dora else None, view, 0.1 + r / 64))
            first, start = first + rows, start + rows * in_features
    table = MergeTable(out, members)
    for _ in range(2):
        table()
        for n, (w, a, b, m, view, scale) in enumerate(members):
            ref = merged_weight_reference(*(None if t is None else t.double() for t in (w, a, b, m)), scale,
                                          torch.float64)
            assert view.dtype == dtype
            close(view, ref.to(dtype), dtype, f"member {n}'s W'")
            if a is None:
                assert torch.equal(view, w)
        for _, a, b, m, _, _ in members:
            for t, f in ((a, 0.5), (b, -1.5), (m, 2.0)):
                if t is not None:
                    t.mul_(f)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_table(dtype):
    """A rollout's merged weights in one launch: groups of three, two and one members of several ranks (4, 16, 24: K
    padded to the dot's 16 and 32) and widths in one table, members shorter than a program's rows and longer (70: a
    whole block and a partial one), `in` over several column tiles with a partial last one, members without an
    adapter (W copied), and DoRA's scaled rows; with ranks up to 16 alone, the tiles of those ranks."""
    check_merge_table(dtype, [((40, 56, 72), 4, 50, False), ((24, 48), 16, 37, True), ((33,), 8, 300, False),
                              ((20, 30, 45), 24, 19, True), ((70, 100), 0, 65, False), ((70,), 4, 65, False)])
    # ranks up to 16 only: launch_config's tiles of 32 rows and 128 columns a step
    check_merge_table(dtype, [((40, 56, 72), 4, 50, False), ((24, 48), 16, 300, True), ((70, 100), 0, 65, False),
                              ((70,), 8, 130, False)])


# ----------------------------------------------------------------------------- no Triton needed

# Prepended to the code of a fresh interpreter: `import triton` fails there, as on a machine
# without Triton (macOS, CPU-only installs).
HIDE_TRITON = """
import importlib.abc, sys
class HideTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, HideTriton())
"""


def run_without_triton(code):
    """Run `code` in a new interpreter at the repository root in which Triton cannot be imported."""
    proc = subprocess.run([sys.executable, "-c", HIDE_TRITON + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_references_need_no_triton():
    run_without_triton("""
        import torch
        try:
            import kernels.rms_norm
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("the kernel module imported: Triton was not hidden")
        from kernels.references import (cross_entropy_reference, fused_linear_cross_entropy_reference,
                                        geglu_reference, rms_norm_reference, rope_reference, swiglu_reference)
        x, w = torch.randn(2, 3, 8), torch.ones(8)
        assert rms_norm_reference(x, w).shape == x.shape
        q, cos = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 8)
        assert rope_reference(q, q, cos, cos)[0].shape == q.shape
        assert swiglu_reference(x, x).shape == geglu_reference(x, x).shape == x.shape
        targets = torch.tensor([1, 2, -100])
        assert cross_entropy_reference(torch.randn(3, 5), targets).isfinite()
        assert fused_linear_cross_entropy_reference(torch.randn(3, 8), torch.randn(5, 8), targets).isfinite()
        assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
    """)


# ----------------------------------------------------------------------------- GPU, realistic sizes

@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [32000, 151936, 262144])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_cross_entropy(dtype, V, softcap):
    check_cross_entropy("cuda", dtype, 4096, V, softcap=softcap)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N, H, V", [(4096, 2048, 32000), (2048, 2304, 256000)])
def test_gpu_fused_linear_cross_entropy(dtype, N, H, V):
    check_fused_linear_cross_entropy("cuda", dtype, N, H, V, softcap=30.0 if V == 256000 else None)


@gpu
@needs_cuda
def test_gpu_fused_linear_cross_entropy_fp16_loss_scale():
    check_fused_linear_cross_entropy("cuda", torch.float16, 4096, 2048, 32000, grad_scale=65536.0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, cast, offset", [(2048, "llama", 0.0), (2304, "gemma", 1.0)])
def test_gpu_rms_norm(dtype, H, cast, offset):
    check_rms_norm("cuda", dtype, (4, 2048, H), cast, offset)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cast, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_gpu_rms_norm_rounds_like_hf(dtype, cast, offset):
    check_rms_norm_bits("cuda", dtype, (4 * 2048, 2048), cast, offset)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hk, D", [(32, 4, 64), (8, 4, 256)])
def test_gpu_rope(dtype, Hq, Hk, D):
    check_rope("cuda", dtype, 4, 2048, Hq, Hk, D)


@gpu
@needs_cuda
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [5632, 9216])
def test_gpu_activation(act, dtype, inter):
    check_activation("cuda", dtype, (4, 2048, inter), act)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out,N,r", [(18944, 4096, 16), (14336, 4096, 16), (14336, 4096, 32), (4864, 8000, 8),
                                     (14336, 4096, 64), (1536, 4096, 16)])
def test_gpu_adapter_grads(dtype, out, N, r):
    """The one-read LoRA dY products at the MLPs of Qwen2.5-7B and Llama-3.1-8B (2 × 2048 tokens; r 16 and 32) and
    Qwen2.5-0.5B (r 8, a partial token block); where one read does not pay (r 64, SmolLM2-135M's MLP) the launcher
    declines and writes nothing."""
    check_adapter_grads("cuda", dtype, 2, out, N, r)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C,k", [(4096, 4096, 16), (4093, 3584, 32), (77, 4096, 64), (4096, 2304, 128)])
def test_gpu_residual_lowrank_add(dtype, N, C, k):
    """o's and down's output at Llama-3.1-8B's and Qwen2.5-7B's widths (2 × 2048 tokens, and a partial row tile),
    Gemma-2-9B's, ranks 16 to 128."""
    check_residual_lowrank_add("cuda", dtype, N, C, k, 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ends,r,in_features", [((576, 768, 960), 16, 576), ((1536, 3072), 16, 576),
                                                ((576,), 16, 1536), ((896, 1024, 1152), 64, 896),
                                                ((896, 1024, 1152), 128, 896), ((2048, 2304, 2560), 256, 2048)])
def test_gpu_dora_norms(dtype, ends, r, in_features):
    """DoRA's norms kernel at the SmolLM2 shape's groups (q|k|v, gate|up, down), a Qwen2.5-0.5B q|k|v of r = 64 and
    128 and a TinyLlama q|k|v of r = 256 (32 rows a program): the tf32x3 dot keeps fp32's precision."""
    test_dora_norms(dtype, ends, r, in_features)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dora_norms_table(dtype):
    """Every group of SmolLM2-135M's 30 layers (q|k|v, o, gate|up, down, r = 16) in one table, as a step computes
    them (model/dora_scales.py): 2430 programs, several waves."""
    layer = [((576, 768, 960), 16, 576), ((576,), 16, 576), ((1536, 3072), 16, 576), ((576,), 16, 1536)]
    check_dora_norms_table(dtype, layer * 30)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_merge_table(dtype):
    """Every projection of Qwen2.5-0.5B's 24 layers (q|k|v, o, gate|up, down, r = 16) in one table, as a rollout
    merges them (`MergedAdapters`): about 4800 programs, 358M weights; DoRA's in a second table."""
    layer = [((896, 128, 128), 16, 896), ((896,), 16, 896), ((4864, 4864), 16, 896), ((896,), 16, 4864)]
    check_merge_table(dtype, [(*group, False) for group in layer] * 24)
    check_merge_table(dtype, [(*group, True) for group in layer] * 2)


@gpu
@needs_cuda
@pytest.mark.parametrize("C,transposed", [(960, False), (576, False), (3072, True)])
def test_gpu_dora_backward(C, transposed):
    """DoRA's one-pass backward at a SmolLM2-135M step's shapes (8 × 512 tokens; q|k|v and o/down row-major, gate|up
    transposed) in bf16: dP and dm equal the reference's, and dm is the same, bit for bit, from a second launch."""
    test_dora_backward(torch.bfloat16, 4096, C, transposed)

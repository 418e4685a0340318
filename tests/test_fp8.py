"""The fp8 base GEMMs (model/fp8.py) through the fused LoRA Functions and a whole tiny model, on CPU with the real
torch._scaled_mm (fp32 out):
- tight: against an fp64 computation that applies the same e4m3 quantization (X, dY per row, the MLP's H and
  [dG | dU] with one scale each, W per row, Wᵀ per column), so that only the GEMMs' own rounding differs;
- loose: against the exact path (no fp8). e4m3 keeps 3 mantissa bits, so each quantized operand is off by up to
  2^-4 of its value (about 2.5% in norm): one projection's output by about 3.5%, and the gradients of a random
  tiny model, whose weights are large enough to saturate its norms, by up to tens of percent (NF4 alone moves
  them by more); the bounds below are a few times what these cases give.
tests/test_fp8_gpu.py repeats the Function checks on a GPU, with the kernels and inside a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from kernels.references import (
    E4M3,
    fp8_quantize_rows_reference,
    fp8_quantize_tensor_reference,
    fp8_reciprocal,
    nf4_dequantize_reference,
    nf4_to_fp8_reference,
)
from model import LoRAConfig, load_model
from model.fp8 import quantize_fp8_, unavailable
from model.lora import lora_mlp, lora_projections
from tests.helpers import USE_KERNELS, H, I, R, frozen_projections, glu, randomize_lora_b, refused, rel_err

# where the CPU torch._scaled_mm takes one scale a tensor, the CPU fp8 path is refused: these GEMM tests skip there
pytestmark = pytest.mark.skipif(unavailable("cpu") is not None, reason=str(unavailable("cpu")))
TIGHT = 1e-5  # fp32 GEMMs of the same e4m3 operands against fp64 (relative, in norm)
N = 32  # tokens: a multiple of 16, so the MLP's transposed products run as such; 13 below: the copied layout


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def dequantized(t, tensorwise=False):
    """t quantized as the fp8 path quantizes it (from t in fp32), back in fp64: each row with its own scale, or
    tensorwise all of it with one (the MLP's operands stored transposed)."""
    quantize = fp8_quantize_tensor_reference if tensorwise else fp8_quantize_rows_reference
    q, s = quantize(t.reshape(-1, t.shape[-1]).float())
    return (q.double() * s[:, None]).view(t.shape)


class EmulatedFP8(torch.autograd.Function):
    """X̂ Ŵᵀ in fp64, X̂ = X quantized; backward dY^ (Ŵᵀ)ᵀ with dY quantized: the fp8 GEMMs' math. w: W dequantized
    (out, in); wt: Wᵀ's e4m3 copy dequantized (in, out); x_tensorwise, dy_tensorwise: X, dY with one scale
    (`dequantized`)."""

    @staticmethod
    def forward(ctx, x, w, wt, x_tensorwise, dy_tensorwise):
        ctx.wt, ctx.dy_tensorwise = wt, dy_tensorwise
        return dequantized(x, x_tensorwise) @ w.t()

    @staticmethod
    def backward(ctx, dy):
        return dequantized(dy, ctx.dy_tensorwise) @ ctx.wt.t(), None, None, None, None


def fp8_operands(projs):
    """(W, Wᵀ) of a group as its fp8 GEMMs see them, dequantized to fp64 from the group's own e4m3 tensors."""
    fp8 = projs[0].fp8
    if fp8.weight is not None:
        w8, wt8 = fp8.weight, fp8.weight_t
    else:
        w8 = torch.cat([nf4_to_fp8_reference(p.nf4.data(), p.nf4.shape, fp8.scale[fp8.spans[p.name]]) for p in projs])
        wt8 = torch.cat([nf4_to_fp8_reference(p.nf4.data(), p.nf4.shape, fp8.scale_t, True) for p in projs], dim=1)
    return w8.double() * fp8.scale[:, None].double(), wt8.double() * fp8.scale_t[:, None].double()


def adapter(p, x):
    """s (X Aᵀ) Bᵀ + b in fp64 (no dropout)."""
    y = (x @ p.lora_A.double().t() @ p.lora_B.double().t()) * p.scale if p.r else 0
    return y + (p.bias.double() if p.bias is not None else 0)


def emulated_group(x, projs, x_tensorwise=False, dy_tensorwise=False):
    w, wt = fp8_operands(projs)
    ones = [torch.ones(p.out_features, dtype=torch.float64, device=x.device) for p in projs]
    base = EmulatedFP8.apply(x, w, wt, x_tensorwise, dy_tensorwise)
    return base + torch.cat([adapter(p, x) * one for p, one in zip(projs, ones)], -1)


def emulated_mlp(x, gate, up, down):
    """down(silu(gate(x)) ⊙ up(x)) in fp64 with the fused MLP's quantization: X and down's dY per row, H (down's
    input) and [dG | dU] (gate/up's dY), stored transposed, with one scale each."""
    g, u = emulated_group(x, (gate, up), dy_tensorwise=True).split(gate.out_features, -1)
    return emulated_group(F.silu(g) * u, (down,), x_tensorwise=True)


def grads(fn, x, projs, dy_seed=1):
    """(output, dX, LoRA grads) of fn(x) for one fixed upstream gradient."""
    x = x.detach().requires_grad_()
    params = [t for p in projs for t in (p.lora_A, p.lora_B) if t is not None]
    for t in params:
        t.grad = None
    y = fn(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed)).to(y.device, y.dtype))
    return [y, x.grad] + [t.grad for t in params]


def check(actual, expected, bound, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a is not None and torch.isfinite(a).all(), f"{what}: tensor {i} missing or not finite"
        err = rel_err(a, e)
        assert err < bound, f"{what}: tensor {i} (output, dX, then LoRA grads) off by {err:.3g} (bound {bound:g})"




def projections(nf4, outs=(("q_proj", 64), ("k_proj", 32), ("v_proj", 32)), in_f=H):
    return frozen_projections(nf4, outs, in_f, R, torch.float32)


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-base", "nf4-base"])
def test_projections_equal_emulated_fp8(nf4):
    projs = projections(nf4)
    exact = [p.base_weight().double() for p in projs]
    quantize_fp8_([projs])
    x = torch.randn(N, H)
    fused = grads(lambda x: torch.cat(lora_projections(x, projs), -1), x, projs)
    emulated = grads(lambda x: emulated_group(x, projs), x.double(), projs)
    check(fused, emulated, TIGHT, "fp8 vs emulated")
    w = torch.cat(exact)
    plain = grads(lambda x: x @ w.t() + torch.cat([adapter(p, x) * torch.ones(p.out_features, dtype=torch.float64)
                                                    for p in projs], -1), x.double(), projs)
    check(fused, plain, 0.1, "fp8 vs exact")


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-base", "nf4-base"])
@pytest.mark.parametrize("tokens", [N, 13])
@pytest.mark.parametrize("kernels", USE_KERNELS, ids=["torch-glu", "kernel-glu"])
def test_mlp_equals_emulated_fp8(nf4, tokens, kernels):
    """The MLP's one scale of H and of [dG | dU] comes from the amax its activation finds as it writes them: the
    torch reference's, or the kernels' (in Triton's interpreter here)."""
    gate, up = projections(nf4, (("gate_proj", I), ("up_proj", I)))
    down, = projections(nf4, (("down_proj", H),), in_f=I)
    projs = (gate, up, down)
    quantize_fp8_([(gate, up), (down,)])
    x = torch.randn(tokens, H)
    fused = grads(lambda x: lora_mlp(x, projs, glu("silu", use_kernels=kernels)), x, projs)
    check(fused, grads(lambda x: emulated_mlp(x, *projs), x.double(), projs), 1e-4, "fp8 MLP vs emulated")


def one_pass_adds(monkeypatch):
    """A list that grows by one at each call of the fp8 path's one-pass add of the residual and the adapter's
    product (model/lora.py `_adapt`)."""
    import model.lora
    calls, add = [], model.lora.add_residual_and_adapter_
    monkeypatch.setattr(model.lora, "add_residual_and_adapter_", lambda *a: calls.append(1) or add(*a))
    return calls


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-base", "nf4-base"])
def test_outputs_into_the_residual_equal_emulated_fp8(nf4, monkeypatch):
    """o and the MLP's down with the residual stream: the fp8 path adds it with the adapter's product in one pass
    (model/lora.py `_late_residual`, once each here), after the GEMM that takes no addend."""
    calls = one_pass_adds(monkeypatch)
    o, = projections(nf4, (("o_proj", H),))
    gate, up = projections(nf4, (("gate_proj", I), ("up_proj", I)))
    down, = projections(nf4, (("down_proj", H),), in_f=I)
    quantize_fp8_([(o,), (gate, up), (down,)])
    x, r = torch.randn(N, H), torch.randn(N, H)
    fused = grads(lambda x: lora_projections(x, (o,), residual=r)[0], x, (o,))
    check(fused, grads(lambda x: emulated_group(x, (o,)) + r.double(), x.double(), (o,)), TIGHT, "o vs emulated")
    projs = (gate, up, down)
    fused = grads(lambda x: lora_mlp(x, projs, glu("silu", use_kernels=False), residual=r), x, projs)
    check(fused, grads(lambda x: emulated_mlp(x, *projs) + r.double(), x.double(), projs), 1e-4, "MLP vs emulated")
    assert len(calls) == 2, "o and down each add the residual with the adapter's product"


def test_nf4_scales_bound_the_weight():
    """The NF4 scales come from block absmaxes alone: they must bound every row and column of the weight, and
    stay near its amax (the block absmax is the largest |value| of its block, up to double quantization)."""
    projs = projections(True, (("q_proj", 48), ("k_proj", 16)), in_f=96)  # 96: rows do not start blocks
    quantize_fp8_([projs])
    fp8 = projs[0].fp8
    w = torch.cat([nf4_dequantize_reference(p.nf4.data(), p.nf4.shape, torch.float32) for p in projs]).abs()
    assert (fp8.scale * 448 >= w.amax(1)).all() and (fp8.scale_t * 448 >= w.amax(0)).all()
    assert (fp8.scale * 448 <= 1.5 * w.amax(1)).all()


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-base", "nf4-base"])
def test_group_keeps_the_reciprocals_of_its_nf4_scales(nf4):
    """An NF4 group's scales' reciprocals, what the kernel multiplies by, are taken once at load (bit for bit the
    reference's) and kept as buffers, so that they move with the model; a bf16 base, stored in e4m3, needs none."""
    projs = projections(nf4)
    quantize_fp8_([projs])
    fp8 = projs[0].fp8
    if not nf4:
        assert fp8.reciprocal is None and fp8.reciprocal_t is None
        return
    assert torch.equal(fp8.reciprocal, fp8_reciprocal(fp8.scale)) and fp8.reciprocal.shape == (128,)
    assert torch.equal(fp8.reciprocal_t, fp8_reciprocal(fp8.scale_t)) and fp8.reciprocal_t.shape == (H,)
    assert {"reciprocal", "reciprocal_t"} <= dict(fp8.named_buffers()).keys()


def test_a_torch_without_per_row_scales_keeps_the_exact_path(monkeypatch):
    """A CPU torch._scaled_mm that takes one scale a tensor: one warning that says so, every group
    left on the exact path, its weights kept."""
    import model.fp8
    monkeypatch.setattr(model.fp8, "_cpu_rowwise", lambda: False)
    projs = projections(False)
    with pytest.warns(UserWarning, match="takes one scale a tensor, not the per-row scales .* stay in the model dtype"):
        quantize_fp8_([projs])
    assert all(p.fp8 is None and p.weight is not None for p in projs)


def test_group_that_does_not_fit_stays_exact():
    """Widths that _scaled_mm cannot take (not multiples of 16): one warning naming them, the bf16 path kept."""
    fits, odd = projections(False, (("o_proj", 32),)), projections(False, (("down_proj", 40),), in_f=I + 2)
    with pytest.warns(UserWarning, match=r"1 projection group\(s\) .* down_proj \(82 -> 40\)"):
        quantize_fp8_([fits, odd])
    assert fits[0].fp8 is not None and fits[0].weight is None
    assert odd[0].fp8 is None and odd[0].weight is not None


# ----------------------------------------------------------------------------- a whole tiny model

def model_grads(model, ids, targets):
    model.train()
    loss = model(ids, targets=targets, reduction="sum")
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    """torch._scaled_mm's definition, (scale_a a)(scale_b b), summed in fp64 whichever accumulation is asked for:
    a model that runs it differs from the fp8 model only by the GEMMs' sums (and the rare e4m3 rounding those
    move across a midpoint)."""
    return ((a.double() * scale_a.double()) @ (b.double() * scale_b.double())).to(out_dtype)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    from tests.tiny_models import save_tiny
    folder = str(tmp_path_factory.mktemp("qwen2"))
    save_tiny("qwen2", folder)  # q/k/v biases, tied embeddings
    return folder


def load(folder, **options):
    model, _ = load_model(folder, lora=LoRAConfig(r=4), **options)
    randomize_lora_b(model)
    return model


def test_model_equals_emulated_fp8_and_is_near_exact(qwen2_folder, monkeypatch):
    ids = torch.randint(0, 256, (2, 24))  # 48 tokens: the MLP's products run transposed
    targets = ids.roll(-1, 1)
    model = load(qwen2_folder, fp8=True)
    assert all(p.fp8 is not None for g in model.projection_groups() for p in g)
    loss, g = model_grads(model, ids, targets)
    exact_loss, exact = model_grads(load(qwen2_folder), ids, targets)
    with monkeypatch.context() as m:
        m.setattr(torch, "_scaled_mm", emulated_scaled_mm)
        ref_loss, ref = model_grads(load(qwen2_folder, fp8=True), ids, targets)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    for n in ref:
        assert torch.isfinite(g[n]).all() and g[n].abs().sum() > 0, f"{n}: no gradient"
        assert rel_err(g[n], ref[n]) < 1e-3, f"{n}: off the emulated fp8 model by {rel_err(g[n], ref[n]):.3g}"
        assert rel_err(g[n], exact[n]) < 0.6, f"{n}: off the exact model by {rel_err(g[n], exact[n]):.3g}"
    assert abs(loss.item() - exact_loss.item()) < 0.01 * abs(exact_loss.item())


def test_model_without_targets_gives_zero_loss_and_zero_grads(qwen2_folder):
    model = load(qwen2_folder, fp8=True, quantize="nf4")
    ids = torch.randint(0, 256, (2, 16))
    loss, g = model_grads(model, ids, torch.full_like(ids, -100))
    assert loss.item() == 0.0
    assert g and all(t is not None and torch.isfinite(t).all() and not t.any() for t in g.values())


def test_fp8_weights_replace_the_bf16_base(qwen2_folder):
    model = load(qwen2_folder, fp8=True)
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight is None and q.fp8.weight.dtype == E4M3 and q.fp8.weight_t.dtype == E4M3
    assert "q_proj.weight" not in "".join(model.state_dict())
    exact = load(qwen2_folder).model.layers[0].self_attn.q_proj.weight
    assert rel_err(q.base_weight(), exact) < 0.05  # the unfused path and merges read it dequantized


@pytest.mark.parametrize("argv, match", [
    (["--fp8", "--device", "cpu"], "--fp8 needs a CUDA GPU of compute capability 8.9 or more .* this run is on cpu"),
    (["--fp8", "--full"], "--fp8 runs the frozen base weights' GEMMs in fp8, and --full trains them"),
    (["--fp8", "--dtype", "fp32"], "--fp8 runs beside bf16 .* not fp32"),
])
def test_fp8_refusals(run_model, argv, match, capsys, tmp_path):
    out = tmp_path / "out"
    refused(["--model", run_model, "--out-dir", str(out), *argv], capsys, out, match)


def test_offload_keeps_no_qkv_output_under_fp8(qwen2_folder):
    """With activation offload, a checkpointed layer hands q | k | v's output to the offload only where the base
    GEMMs run in bf16: an fp8 forward is about twice as short, and the extra copies outlast it
    (dev/benchmarks-history.md, section 36). The attention's two and o's stay."""
    for fp8, kept in ((False, 4), (True, 3)):
        model = load(qwen2_folder, fp8=fp8, gradient_checkpointing=True, offload_activations=True)
        assert len(model.kept_tensors(2, 24, torch.float32)) == kept, fp8

"""GPU (compute capability 8.9+): the fp8 base GEMMs with the Triton kernels and cuBLAS's torch._scaled_mm, at
real sizes and odd-ish shapes, against the emulated references of tests/test_fp8.py, and inside a CUDA graph.

Run on a GPU machine with `python -m pytest -m gpu tests/test_fp8_gpu.py`.
"""
import pytest
import torch

import data
import step
from kernels.fp8_quantize import fp8_quantize_rows
from kernels.fp8_quantize_tensor import fp8_quantize_tensor
from kernels.nf4_to_fp8 import nf4_to_fp8
from kernels.references import (
    E4M3,
    fp8_quantize_rows_reference,
    fp8_quantize_tensor_reference,
    fp8_reciprocal,
    nf4_to_fp8_reference,
)
from model import LoRAConfig, load_model
from model.fp8 import _mm, _weights, quantize_fp8_
from model.lora import lora_mlp, lora_parameters, lora_projections
from model.qlora import NF4Weight
from tests.helpers import assert_bit_equal, frozen_projections, glu, randomize_lora_b, rel_err
from tests.test_fp8 import emulated_group, emulated_mlp, grads, one_pass_adds

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU of compute capability 8.9+")]
DEV = "cuda"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("shape", [(4096, 4096), (2048, 6144), (4093, 14336), (37, 4096)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_quantize_rows_kernel_on_gpu(shape, dtype, layout):
    x = (torch.randn(shape, device=DEV) * 3).to(dtype)
    x = x.t().contiguous().t() if layout == "transposed" else x
    q, s = fp8_quantize_rows(x)
    q_ref, s_ref = fp8_quantize_rows_reference(x)
    assert_bit_equal(s, s_ref, "scales")
    assert_bit_equal(q, q_ref, "e4m3 values")


@pytest.mark.parametrize("shape", [(4096, 14336), (4096, 28672), (4093, 14336), (37, 4096)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_quantize_tensor_kernel_on_gpu(shape, dtype, layout):
    """The Llama-3.1-8B MLP's H [tokens, 14336] and [dG | dU] [tokens, 28672] of a 2 × 2048 batch, stored
    transposed as the MLP keeps them, an odd token count and a few tokens, with values over 6 decades."""
    x = (torch.randn(shape, device=DEV) * torch.logspace(-3, 3, shape[1], device=DEV)).to(dtype)
    x = x.t().contiguous().t() if layout == "transposed" else x
    q, s = fp8_quantize_tensor(x)
    q_ref, s_ref = fp8_quantize_tensor_reference(x)
    assert_bit_equal(s, s_ref, "scales")
    assert_bit_equal(q, q_ref, "e4m3 values")


@pytest.mark.parametrize("rows, K", [((4096, 1024, 1024), 4096), ((14336, 14336), 4096), ((4096,), 14336),
                                     ((1040, 208, 208), 4096), ((37, 1024), 1040)], ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_nf4_to_fp8_kernel_on_gpu(rows, K, transposed):
    """Llama-3.1-8B's q|k|v, gate|up and down groups, one launch each, then groups whose projections end inside
    a row tile, with and without whole 64-value blocks a row."""
    weights = [NF4Weight(torch.randn(R, K, device=DEV, dtype=torch.bfloat16)) for R in rows]
    scale = torch.rand(K if transposed else sum(rows), device=DEV) * 0.05 + 0.01
    out = torch.empty((K, sum(rows)) if transposed else (sum(rows), K), dtype=E4M3, device=DEV)
    starts = [sum(rows[:j]) for j in range(len(rows))]
    expected = [nf4_to_fp8_reference(w.data(), w.shape, scale if transposed else scale[a:a + w.shape[0]], transposed)
                for w, a in zip(weights, starts)]
    nf4_to_fp8([(w.data(), w.shape) for w in weights], fp8_reciprocal(scale), out, transposed)
    assert_bit_equal(out, torch.cat(expected, 1 if transposed else 0), "kernel")


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_fp8_group_weights_in_one_launch(transposed, monkeypatch):
    """The fp8 path makes an NF4 group's e4m3 W (or Wᵀ) with one kernel launch and no per-pass op on its scales
    (their reciprocals are taken at load), its values the reference's."""
    import kernels.nf4_to_fp8 as module
    qkv = projections(True, (("q_proj", 1040), ("k_proj", 208), ("v_proj", 208)), 1040)
    quantize_fp8_([qkv])
    fp8 = qkv[0].fp8
    _weights(qkv, transposed)  # compiles the kernel
    launches = []
    kernel = module._nf4_to_fp8_kernel
    monkeypatch.setattr(module, "_nf4_to_fp8_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: launches.append(grid) or kernel[grid]})())
    with torch.profiler.profile() as prof:
        w, s = _weights(qkv, transposed)
    assert len(launches) == 1
    assert not {"aten::div", "aten::reciprocal", "aten::_to_copy", "aten::copy_"} & {e.name for e in prof.events()}
    scale = fp8.scale_t if transposed else fp8.scale
    expected = [nf4_to_fp8_reference(p.nf4.data(), p.nf4.shape, scale if transposed else scale[fp8.spans[p.name]],
                                     transposed) for p in qkv]
    assert s is scale
    assert_bit_equal(w, torch.cat(expected, 1 if transposed else 0), "group")


@pytest.mark.parametrize("K", [4096, 28672])
@pytest.mark.parametrize("transposed", [False, True])
def test_fast_accumulation_error_is_small_beside_e4m3_rounding(K, transposed):
    """The GEMMs sum in the tensor cores' own accumulator (use_fast_accum): at 7-9B reductions (K up to gate |
    up's 28672 in dX), its error against the fp64 sum of the same e4m3 operands stays under 1% and under a
    fifth of what e4m3's rounding of the bf16 operands costs the product."""
    M, n = 256, 512
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(n, K, device=DEV) * 0.02).to(torch.bfloat16)
    a, sa = fp8_quantize_rows(x)
    b, sb = fp8_quantize_rows(w)
    y = _mm(a, sa, b, sb, torch.bfloat16, transposed)
    assert y.shape == (M, n) and y.dtype == torch.bfloat16
    same_operands = (a.double() * sa[:, None].double()) @ (b.double() * sb[:, None].double()).t()
    exact = x.double() @ w.double().t()
    accumulation, rounding = rel_err(y, same_operands), rel_err(same_operands, exact)
    assert accumulation < 1e-2 and accumulation < rounding / 5, f"{accumulation:.3g} against e4m3's {rounding:.3g}"


def projections(nf4, outs, in_f):
    return frozen_projections(nf4, outs, in_f, 8, torch.bfloat16, DEV)


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-base", "nf4-base"])
@pytest.mark.parametrize("tokens", [1, 77, 512])
def test_fused_fp8_equals_emulated_on_gpu(nf4, tokens):
    """q/k/v (q 1040 wide, k and v 208: widths multiples of 16, not of 64) and an MLP of intermediate 1360, bf16
    activations, the GEMMs on cuBLAS: against the fp64 emulation of the same e4m3 operands. bf16 outputs round
    each value once (2^-9), and the e4m3 roundings of bf16 inputs that the emulation recomputes from its own
    fp64 values may differ where they sit at a midpoint: bounds of a few bf16 ulps in norm."""
    H, I = 1040, 1360
    qkv = projections(nf4, (("q_proj", 1040), ("k_proj", 208), ("v_proj", 208)), H)
    gate, up = projections(nf4, (("gate_proj", I), ("up_proj", I)), H)
    down, = projections(nf4, (("down_proj", H),), I)
    quantize_fp8_([qkv, (gate, up), (down,)])
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    fused = grads(lambda x: torch.cat(lora_projections(x, qkv), -1), x, qkv)
    emulated = grads(lambda x: emulated_group(x, qkv), x.double(), qkv)
    for i, (a, e) in enumerate(zip(fused, emulated)):
        assert rel_err(a, e) < 2e-2, f"q/k/v tensor {i}: {rel_err(a, e):.3g}"

    projs = (gate, up, down)
    fused = grads(lambda x: lora_mlp(x, projs, glu("silu", use_kernels=True)), x, projs)
    for i, (a, e) in enumerate(zip(fused, grads(lambda x: emulated_mlp(x, *projs), x.double(), projs))):
        assert rel_err(a, e) < 3e-2, f"MLP tensor {i}: {rel_err(a, e):.3g}"


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16-base", "nf4-base"])
@pytest.mark.parametrize("tokens", [77, 512])
def test_fp8_outputs_into_the_residual_equal_emulated_on_gpu(nf4, tokens, monkeypatch):
    """o and the MLP's down with the residual stream: the fp8 path adds it with the adapter's product in one pass
    (model/lora.py `_late_residual`, once each here); the outputs, dX and the LoRA grads against the fp64 emulation
    plus the residual."""
    calls = one_pass_adds(monkeypatch)
    H, I = 1040, 1360
    o, = projections(nf4, (("o_proj", H),), H)
    gate, up = projections(nf4, (("gate_proj", I), ("up_proj", I)), H)
    down, = projections(nf4, (("down_proj", H),), I)
    quantize_fp8_([(o,), (gate, up), (down,)])
    x, r = (torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    fused = grads(lambda x: lora_projections(x, (o,), residual=r)[0], x, (o,))
    emulated = grads(lambda x: emulated_group(x, (o,)) + r.double(), x.double(), (o,))
    for i, (a, e) in enumerate(zip(fused, emulated)):
        assert rel_err(a, e) < 2e-2, f"o tensor {i}: {rel_err(a, e):.3g}"
    projs = (gate, up, down)
    fused = grads(lambda x: lora_mlp(x, projs, glu("silu", use_kernels=True), residual=r), x, projs)
    emulated = grads(lambda x: emulated_mlp(x, *projs) + r.double(), x.double(), projs)
    for i, (a, e) in enumerate(zip(fused, emulated)):
        assert rel_err(a, e) < 3e-2, f"MLP tensor {i}: {rel_err(a, e):.3g}"
    assert len(calls) == 2, "o and down each add the residual with the adapter's product"


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_fp8_model_in_a_cuda_graph(llama_folder, quantize):
    """A replayed step with --fp8 gives the eager step's loss and gradients (no host sync, fixed allocations)."""
    dev = torch.device(DEV)
    model, _ = load_model(llama_folder, dtype=torch.bfloat16, device=dev, use_kernels=True, quantize=quantize,
                          lora=LoRAConfig(r=4, alpha=8), fp8=True)
    assert all(p.fp8 is not None for g in model.projection_groups() for p in g)
    randomize_lora_b(model)
    model.train()
    params = [p for _, p in lora_parameters(model)]
    g = torch.Generator().manual_seed(0)
    encoded = [(torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist(), [True] * n)
               for n in (37, 50, 21)]
    batch = step.pad_to_bucket(data.pad_batch(encoded, pad_id=0), 2048)

    def run(fn):
        for p in params:  # zeroed in place: a graph adds into the .grad buffers it captured
            if p.grad is not None:
                p.grad.zero_()
        loss = fn(batch, data.num_targets(batch), 1.0)
        return float(loss), [p.grad.detach().clone() for p in params]

    graph = step.GraphStep(model, dev, params, max_len=2048, warmed=True)
    loss_e, grads_e = run(step.EagerStep(model, dev))
    loss_g, grads_g = run(graph)
    loss_r, grads_r = run(graph)
    assert len(graph.graphs) == 1 and not graph.failed
    assert abs(loss_g - loss_e) <= 1e-2 * abs(loss_e) and loss_r == loss_g
    for ge, gg, gr in zip(grads_e, grads_g, grads_r):
        assert torch.isfinite(gg).all() and rel_err(gg, ge) < 2e-2 and torch.equal(gg, gr)

"""QLoRA: NF4 storage, the fused Functions on NF4 weights against a dequantized-weight
reference, quantize-on-load, and the memory it saves."""
from collections import defaultdict
from functools import partialmethod

import pytest
import torch
import torch.nn as nn
from bitsandbytes.functional import dequantize_4bit, quantize_4bit
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.adapter_grads import adapter_grads
from model import LoRAConfig, load_model
from model.lora import LoRALinear, lora_mlp, lora_parameters, lora_projections
from model.qlora import NF4Weight, quantize_linear_, quantize_model
from tests.helpers import (
    USE_KERNELS,
    H,
    I,
    R,
    attention_projs,
    compare,
    glu,
    interpreter,
    make_proj,
    mlp_projs,
    randomize_lora_b,
    rel_err,
    run,
    unfused_mlp,
)

B, T = 2, 20


def test_nf4_weight_round_trip():
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    nf4 = NF4Weight(w)
    packed, state = quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(nf4.dequantize(), dequantize_4bit(packed, state))
    assert nf4.dequantize().dtype == torch.bfloat16 and nf4.packed.dtype == torch.uint8
    assert nf4.packed.numel() == w.numel() // 2 and nf4.absmax.numel() == w.numel() // 64
    assert rel_err(nf4.dequantize(), w) < 0.12  # 16 levels: about 10% for Gaussian weights
    assert not nf4.state_dict()  # never persisted: the checkpoint is the source of truth


def nf4_pair(dtype, make):
    """(NF4 modules, reference modules holding the dequantized weights in full precision);
    both share base biases and LoRA weights."""
    quant, ref = make(dtype), make(dtype)
    for q, r in zip(quant, ref):
        quantize_linear_(q, q.weight)
        r.weight = nn.Parameter(q.nf4.dequantize(), requires_grad=False)
        assert q.weight is None and r.weight.dtype == dtype
    return quant, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_nf4_matches_dequantized_reference(dtype):
    x = torch.randn(3, 7, H).to(dtype)
    quant, ref = nf4_pair(dtype, mlp_projs)
    silu = glu("silu")
    expected = run(lambda t: unfused_mlp(t, ref, "silu"), x, ref)
    compare(run(lambda t: lora_mlp(t, quant, silu), x, quant), expected, dtype, "NF4 fused MLP")
    compare(run(lambda t: unfused_mlp(t, quant, "silu"), x, quant), expected, dtype, "NF4 unfused MLP")
    quant, ref = nf4_pair(dtype, lambda d: attention_projs(d)[0])  # q, k, v
    compare(run(lambda t: lora_projections(t, quant), x, quant), run(lambda t: tuple(p(t) for p in ref), x, ref),
            dtype, "NF4 fused projections")


def test_fused_nf4_saves_no_dequantized_weight():
    quant, _ = nf4_pair(torch.float32, mlp_projs)
    x = torch.randn(21, H, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        lora_mlp(x, quant, glu("silu"))
        lora_projections(x, quant[:2])  # gate and up: two projections of one input
    assert not [s for s in shapes if s in ((I, H), (H, I))], f"a dequantized weight was saved: {shapes}"


def equal_runs(a, b, what):
    """Two `run`s give the same outputs, dx and LoRA grads, bit for bit."""
    for name, x, y in zip(("outputs", "dx", "LoRA grads"), a, b):
        xs, ys = (x, y) if isinstance(x, (list, tuple)) else ([x], [y])
        assert all(torch.equal(s, t) for s, t in zip(xs, ys, strict=True)), f"{what}: {name} differ"


GROUPS = {"gate/up/down": (mlp_projs, lambda t, projs: lora_mlp(t, projs, glu("silu"))),
          "q/k/v": (lambda dtype: attention_projs(dtype)[0], lora_projections)}


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("kernel", USE_KERNELS, ids=["bitsandbytes", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_nf4_equals_fused_dequantized_weights(dtype, kernel, group, monkeypatch):
    """The fused Functions on NF4 weights, which dequantize a group's weights into the rows of one buffer, give
    exactly what they give on full-precision weights holding the dequantized values: the same values in the
    same GEMMs, forward and backward, whether bitsandbytes or the Triton kernel dequantizes."""
    monkeypatch.setattr(NF4Weight, "dequantize", partialmethod(NF4Weight.dequantize, kernel=kernel))
    make, fn = GROUPS[group]
    quant, ref = nf4_pair(dtype, make)
    x = torch.randn(3, 7, H).to(dtype)
    equal_runs(run(lambda t: fn(t, quant), x, quant), run(lambda t: fn(t, ref), x, ref), group)


def no_dropout(projs):
    for p in projs:
        p.dropout_p = 0.0
    return projs


FOLD_H, FOLD_I = 64, 128  # widths of 64: the Triton kernel writes W straight into [W | B]
FOLDED = {  # (name, in, out, bias, adapted) of the projections of each case
    "mlp": [("gate_proj", FOLD_H, FOLD_I, False, True), ("up_proj", FOLD_H, FOLD_I, False, True),
            ("down_proj", FOLD_I, FOLD_H, False, True)],
    "q/k/v": [("q_proj", FOLD_H, 64, True, True), ("k_proj", FOLD_H, 32, True, False),
              ("v_proj", FOLD_H, 32, True, True)],
    "o": [("o_proj", FOLD_H, FOLD_H, False, True)]}


@pytest.mark.parametrize("case", ["mlp", pytest.param("mlp-kernels", marks=interpreter), "q/k/v", "o"])
@pytest.mark.parametrize("kernel", USE_KERNELS, ids=["bitsandbytes", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_folded_adapters_match_the_dequantized_reference(dtype, kernel, case, monkeypatch):
    """Without dropout, the adapters of NF4 projections join the base GEMM along K ([X | s X Aᵀ] [W | B]ᵀ forward,
    [dY | s dY B] [W; A] backward): outputs, dx and the LoRA gradients match the unfused reference on the
    dequantized weights, for q/k/v (k without an adapter), o, and the MLP with the torch activation and with the
    kernels' in-place one (whose buffer carries s dY B). The folds are seen to run: X (forward) and the MLP's dY
    (down's backward) are concatenated with the adapters' products."""
    monkeypatch.setattr(NF4Weight, "dequantize", partialmethod(NF4Weight.dequantize, kernel=kernel))
    specs = FOLDED[case.removesuffix("-kernels")]

    def make(dtype):
        projs = [make_proj(a, b, bias, R if adapted else 0, dtype, name, seed)
                 for seed, (name, a, b, bias, adapted) in enumerate(specs)]
        for p in projs:
            p.dropout_p = 0.0
        return projs

    quant, ref = nf4_pair(dtype, make)
    x = torch.randn(3, 7, FOLD_H).to(dtype)
    if case.startswith("mlp"):
        silu = glu("silu", use_kernels=case == "mlp-kernels")
        fused, unfused = (lambda t: lora_mlp(t, quant, silu)), (lambda t: unfused_mlp(t, ref, "silu"))
        widths = {FOLD_H + 2 * R, FOLD_H + R}  # [X | s X Aᵀ] of gate/up; [dY | s dY B] of down
    else:
        fused, unfused = (lambda t: lora_projections(t, quant)), (lambda t: tuple(p(t) for p in ref))
        widths = {FOLD_H + sum(p.r for p in quant)}
    with OpShapes() as seen:
        result = run(fused, x, quant)
    compare(result, run(unfused, x, ref), dtype, f"folded {case}")
    assert {(len(x.view(-1, FOLD_H)), w) for w in widths} <= seen[torch.ops.aten.cat.default], "not folded"


def test_fused_nf4_concatenates_no_weights():
    """A group's NF4 weights are dequantized straight into one buffer, never concatenated after (forward and
    backward): no `cat` makes a tensor of the group's packed weight shape."""
    quant, _ = nf4_pair(torch.float32, mlp_projs)
    qkv, _ = nf4_pair(torch.float32, lambda d: attention_projs(d)[0])
    x = torch.randn(21, H, requires_grad=True)
    with OpShapes() as seen:
        lora_mlp(x, quant, glu("silu")).sum().backward()
        sum(y.sum() for y in lora_projections(x, qkv)).backward()
    packed = {(2 * I, H), (sum(p.out_features for p in qkv), H)}
    cats = seen[torch.ops.aten.cat.default]
    assert not packed & cats, f"weights were concatenated: {cats}"


class OpShapes(TorchDispatchMode):
    """Within the block, the output shapes of every aten op that runs: {op: set of shapes}."""

    def __enter__(self):
        self.shapes = defaultdict(set)
        super().__enter__()
        return self.shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.shapes[func].add(tuple(out.shape))
        return out


def weight_bytes(model):
    """Bytes of the projection weights: full precision, or NF4 with its block scales."""
    total = 0
    for m in model.modules():
        if isinstance(m, LoRALinear):
            tensors = [m.weight] if m.nf4 is None else list(m.nf4.buffers())
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def model_bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def test_quantize_on_load_saves_three_quarters(llama_folder):
    bf16, _ = load_model(llama_folder, dtype=torch.bfloat16)
    nf4, _ = load_model(llama_folder, dtype=torch.bfloat16, quantize="nf4")
    projections = [m for m in nf4.modules() if isinstance(m, LoRALinear)]
    assert projections and all(m.weight is None and m.nf4 is not None for m in projections)
    ratio = weight_bytes(nf4) / weight_bytes(bf16)
    assert 0.25 < ratio < 0.27, f"NF4 projection weights take {ratio:.3f} of bf16's bytes, expected ~0.258"
    saved = model_bytes(bf16) - model_bytes(nf4)
    assert saved == weight_bytes(bf16) - weight_bytes(nf4), "only the projection weights change"


def test_nf4_model_matches_dequantized_model(llama_folder):
    """Logits and LoRA grads of the fused NF4 model equal those of a full-precision model
    holding the dequantized weights (the same computation, without 4-bit storage)."""
    lora = LoRAConfig(r=4, alpha=8.0, dropout=0.1)
    ours, cfg = load_model(llama_folder, lora=lora, quantize="nf4")
    ref, _ = load_model(llama_folder, lora=lora, fused_lora=False)
    randomize_lora_b(ours)
    randomize_lora_b(ref)
    refs = dict(ref.named_modules())
    for name, m in ours.named_modules():
        if isinstance(m, LoRALinear):
            refs[name].weight.data = m.nf4.dequantize()
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    for model in (ours, ref):
        model.train()
        torch.manual_seed(0)
        model(ids, targets=ids).backward()
    assert rel_err(ours.eval()(ids), ref.eval()(ids)) < 1e-5
    ref_grads = dict(lora_parameters(ref))
    for n, p in lora_parameters(ours):
        assert rel_err(p.grad, ref_grads[n].grad) < 1e-4, n


def test_quantize_model_in_memory_equals_quantize_on_load(llama_folder):
    model, cfg = load_model(llama_folder)
    quantize_model(model)
    assert not any(n.endswith("proj.weight") for n, _ in model.named_parameters())
    on_load, _ = load_model(llama_folder, quantize="nf4")
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    assert torch.equal(model(ids), on_load(ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nf4_decoding_replays_as_eager(llama_folder):
    """QLoRA on CUDA: the decoding step, with bitsandbytes dequantizing inside the captured graph, gives the
    tokens of eager decoding."""
    from model.generate import generate
    model, cfg = load_model(llama_folder, device="cuda", use_kernels=True, quantize="nf4",  # fp32: no rounding ties
                            lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    model.eval()
    prompt = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    assert generate(model, prompt, 12, cuda_graph=True) == generate(model, prompt, 12, cuda_graph=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["mlp", "mlp-one-read", "q/k/v", "o"])
def test_folded_adapters_on_gpu(case):
    """The folds on CUDA in bf16 at a model's widths (the Triton kernel writing W into [W | B], cuBLAS on the
    strided [X | s X Aᵀ] and [dY | s dY B], the kernels' activation), against the unfused reference; with 6000
    tokens [dG | dU] is large enough that gate's and up's s dY B and dB come from one read of it
    (kernels/adapter_grads.py), which is seen to run."""
    h, i = 1024, 2816
    specs = {"q/k/v": [("q_proj", h, 1024, True), ("k_proj", h, 256, True), ("v_proj", h, 256, True)],
             "o": [("o_proj", h, h, False)]}.get(
        case, [("gate_proj", h, i, False), ("up_proj", h, i, False), ("down_proj", i, h, False)])

    def make(dtype):
        projs = [make_proj(a, b, bias, 16, dtype, name, seed).cuda() for seed, (name, a, b, bias) in enumerate(specs)]
        for p in projs:
            p.dropout_p = 0.0
        return projs

    quant, ref = nf4_pair(torch.bfloat16, make)
    x = torch.randn(2, 3000 if case == "mlp-one-read" else 300, h, device="cuda").to(torch.bfloat16)
    ran = []  # whether gate/up's one read ran, each time it was offered

    def one_read(*args, **kw):
        result = adapter_grads(*args, **kw)
        ran.append(result is not None)
        return result

    if case.startswith("mlp"):
        silu = glu("silu", use_kernels=True)._replace(adapter_grads=one_read)
        fused, unfused = (lambda t: lora_mlp(t, quant, silu)), (lambda t: unfused_mlp(t, ref, "silu"))
    else:
        fused, unfused = (lambda t: lora_projections(t, quant)), (lambda t: tuple(p(t) for p in ref))
    expected = run(unfused, x, ref)
    compare(run(fused, x, quant), expected, torch.bfloat16, f"folded {case} on CUDA")
    assert ran == ([case == "mlp-one-read"] if case.startswith("mlp") else []), ran
    if case == "mlp-one-read":  # the unfolded path (full-precision weights) takes the one read too
        ran.clear()
        compare(run(lambda t: lora_mlp(t, ref, silu), x, ref), expected, torch.bfloat16, "unfolded MLP on CUDA")
        assert ran == [True], ran

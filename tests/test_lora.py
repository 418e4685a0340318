"""LoRA: parity with PEFT on every family, the fused Functions against the unfused path in
every dtype (bias and dropout included), gradcheck, and dtype discipline under autocast."""
import math

import pytest
import torch
import torch.nn.functional as F

from model import LoRAConfig, load_model
from model.lora import (
    ALL_TARGETS,
    DoRAOps,
    LoRALinear,
    MergedAdapters,
    NoDropout,
    _LoRAMLP,
    _LoRAProjections,
    _mm_to,
    _packed,
    adapters_disabled,
    givable,
    lora_mlp,
    lora_parameters,
    lora_projections,
    merged_weight,
    pack_weights_,
)
from tests.helpers import (
    RTOL,
    USE_KERNELS,
    BaseGemms,
    H,
    I,
    P,
    assert_close,
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
from tests.tiny_models import FAMILIES, save_tiny

B, T = 2, 20


def peft_name(name):
    return f"base_model.model.{name}.default.weight"


# ----------------------------------------------------------------------------- merged adapters for sampling

@pytest.fixture(scope="module", params=FAMILIES)
def family_folder(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    save_tiny(request.param, folder)
    return folder


MERGE_VARIANTS = {"lora": {}, "rslora": {"rslora": True}, "dora": {"dora": True},
                  "some targets": {"targets": ("q_proj", "v_proj", "down_proj")}}  # k_proj, gate|up copied as W


MERGE_CASES = ([(torch.float32, v, True) for v in MERGE_VARIANTS]
               + [(torch.float32, v, False) for v in ("lora", "dora")]
               + [(torch.bfloat16, v, True) for v in ("lora", "dora")])


@pytest.mark.parametrize("dtype,variant,fused", MERGE_CASES,
                         ids=[f"{str(d)[6:]}-{v}-{'fused' if f else 'unfused'}" for d, v, f in MERGE_CASES])
def test_merged_adapters_give_the_adapter_path(family_folder, dtype, variant, fused):
    """Inside MergedAdapters the logits are the adapter path's (fp32: to rounding; bf16: to W + s·B·A's rounding),
    computed from the merged buffers (changing B inside the block changes nothing), and after it the adapter
    path is back, bit for bit."""
    model, cfg = load_model(family_folder, dtype=dtype, fused_lora=fused,
                            lora=LoRAConfig(r=4, alpha=8.0, **MERGE_VARIANTS[variant]))
    randomize_lora_b(model, std=0.1)
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (B, 12), generator=torch.Generator().manual_seed(0))
    merged = MergedAdapters(model)
    assert merged.groups
    with torch.no_grad():
        want = model(ids)
        with merged:
            got = model(ids)
            saved = [p.clone() for _, p in lora_parameters(model)]
            for _, p in lora_parameters(model):
                p.add_(1.0)
            unchanged = model(ids)
            for (_, p), t in zip(lora_parameters(model), saved, strict=True):
                p.copy_(t)
        after = model(ids)
    if dtype == torch.float32:
        assert_close(got, want, atol=1e-5, rtol=1e-5, name="merged logits")
    else:
        assert rel_err(got, want) < 2e-2, rel_err(got, want)
    assert torch.equal(unchanged, got)
    assert torch.equal(after, want)


MERGE_TABLE_CASES = [(torch.float32, "lora", None), (torch.float32, "dora", None),
                     (torch.float32, "some targets", None), (torch.bfloat16, "lora", None),
                     (torch.bfloat16, "dora", None), (torch.float32, "some targets", "nf4"),
                     (torch.bfloat16, "dora", "nf4")]


@interpreter
@pytest.mark.parametrize("dtype,variant,quantize", MERGE_TABLE_CASES,
                         ids=[f"{str(d)[6:]}-{v}{'-' + q if q else ''}" for d, v, q in MERGE_TABLE_CASES])
def test_merged_adapters_with_the_kernels_equal_merged_weight(llama_folder, dtype, variant, quantize):
    """With the kernels, entering MergedAdapters writes every projection's W' in one launch (`MergeTable`): each
    projection's merged buffer equals `merged_weight` (fp32: to fp32's rounding, the kernel's tf32x3 dot is not
    torch's fp32 GEMM; bf16: to one rounding of W + s·B·A), and W itself where the projection has no adapter; an
    NF4 base is dequantized into the buffer first and merged there in place. A second block reads the adapters'
    in-place updates into the same buffers with the same table; a projection whose adapter is replaced by a new
    tensor gets a new table."""
    from kernels.dora_norm import MergeTable
    model, _ = load_model(llama_folder, dtype=dtype, use_kernels=True, quantize=quantize,
                          lora=LoRAConfig(r=4, alpha=8.0, **MERGE_VARIANTS[variant]))
    randomize_lora_b(model, std=0.1)
    merged = MergedAdapters(model)
    assert merged.make_table is MergeTable and merged.groups
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=2 ** -7)
    address = merged.buffer.data_ptr()
    for step in range(3):
        if step == 2:
            proj = model.model.layers[0].self_attn.q_proj
            proj.lora_B = torch.nn.Parameter(proj.lora_B.detach() * 2)
        want = {p: merged_weight(p) for p, _ in merged.views}
        table = merged.table
        with merged:
            for p, view in merged.views:
                assert_close(view, want[p], **tol, name=f"{p.name}'s W'")
                if p.lora_A is None:
                    assert torch.equal(view, p.base_weight() if p.nf4 is None else p.nf4.dequantize())
        assert merged.buffer.data_ptr() == address
        assert (merged.table is table) == (step == 1), "the table is built again exactly when a tensor moved"
        with torch.no_grad():
            for _, t in lora_parameters(model):
                t.mul_(0.5)


def test_adapters_disabled_inside_merged_adapters_is_the_base(llama_folder):
    """adapters_disabled gives the base model's logits inside a MergedAdapters block too (whose projections hold the
    merged W + s·B·A with their ranks at 0), in either nesting, and each block puts back what it found."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8.0))
    randomize_lora_b(model, std=0.1)
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (B, 12), generator=torch.Generator().manual_seed(0))
    merged = MergedAdapters(model)
    with torch.no_grad():
        with adapters_disabled(model):
            base = model(ids)
        with merged:
            with adapters_disabled(model):
                inner = model(ids)
            adapted = model(ids)
        with adapters_disabled(model), merged:
            outer = model(ids)
        after = model(ids)
    assert torch.equal(inner, base) and torch.equal(outer, base)
    assert not torch.allclose(adapted, base)
    assert_close(after, adapted, atol=1e-5, rtol=1e-5, name="the adapter path after both blocks")


def test_merged_adapters_are_not_taken_for_an_fp8_base(llama_folder, monkeypatch):
    """fp8 bases, and a merged copy too large for free memory, keep the adapter path: no buffers."""
    model, _ = load_model(llama_folder, lora=LoRAConfig(r=4))
    assert MergedAdapters(model).groups
    monkeypatch.setattr("model.lora.free_memory", lambda device: 1000)
    assert not MergedAdapters(model).groups
    monkeypatch.undo()
    model.model.layers[0].mlp.down_proj.fp8 = object()  # stands for the group's FP8Weights: only its presence is read
    merged = MergedAdapters(model)
    assert not merged.groups
    with merged:
        assert all(p.r for p in model.modules() if isinstance(p, LoRALinear) and p.lora_A is not None)


@pytest.mark.parametrize("variant", ["lora", "some targets"])
def test_merged_adapters_of_an_nf4_base_give_the_adapter_path(llama_folder, variant):
    """An NF4 (QLoRA) base is merged too: inside the block the logits are the NF4 adapter path's (fp32: to rounding)
    from buffers of the dequantized W + s·B·A, which take W's unquantized bytes; after it the NF4 path is back, bit
    for bit."""
    model, cfg = load_model(llama_folder, quantize="nf4", lora=LoRAConfig(r=4, alpha=8.0, **MERGE_VARIANTS[variant]))
    randomize_lora_b(model, std=0.1)
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (B, 12), generator=torch.Generator().manual_seed(0))
    merged = MergedAdapters(model)
    projs = [p for p, _ in merged.views]
    assert merged.groups and all(p.nf4 is not None for p in projs)
    assert merged.buffer.dtype == torch.float32 and merged.buffer.numel() == sum(p.nf4.shape.numel() for p in projs)
    weights = {p: merged_weight(p) for p in projs}  # from the dequantized W, outside the block
    with torch.no_grad():
        want = model(ids)
        with merged:
            got = model(ids)
            for p, view in merged.views:
                assert_close(view, weights[p], atol=1e-6, rtol=1e-6, name=f"{p.name}'s W'")
        after = model(ids)
    assert_close(got, want, atol=1e-5, rtol=1e-5, name="merged NF4 logits")
    assert torch.equal(after, want)


def test_no_dropout_turns_the_adapters_dropout_off_in_train_mode(llama_folder):
    """Inside NoDropout a model in train mode gives its eval-mode logits (its adapters draw no dropout); on leaving,
    every adapter is back in its mode (train or eval), and the train-mode forward draws dropout again."""
    model, _ = load_model(llama_folder, lora=LoRAConfig(r=4, dropout=0.5))
    randomize_lora_b(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    no_dropout = NoDropout(model)
    assert len(no_dropout.dropped) == sum(isinstance(m, LoRALinear) and m.r > 0 for m in model.modules()) > 0
    with torch.no_grad():
        evaluated = model.eval()(ids)
        with no_dropout:
            in_eval = model(ids)
        assert not any(m.training for m in model.modules())
        model.train()
        with no_dropout:
            assert not any(m.training for m in no_dropout.dropped)
            inside = model(ids)
        assert all(m.training for m in model.modules())
        dropped = model(ids)
    assert torch.equal(inside, evaluated) and torch.equal(in_eval, evaluated)
    assert not torch.allclose(dropped, evaluated), "the train-mode forward draws dropout"
    assert NoDropout(load_model(llama_folder, lora=LoRAConfig(r=4))[0]).dropped == []  # dropout 0: nothing to do


# ----------------------------------------------------------------------------- parity with PEFT

@pytest.fixture(scope="module", params=FAMILIES)
def peft_pair(request, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    family = request.param
    folder = str(tmp_path_factory.mktemp(family))
    hf = save_tiny(family, folder)
    rslora = family in ("qwen2", "gemma2")
    ours, cfg = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, dropout=0.25, rslora=rslora))
    randomize_lora_b(ours, std=0.1)
    peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.25, use_rslora=rslora,
                                         target_modules=list(ALL_TARGETS)))
    ref_params = dict(peft.named_parameters())
    with torch.no_grad():
        for n, p in lora_parameters(ours):
            ref_params[peft_name(n)].copy_(p)
    return family, peft, ours, cfg


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("dropout", [False, True], ids=["eval", "dropout"])
def test_matches_peft(peft_pair, fused, dropout):
    """Logits and every LoRA gradient match PEFT on the transformers model. With dropout on,
    both draw their masks in the same order from one seed, so the masks are identical."""
    family, peft, ours, cfg = peft_pair
    ours.ops.fused_lora = fused
    ours.train(dropout)
    peft.train(dropout)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    peft.zero_grad()
    torch.manual_seed(2)
    ref = peft(input_ids=ids).logits
    F.cross_entropy(ref.flatten(0, 1), labels.flatten()).backward()
    torch.manual_seed(2)
    out = ours(ids)
    F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
    assert rel_err(out, ref) < 1e-4, f"{family}: logits rel err {rel_err(out, ref):.2e}"
    ref_params = dict(peft.named_parameters())
    for n, p in lora_parameters(ours):
        err = rel_err(p.grad, ref_params[peft_name(n)].grad)
        assert err < 1e-4, f"{family}: grad of {n} rel err {err:.2e}"
        p.grad = None
    ours.ops.fused_lora = True
    ours.eval()


# ----------------------------------------------------------------------------- fused vs unfused

# (activation dtype, autocast dtype or None): the base weights are in the activation dtype
DTYPE_CASES = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
               (torch.float32, torch.bfloat16), (torch.float32, torch.float16)]
DTYPE_IDS = ["fp32", "bf16", "fp16", "autocast-bf16", "autocast-fp16"]


def maybe_autocast(amp):
    return torch.autocast("cpu", dtype=amp) if amp else torch.autocast("cpu", enabled=False)


def set_dropout(projs, dropout):
    """Dropout on every adapter ("on"), on none ("off": the adapters that read X share one stacked A), or
    on the first only ("mixed": it reads its own X̃, the others X)."""
    for i, p in enumerate(projs):
        p.dropout_p = 0.0 if dropout == "off" or (dropout == "mixed" and i > 0) else P


def maybe_pack(projs, packed):
    """packed: the base weights as rows of one tensor, as load_model stores them; else separate tensors, which
    the fused Functions concatenate at every step (an NF4 model's, or a model moved after loading)."""
    if packed:
        pack_weights_(projs)
        assert projs[1].weight.data_ptr() == projs[0].weight.data_ptr() + projs[0].weight.nbytes
    return projs


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("dropout", ["on", "off", "mixed"])
@pytest.mark.parametrize("dtype,amp", DTYPE_CASES, ids=DTYPE_IDS)
def test_fused_projections_match_unfused(dtype, amp, dropout, packed):
    qkv, o = attention_projs(dtype)
    maybe_pack(qkv, packed)
    set_dropout(qkv, dropout)
    x = torch.randn(3, 7, H).to(dtype)
    y = torch.randn(3, 7, 64).to(dtype)
    with maybe_autocast(amp):
        compare(run(lambda t: lora_projections(t, qkv), x, qkv), run(lambda t: tuple(p(t) for p in qkv), x, qkv),
                amp or dtype, "q/k/v")
        compare(run(lambda t: lora_projections(t, (o,)), y, (o,)), run(o, y, (o,)), amp or dtype, "o")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("dropout", ["on", "off", "mixed"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype,amp", DTYPE_CASES, ids=DTYPE_IDS)
def test_fused_mlp_matches_unfused(dtype, amp, act, dropout, packed):
    projs = mlp_projs(dtype)
    maybe_pack(projs[:2], packed)
    set_dropout(projs, dropout)
    x = torch.randn(3, 7, H).to(dtype)
    with maybe_autocast(amp):
        compare(run(lambda t: lora_mlp(t, projs, glu(act)), x, projs),
                run(lambda t: unfused_mlp(t, projs, act), x, projs), amp or dtype, f"{act} MLP")


@pytest.mark.parametrize("use_kernels", USE_KERNELS, ids=["torch", "kernels"])
@pytest.mark.parametrize("dropout", ["on", "off"])
@pytest.mark.parametrize("dtype,amp", DTYPE_CASES, ids=DTYPE_IDS)
def test_fused_residual_matches_unfused(dtype, amp, dropout, use_kernels):
    """o's and down's Functions take the layer's residual R and return R + Y (the base GEMM adds it: `_base`), with
    dR = dY; under autocast (R in another dtype than the output) the caller adds it. Values and gradients (R is a
    slice of the input here, so dX carries dR) equal the unfused R + Y, with the down projection's bias."""
    _, o = attention_projs(dtype)
    projs = mlp_projs(dtype)
    set_dropout((o, *projs), dropout)
    x = torch.randn(3, 7, 64).to(dtype)
    with maybe_autocast(amp):
        compare(run(lambda t: lora_projections(t, (o,), residual=t[..., :H] * 2)[0], x, (o,)),
                run(lambda t: t[..., :H] * 2 + o(t), x, (o,)), amp or dtype, "o + residual")
        compare(run(lambda t: lora_mlp(t, projs, glu("silu", use_kernels), residual=t * 2), x[..., :H], projs),
                run(lambda t: t * 2 + unfused_mlp(t, projs, "silu"), x[..., :H], projs), amp or dtype,
                "MLP + residual")


@pytest.mark.parametrize("dropout", ["on", "off"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_given_output_gives_the_same_gradients(dtype, residual, dropout):
    """o's Function with its output given (a checkpointed layer's recompute whose first run kept it: `kept_output` in
    model/transformer.py) returns that output, runs no GEMM with the base weight, and, given the output it computes,
    the same dX and LoRA gradients, bit for bit."""
    _, o = attention_projs(dtype)
    set_dropout((o,), dropout)
    x = torch.randn(3, 7, 64).to(dtype)
    fn = (lambda t, **kw: lora_projections(t, (o,), residual=t[..., :H] * 2, **kw)[0]) if residual else (
        lambda t, **kw: lora_projections(t, (o,), **kw)[0])
    (y,), dx, grads = run(fn, x, (o,))
    with BaseGemms(o.weight) as gemms:
        (given,), given_dx, given_grads = run(lambda t: fn(t, given=y.detach()), x, (o,))
    assert gemms.count == 1  # dX's, in backward
    assert torch.equal(given, y) and torch.equal(given_dx, dx)
    assert all(torch.equal(g, r) for g, r in zip(given_grads, grads))
    assert givable((o,), x, residual=x[..., :H]) and not givable((o,), x, residual=x[..., :H].double())


@pytest.mark.parametrize("family,inside", [("llama", 2), ("qwen2", 2), ("gemma2", 0)])
def test_residual_added_by_the_base_gemm(family, inside, monkeypatch, tmp_path):
    """Plain LoRA adds the layer's residual in o's and down's base GEMM (R as its C): twice a layer, with no add of
    its own; never with sandwich norms (Gemma 2/3: the sublayer's output is normalized before the add)."""
    import model.lora as lora_module
    from tests.tiny_models import save_tiny
    original, calls = lora_module._base, []

    def recorded(*args, residual=None, **kw):
        calls.append(residual is not None)
        return original(*args, residual=residual, **kw)
    monkeypatch.setattr(lora_module, "_base", recorded)
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path), lora=LoRAConfig(r=4))
    model(torch.randint(0, cfg.vocab_size, (B, T)), targets=torch.randint(0, cfg.vocab_size, (B, T))).backward()
    assert sum(calls) == inside * len(model.model.layers)


@interpreter
@pytest.mark.parametrize("family,forward_adds", [("llama", 0), ("gemma2", 2)])
def test_residual_stream_adds_no_pass_of_its_own(family, forward_adds, tmp_path):
    """With the kernels, a step runs no add of whole (B, T, H) activations for the residual stream: forward adds the
    residual in o's and down's GEMMs (but Gemma 2's sandwich norms add after a norm: two a layer), and backward sums
    a layer input's two gradients (its norm's and the residual's) in the norm's backward kernel
    (`RMSNorm.with_residual`), where autograd would add them. The gradients equal the torch path's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.tiny_models import save_tiny

    class CountAdds(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and args[0].shape == self.shape:
                self.count += 1
            return func(*args, **(kwargs or {}))

    save_tiny(family, str(tmp_path))
    results = []
    for use_kernels in (True, False):
        model, cfg = load_model(str(tmp_path), lora=LoRAConfig(r=4), use_kernels=use_kernels)
        randomize_lora_b(model, std=0.1)
        ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
        shape = (1, 6, cfg.hidden_size)
        with CountAdds(shape) as forward:
            loss = model(ids, targets=ids)
        with CountAdds(shape) as backward:
            loss.backward()
        results.append([p.grad for _, p in lora_parameters(model)])
        if use_kernels:
            assert (forward.count, backward.count) == (forward_adds * len(model.model.layers), 0)
    for g, ref in zip(*results):
        assert_close(g, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4, name="LoRA grad with the kernels")


@pytest.mark.parametrize("adapted", [("up_proj",), ("gate_proj", "down_proj")])
def test_fused_mlp_partial_targets(adapted):
    projs = mlp_projs(torch.float32, adapted)
    x = torch.randn(21, H)
    compare(run(lambda t: lora_mlp(t, projs, glu("gelu")), x, projs),
            run(lambda t: unfused_mlp(t, projs, "gelu"), x, projs), torch.float32, "MLP")


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_mlp_with_triton_kernels(dtype, act):
    """The kernels' forward/backward helpers inside the fused MLP (Triton's interpreter on CPU)."""
    projs = mlp_projs(dtype)
    x = torch.randn(5, H).to(dtype)
    compare(run(lambda t: lora_mlp(t, projs, glu(act, use_kernels=True)), x, projs),
            run(lambda t: unfused_mlp(t, projs, act), x, projs), dtype, f"{act} MLP (kernels)")


def recording(glu_ops, calls):
    """The GLU `glu_ops` with its forward and backward recording the keywords of each call into `calls`."""
    def forward(*args, **kw):
        calls.append(("forward", sorted(kw)))
        return glu_ops.forward(*args, **kw)

    def backward(*args, **kw):
        calls.append(("backward", sorted(kw)))
        return glu_ops.backward(*args, **kw)
    return glu_ops._replace(forward=forward, backward=backward)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dropout", ["off", "mixed", "down"])
def test_fused_mlp_adapters_inside_the_activation(dtype, act, dropout):
    """With the kernels and no dropout, gate's and up's s (X Aᵀ) Bᵀ and down's s (dY B) A are added by the
    activation's kernels as they read [G | U] and dH (keywords terms and dh_term), and the output, dX and the LoRA
    gradients still equal the unfused path's; with dropout on gate (its own X̃: "mixed") the activation takes only
    dH's term, and with dropout on down only gate's and up's."""
    projs = mlp_projs(dtype)
    drops = {"off": (0, 0, 0), "mixed": (P, 0, 0), "down": (0, 0, P)}[dropout]
    for p, d in zip(projs, drops):
        p.dropout_p = d
    calls = []
    x = torch.randn(2, 9, H).to(dtype)
    compare(run(lambda t: lora_mlp(t, projs, recording(glu(act, use_kernels=True), calls)), x, projs),
            run(lambda t: unfused_mlp(t, projs, act), x, projs), dtype, f"{act} MLP, adapters in the activation")
    gate_up = ["terms"] if dropout != "mixed" else []
    dh = ["dh_term"] if dropout != "down" else []
    assert calls == [("forward", sorted(["amax"] + gate_up)), ("backward", sorted(["amax"] + gate_up + dh))]


def exact_copies(projs):
    """float64 copies of bf16 LoRALinears (the same rounded base weights and biases, the same LoRA weights, the
    same weights trained): the reference whose GEMMs sum every token (see
    `test_cuda_lora_gradient_gemms_sum_every_token`)."""
    out = []
    for p in projs:
        e = make_proj(p.in_features, p.out_features, p.bias is not None, p.r, torch.float64, p.name, 0).cuda()
        with torch.no_grad():
            e.weight.copy_(p.weight.double())
            if p.bias is not None:
                e.bias.copy_(p.bias.double())
            if p.r:
                e.lora_A.copy_(p.lora_A)
                e.lora_B.copy_(p.lora_B)
        for t, te in ((p.weight, e.weight), (p.bias, e.bias)):
            if t is not None:
                te.requires_grad_(t.requires_grad)
        e.dropout_p = p.dropout_p
        out.append(e)
    return out


def assert_near_exact(got, exact, what, tol=RTOL[torch.bfloat16]):
    """Outputs, dx and LoRA grads of a bf16 `run` within tol × each tensor's largest value of float64's."""
    for name, g, e in zip(("output", "dx", *(f"LoRA grad {i}" for i in range(len(got[2])))),
                          (got[0][0], got[1], *got[2]), (exact[0][0], exact[1], *exact[2])):
        err = (g.double() - e).abs().max().item() / e.abs().max().item()
        assert err < tol, f"{what}: {name} {err:.4f} of its largest value off float64"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_cuda_mlp_adapters_inside_the_activation(act):
    """On CUDA in bf16, at a size where the activation's kernels take the adapters' terms (gate of 2^24 elements,
    `terms_pay`), the fused MLP equals float64's; at a small size or an odd token count the add passes run
    instead."""
    from kernels.glu import MIN_TERM_ELEMENTS
    width = 4096
    projs = [make_proj(i, o, False, 16, torch.bfloat16, n, seed).cuda() for seed, (n, i, o) in
             enumerate([("gate_proj", H, width), ("up_proj", H, width), ("down_proj", width, H)])]
    set_dropout(projs, "off")
    gate, up, down = exact_copies(projs)
    fn = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}[act]
    for tokens, inside in ((MIN_TERM_ELEMENTS // width, True), (64, False), (MIN_TERM_ELEMENTS // width + 1, False)):
        calls = []
        activation = recording(glu(act, use_kernels=True), calls)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to("cuda", torch.bfloat16)
        assert_near_exact(run(lambda t, ops=activation: lora_mlp(t, projs, ops), x, projs),
                          run(lambda t: down(fn(gate(t)) * up(t)), x.double(), (gate, up, down)),
                          f"cuda {act} MLP, {tokens} tokens")
        assert ("terms" in calls[0][1], "dh_term" in calls[1][1]) == (inside, inside)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_lora_gradient_gemms_sum_every_token():
    """`_mm_to`, the GEMM of the LoRA gradients dB = dYᵀ (s X Aᵀ) and dA = (s dY B)ᵀ X, sums every one of its K
    tokens in each layout of its operands: cuBLAS loses the last term of a column-major bf16 `a` times a row-major
    `b` at some K (4097, 6145, ... on an H200; kernels/token_sum_layouts.py). Against fp32 products (a lost term
    is ~2% of the largest value, the fp32 output's rounding ~1e-6)."""
    torch.manual_seed(0)
    for K in (*range(4090, 4106), 4225, 6145, 8193):
        for (m, n) in ((4096, 16), (16, 4096), (896, 32)):
            for a_cols, b_cols in ((True, False), (False, False), (True, True), (False, True)):
                a = (torch.randn(K, m, device="cuda").t() if a_cols else torch.randn(m, K, device="cuda")).bfloat16()
                b = (torch.randn(n, K, device="cuda").t() if b_cols else torch.randn(K, n, device="cuda")).bfloat16()
                ref = a.float() @ b.float()
                err = (_mm_to(a, b, torch.float32) - ref).abs().max().item() / ref.abs().max().item()
                assert err < 1e-4, (K, m, n, a_cols, b_cols, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [4096, 4097, 6145])
def test_cuda_lora_projections_sum_every_token(tokens):
    """A q-shaped (48 → 4096) and an o-shaped (4096 → 48) projection on the fused path in bf16 (r 16, no dropout),
    at token counts where cuBLAS would lose a token's term of dA and dB (3-7% of dB's largest value; bf16's rounding
    ~0.5%): outputs and gradients equal float64's."""
    up = make_proj(H, 4096, False, 16, torch.bfloat16, "q_proj", 0).cuda()
    back = make_proj(4096, H, False, 16, torch.bfloat16, "o_proj", 1).cuda()
    set_dropout((up, back), "off")
    for proj in (up, back):
        x = torch.randn(tokens, proj.in_features, generator=torch.Generator().manual_seed(tokens))
        x = x.to("cuda", torch.bfloat16)
        exact, = exact_copies((proj,))
        assert_near_exact(run(lambda t, p=proj: lora_projections(t, (p,))[0], x, (proj,)),
                          run(exact, x.double(), (exact,)), f"{proj.name}, {tokens} tokens")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [4096, 2817, 4353])
def test_cuda_trained_projection_sums_every_token(tokens):
    """Full fine-tuning: a bf16 projection that trains its weight (SmolLM2's k_proj, 576 → 192), through
    `project` on the fused path, at token counts where torch's own autograd GEMM loses a token's term of dW on an
    H200: dW, db and dX equal float64's."""
    from model.transformer import project
    p = make_proj(576, 192, True, 0, torch.bfloat16, "k_proj", 0).cuda()
    p.weight.requires_grad_(True)
    p.bias.requires_grad_(True)
    exact, = exact_copies((p,))
    x = torch.randn(tokens, 576, generator=torch.Generator().manual_seed(tokens))
    dy = torch.randn(tokens, 192, generator=torch.Generator().manual_seed(0))
    xg, xe = x.to("cuda", torch.bfloat16).requires_grad_(), x.to("cuda", torch.float64).requires_grad_()
    project(p, xg, True).backward(dy.to("cuda", torch.bfloat16))
    exact(xe).backward(dy.to("cuda", torch.bfloat16).double())
    for name, g, e in (("dW", p.weight.grad, exact.weight.grad), ("db", p.bias.grad, exact.bias.grad),
                       ("dX", xg.grad, xe.grad)):
        err = (g.double() - e).abs().max().item() / e.abs().max().item()
        assert err < RTOL[torch.bfloat16], f"{name}: {err:.4f} of its largest value off float64 at {tokens} tokens"


def test_terms_join_the_kernels_on_a_gpu_where_large_and_aligned():
    """`terms_pay`: on a GPU the adapters' terms join the activation's kernels for a gate of at least 2^24 elements
    whose dimensions are multiples of 16 (either layout), not for a smaller one or an odd token count; always in
    Triton's interpreter."""
    from types import SimpleNamespace

    from kernels.glu import MIN_TERM_ELEMENTS, terms_pay

    def gate(*shape, cuda=True):
        return SimpleNamespace(is_cuda=cuda, shape=shape, numel=lambda: math.prod(shape))
    tokens = MIN_TERM_ELEMENTS // 4096
    assert terms_pay(gate(4096, tokens)) and terms_pay(gate(tokens, 4096))
    assert not terms_pay(gate(4096, tokens - 16)) and not terms_pay(gate(4096, tokens + 1))
    assert not terms_pay(gate(4096 + 8, tokens)) and terms_pay(gate(4096, tokens - 16, cuda=False))


@interpreter
def test_kernel_mlp_backward_runs_once():
    """With the kernels, backward overwrites the saved G and U: a second backward must fail loudly."""
    projs = mlp_projs(torch.float32)
    y = lora_mlp(torch.randn(5, H, requires_grad=True), projs, glu("silu", use_kernels=True))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.sum().backward()


@pytest.mark.parametrize("use_kernels", USE_KERNELS, ids=["torch", "kernels"])
@pytest.mark.parametrize("dropout", ["on", "off"])
def test_mlp_backward_runs_no_activation_forward(use_kernels, dropout):
    """The MLP's backward takes H for the down adapter's dA from the activation's backward (written over dH), so
    the activation's forward runs once a step, in forward; the gradients are the unfused path's."""
    projs = mlp_projs(torch.float32)
    set_dropout(projs, dropout)
    act = glu("silu", use_kernels)
    calls = []
    counted = act._replace(forward=lambda *a, **kw: calls.append(1) or act.forward(*a, **kw))
    x = torch.randn(5, H)
    fused = run(lambda t: lora_mlp(t, projs, counted), x, projs)
    assert len(calls) == 1, f"the activation's forward ran {len(calls)} times"
    compare(fused, run(lambda t: unfused_mlp(t, projs, "silu"), x, projs), torch.float32, "MLP")


def test_gradcheck_float64():
    """Both Functions against finite differences, dropout on (masks fixed by the seed) and off."""
    f64 = torch.float64

    def lora64(m):
        if m.r:
            m.lora_A.data, m.lora_B.data = m.lora_A.data.double(), m.lora_B.data.double()
        return m

    q, k, v = (lora64(make_proj(6, o, True, 0 if n == "k" else 2, f64, n, s))
               for s, (n, o) in enumerate([("q", 4), ("k", 2), ("v", 2)]))
    x = torch.randn(3, 6, dtype=f64, requires_grad=True)

    def projections(x, aq, bq, av, bv):
        torch.manual_seed(0)  # q's adapter reads dropout(x); v's reads x itself
        return _LoRAProjections.apply((q, k, v), None, DoRAOps(), None, x, F.dropout(x, P), aq, bq, None, None, None,
                                      None, av, bv)

    leaves = [t.detach().clone().requires_grad_() for t in (q.lora_A, q.lora_B, v.lora_A, v.lora_B)]
    assert torch.autograd.gradcheck(projections, (x, *leaves))

    gate, up, down = (lora64(make_proj(i, o, True, 2, f64, n, s))
                      for s, (n, i, o) in enumerate([("gate", 6, 10), ("up", 6, 10), ("down", 10, 6)]))
    silu = glu("silu")

    def mlp(x, *ab):
        torch.manual_seed(0)  # the down mask is drawn inside, after gate's
        return _LoRAMLP.apply((gate, up, down), silu, True, None, DoRAOps(), x, F.dropout(x, P), None, *ab)

    leaves = [t.detach().clone().requires_grad_() for m in (gate, up, down) for t in (m.lora_A, m.lora_B)]
    assert torch.autograd.gradcheck(mlp, (x, *leaves))


def test_gradcheck_stacked_adapters():
    """Adapters that read the same X with the same scale run as one stacked A (ranks 2 and 3 here); one
    with another scale forms a group of its own. Against finite differences in float64."""
    f64 = torch.float64
    projs = [make_proj(6, o, False, r, f64, n, s) for s, (n, o, r) in
             enumerate([("q", 4, 2), ("k", 2, 0), ("v", 2, 3), ("x", 3, 2)])]
    for p in projs:
        p.eval()  # no dropout: every adapter reads X
        if p.r:
            p.lora_A.data, p.lora_B.data = p.lora_A.data.double(), p.lora_B.data.double()
    projs[3].scale = 0.5  # q and v stack (scale 2), x_proj is its own group
    x = torch.randn(5, 6, dtype=f64, requires_grad=True)

    def projections(x, *ab):
        it = iter(ab)
        lora = [t for p in projs for t in ((None, next(it), next(it)) if p.r else (None, None, None))]
        return _LoRAProjections.apply(tuple(projs), None, DoRAOps(), None, x, *lora)

    leaves = [t.detach().clone().requires_grad_() for p in projs if p.r for t in (p.lora_A, p.lora_B)]
    assert torch.autograd.gradcheck(projections, (x, *leaves))

    gate, up, down = (make_proj(i, o, True, r, f64, n, s) for s, (n, i, o, r) in
                      enumerate([("gate", 6, 10, 2), ("up", 6, 10, 3), ("down", 10, 6, 2)]))
    for p in (gate, up, down):
        p.eval()
        p.lora_A.data, p.lora_B.data = p.lora_A.data.double(), p.lora_B.data.double()
    silu = glu("silu")
    leaves = [t.detach().clone().requires_grad_() for m in (gate, up, down) for t in (m.lora_A, m.lora_B)]
    assert torch.autograd.gradcheck(
        lambda x, *ab: _LoRAMLP.apply((gate, up, down), silu, True, None, DoRAOps(), x, None, None, *ab),
        (x, *leaves))


def test_fused_mlp_saves_no_weight_and_no_h():
    """What the MLP Function keeps for backward: G and U are the only float [N, I] tensors;
    no base weight (transposed or not) and no H."""
    projs = mlp_projs(torch.float32)
    x = torch.randn(21, H, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora_mlp(x, projs, glu("silu"))
    assert not [s for s, _ in saved if s in ((I, H), (H, I), (2 * I, H))], f"a base weight was saved: {saved}"
    assert not [s for s, d in saved if s == (21, I) and d == torch.float32], f"H was saved: {saved}"
    assert sum(s == (2 * I, 21) and d == torch.float32 for s, d in saved) == 1, saved  # [G | U], stored transposed
    assert ((21, I), torch.bool) in saved  # the down-projection dropout mask


def test_packed_weights(llama_folder):
    """load_model stores q/k/v's and gate/up's base weights as rows of one tensor each: every projection keeps its
    own parameter (a view, same name and shape), `_packed` returns the group's weight without a copy, and the
    model gives what it gives with separate weights."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4))
    randomize_lora_b(model, std=0.1)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        ws = [p.weight for p in group]
        packed = _packed(ws)
        assert packed.data_ptr() == ws[0].data_ptr() and torch.equal(packed, torch.cat(ws))
        assert all(w.shape == (p.out_features, p.in_features) and not w.requires_grad for p, w in zip(group, ws))
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.k_proj.weight" in names and len(names) == len(model.state_dict())

    def separate(model):  # separate weights again: each a tensor of its own
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.weight = torch.nn.Parameter(m.weight.detach().clone(), requires_grad=False)
        assert attn.k_proj.weight.data_ptr() != attn.q_proj.weight.data_ptr() + attn.q_proj.weight.nbytes

    assert_unchanged_by(model, torch.randint(0, cfg.vocab_size, (B, T)), separate)


def assert_unchanged_by(model, ids, change):
    """The loss and every LoRA gradient of `model` on ids are those it gives after `change(model)`."""
    before = model(ids, targets=ids)
    before.backward()
    grads = [p.grad.clone() for _, p in lora_parameters(model)]
    model.zero_grad()
    change(model)
    after = model(ids, targets=ids)
    after.backward()
    assert_close(before, after, atol=1e-6, rtol=1e-5, name="loss")
    for (n, p), g in zip(lora_parameters(model), grads):
        assert_close(g, p.grad, atol=1e-6, rtol=1e-5, name=n)


def test_packed_adapters(llama_folder):
    """load_model stores the LoRA masters of q/k/v and of gate/up as rows of one fp32 tensor per group (each
    projection keeps its own parameter, a view), so a fused forward builds a group's compute-dtype A and block B
    without concatenating, filling or copying; the loss and every LoRA gradient equal those with separate masters."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4))
    randomize_lora_b(model, std=0.1)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
    for group in groups:
        for attr in ("lora_A", "lora_B"):
            ts = [getattr(p, attr) for p in group]
            assert _packed(ts).data_ptr() == ts[0].data_ptr() and all(t.requires_grad for t in ts)
    assert len(lora_parameters(model)) == 7 * 2 * cfg.n_layers

    def adapter_ops(projs):
        x = torch.randn(B * T, projs[0].in_features)
        with Ops() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
            _LoRAProjections.apply(projs, None, DoRAOps(), None, x,
                                   *[t for p in projs for t in (None, p.lora_A, p.lora_B)])
        return ops.names

    for projs in groups:
        names = adapter_ops(projs)
        assert not {"cat", "new_zeros", "zeros", "zero_", "fill_"} & set(names), names

    def separate(model):  # separate masters again: each a tensor of its own, on the concatenating path
        for m in model.modules():
            if isinstance(m, LoRALinear) and m.r:
                m.lora_A = torch.nn.Parameter(m.lora_A.detach().clone())
                m.lora_B = torch.nn.Parameter(m.lora_B.detach().clone())
        assert "cat" in adapter_ops(groups[0]) and "cat" in adapter_ops(groups[1])

    assert_unchanged_by(model, torch.randint(0, cfg.vocab_size, (B, T)), separate)


# ----------------------------------------------------------------------------- dtype discipline

class NaiveLoRA(torch.autograd.Function):
    """The classic mistake: save the fp32 master weights, multiply the incoming grad by them."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(x, a, b)
        return x @ a.t() @ b.t()  # under autocast: bf16 matmuls

    @staticmethod
    def backward(ctx, dy):
        x, a, b = ctx.saved_tensors
        dyb = dy @ b  # bf16 grad @ fp32 master: autocast does not apply in backward
        return dyb @ a, dyb.t() @ x, dy.t() @ (x @ a.t())


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_masters_under_autocast(amp):
    """The naive Function fails in backward ("expected BFloat16 but got Float"); nanotune's
    Functions, same setting (fp32 masters, bf16/fp16 autocast), return fp32 LoRA grads."""
    (q, k, v), o = attention_projs(torch.float32)
    x = torch.randn(21, H, requires_grad=True)
    with torch.autocast("cpu", dtype=amp):
        y = NaiveLoRA.apply(x.to(amp), q.lora_A, q.lora_B)
    assert y.dtype == amp
    with pytest.raises(RuntimeError, match="dtype|BFloat16|Half|Float"):
        y.sum().backward()
    mlp = mlp_projs(torch.float32)
    with torch.autocast("cpu", dtype=amp):
        outs = lora_projections(x, (q, k, v)) + (lora_mlp(x, mlp, glu("silu")),)
    assert all(t.dtype == amp for t in outs)
    sum(t.float().sum() for t in outs).backward()
    assert x.grad.dtype == torch.float32
    for m in (q, v) + mlp:
        assert m.lora_A.grad.dtype == m.lora_B.grad.dtype == torch.float32
        assert torch.isfinite(m.lora_A.grad).all() and m.lora_B.grad.abs().sum() > 0


def test_low_precision_master_weights_are_refused():
    (q, k, v), o = attention_projs(torch.bfloat16)
    q.lora_A.data = q.lora_A.data.bfloat16()
    with pytest.raises(AssertionError, match="lora_A of q_proj must be an fp32 master weight"):
        lora_projections(torch.randn(5, H, dtype=torch.bfloat16), (q, k, v))


# ----------------------------------------------------------------------------- model level

def test_trainable_parameters_and_init(llama_folder):
    lora = LoRAConfig(r=8, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"), rslora=True)
    model, cfg = load_model(llama_folder, lora=lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters(model)}
    assert len(trainable) == 2 * 3 * cfg.n_layers
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.r == 0 and attn.k_proj.lora_A is None
    assert attn.q_proj.scale == pytest.approx(4.0 / 8 ** 0.5)
    assert attn.q_proj.lora_A.dtype == torch.float32 and attn.q_proj.lora_A.abs().max() <= cfg.hidden_size ** -0.5
    assert (attn.q_proj.lora_B == 0).all()
    built = LoRALinear(64, 32, False, lora)  # built in memory rather than loaded: the same init
    assert 0 < built.lora_A.abs().max() <= 64 ** -0.5 and (built.lora_B == 0).all()


def saved_tensor_count(model, ids):
    """How many tensors autograd saves for backward in one training forward."""
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, targets=ids)
    return count[0]


def test_checkpointing_is_a_load_option(llama_folder):
    """gradient_checkpointing=True (a load_model / Transformer argument) keeps only the layer inputs
    for backward, far fewer tensors than a plain forward saves."""
    plain, cfg = load_model(llama_folder, lora=LoRAConfig(r=4))
    ckpt, _ = load_model(llama_folder, lora=LoRAConfig(r=4), gradient_checkpointing=True)
    assert ckpt.gradient_checkpointing and not plain.gradient_checkpointing and not ckpt.offload_activations
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    n_plain, n_ckpt = saved_tensor_count(plain, ids), saved_tensor_count(ckpt, ids)
    assert n_ckpt < n_plain / 3, (n_ckpt, n_plain)
    offload, _ = load_model(llama_folder, lora=LoRAConfig(r=4), gradient_checkpointing=True, offload_activations=True)
    assert offload.offload_activations


def test_checkpointing_keeps_dropout_masks(llama_folder):
    """Recomputation in backward redraws the same masks: grads equal those without checkpointing."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, dropout=0.3))
    randomize_lora_b(model, std=0.1)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    grads = []
    for ckpt in (False, True):
        model.gradient_checkpointing = ckpt
        torch.manual_seed(0)
        model(ids, targets=ids).backward()
        grads.append([p.grad.clone() for _, p in lora_parameters(model)])
        model.zero_grad()
    for a, b in zip(*grads):
        assert_close(a, b, atol=1e-6, rtol=1e-5, name="grad with checkpointing")


def test_recompute_skips_the_unread_down_projection(llama_folder):
    """With checkpointing, backward's recompute of a layer skips the down projection's GEMM, whose output
    nothing reads: the down weight is read twice per step (forward, and dH in backward), as without
    checkpointing, not three times. The gradients are those without checkpointing."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4))
    randomize_lora_b(model, std=0.1)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    down = model.model.layers[0].mlp.down_proj
    reads, weight = [], down.base_weight
    down.base_weight = lambda: reads.append(1) or weight()  # counts the reads of W_d
    results = []
    for ckpt in (False, True):
        model.gradient_checkpointing = ckpt
        reads.clear()
        loss = model(ids, targets=ids)
        loss.backward()
        results.append((loss.detach(), len(reads), [p.grad.clone() for _, p in lora_parameters(model)]))
        model.zero_grad()
    (loss, n, grads), (ckpt_loss, ckpt_n, ckpt_grads) = results
    assert n == 2 and ckpt_n == 2, (n, ckpt_n)
    assert_close(ckpt_loss, loss, atol=1e-6, rtol=1e-6, name="loss with checkpointing")
    for a, b in zip(grads, ckpt_grads):
        assert_close(b, a, atol=1e-6, rtol=1e-5, name="grad with checkpointing")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dropout", ["on", "off", "mixed"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_fused_lora_matches_unfused(dtype, act, dropout):
    """On CUDA in bf16 and fp16, with the Triton kernels inside: fused MLP and q/k/v/o vs the unfused path,
    with adapters stacked (dropout off), each on its own (on), and both (mixed)."""
    projs = [m.cuda() for m in mlp_projs(dtype)]
    maybe_pack(projs[:2], packed=True)
    set_dropout(projs, dropout)
    x = torch.randn(4, 33, H, device="cuda").to(dtype)
    compare(run(lambda t: lora_mlp(t, projs, glu(act, use_kernels=True)), x, projs),
            run(lambda t: unfused_mlp(t, projs, act), x, projs), dtype, f"cuda {act} MLP")
    qkv, o = attention_projs(dtype)
    qkv, o = maybe_pack(tuple(m.cuda() for m in qkv), packed=True), o.cuda()
    set_dropout(qkv, dropout)
    compare(run(lambda t: lora_projections(t, qkv), x, qkv), run(lambda t: tuple(p(t) for p in qkv), x, qkv),
            dtype, "cuda q/k/v")

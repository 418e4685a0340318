"""LoRA: parity with PEFT on every family, the fused Functions against the unfused path in
every dtype (bias and dropout included), gradcheck, and dtype discipline under autocast."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import LoRAConfig, load_model
from model.lora import (ALL_TARGETS, LoRALinear, _LoRAMLP, _LoRAProjections, lora_mlp, lora_parameters,
                        lora_projections, make_glu, mark_trainable)
from tests.helpers import assert_close, rel_err
from tests.tiny_models import FAMILIES, save_tiny

B, T = 2, 20
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
H, I, R = 48, 80, 4  # function-level shapes: hidden, intermediate, rank; 21 tokens (odd)
P = 0.25  # LoRA dropout of the function-level tests


def randomize_lora(model, seed=0, std=0.1):
    """Nonzero lora_B everywhere, so the adapters change the output (B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in lora_parameters(model):
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def peft_name(name):
    return f"base_model.model.{name}.default.weight"


# ----------------------------------------------------------------------------- parity with PEFT

@pytest.fixture(scope="module", params=FAMILIES)
def peft_pair(request, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    family = request.param
    folder = str(tmp_path_factory.mktemp(family))
    hf = save_tiny(family, folder)
    rslora = family in ("qwen2", "gemma2")
    ours, cfg = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, dropout=0.25, rslora=rslora))
    randomize_lora(ours)
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

def make_proj(in_f, out_f, bias, r, dtype, name, seed):
    """A LoRALinear with base weights in `dtype`, fp32 LoRA weights (B nonzero), in train mode."""
    torch.manual_seed(seed)
    lora = LoRAConfig(r=r, alpha=2.0 * r, dropout=P) if r else None
    m = LoRALinear(in_f, out_f, bias, lora, name=name)
    m.weight = nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)
    if bias:
        m.bias = nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
    if r:
        with torch.no_grad():
            m.lora_B.normal_(0, 0.1)
    return m.train()


def attention_projs(dtype):
    """q, k, v with a bias (Qwen2), k without an adapter; o without bias."""
    qkv = tuple(make_proj(H, out, True, 0 if n == "k_proj" else R, dtype, n, seed)
                for seed, (n, out) in enumerate([("q_proj", 64), ("k_proj", 32), ("v_proj", 32)]))
    return qkv, make_proj(64, H, False, R, dtype, "o_proj", 3)


def mlp_projs(dtype, adapted=("gate_proj", "up_proj", "down_proj")):
    return tuple(make_proj(i, o, True, R if n in adapted else 0, dtype, n, seed) for seed, (n, i, o) in
                 enumerate([("gate_proj", H, I), ("up_proj", H, I), ("down_proj", I, H)]))


def unfused_mlp(x, projs, act):
    gate, up, down = projs
    h = make_glu(act, use_kernels=False).forward(gate(x), up(x))
    return down(h)


def run(fn, x, projs, seed=0):
    """(outputs, dx, LoRA grads) of fn(x) under one seed, for one fixed upstream gradient."""
    x = x.detach().requires_grad_()
    params = [p for m in projs for p in (m.lora_A, m.lora_B) if p is not None]
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed + 1)
    dys = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, dys)
    return outs, x.grad, [p.grad for p in params]


def compare(fused, unfused, dtype, what):
    (outs, dx, grads), (ref_outs, ref_dx, ref_grads) = fused, unfused
    rtol = RTOL[dtype]
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == r.dtype, f"{what}: output {i} is {o.dtype}, unfused gives {r.dtype}"
        assert_close(o, r, atol=rtol * r.abs().max().item(), rtol=rtol, name=f"{what} output {i}")
    assert dx.dtype == ref_dx.dtype
    assert_close(dx, ref_dx, atol=rtol * ref_dx.abs().max().item(), rtol=rtol, name=f"{what} dx")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.dtype == torch.float32, f"{what}: LoRA grad {i} is {g.dtype}, the fp32 master needs fp32"
        assert_close(g, r, atol=rtol * r.abs().max().item(), rtol=rtol, name=f"{what} LoRA grad {i}")


# (activation dtype, autocast dtype or None): the base weights are in the activation dtype
DTYPE_CASES = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
               (torch.float32, torch.bfloat16), (torch.float32, torch.float16)]
DTYPE_IDS = ["fp32", "bf16", "fp16", "autocast-bf16", "autocast-fp16"]


def maybe_autocast(amp):
    return torch.autocast("cpu", dtype=amp) if amp else torch.autocast("cpu", enabled=False)


@pytest.mark.parametrize("dtype,amp", DTYPE_CASES, ids=DTYPE_IDS)
def test_fused_projections_match_unfused(dtype, amp):
    qkv, o = attention_projs(dtype)
    x = torch.randn(3, 7, H).to(dtype)
    y = torch.randn(3, 7, 64).to(dtype)
    with maybe_autocast(amp):
        compare(run(lambda t: lora_projections(t, qkv), x, qkv), run(lambda t: tuple(p(t) for p in qkv), x, qkv),
                amp or dtype, "q/k/v")
        compare(run(lambda t: lora_projections(t, (o,)), y, (o,)), run(o, y, (o,)), amp or dtype, "o")


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype,amp", DTYPE_CASES, ids=DTYPE_IDS)
def test_fused_mlp_matches_unfused(dtype, amp, act):
    projs = mlp_projs(dtype)
    x = torch.randn(3, 7, H).to(dtype)
    with maybe_autocast(amp):
        compare(run(lambda t: lora_mlp(t, projs, make_glu(act, use_kernels=False)), x, projs),
                run(lambda t: unfused_mlp(t, projs, act), x, projs), amp or dtype, f"{act} MLP")


@pytest.mark.parametrize("adapted", [("up_proj",), ("gate_proj", "down_proj")])
def test_fused_mlp_partial_targets(adapted):
    projs = mlp_projs(torch.float32, adapted)
    x = torch.randn(21, H)
    compare(run(lambda t: lora_mlp(t, projs, make_glu("gelu", use_kernels=False)), x, projs),
            run(lambda t: unfused_mlp(t, projs, "gelu"), x, projs), torch.float32, "MLP")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_mlp_with_triton_kernels(dtype, act):
    """The kernels' forward/backward helpers inside the fused MLP (Triton's interpreter on CPU)."""
    projs = mlp_projs(dtype)
    x = torch.randn(5, H).to(dtype)
    compare(run(lambda t: lora_mlp(t, projs, make_glu(act, use_kernels=True)), x, projs),
            run(lambda t: unfused_mlp(t, projs, act), x, projs), dtype, f"{act} MLP (kernels)")


def test_kernel_mlp_backward_runs_once():
    """With the kernels, backward overwrites the saved G and U: a second backward must fail loudly."""
    projs = mlp_projs(torch.float32)
    y = lora_mlp(torch.randn(5, H, requires_grad=True), projs, make_glu("silu", use_kernels=True))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.sum().backward()


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
        return _LoRAProjections.apply((q, k, v), x, F.dropout(x, P), aq, bq, None, None, None, None, av, bv)

    leaves = [t.detach().clone().requires_grad_() for t in (q.lora_A, q.lora_B, v.lora_A, v.lora_B)]
    assert torch.autograd.gradcheck(projections, (x, *leaves))

    gate, up, down = (lora64(make_proj(i, o, True, 2, f64, n, s))
                      for s, (n, i, o) in enumerate([("gate", 6, 10), ("up", 6, 10), ("down", 10, 6)]))
    glu = make_glu("silu", use_kernels=False)

    def mlp(x, *ab):
        torch.manual_seed(0)  # the down mask is drawn inside, after gate's
        return _LoRAMLP.apply((gate, up, down), glu, x, F.dropout(x, P), None, *ab)

    leaves = [t.detach().clone().requires_grad_() for m in (gate, up, down) for t in (m.lora_A, m.lora_B)]
    assert torch.autograd.gradcheck(mlp, (x, *leaves))


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
        lora_mlp(x, projs, make_glu("silu", use_kernels=False))
    assert not [s for s, _ in saved if s in ((I, H), (H, I))], f"a base weight was saved: {saved}"
    assert sum(s == (21, I) and d == torch.float32 for s, d in saved) == 2, saved  # G, U
    assert ((21, I), torch.bool) in saved  # the down-projection dropout mask


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
def test_autocast_dtype_regression(amp):
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
        outs = lora_projections(x, (q, k, v)) + (lora_mlp(x, mlp, make_glu("silu", False)),)
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

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    save_tiny("llama", folder)
    return folder


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
    mark_trainable(model, train_embeddings=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= trainable


def test_checkpointing_keeps_dropout_masks(llama_folder):
    """Recomputation in backward redraws the same masks: grads equal those without checkpointing."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, dropout=0.3))
    randomize_lora(model)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_fused_lora_matches_unfused(dtype, act):
    """On CUDA in bf16 and fp16, with the Triton kernels inside: fused MLP and q/k/v/o vs the unfused path."""
    projs = [m.cuda() for m in mlp_projs(dtype)]
    x = torch.randn(4, 33, H, device="cuda").to(dtype)
    compare(run(lambda t: lora_mlp(t, projs, make_glu(act, use_kernels=True)), x, projs),
            run(lambda t: unfused_mlp(t, projs, act), x, projs), dtype, f"cuda {act} MLP")
    qkv, o = attention_projs(dtype)
    qkv, o = tuple(m.cuda() for m in qkv), o.cuda()
    compare(run(lambda t: lora_projections(t, qkv), x, qkv), run(lambda t: tuple(p(t) for p in qkv), x, qkv),
            dtype, "cuda q/k/v")

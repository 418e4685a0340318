"""Adapter variants against PEFT: DoRA (logits, one step's gradients, the magnitude's init, save/load, merge),
LoRA+ (B's AdamW step at lr × ratio) and the PiSSA / OLoRA / gaussian inits (the base they move, the logits
they keep, and the converted rank-2r adapter on the original base)."""
import json
import os

import pytest
import torch

from model import LoRAConfig, load_model
from model.adapters import load_with_adapter, merge_and_save, read_adapter_config, save_adapter
from model.lora import (
    LoRALinear,
    _adapt_groups,
    _adapter_groups,
    _dora_scales,
    _magnitudes,
    lora_parameters,
    pack_adapters_,
    pack_weights_,
)
from tests.helpers import interpreter, randomize_lora_b, rel_err
from tests.tiny_models import FAMILIES, save_tiny

B, T = 2, 12
TOL = 1e-5  # fp32 relative error between nanotune and PEFT
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ids_for(model):
    return torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))


def hf_from(folder):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def ours(peft_name):
    """nanotune's parameter name for PEFT's: base_model.model.X.lora_A.default.weight -> X.lora_A."""
    return peft_name.removeprefix("base_model.model.").removesuffix(".weight").removesuffix(".default")


def randomize_magnitudes(model):
    """Magnitudes away from their init ‖W + s·B·A‖, so that the test sees them."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in lora_parameters(model):
            if n.endswith("lora_magnitude_vector"):
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))


def grads_of(model, named, ids):
    """{nanotune name: gradient} of Σ logits ⊙ R (R fixed) for `named` (name, parameter) pairs."""
    for _, p in named:
        p.grad = None
    logits = model(ids) if not hasattr(model, "peft_config") else model(input_ids=ids).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights).sum().backward()
    return logits.detach(), {ours(n): p.grad for n, p in named}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """family -> the folder of its tiny checkpoint, saved once for the module."""
    folders = {}

    def folder(family):
        if family not in folders:
            folders[family] = str(tmp_path_factory.mktemp(family) / "base")
            save_tiny(family, folders[family])
        return folders[family]
    return folder


# ----------------------------------------------------------------------------- DoRA

@pytest.fixture(scope="module", params=FAMILIES)
def dora(request, base, tmp_path_factory):
    """(family, base folder, nanotune DoRA model with random B and magnitudes, its saved adapter folder)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"dora-{family}")
    folder = base(family)
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, dora=True, rslora=family == "gemma"))
    randomize_lora_b(model, std=0.1)
    randomize_magnitudes(model)
    save_adapter(model, str(root / "adapter"), base_model=folder)
    return family, folder, model, str(root / "adapter")


def test_dora_magnitude_starts_as_peft_does(dora):
    """A fresh DoRA adapter's magnitudes are PEFT's: the row norms of W (B = 0), so it starts as a no-op."""
    from peft import LoraConfig, get_peft_model
    family, folder, _, _ = dora
    fresh, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, dora=True))
    peft = get_peft_model(hf_from(folder), LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=list(ALL)))
    want = {ours(n): p for n, p in peft.named_parameters() if "lora_magnitude_vector" in n}
    have = {n: p for n, p in lora_parameters(fresh) if n.endswith("lora_magnitude_vector")}
    assert have.keys() == want.keys() and len(have) == 7 * fresh.config.n_layers
    for n, p in have.items():
        assert rel_err(p, want[n]) < 1e-6, n
    ids = ids_for(fresh)
    with torch.no_grad():
        assert rel_err(fresh(ids), hf_from(folder)(ids).logits) < TOL


def test_dora_logits_and_gradients_equal_peft(dora):
    """The saved DoRA adapter loads in PEFT (use_dora, PEFT's key names) and gives nanotune's logits, and one
    backward gives the same gradients of A, B and the magnitudes (the norm a constant in backward, the bias
    unscaled: Qwen2). nanotune's model runs its default path, the fused LoRA Functions."""
    from peft import PeftModel
    family, folder, model, adapter = dora
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["use_dora"] is True
    peft = PeftModel.from_pretrained(hf_from(folder), adapter, is_trainable=True).eval()
    ids = ids_for(model)
    ours_named = lora_parameters(model)
    peft_named = [(n, p) for n, p in peft.named_parameters() if p.requires_grad]
    logits, grads = grads_of(model, ours_named, ids)
    peft_logits, peft_grads = grads_of(peft, peft_named, ids)
    assert grads.keys() == peft_grads.keys()
    assert rel_err(logits, peft_logits) < TOL, f"{family}: logits"
    for n, g in grads.items():
        assert rel_err(g, peft_grads[n]) < 1e-4, f"{family}: gradient of {n}"


def test_dora_round_trip_and_merge(dora, tmp_path):
    """load_with_adapter reads the DoRA adapter back; merge_and_save writes m / ‖W + s·B·A‖ ⊙ (W + s·B·A), which
    transformers loads to PEFT's merge_and_unload() logits."""
    from peft import PeftModel
    family, folder, model, adapter = dora
    back, _ = load_with_adapter(folder, adapter)
    assert read_adapter_config(adapter).dora
    ids = ids_for(model)
    merge_and_save(back, None, str(tmp_path / "merged"))
    merged = PeftModel.from_pretrained(hf_from(folder), adapter).merge_and_unload()
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
        assert rel_err(hf_from(str(tmp_path / "merged"))(ids).logits, merged(input_ids=ids).logits) < TOL


def dora_run(folder, lora, fused, dtype=torch.float32, **options):
    """(logits, {name: gradient}) of a DoRA model with random B and magnitudes, in train mode."""
    model, _ = load_model(folder, lora=lora, fused_lora=fused, dtype=dtype, **options)
    randomize_lora_b(model, std=0.1)
    randomize_magnitudes(model)
    model.train()
    return grads_of(model, lora_parameters(model), ids_for(model))


@pytest.mark.parametrize("family,kernels,checkpointing", [(f, False, False) for f in FAMILIES] + [
    ("qwen2", False, True), pytest.param("llama", True, True, marks=interpreter),
    pytest.param("gemma", True, False, marks=interpreter)])
def test_dora_fused_path_equals_unfused(family, kernels, checkpointing, base, monkeypatch):
    """The fused LoRA Functions carry DoRA (without dropout): logits and every adapter gradient (A, B, magnitudes)
    equal the unfused reference's, with some projections unadapted (llama: a q/k/v and a gate/up group with
    DoRA and plain members), with biases (Qwen2), under a checkpointed layer's recompute (output=False) and
    with the Triton kernels (SwiGLU and GeGLU reading gate and up through DoRA's scaling, the one-pass
    magnitude gradient)."""
    folder = base(family)
    targets = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj") if family == "llama" else ALL
    lora = LoRAConfig(r=4, alpha=8.0, dora=True, targets=targets)
    options = dict(use_kernels=kernels, gradient_checkpointing=checkpointing)
    ref_logits, ref = dora_run(folder, lora, fused=False, **options)
    monkeypatch.setattr(LoRALinear, "dora_forward", lambda *a: pytest.fail("DoRA left the fused path"))
    logits, grads = dora_run(folder, lora, fused=True, **options)
    assert rel_err(logits, ref_logits) < TOL
    assert grads.keys() == ref.keys()
    for n, g in grads.items():
        assert rel_err(g, ref[n]) < 1e-5, n


def test_dora_fused_path_in_bf16(base):
    """In bf16 the fused DoRA path is as close to the fp32 reference as the unfused path is (the two round at
    different places), and its gradients are fp32, for the fp32 masters."""
    folder, lora = base("qwen2"), LoRAConfig(r=4, alpha=8.0, dora=True)
    ref_logits, ref = dora_run(folder, lora, fused=False)
    runs = {fused: dora_run(folder, lora, fused, dtype=torch.bfloat16) for fused in (False, True)}
    (plain_logits, plain), (logits, grads) = runs[False], runs[True]
    assert rel_err(logits, ref_logits) < 2 * rel_err(plain_logits, ref_logits) + 1e-3
    for n, g in grads.items():
        assert g.dtype == torch.float32, n
        assert rel_err(g, ref[n]) < 2 * rel_err(plain[n], ref[n]) + 1e-3, n


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -10)])
@pytest.mark.parametrize("std", [0.0, 1e-4, 1e-2, 1.0, 10.0])
def test_dora_norms_of_a_group_equal_the_direct_norms(dtype, tol, std):
    """The fused path's ‖W_r + s·B_r·A‖ of a q/k/v group, from ‖W_r‖² and r-wide products (`_dora_scales`), against
    the norm of the merged weight in fp64, where s·B·A is zero (DoRA's start), small, as large as W and far larger.
    fp32: within 1e-6 relative, as the fp32 norm of the merged weight is (about 1e-7 both). bf16 base: within
    2⁻¹⁰, a quarter of the unit roundoff of the bf16 g that it gives (W Aᵀ is a GEMM of W and A in bf16)."""
    torch.manual_seed(0)
    projs = tuple(LoRALinear(96, o, False, LoRAConfig(r=8, alpha=16.0, dora=True), name=n)
                  for n, o in (("q_proj", 96), ("k_proj", 32), ("v_proj", 32)))
    with torch.no_grad():
        for p in projs:
            p.weight = torch.nn.Parameter(p.weight.to(dtype), requires_grad=False)
            p.lora_B.normal_(0, std)
        pack_weights_(projs), pack_adapters_(projs)
        masters = [p.lora_A for p in projs], [p.lora_B for p in projs]
        groups = _adapter_groups(projs, [None] * 3)
        saved = _adapt_groups(None, projs, groups, [None] * 3, torch.randn(4, 96, dtype=dtype), *masters, dtype)
        _, inv = _dora_scales(projs, groups, saved, _magnitudes(projs), masters, dtype)
    want = torch.cat([torch.linalg.vector_norm(p.weight.double() + p.scale * p.lora_B.double() @ p.lora_A.double(),
                                               dim=1) for p in projs])
    assert (1 / (inv.double() * want) - 1).abs().max() < tol


def test_dora_scales_are_computed_once_per_checkpointed_layer(base, monkeypatch):
    """With gradient checkpointing each layer runs twice in a step; the fused path computes DoRA's norms in the
    first run only and reads them in the recompute (the values of both runs are one: the logits and gradients
    equal the unfused path's, test_dora_fused_path_equals_unfused)."""
    import model.lora as lora_module
    model, _ = load_model(base("llama"), lora=LoRAConfig(r=4, alpha=8.0, dora=True), gradient_checkpointing=True)
    original, calls = lora_module.base_sq_norms, []
    monkeypatch.setattr(lora_module, "base_sq_norms", lambda projs: calls.append(projs) or original(projs))
    model.train()
    ids = ids_for(model)
    model(ids, targets=ids).backward()
    assert len(calls) == 4 * len(model.model.layers)  # q/k/v, o, gate/up and down, each once


@interpreter
def test_dora_kernel_computes_the_scales_of_every_packed_group(base, monkeypatch):
    """With the kernels and DoRA on every projection, each group's scales come from the one-launch kernel
    (kernels/dora_norm.py), never from the torch ops (their values: test_dora_fused_path_equals_unfused, gemma)."""
    import model.lora as lora_module
    monkeypatch.setattr(lora_module, "_dora_scales_torch", lambda *a: pytest.fail("DoRA's norms left the kernel"))
    model, _ = load_model(base("qwen2"), lora=LoRAConfig(r=4, alpha=8.0, dora=True), use_kernels=True,
                          gradient_checkpointing=True)
    model.train()
    ids = ids_for(model)
    model(ids, targets=ids).backward()
    assert all(p.grad is not None for n, p in lora_parameters(model) if n.endswith("lora_magnitude_vector"))


@interpreter
def test_dora_scales_of_every_layer_come_from_one_launch(base, monkeypatch):
    """With the kernels, the scales of every packed group of every layer come from one launch a forward
    (model/dora_scales.py), never from a launch a group, and its table of addresses is built once: the later
    forwards read the adapters' new values in place (an optimizer's update), and their logits and gradients equal
    the torch path's, under checkpointing's recompute."""
    from kernels.dora_norm import NormsTable
    folder, lora = base("qwen2"), LoRAConfig(r=4, alpha=8.0, dora=True)
    ref, model = (load_model(folder, lora=lora, use_kernels=k, gradient_checkpointing=True)[0].train()
                  for k in (False, True))
    tables = []
    monkeypatch.setattr(model.ops, "dora", model.ops.dora._replace(
        norms=lambda *a: pytest.fail("a group's scales left the table"),
        norms_table=lambda groups: tables.append(len(groups)) or NormsTable(groups)))
    ids = ids_for(model)
    for std in (0.1, 0.3):
        randomize_lora_b(ref, std=std)
        randomize_magnitudes(ref)
        with torch.no_grad():
            for (_, p), (_, q) in zip(lora_parameters(ref), lora_parameters(model), strict=True):
                q.copy_(p)
        (ref_logits, ref_grads), (logits, grads) = (grads_of(m, lora_parameters(m), ids) for m in (ref, model))
        assert rel_err(logits, ref_logits) < TOL
        for n, g in grads.items():
            assert rel_err(g, ref_grads[n]) < 1e-5, n
    assert tables == [4 * len(model.model.layers)]


@pytest.mark.parametrize("family,inside", [("llama", 2), ("gemma2", 0)])
def test_dora_adds_the_residual_where_it_scales_o_and_down(family, inside, base, monkeypatch):
    """The fused path adds the layer's residual in the op that scales o's and down's outputs (R + g ⊙ P + b, so that
    g ⊙ P is not written and read back by a separate add): twice a layer, and never with sandwich norms (Gemma 2/3:
    the output is normalized before the add). Values: test_dora_fused_path_equals_unfused."""
    import model.lora as lora_module
    original, calls = lora_module._dora_output, []

    def recorded(pre, g, b, residual=None):
        calls.append(residual is not None)
        return original(pre, g, b, residual)
    monkeypatch.setattr(lora_module, "_dora_output", recorded)
    model, _ = load_model(base(family), lora=LoRAConfig(r=4, alpha=8.0, dora=True))
    model(ids_for(model))
    assert sum(calls) == inside * len(model.model.layers)


def test_dora_with_dropout_reads_the_dropped_input():
    """With dropout on, the magnitude's base term reads X̃ too, as PEFT's DoRA does:
    Y = X Wᵀ + b + (g - 1) ⊙ X̃ Wᵀ + g ⊙ s X̃ Aᵀ Bᵀ, for the mask F.dropout draws."""
    torch.manual_seed(0)
    m = LoRALinear(24, 16, True, LoRAConfig(r=4, alpha=8.0, dropout=0.3, dora=True)).train()
    with torch.no_grad():
        m.lora_B.normal_(0, 0.1)
        m.lora_magnitude_vector.mul_(1.5)
    x = torch.randn(5, 24)
    torch.manual_seed(1)
    y = m(x)
    torch.manual_seed(1)
    xd = torch.nn.functional.dropout(x, 0.3)
    w, s = m.weight, m.scale
    g = m.lora_magnitude_vector / (w + s * m.lora_B @ m.lora_A).norm(dim=1)
    want = x @ w.t() + m.bias + (g - 1) * (xd @ w.t()) + g * s * (xd @ m.lora_A.t() @ m.lora_B.t())
    assert rel_err(y, want) < 1e-6


def _low_rank_case(tokens, device, dtype, seed=0, sizes=(40, 4, 24)):
    """x (tokens, in) of `dtype`, fp32 masters A (r, in) and B (out, r), dY (tokens, out) of `dtype`, on `device`,
    for sizes (in, r, out)."""
    i, r, o = sizes
    g = torch.Generator().manual_seed(seed)
    x, a, b, dy = (torch.randn(*shape, generator=g) for shape in ((tokens, i), (r, i), (o, r), (tokens, o)))
    return x.to(device, dtype), a.to(device), b.to(device), dy.to(device, dtype)


def _low_rank_grads(fn, x, a, b, dy):
    """(output, dX, dA, dB) of fn(x, a, b) against dY."""
    x, a, b = (t.detach().clone().requires_grad_() for t in (x, a, b))
    y = fn(x, a, b)
    y.backward(dy)
    return y.detach(), x.grad, a.grad, b.grad


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast-bf16"])
def test_dora_dropout_adapter_term_matches_float64(amp):
    """DoRA with dropout's adapter term s (X̃ Aᵀ) Bᵀ (`_LowRank`, whose token sums run through `_mm_to`): its output
    and gradients equal float64's, in the compute dtype's tolerance, with the dtypes of the fused Functions (the
    output in the compute dtype, dX in X's, dA and dB in fp32, for the masters), under autocast too."""
    from model.lora import _LowRank
    x, a, b, dy = _low_rank_case(37, "cpu", torch.float32)
    with torch.autocast("cpu", dtype=amp) if amp else torch.autocast("cpu", enabled=False):
        got = _low_rank_grads(lambda t, a_, b_: _LowRank.apply(t, a_, b_, 0.5), x, a, b, dy)
    want = _low_rank_grads(lambda t, a_, b_: (t @ a_.t() @ b_.t()) * 0.5, x.double(), a.double(), b.double(),
                           dy.double())
    assert [t.dtype for t in got] == [amp or torch.float32, torch.float32, torch.float32, torch.float32]
    for name, g, w in zip(("output", "dX", "dA", "dB"), got, want):
        assert rel_err(g.double(), w) < (2e-2 if amp else 1e-6), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [4096, 4097, 6145, 2817])
def test_cuda_dora_dropout_adapter_term_sums_every_token(tokens):
    """On CUDA in bf16, at SmolLM2's q_proj (576 → 576, r 16) and token counts where cuBLAS would lose a token's
    term of dA and dB in plain autograd's layout (kernels/token_sum_layouts.py), DoRA with dropout's adapter term's
    gradients equal float64's."""
    from model.lora import _LowRank
    x, a, b, dy = _low_rank_case(tokens, "cuda", torch.bfloat16, seed=tokens, sizes=(576, 16, 576))
    got = _low_rank_grads(lambda t, a_, b_: _LowRank.apply(t, a_, b_, 0.5), x, a, b, dy)
    want = _low_rank_grads(lambda t, a_, b_: (t @ a_.t() @ b_.t()) * 0.5, x.double(), a.double(), b.double(),
                           dy.double())
    for name, g, w in zip(("output", "dX", "dA", "dB"), got, want):
        err = (g.double() - w).abs().max().item() / w.abs().max().item()
        assert err < 1e-2, f"{name}: {err:.4f} of its largest value off float64 at {tokens} tokens"


def test_dora_nf4_uses_the_dequantized_weight(tmp_path):
    """On an NF4 base the magnitudes start as the dequantized weight's row norms, and the merge into the
    dequantized weights gives the NF4 model's logits."""
    pytest.importorskip("bitsandbytes")
    folder = str(tmp_path / "base")
    save_tiny("llama", folder)
    model, _ = load_model(folder, lora=LoRAConfig(r=4, dora=True), quantize="nf4")
    q = model.model.layers[0].self_attn.q_proj
    assert rel_err(q.lora_magnitude_vector, q.base_weight().float().norm(dim=1)) < 1e-6
    randomize_lora_b(model, std=0.1)
    randomize_magnitudes(model)
    merge_and_save(model, None, str(tmp_path / "merged"))
    ids = ids_for(model)
    with torch.no_grad():
        assert rel_err(hf_from(str(tmp_path / "merged"))(ids).logits, model(ids)) < 1e-4


def test_dora_merge_and_export_scripts(tmp_path, monkeypatch):
    """scripts/merge.py and scripts/export_gguf.py merge a DoRA adapter exactly: the merged folder and the f32 GGUF
    give the adapted model's logits."""
    pytest.importorskip("gguf")
    from tests.helpers import run_script_here
    from tests.tiny_models import make_run_folder
    folder = make_run_folder(str(tmp_path / "base"), family="qwen2")
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, dora=True))
    randomize_lora_b(model, std=0.1)
    randomize_magnitudes(model)
    save_adapter(model, str(tmp_path / "adapter"), base_model=folder)
    run_script_here(monkeypatch, "merge.py", "--model", folder, "--adapter", tmp_path / "adapter", "--out",
                    tmp_path / "merged", "--dtype", "fp32")
    run_script_here(monkeypatch, "export_gguf.py", "--model", folder, "--adapter", tmp_path / "adapter", "--out",
                    tmp_path / "m.gguf", "--ftype", "f32")
    ids = ids_for(model)
    with torch.no_grad():
        want = model(ids)
        assert rel_err(hf_from(str(tmp_path / "merged"))(ids).logits, want) < TOL
        assert rel_err(load_model(str(tmp_path / "m.gguf"))[0](ids), want) < TOL


# ----------------------------------------------------------------------------- LoRA+ and the loop

def cfg_for(model_dir, out_dir, **kw):
    """A short CPU run on the builtin dataset's first rows, without evals."""
    import config
    from tests.helpers import builtin_jsonl
    os.makedirs(out_dir.parent / "data", exist_ok=True)
    base = dict(model=model_dir, out_dir=str(out_dir), data=builtin_jsonl(str(out_dir.parent / "data"), 24),
                max_len=64, batch_size=2, max_steps=1, warmup_steps=0, eval_every=0, eval_batches=0, save_every=0,
                lr=1e-3, dtype="fp32", device="cpu", kernels=False, log_every=1, sample_every=0, lora_r=4,
                lora_alpha=8.0, num_proc=1, gradient_checkpointing=False)
    base.update(kw)
    return config.TrainConfig(**base)


def trained_adapter(out_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(out_dir, "adapter", "adapter_model.safetensors"))


def test_lora_plus_step_moves_b_at_lr_times_ratio(run_model, tmp_path):
    """One AdamW step of train.py with --lora-plus-ratio 4 moves each B by 4 × the step it takes with ratio 1
    (B starts at 0: AdamW's first step is lr · g / (|g| + eps), linear in the lr) and each A as with ratio 1."""
    import train
    start = load_model(run_model, lora=LoRAConfig(r=4, alpha=8.0), lora_seed=0)[0]
    init = {f"base_model.model.{n}.weight": p.detach().clone() for n, p in lora_parameters(start)}
    steps = {}
    for ratio in (1.0, 4.0):
        cfg = cfg_for(run_model, tmp_path / str(ratio), lora_plus_ratio=ratio, weight_decay=0.1)
        assert train.main(cfg) == 0
        steps[ratio] = {k: t - init[k] for k, t in trained_adapter(cfg.out_dir).items()}
    for k, plain in steps[1.0].items():
        if k.endswith("lora_B.weight"):
            assert plain.abs().max() > 0, k
            assert rel_err(steps[4.0][k], 4 * plain) < 1e-5, k
        else:  # B = 0: no gradient reaches A, only the weight decay at lr
            assert plain.abs().max() > 0, k
            assert rel_err(steps[4.0][k], plain) < 1e-6, k


def test_dora_lora_plus_run_resumes_exactly(run_model, tmp_path):
    """A --dora --lora-plus-ratio run resumed from its step-2 checkpoint continues with the same losses (the
    magnitudes and both parameter groups' optimizer state are saved), and its adapter loads as DoRA."""
    import shutil

    import train
    from tests.helpers import read_metrics
    kw = dict(max_steps=4, save_every=2, dora=True, lora_plus_ratio=8.0, warmup_steps=1)
    full = cfg_for(run_model, tmp_path / "full", **kw)
    assert train.main(full) == 0
    ref = [r["loss"] for r in read_metrics(full.out_dir) if "loss" in r]
    os.makedirs(tmp_path / "part" / "checkpoints")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-0000002",
                    tmp_path / "part" / "checkpoints" / "step-0000002")
    assert train.main(cfg_for(run_model, tmp_path / "part", resume="auto", **kw)) == 0
    assert [r["loss"] for r in read_metrics(tmp_path / "part") if "loss" in r] == ref[2:]
    assert read_adapter_config(os.path.join(full.out_dir, "adapter")).dora
    assert any(k.endswith("lora_magnitude_vector") for k in trained_adapter(full.out_dir))


# ----------------------------------------------------------------------------- PiSSA, OLoRA, gaussian


def peft_init(folder, init, r=4, alpha=8):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(hf_from(folder), LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=init,
                                                      target_modules=list(ALL)))


@pytest.mark.parametrize("init,family", [("pissa", f) for f in FAMILIES] + [("olora", "llama"), ("olora", "qwen2"),
                                                                            ("olora", "gemma2")])
def test_base_moving_init_equals_peft(init, family, base):
    """PiSSA (SVD) and OLoRA (QR) set A, B and the residual base W - s·B·A as PEFT does, and the model's logits
    before training are the original model's."""
    folder = base(family)
    hf = hf_from(folder)
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, init=init))
    peft = dict(peft_init(folder, init).named_parameters())
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            for ab in ("lora_A", "lora_B"):
                assert rel_err(getattr(m, ab), peft[f"base_model.model.{name}.{ab}.default.weight"]) < 1e-5, name
            assert rel_err(m.weight, peft[f"base_model.model.{name}.base_layer.weight"]) < 1e-6, name
    ids = ids_for(model)
    with torch.no_grad():
        assert rel_err(model(ids), hf(input_ids=ids).logits) < TOL


def test_gaussian_init(base):
    """gaussian: A ~ N(0, (1/r)²), B = 0, the base unchanged: the logits are the original model's."""
    folder = base("qwen2")
    hf = hf_from(folder)
    model, _ = load_model(folder, lora=LoRAConfig(r=8, alpha=8.0, init="gaussian"))
    a = torch.cat([p.flatten() for n, p in lora_parameters(model) if n.endswith("lora_A")])
    assert abs(a.std().item() - 1 / 8) < 0.01 and abs(a.mean().item()) < 0.01
    assert all(not p.any() for n, p in lora_parameters(model) if n.endswith("lora_B"))
    ids = ids_for(model)
    with torch.no_grad():
        assert rel_err(model(ids), hf(input_ids=ids).logits) < TOL


def perturb(model, std=0.05):
    """Move A and B away from their init, as training would."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.add_(torch.randn(p.shape, generator=gen) * std)


@pytest.mark.parametrize("init,family,rslora", [("pissa", "llama", False), ("olora", "qwen2", True),
                                                ("pissa", "gemma", False)])
def test_converted_adapter_on_the_original_base(init, family, rslora, base, tmp_path):
    """A trained PiSSA/OLoRA adapter is saved as PEFT's converted form, tensor for tensor what PEFT's
    save_pretrained(path_initial_model_for_weight_conversion=...) writes: a rank-2r plain LoRA that, on the
    ORIGINAL base, gives the trained model's logits in PEFT, in nanotune (load_with_adapter) and merged."""
    from peft import PeftModel
    from safetensors.torch import load_file
    folder = base(family)
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0, init=init, rslora=rslora))
    perturb(model)
    adapter = str(tmp_path / "adapter")
    save_adapter(model, adapter, base_model=folder)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        saved = json.load(f)
    assert saved["r"] == 8 and saved["lora_alpha"] == pytest.approx(8.0 * (2 ** 0.5 if rslora else 2))

    # PEFT's own conversion of the same trained weights.
    from peft import LoraConfig, get_peft_model
    peft = get_peft_model(hf_from(folder), LoraConfig(r=4, lora_alpha=8, init_lora_weights=init, use_rslora=rslora,
                                                      target_modules=list(ALL)))
    peft.peft_config["default"].init_lora_weights = True
    peft.save_pretrained(str(tmp_path / "peft-init"))
    trained = dict(lora_parameters(model))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(trained[ours(n)])
    peft.save_pretrained(str(tmp_path / "peft-out"),
                         path_initial_model_for_weight_conversion=str(tmp_path / "peft-init"))
    want = load_file(str(tmp_path / "peft-out" / "adapter_model.safetensors"))
    have = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert have.keys() == want.keys()
    for k in have:
        assert rel_err(have[k], want[k]) < 1e-5, k

    ids = ids_for(model)
    with torch.no_grad():
        logits = model(ids)
        on_original = PeftModel.from_pretrained(hf_from(folder), adapter).eval()
        assert rel_err(on_original(input_ids=ids).logits, logits) < TOL
        back, _ = load_with_adapter(folder, adapter)
        assert rel_err(back(ids), logits) < TOL
        merge_and_save(back, None, str(tmp_path / "merged"))
        assert rel_err(hf_from(str(tmp_path / "merged"))(ids).logits, logits) < TOL


def test_base_moving_init_refused_with_nf4_and_dora(run_model, tmp_path, capsys):
    """--lora-init pissa/olora with --quantize nf4, or with --dora, is one error line before anything is written;
    library callers get a ValueError."""
    from tests.helpers import refused
    out = str(tmp_path / "out")
    refused(["--model", run_model, "--out-dir", out, "--lora-init", "pissa", "--quantize", "nf4"], capsys, out,
            r"--lora-init pissa with --quantize nf4: .*quantized after that.*leave out --quantize")
    refused(["--model", run_model, "--out-dir", out, "--lora-init", "olora", "--dora"], capsys, out,
            r"--dora with --lora-init olora")
    refused(["--model", run_model, "--out-dir", out, "--lora-init", "svd"], capsys, out, r"--lora-init must be one of")
    refused(["--model", run_model, "--out-dir", out, "--lora-plus-ratio", "0"], capsys, out,
            r"--lora-plus-ratio must be > 0")
    with pytest.raises(ValueError, match="DoRA with the pissa init"):
        LoRAConfig(dora=True, init="pissa")
    with pytest.raises(ValueError, match=r"takes the adapter's r = 64 components from .* lower --lora-r"):
        load_model(run_model, lora=LoRAConfig(r=64, init="pissa"))  # more than a tiny projection's rank

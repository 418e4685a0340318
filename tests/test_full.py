"""Full fine-tuning (--full, --train-modules): one step against transformers + torch AdamW, the fp32 masters,
which weights train, exact resume, the saved Hugging Face folder (transformers, GGUF), the memory check, and q, k, v
that train as one GEMM each way (model/stacked.py) against one projection at a time."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import config
import full
import memory
import train
from checkpoint import trained_weights
from masters import Masters, param_groups
from model import load_model, read_config
from model.lora import LoRALinear, _rows_view, pack_weights_
from model.stacked import stacked, stacked_projections
from model.weights import trainable_parameters
from precision import LossScaler
from tests.helpers import assert_close, read_metrics, refused
from tests.tiny_models import save_tiny

# eps: AdamW's first update is lr·g/(|g| + eps), whose slope in g is up to lr/eps where |g| is near 0. There the
# two models' gradients differ by their fp32 sums' rounding δ (terms of 1e-2 that cancel, δ of 1e-8 to 1e-7), which
# moves the update by up to lr·|δ|/eps, while an ordinary weight moves by lr = 1e-3: the weights are compared within
# that bound, element by element (`step_tolerance`).
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-5, weight_decay=0.1)


def cfg_for(model_dir, out_dir, **kw):
    base = dict(model=model_dir, out_dir=str(out_dir), max_len=64, batch_size=2, max_steps=3, warmup_steps=1,
                eval_every=0, save_every=0, lr=1e-3, dtype="fp32", device="cpu", kernels=False, log_every=1,
                sample_every=0, eval_batches=1, max_examples=40, full=True, gradient_checkpointing=False)
    base.update(kw)
    return config.TrainConfig(**base)


def _batch(vocab, seed=0, B=2, T=12):
    ids = torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    targets = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    return ids, targets


@pytest.mark.parametrize("family", ["llama", "gemma"])  # untied head; tied head with Gemma's norm offset and scale
def test_one_step_equals_transformers_and_torch_adamw(family, tmp_path):
    """Every weight's gradient, and every weight after one AdamW step (weight decay on), equal transformers' model
    stepped by torch.optim.AdamW on the same batch and hyper-parameters."""
    hf = save_tiny(family, str(tmp_path / family))
    model, mcfg = load_model(str(tmp_path / family), train=full.train_filter(None, read_config(str(tmp_path / family))))
    masters = Masters(trainable_parameters(model))
    assert masters.names == [n for n, _ in hf.named_parameters()]  # every weight trains; a tied head once
    optimizer = torch.optim.AdamW(masters.params, **HYPER, fused=True)
    ids, targets = _batch(mcfg.vocab_size)
    n = (targets != -100).sum()
    (model(ids, targets=targets, reduction="sum") / n).backward()
    optimizer.step()

    hf.train()
    ref_opt = torch.optim.AdamW(hf.parameters(), **HYPER)
    hf(ids, labels=ids).loss.backward()  # transformers shifts the labels itself
    grads = {name: m.grad for name, m in masters.named()}
    for name, p in hf.named_parameters():
        assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, name=f"gradient of {name}")
    ref_grads = {name: p.grad for name, p in hf.named_parameters()}
    ref_opt.step()
    before = load_file(os.path.join(str(tmp_path / family), "model.safetensors"))
    ours = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not move"
        diff = (ours[name].detach() - p.detach()).abs()
        bound = step_tolerance(grads[name], ref_grads[name], p.detach())
        assert (diff <= bound).all(), (f"{name}: max |diff| {diff.max().item():.3g}, "
                                       f"{(diff / bound).max().item():.3g}× its bound")


def step_tolerance(grad, ref_grad, weight):
    """Per element, how far one AdamW step (HYPER) from equal weights may land apart given the two gradients: the
    update lr·g/(|g| + eps) moves by at most lr·|δ|/eps for a gradient difference δ, plus fp32's rounding of the
    weight (2e-6 absolute, 1e-5 relative)."""
    return 2e-6 + 1e-5 * weight.abs() + HYPER["lr"] * (grad - ref_grad).abs() / HYPER["eps"]


def test_bf16_weights_step_through_fp32_masters(tmp_path):
    """In bf16 the optimizer steps fp32 copies: the masters equal an fp32 AdamW step on the bf16 weights' upcast
    gradients, and the model's weights are the masters rounded to bf16. Without masters the same update, applied to
    the bf16 weights, would round away for most of them."""
    save_tiny("llama", str(tmp_path / "m"))
    path = str(tmp_path / "m")
    model, mcfg = load_model(path, dtype=torch.bfloat16, train=full.train_filter(None, read_config(path)))
    masters = Masters(trainable_parameters(model))
    assert all(m.dtype == torch.float32 for m in masters.params)
    start = [m.detach().clone() for m in masters.params]
    optimizer = masters.optimizer(param_groups(masters.named(), 0.01), lr=1e-4, use_kernels=False)
    ids, targets = _batch(mcfg.vocab_size)
    (model(ids, targets=targets, reduction="mean")).backward()
    grads = [w.grad.float() for w in masters.weights]
    assert all(g.abs().sum() > 0 for g in grads)  # the backward accumulated into the flat gradient buffer
    masters.unscale_and_clip_(LossScaler(1.0, 100, enabled=False), None)
    optimizer.step()

    ref = [s.clone().requires_grad_() for s in start]
    for r, g in zip(ref, grads):
        r.grad = g
    torch.optim.AdamW(ref, lr=1e-4).step()
    for name, r, m, w in zip(masters.names, ref, masters.params, masters.weights):
        assert_close(m, r, atol=1e-7, rtol=1e-6, name=name)
        assert torch.equal(w, m.to(torch.bfloat16)), name
    named = dict(model.named_parameters())
    assert all(named[n] is w for n, w in zip(masters.names, masters.weights))  # the model computes with them
    rounded_away = sum(int((r.to(torch.bfloat16) == s.to(torch.bfloat16)).sum()) for r, s in zip(ref, start))
    assert rounded_away > 0.5 * sum(s.numel() for s in start)  # what masters are for
    masters.zero_grad()
    assert all(not w.grad.any() for w in masters.weights)


def test_train_modules_selects_by_name_and_layer(tmp_path):
    """Projection names, norm, embed_tokens, lm_head and layer ranges choose the weights; a tied head is the
    embedding; unknown names and layers the model lacks are one error line each."""
    save_tiny("qwen2", str(tmp_path / "q"))  # tied embeddings, q/k/v biases
    mcfg = read_config(str(tmp_path / "q"))

    def trained(spec):
        model, _ = load_model(str(tmp_path / "q"), train=full.train_filter(spec, mcfg))
        return {n for n, _ in trainable_parameters(model)}

    assert trained("q_proj,layers.1") == {"model.layers.1.self_attn.q_proj.weight",
                                          "model.layers.1.self_attn.q_proj.bias"}
    assert trained("norm,layers.0") == {"model.layers.0.input_layernorm.weight",
                                        "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"}
    assert trained("lm_head") == trained("embed_tokens") == {"model.embed_tokens.weight"}
    assert trained("layers.1-1") == {n for n in trained(None) if n.startswith("model.layers.1.")}
    assert len(trained("q_proj,v_proj")) == 8  # weight and bias, 2 layers
    with pytest.raises(ValueError, match=r"unknown name 'attn'; valid: q_proj,.*layers\.A-B"):
        full.train_filter("attn", mcfg)
    with pytest.raises(ValueError, match="layer 5 does not exist; this model has layers 0 to 1"):
        full.train_filter("layers.2-5", mcfg)
    with pytest.raises(ValueError, match="empty"):
        full.parse_train_modules("layers.3-1")


def test_train_modules_run_changes_only_those_weights(run_model, tmp_path):
    """A --train-modules run changes exactly the chosen weights in the saved model; every other tensor is the
    base's, bit for bit."""
    cfg = cfg_for(run_model, tmp_path / "out", train_modules="q_proj,down_proj,norm,layers.1", lr=1e-2)
    assert train.main(cfg) == 0
    base = load_file(os.path.join(run_model, "model.safetensors"))
    tuned = load_file(os.path.join(cfg.out_dir, "model", "model.safetensors"))
    assert tuned.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert changed == {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                       "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                       "model.norm.weight"}


def test_bf16_resume_is_exact(run_model, tmp_path):
    """A bf16 run resumed from its step-2 checkpoint (fp32 masters and AdamW state) ends with the same weights and
    losses as the uninterrupted run."""
    whole = cfg_for(run_model, tmp_path / "whole", dtype="bf16", max_steps=4, save_every=2, lr=1e-3)
    assert train.main(whole) == 0
    part = tmp_path / "part"
    os.makedirs(part / "checkpoints")
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-0000002", part / "checkpoints" / "step-0000002")
    assert train.main(cfg_for(run_model, part, dtype="bf16", max_steps=4, save_every=2, lr=1e-3,
                              resume="auto")) == 0
    losses = [[r["loss"] for r in read_metrics(d) if "loss" in r] for d in (whole.out_dir, part)]
    assert losses[1] == losses[0][2:]
    a, b = (load_file(os.path.join(d, "model", "model.safetensors")) for d in (whole.out_dir, part))
    assert a["model.embed_tokens.weight"].dtype == torch.bfloat16
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_saved_model_loads_in_transformers_and_exports_to_gguf(run_model, tmp_path, monkeypatch):
    """out/model/ is a Hugging Face folder: transformers loads it to the trained model's logits, and
    scripts/export_gguf.py writes a GGUF of it whose logits (read back through the gguf package) are the same."""
    import sys

    pytest.importorskip("gguf", reason="the optional gguf package is not installed: pip install -e '.[gguf]'")

    import transformers as tf

    from tests.helpers import ROOT
    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "scripts"), *sys.path])
    import export_gguf
    cfg = cfg_for(run_model, tmp_path / "out", lr=1e-2)
    assert train.main(cfg) == 0
    folder = os.path.join(cfg.out_dir, "model")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    ids, _ = _batch(300)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    ours, _ = load_model(folder)
    masters = load_file(os.path.join(cfg.out_dir, "checkpoints", "step-0000003", "tensors.safetensors"))
    assert_close(ours.model.embed_tokens.weight, masters["lora.model.embed_tokens.weight"], 0, 0, "embedding")
    with torch.no_grad():
        expected = hf(ids).logits
        assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4, name="logits")
        base = tf.AutoModelForCausalLM.from_pretrained(run_model, attn_implementation="eager").float().eval()
        assert (base(ids).logits - expected).abs().max() > 1e-3  # the saved model is the trained one
    gguf_path = export_gguf.export(folder, str(tmp_path / "tuned.gguf"), ftype="f32")
    from_gguf, _ = load_model(gguf_path)
    with torch.no_grad():
        assert_close(from_gguf(ids), expected, atol=1e-4, rtol=1e-4, name="GGUF logits")


def test_full_refuses_lora_options_and_bad_modules(run_model, tmp_path, capsys):
    """--full with a LoRA option or --quantize, --train-modules without --full, and names or layers the model
    lacks: one error line each, before anything is written."""
    out = str(tmp_path / "out")
    common = ["--model", run_model, "--out-dir", out, "--device", "cpu", "--max-steps", "1"]
    refused(common + ["--full", "--lora-r", "8"], capsys, out, "drop the LoRA option")
    refused(common + ["--full", "--quantize", "nf4"], capsys, out, "--quantize nf4")
    refused(common + ["--train-modules", "q_proj"], capsys, out, "add --full")
    refused(common + ["--full", "--train-modules", "q_proj,attn"], capsys, out, "unknown name 'attn'")
    refused(common + ["--full", "--train-modules", "layers.9"], capsys, out, "layer 9 does not exist")
    refused(common + ["--full", "--method", "dpo"], capsys, out, "simpo or orpo")


def test_memory_check_refuses_what_a_gpu_cannot_hold(monkeypatch):
    """Before loading: weights + gradients + fp32 masters + AdamW state against the GPU's free memory; too little
    is one line that says what fits. On the CPU only the estimate."""
    from model.config import from_hf_config
    from tests.tiny_models import hf_model
    hf = hf_model("llama")
    mcfg = from_hf_config(hf.config.to_dict())
    total = sum(p.numel() for p in hf.parameters())
    assert full.weight_counts(mcfg, full.train_filter(None, mcfg)) == (total, total)
    counts = full.weight_counts(mcfg, full.train_filter("q_proj", mcfg))
    assert counts == (total, sum(p.numel() for n, p in hf.named_parameters() if "q_proj" in n))
    assert memory.training_bytes(total, total, torch.bfloat16) == total * (2 + 2 + 4 + 8)
    assert memory.training_bytes(total, total, torch.float32) == total * (4 + 4 + 8)
    line = memory.full_finetuning_fit(mcfg, counts, torch.bfloat16, torch.device("cpu"), 1)
    assert line.startswith("full fine-tuning: ") and "GiB" in line
    counts = (total, total)
    need = memory.training_bytes(total, total, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need - 1, 2 * need))
    with pytest.raises(config.UserError, match=r"LoRA \(drop --full.*QLoRA \(--quantize nf4"):
        memory.full_finetuning_fit(mcfg, counts, torch.bfloat16, torch.device("cuda"), 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need, 2 * need))
    assert "GiB free" in memory.full_finetuning_fit(mcfg, counts, torch.bfloat16, torch.device("cuda"), 1)


def test_checkpoint_names_the_masters(run_model):
    """trained_weights pairs the optimizer's tensors (the fp32 masters) with the model's parameter names."""
    model, mcfg = load_model(run_model, dtype=torch.bfloat16, train=full.train_filter("norm", read_config(run_model)))
    masters = Masters(trainable_parameters(model))
    optimizer = torch.optim.AdamW(param_groups(masters.named(), 0.0))
    named = trained_weights(model, optimizer)
    assert [n for n, _ in named] == masters.names and all(t.dtype == torch.float32 for _, t in named)


def _qkv(model):
    return [(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in model.model.layers)]


def _graph_nodes(t):
    """The names of the autograd nodes that t's graph holds."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [n for n, _ in node.next_functions]
    return {type(n).__name__ for n in seen}


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # no biases; q, k, v biases and a tied head
def test_trained_qkv_run_as_one_gemm_each_way(family, tmp_path):
    """Where q, k, v all train, each layer runs them as one Function (model/stacked.py): the loss and every weight's
    and bias's gradient equal those of the path that runs one projection at a time (fused_lora=False), also under
    gradient checkpointing, whose recompute runs the Function again."""
    path = str(tmp_path / family)
    save_tiny(family, path)
    train = full.train_filter(None, read_config(path))
    ids, targets = _batch(256)
    results = []
    for options in (dict(fused_lora=False), dict(), dict(gradient_checkpointing=True)):
        model, _ = load_model(path, train=train, **options)
        model.train()
        assert all(stacked(qkv) for qkv in _qkv(model))
        loss = model(ids, targets=targets, reduction="mean")
        assert ("_StackedLinearBackward" in _graph_nodes(loss)) == ("fused_lora" not in options and
                                                                    not model.gradient_checkpointing)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), *others = results
    for loss, grads in others:
        assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6, name="loss")
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, name=f"gradient of {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_projections_equal_one_projection_at_a_time(dtype):
    """The stacked Function's outputs, dX, dW and db equal those of each projection's own F.linear, in the weights'
    and input's dtypes; each weight's gradient is its rows of the one dW."""
    torch.manual_seed(0)
    projs = [LoRALinear(40, out, bias=True, name=n) for n, out in (("q_proj", 24), ("k_proj", 8), ("v_proj", 8))]
    for p in projs:
        p.weight = torch.nn.Parameter(p.weight.detach().to(dtype))
        p.bias = torch.nn.Parameter(p.bias.detach().to(dtype))
    pack_weights_(projs)
    assert stacked(projs)
    x = torch.randn(3, 5, 40, dtype=dtype)
    dys = [torch.randn(3, 5, p.out_features, dtype=dtype) for p in projs]
    results = []
    for fn in (lambda x: tuple(p(x) for p in projs), lambda x: stacked_projections(x, projs)):
        x = x.detach().requires_grad_()
        for p in projs:
            p.weight.grad = p.bias.grad = None
        outs = fn(x)
        torch.autograd.backward(outs, dys)
        results.append((outs, x.grad, [t.grad for p in projs for t in (p.weight, p.bias)]))
    (ref_outs, ref_dx, ref_grads), (outs, dx, grads) = results
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for t, ref, name in [*zip(outs, ref_outs, ("q", "k", "v")), (dx, ref_dx, "dX"),
                         *zip(grads, ref_grads, ("dW_q", "db_q", "dW_k", "db_k", "dW_v", "db_v"))]:
        assert t.dtype == ref.dtype == dtype, name
        assert_close(t, ref, **tol, name=name)
    assert _rows_view(grads[0::2]) is not None  # dW_q, dW_k, dW_v: the rows of one GEMM's output


def test_masters_keep_stacked_groups_one_view(tmp_path):
    """In bf16 the flat buffers keep each layer's q, k, v weights, and their biases, as one view each (the biases lie
    apart from the weights in the parameters' order); the names and the checkpoint's order stay the parameters'."""
    path = str(tmp_path / "q")
    save_tiny("qwen2", path)
    model, _ = load_model(path, dtype=torch.bfloat16, train=full.train_filter(None, read_config(path)))
    named = trainable_parameters(model)
    masters = Masters(named)
    assert masters.names == [n for n, _ in named]
    for qkv in _qkv(model):
        assert stacked(qkv)
        for t in [p.weight for p in qkv] + [p.bias for p in qkv]:
            assert t.untyped_storage().data_ptr() == masters.weight_buffer.untyped_storage().data_ptr()


def test_train_modules_of_one_projection_leave_the_group_apart(tmp_path):
    """--train-modules q_proj trains only q: q, k, v stay one projection at a time (and k, v are not stored with a
    trained q); q, k, v together train as one group."""
    path = str(tmp_path / "q")
    save_tiny("qwen2", path)
    mcfg = read_config(path)
    model, _ = load_model(path, train=full.train_filter("q_proj", mcfg))
    for q, k, v in _qkv(model):
        assert not stacked((q, k, v)) and _rows_view([q.weight, k.weight]) is None
        assert q.weight.requires_grad and q.bias.requires_grad and not (k.weight.requires_grad or v.bias.requires_grad)
    ids, targets = _batch(256)
    model(ids, targets=targets, reduction="mean").backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {n for n, _ in trainable_parameters(model)}
    model, _ = load_model(path, train=full.train_filter("q_proj,k_proj,v_proj", mcfg))
    assert all(stacked(qkv) for qkv in _qkv(model))

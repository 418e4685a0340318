"""The training loop: loss normalization (packed = padded, accumulation), fp16 scaling, resume, CLI."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import config
import data
import step
import train
from model import LoRAConfig, load_model, load_tokenizer
from model.lora import lora_parameters
from tests.helpers import read_metrics, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg_for(model_dir, out_dir, **kw):
    base = dict(model=model_dir, out_dir=str(out_dir), max_len=96, batch_size=2, max_steps=4, warmup_steps=1,
                eval_every=0, save_every=0, lr=1e-3, dtype="fp32", device="cpu", kernels=False, log_every=1,
                sample_every=0)
    base.update(kw)
    return config.TrainConfig(**base)


def adapter(out_dir):
    return load_file(os.path.join(out_dir, "adapter", "adapter_model.safetensors"))


def _lora_model(folder, seed=0):
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8), lora_seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # B = 0 at init would hide half the gradient paths
        for n, p in lora_parameters(model):
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _examples(tok, n=5):
    exs = data.builtin_dataset("train")[:n]
    return [data.encode_example(e, tok) for e in exs]


def test_packed_equals_padded(run_model):
    """The same examples give the same loss and LoRA gradients, packed or padded (bug 4)."""
    tok = load_tokenizer(run_model)
    enc = _examples(tok)
    results = []
    for batch in (data.pack(enc, 256, pad_id=tok.pad_id)[0], data.pad_batch(enc, pad_id=tok.pad_id)):
        model = _lora_model(run_model)
        n = data.num_targets(batch)
        loss = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], targets=batch["targets"],
                     num_targets=n)
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in lora_parameters(model)}))
    (l1, g1), (l2, g2) = results
    assert results[0][0].shape == ()
    assert rel_err(l1, l2) < 1e-5, (l1, l2)
    for k in g1:
        assert rel_err(g1[k], g2[k]) < 1e-5, k


def test_packing_without_document_masking_would_differ(run_model):
    """Guard for the test above: dropping doc_ids/position_ids changes the loss, so equality means something."""
    tok = load_tokenizer(run_model)
    enc = _examples(tok)
    rows, _ = data.pack(enc, 256, pad_id=tok.pad_id)
    model = _lora_model(run_model)
    with torch.no_grad():
        good = model(rows["input_ids"], rows["position_ids"], rows["doc_ids"], targets=rows["targets"])
        leaky = model(rows["input_ids"], targets=rows["targets"])
    assert rel_err(leaky, good) > 1e-3


@pytest.mark.parametrize("packing", [True, False])
def test_grad_accumulation_equals_big_batch(run_model, tmp_path, packing):
    """4 micro-batches of 1 row == 1 batch of 4 rows (sequences of different lengths when padded)."""
    a = cfg_for(run_model, tmp_path / "a", batch_size=4, grad_accum=1, max_steps=1, packing=packing, max_len=64)
    b = cfg_for(run_model, tmp_path / "b", batch_size=1, grad_accum=4, max_steps=1, packing=packing, max_len=64)
    train.main(a)
    train.main(b)
    ma, mb = read_metrics(a.out_dir)[0], read_metrics(b.out_dir)[0]
    assert ma["target_tokens"] == mb["target_tokens"]
    assert abs(ma["loss"] - mb["loss"]) < 1e-5 * abs(ma["loss"])
    wa, wb = adapter(a.out_dir), adapter(b.out_dir)
    for k in wa:
        assert rel_err(wb[k], wa[k]) < 1e-5, k


def test_loss_falls_and_accuracy_rises(run_model, tmp_path):
    """Convergence on the embedded dataset: a tiny model learns the answer format in 30 steps."""
    cfg = cfg_for(run_model, tmp_path / "conv", max_steps=30, lr=3e-3, batch_size=4, max_len=128, eval_every=15,
                  eval_batches=4, lora_r=8)
    train.main(cfg)
    m = read_metrics(cfg.out_dir)
    losses = [r["loss"] for r in m if "loss" in r]
    evals = [r for r in m if "eval_loss" in r]
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[-1]["eval_token_accuracy"] > evals[0]["eval_token_accuracy"]
    assert evals[-1]["eval_token_accuracy"] > 10 / 400  # well above uniform chance over the vocabulary


def test_resume_is_bit_exact(run_model, tmp_path):
    """A run resumed from its step-3 checkpoint continues with exactly the same losses."""
    full = cfg_for(run_model, tmp_path / "full", max_steps=6, save_every=3, lora_dropout=0.1)
    train.main(full)
    ref = [r["loss"] for r in read_metrics(full.out_dir) if "loss" in r]
    # Copy the run as it stood at step 3, then resume it.
    import shutil
    part = tmp_path / "part"
    os.makedirs(part / "checkpoints")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-0000003", part / "checkpoints" / "step-0000003")
    resumed = cfg_for(run_model, part, max_steps=6, save_every=3, lora_dropout=0.1, resume="auto")
    train.main(resumed)
    got = [r["loss"] for r in read_metrics(resumed.out_dir) if "loss" in r]
    assert got == ref[3:], (got, ref)


def test_a_resumed_run_pads_short_batches_as_the_uninterrupted_run(run_model, tmp_path, monkeypatch):
    """The CUDA graphs' shortest length bucket (step.shortest_bucket) follows from the run's length in micro-steps
    (--max-steps x --grad-accum), not from the steps left or the batches this process has seen: a resumed run pads
    its batches to the shapes of the uninterrupted run, so its kernels and results are the same."""
    monkeypatch.setattr(step, "SHORT_RUN", 4)
    seen = []

    def shortest_bucket(micro_steps):
        seen.append(step.shortest_bucket(micro_steps))
        return seen[-1]

    monkeypatch.setattr(train, "shortest_bucket", shortest_bucket)
    train.main(cfg_for(run_model, tmp_path / "short", max_steps=4))
    train.main(cfg_for(run_model, tmp_path / "accum", max_steps=2, grad_accum=3))
    train.main(cfg_for(run_model, tmp_path / "full", max_steps=6, save_every=3))
    import shutil
    step3 = os.path.join("checkpoints", "step-0000003")
    shutil.copytree(tmp_path / "full" / step3, tmp_path / "part" / step3)
    train.main(cfg_for(run_model, tmp_path / "part", max_steps=6, save_every=3, resume="auto"))  # 3 steps left
    assert seen == [step.SHORTEST, step.BUCKET, step.BUCKET, step.BUCKET]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ckpt", [True, False], ids=["ckpt", "no-ckpt"])
def test_resume_is_bit_exact_on_gpu(run_model, tmp_path, ckpt):
    """On CUDA (fused AdamW, whose step counters live on the GPU, Triton kernels, bf16, CUDA graphs): a run
    resumed from its step-3 checkpoint continues with exactly the same losses and ends with the same adapter."""
    opts = dict(max_steps=6, save_every=3, lora_dropout=0.1, device="cuda", dtype="bf16", kernels=True,
                gradient_checkpointing=ckpt)
    full = cfg_for(run_model, tmp_path / "full", **opts)
    train.main(full)
    import shutil
    part = tmp_path / "part"
    os.makedirs(part / "checkpoints")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-0000003", part / "checkpoints" / "step-0000003")
    resumed = cfg_for(run_model, part, resume="auto", **opts)
    train.main(resumed)
    ref = [r["loss"] for r in read_metrics(full.out_dir) if "loss" in r]
    assert [r["loss"] for r in read_metrics(resumed.out_dir) if "loss" in r] == ref[3:]
    a, b = adapter(full.out_dir), adapter(resumed.out_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fp16_padded_is_finite_and_scaler_recovers(run_model, tmp_path, monkeypatch):
    """fp16, padding (the path that gave NaN grad norms elsewhere), TinyLlama-shaped: every applied step has
    a finite grad norm; an absurd initial loss scale overflows, is skipped, backs off and recovers (bug 5)."""
    monkeypatch.setattr(train, "choose_dtype", lambda cfg, device: (torch.float16, "test: fp16 on CPU"))
    cfg = cfg_for(run_model, tmp_path / "fp16", packing=False, max_steps=20, loss_scale=2.0 ** 24, lr=1e-3,
                  batch_size=3)
    train.main(cfg)
    m = [r for r in read_metrics(cfg.out_dir) if "loss" in r]
    assert len(m) == 20
    scales = [r["loss_scale"] for r in m]
    assert scales[0] < 2.0 ** 24, "the overflowing first step must be skipped and the scale halved"
    assert m[0]["skipped"]
    applied = [r for r in m if not r["skipped"]]
    assert len(applied) >= 5 and not m[-1]["skipped"], scales  # it recovered: steps are applied again
    for r in applied:
        assert torch.isfinite(torch.tensor(r["grad_norm"])) and torch.isfinite(torch.tensor(r["loss"])), r


def test_cli_end_to_end(run_model, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "train.py", "--model", run_model, "--out-dir", str(out), "--max-steps", "3",
           "--max-len", "96", "--batch-size", "2", "--eval-every", "2", "--save-every", "2", "--device", "cpu"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 3/3 | loss" in r.stdout and "answer accuracy" in r.stdout
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "adapter" / "adapter_config.json").exists()
    assert (out / "checkpoints" / "step-0000003" / "state.json").exists()
    assert (out / "train_config.json").exists()
    rows = read_metrics(str(out))
    assert any("eval_loss" in r for r in rows) and any("grad_norm" in r for r in rows)
    # The help explains every option.
    h = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert "--no-packing" in h.stdout and "--offload-activations" in h.stdout and "--no-kernels" in h.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_start_changes_no_result(run_model, tmp_path, monkeypatch):
    """The warm start beside the loading (step.py, WarmStart) runs in a GPU run and leaves its results as they
    are: the same losses and adapter, bit for bit, as a run without it (LoRA dropout on, so that a draw from the
    run's generator would show)."""
    started = []
    real_start = step.WarmStart.start

    def start(*args, **kw):
        warm = real_start(*args, **kw)
        started.append(warm)
        return warm

    runs = []
    for name, starter in (("with", start), ("without", lambda *a, **k: None)):
        monkeypatch.setattr(step.WarmStart, "start", starter)
        cfg = cfg_for(run_model, tmp_path / name, max_steps=4, lora_dropout=0.1, device="cuda", dtype="bf16",
                      kernels=True)
        train.main(cfg)
        runs.append(([r["loss"] for r in read_metrics(cfg.out_dir) if "loss" in r], adapter(cfg.out_dir)))
    assert started and started[0] is not None and started[0].failed is None
    (loss_a, a), (loss_b, b) = runs
    assert loss_a == loss_b
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["tinyllama", "gemma3"])
def test_warm_start_runs_and_keeps_the_random_state(family, tmp_path):
    """WarmStart runs its one-layer step for every dtype (Gemma 3: a layer of each type), on the device given
    whatever the thread's current device, padded to its bucket or not, and draws nothing from the CPU's or the
    GPU's default generators."""
    from model import read_config
    from tests.tiny_models import save_tiny
    save_tiny(family, str(tmp_path))
    mcfg = read_config(str(tmp_path))
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    batch = data.pad_batch([(list(range(3, 40)), [True] * 37), (list(range(5, 20)), [True] * 15)], pad_id=0)
    for dtype, max_len in ((torch.bfloat16, 128), (torch.float16, None), (torch.float32, 128)):
        cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state(device)
        warm = step.WarmStart.start(mcfg, batch, device, dtype, lora=LoRAConfig(r=4, dropout=0.1), max_len=max_len)
        assert warm is not None
        warm.join()
        assert warm.failed is None, warm.failed
        assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(device), gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", [dict(full=True, lr=1e-4), dict(dora=True), dict(lora_plus_ratio=4.0),
                                     dict(train_embeddings=True, add_tokens="<t1>,<t2>"),
                                     dict(lora_init="pissa", lora_r=4),
                                     dict(full=True, train_modules="q_proj,norm", gradient_checkpointing=True)],
                         ids=["full", "dora", "lora-plus", "embeddings", "pissa", "full-subset-ckpt"])
def test_variants_replay_from_cuda_graphs_as_they_run_eagerly(run_model, tmp_path, variant, capsys):
    """Every trainer variant (--full with its fp32 masters, --dora on the fused path, LoRA+, trainable embeddings
    with new tokens, a PiSSA init) runs on CUDA in bf16 with the Triton kernels, its steps captured into CUDA
    graphs without falling back to eager steps, to the losses of the same run issued eagerly."""
    runs = []
    for graphs in ("on", "off"):
        cfg = cfg_for(run_model, tmp_path / graphs, device="cuda", dtype="bf16", kernels=True, cuda_graphs=graphs,
                      max_steps=5, **variant)
        assert train.main(cfg) == 0
        runs.append([r["loss"] for r in read_metrics(cfg.out_dir) if "loss" in r])
    out = capsys.readouterr().out
    assert "CUDA graphs on" in out and "capture failed" not in out
    graphed, eager = runs
    assert len(graphed) == 5 and all(abs(g - e) <= 2e-2 * abs(e) for g, e in zip(graphed, eager)), (graphed, eager)
    assert graphed[-1] < graphed[0]

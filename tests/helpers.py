"""Shared test helpers."""
import json
import os
import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Triton kernels on CPU tensors run in Triton's interpreter, which tests/conftest.py turns on only where there is no
# CUDA GPU. A test or a parameter that needs it is marked `interpreter`, and skipped on a GPU machine, whose kernel
# tests run on the GPU (tests/test_kernels*.py, `-m gpu`). USE_KERNELS: use_kernels False, then True so marked.
interpreter = pytest.mark.interpreter
USE_KERNELS = [False, pytest.param(True, marks=interpreter)]


def assert_close(actual, expected, atol, rtol, name="tensor"):
    """torch.testing.assert_close on fp32 copies, with the max and mean |difference| in the message."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    a, e = actual.detach().float(), expected.detach().float()
    diff = (a - e).abs()
    stats = (f"{name}: max |diff| {diff.max().item():.3g}, mean |diff| {diff.mean().item():.3g}"
             if diff.numel() else f"{name}: empty")
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False, msg=lambda m: f"{stats}\n{m}")


def rel_err(actual, expected):
    """‖a − b‖ / ‖b‖ in float64 (the absolute norm of the difference when b is zero)."""
    a, b = actual.detach().double(), expected.detach().double()
    den = b.norm()
    return ((a - b).norm() / den).item() if den > 0 else (a - b).norm().item()


def builtin_jsonl(folder, n):
    """A .jsonl file in `folder` of the builtin dataset's first n training examples (Alpaca rows): a run on
    them starts in a fraction of the whole dataset's time. Its path."""
    import data
    path = os.path.join(folder, "small.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in data.builtin_dataset("train")[:n]))
    return path


def refused(argv, capsys, out, match):
    """`train.py argv` stops with exit status 2 and one error line matching `match`, before creating `out`;
    the line."""
    import re

    import train
    assert train.cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(match, err), err
    assert not os.path.exists(out), f"{out} was created"
    return err


def read_metrics(out_dir):
    """The records of a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def randomize_lora_b(model, std=0.05):
    """Random non-zero lora_B (initialized to 0, it would hide every gradient that flows
    through B), the same values for the same parameter name on any device."""
    from model.lora import lora_parameters
    with torch.no_grad():
        for n, p in lora_parameters(model):
            if n.endswith("lora_B"):
                gen = torch.Generator().manual_seed(zlib.crc32(n.encode()))
                p.copy_(torch.randn(p.shape, generator=gen) * std)


# ----------------------------------------------------------------------------- LoRA projections, function level

RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
H, I, R = 48, 80, 4  # function-level shapes: hidden, intermediate, rank
P = 0.25  # LoRA dropout of the function-level tests


def glu(act, use_kernels=False):
    """The gated activation a model with these settings runs (model.transformer.Ops)."""
    from model.transformer import Ops
    return Ops(use_kernels).glu(act)


def make_proj(in_f, out_f, bias, r, dtype, name, seed):
    """A LoRALinear with base weights in `dtype`, fp32 LoRA weights (B nonzero), in train mode."""
    import torch.nn as nn

    from model.lora import LoRAConfig, LoRALinear
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
    return down(glu(act).function(gate(x), up(x)))


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
    """Outputs, dx and LoRA grads of two `run`s agree to dtype's tolerance, in the same dtypes."""
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


# ----------------------------------------------------------------------------- running the scripts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name, *args):
    """`python scripts/<name> args` from the repository root, as a user runs it: the CompletedProcess."""
    import subprocess
    import sys
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


def run_script_here(monkeypatch, name, *args):
    """The same in this process, so that monkeypatches (the hub) hold inside it."""
    import runpy
    import sys
    monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
    runpy.run_path(os.path.join(ROOT, "scripts", name), run_name="__main__")


def refusal_here(monkeypatch, capsys, name, *args):
    """`run_script_here` for input the script refuses (no Python start each): a CompletedProcess-like
    (returncode, stderr) of the one error line and exit status that its `cli.run_tool(main)` gives."""
    import types
    capsys.readouterr()
    try:
        run_script_here(monkeypatch, name, *args)
        code = 0
    except SystemExit as e:
        code = e.code
    return types.SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)


def untimed(rows):
    """metrics.jsonl records without what is measured rather than computed (the rate, the process's memory):
    what two runs of the same computation agree on."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "peak_rss_gib")} for r in rows]


def signal_after_line(argv, prefix, signum, **popen):
    """Run `python -u train.py *argv` from the repository root, send it `signum` once a stdout line starts with
    `prefix`, and let it finish: (exit status, stdout, stderr)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-u", "train.py", *argv], cwd=root, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, **popen)
    for line in p.stdout:
        if line.startswith(prefix):
            p.send_signal(signum)
            break
    stdout, stderr = p.communicate(timeout=120)
    return p.returncode, stdout, stderr


BIT_VIEWS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float8_e4m3fn: torch.uint8}


def assert_bit_equal(actual, expected, name):
    """actual and expected hold the same bits: same shape, same dtype, every value (NaNs included)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{name}: {tuple(actual.shape)} {actual.dtype} != {tuple(expected.shape)} {expected.dtype}")
    differ = actual.view(BIT_VIEWS[actual.dtype]) != expected.view(BIT_VIEWS[expected.dtype])
    assert not differ.any(), (f"{name}: {differ.sum().item()} of {differ.numel()} values differ, e.g. "
                              f"{actual[differ][:4].float().tolist()} for {expected[differ][:4].float().tolist()}")


def frozen_projections(nf4, outs, in_f, r, dtype, device="cpu"):
    """make_proj's projections `outs` ((name, out_features), ...) of one input, no dropout, their base in
    `dtype` or quantized to NF4 (nf4=True)."""
    projs = tuple(make_proj(in_f, o, True, r, dtype, n, i).to(device) for i, (n, o) in enumerate(outs))
    for p in projs:
        p.dropout_p = 0.0
        if nf4:
            from model.qlora import quantize_linear_
            quantize_linear_(p, p.weight)
    return projs


class BaseGemms(TorchDispatchMode):
    """Counts the GEMMs (mm, addmm, linear) that read any of the given weights' storage inside the block."""

    def __init__(self, *weights):
        super().__init__()
        self.storages, self.count = {w.untyped_storage().data_ptr() for w in weights}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("mm", "addmm", "linear") and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages for a in args)
        return func(*args, **(kwargs or {}))

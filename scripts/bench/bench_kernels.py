"""Benchmark every Triton kernel against torch eager and torch.compile of its reference.

Measures forward + backward time (triton.testing.do_bench, median), the GPU kernel time
of one step (the sum of its CUDA kernels in torch.profiler: where it is well below the
do_bench time, the step is bound by the CPU that launches it), and the peak memory the
step allocates (torch.cuda.max_memory_allocated above what was allocated before).
Prints a markdown table; --out writes the rows as JSON. A failing case (compile error,
OOM, ...) is reported in its row and the run goes on.

    python scripts/bench/bench_kernels.py --out bench.json
    python scripts/bench/bench_kernels.py --only rms_norm rope
"""
import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `kernels`, `model`, `scripts`
from kernels.cross_entropy import cross_entropy  # noqa: E402
from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402
from kernels.geglu import geglu  # noqa: E402
from kernels.references import (  # noqa: E402
    cross_entropy_reference,
    fused_linear_cross_entropy_reference,
    geglu_reference,
    rms_norm_reference,
    rope_reference,
    swiglu_reference,
)
from kernels.rms_norm import rms_norm  # noqa: E402
from kernels.rope import apply_rope  # noqa: E402
from kernels.swiglu import swiglu  # noqa: E402
from model.transformer import rope_cos_sin  # noqa: E402
from scripts.bench.harness import cuda_kernel_ms, median_ms, peak_bytes_above  # noqa: E402

MiB = 2**20
BF16 = torch.bfloat16


@dataclass
class Case:
    kernel: str
    shape: str
    make: Callable  # () -> (args tuple, leaves needing grad, kwargs)
    triton_fn: Callable
    reference: Callable


def targets_for(N, V):
    t = torch.randint(0, V, (N,), device="cuda")
    t[torch.rand(N, device="cuda") < 0.1] = -100  # some ignored positions, as in chat fine-tuning
    return t


def ce_case(N, V):
    def make():
        logits = torch.randn(N, V, device="cuda", dtype=BF16, requires_grad=True)
        return (logits, targets_for(N, V)), [logits], {}
    return Case("cross_entropy", f"N={N} V={V} bf16", make, cross_entropy, cross_entropy_reference)


def flce_case(N, H, V, train_weight):
    def make():
        h = torch.randn(N, H, device="cuda", dtype=BF16, requires_grad=True)
        w = (torch.randn(V, H, device="cuda") / H**0.5).to(BF16).requires_grad_(train_weight)
        return (h, w, targets_for(N, V)), [h, w] if train_weight else [h], {"softcap": 30.0}
    which = "W trainable" if train_weight else "W frozen"
    return Case("fused_linear_cross_entropy", f"N={N} H={H} V={V} bf16, {which}", make,
                fused_linear_cross_entropy, fused_linear_cross_entropy_reference)


def rms_case(name, B, T, H, cast, offset):
    def make():
        x = torch.randn(B, T, H, device="cuda", dtype=BF16, requires_grad=True)
        w = torch.randn(H, device="cuda", dtype=BF16, requires_grad=True)
        return (x, w), [x, w], {"offset": offset, "cast": cast}
    return Case("rms_norm", f"{name} ({B},{T},{H}) {cast}", make, rms_norm, rms_norm_reference)


def rope_case(name, B, T, Hq, Hk, D):
    def make():
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=BF16, requires_grad=True)
        k = torch.randn(B, T, Hk, D, device="cuda", dtype=BF16, requires_grad=True)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
        cos, sin = rope_cos_sin(torch.arange(T, device="cuda").expand(B, T), inv_freq, BF16)
        return (q, k, cos, sin), [q, k], {}
    return Case("rope", f"{name} q({B},{T},{Hq},{D}) k({Hk})", make, apply_rope, rope_reference)


def glu_case(kernel, fn, reference, name, B, T, inter, kwargs):
    def make():
        gate = torch.randn(B, T, inter, device="cuda", dtype=BF16, requires_grad=True)
        up = torch.randn(B, T, inter, device="cuda", dtype=BF16, requires_grad=True)
        return (gate, up), [gate, up], kwargs
    return Case(kernel, f"{name} ({B},{T},{inter})", make, fn, reference)


def cases():
    B, T = 4, 2048
    return [
        ce_case(8192, 32000), ce_case(8192, 151936), ce_case(8192, 262144),
        flce_case(8192, 2304, 256000, train_weight=False), flce_case(8192, 2304, 256000, train_weight=True),
        rms_case("TinyLlama", B, T, 2048, "llama", 0.0), rms_case("Gemma-2-2B", B, T, 2304, "gemma", 1.0),
        rope_case("TinyLlama", B, T, 32, 4, 64), rope_case("Gemma-2-2B", B, T, 8, 4, 256),
        glu_case("swiglu", swiglu, swiglu_reference, "TinyLlama", B, T, 5632, {}),
        glu_case("swiglu", swiglu, swiglu_reference, "Gemma-2-2B", B, T, 9216, {}),
        glu_case("geglu", geglu, geglu_reference, "TinyLlama", B, T, 5632, {"approximate": "tanh"}),
        glu_case("geglu", geglu, geglu_reference, "Gemma-2-2B", B, T, 9216, {"approximate": "tanh"}),
    ]


def measure(fn, args, leaves, kwargs):
    """(median ms of forward + backward, its GPU kernel ms, peak MiB allocated by one step above
    the inputs)."""
    out = fn(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]  # one fixed upstream gradient

    def step():
        torch.autograd.backward(fn(*args, **kwargs), grads)

    def clear():
        for t in leaves:
            t.grad = None

    del out, outs
    clear()
    ms = median_ms(step, "cuda", grad_to_none=leaves)
    clear()
    gpu_ms = cuda_kernel_ms(step)
    clear()
    peak = peak_bytes_above(step, "cuda") / MiB
    clear()
    return ms, gpu_ms, peak


def run(case: Case):
    rows = []
    impls = {"triton": case.triton_fn, "torch eager": case.reference,
             "torch.compile": torch.compile(case.reference, dynamic=False)}
    for impl, fn in impls.items():
        row = {"kernel": case.kernel, "shape": case.shape, "impl": impl}
        try:
            args, leaves, kwargs = case.make()
            row["ms"], row["gpu_ms"], row["peak_mib"] = measure(fn, args, leaves, kwargs)
        except Exception as e:  # a broken or out-of-memory case is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            traceback.print_exc(file=sys.stderr)
        finally:
            args = leaves = None
            torch.cuda.empty_cache()
        rows.append(row)
    eager = next((r for r in rows if r["impl"] == "torch eager" and "ms" in r), None)
    for r in rows:
        if eager and "ms" in r:
            r["speedup_vs_eager"] = eager["ms"] / r["ms"]
    return rows


def markdown(rows):
    lines = ["| kernel | shape | impl | fwd+bwd ms | GPU kernel ms | speedup vs eager | peak MiB |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['impl']} | error: {r['error']} | | | |")
        else:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['impl']} | {r['ms']:.3f} | {r['gpu_ms']:.3f} | "
                         f"{r.get('speedup_vs_eager', float('nan')):.2f}x | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the rows as JSON to this path")
    parser.add_argument("--only", nargs="*", help="kernel names to run (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    rows = []
    for case in cases():
        if args.only and case.kernel not in args.only:
            continue
        print(f"{case.kernel} {case.shape} ...", file=sys.stderr, flush=True)
        rows.extend(run(case))
    print(markdown(rows))
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

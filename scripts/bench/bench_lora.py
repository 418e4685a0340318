"""Benchmark one LoRA MLP block, forward + backward: nanotune's fused Function against its
unfused path and against PEFT on transformers' LlamaMLP.

    python scripts/bench/bench_lora.py                        # TinyLlama MLP: hidden 2048, inter 5632,
                                                              # 8192 tokens, bf16, r=16, on the GPU
    python scripts/bench/bench_lora.py --out bench_lora.json  # also write the results as JSON
    python scripts/bench/bench_lora.py --device cpu --hidden 64 --inter 96 --tokens 64   # smoke test

Every case gets the same input x (requires grad, as inside a model) and upstream gradient.
Time is the median of triton.testing.do_bench on CUDA (wall-clock median on CPU). Peak
memory is the most allocated during one forward + backward above what was allocated
before it (inputs, weights): activations saved for backward plus temporaries. On CUDA
nanotune's cases use the Triton SwiGLU kernels; on CPU the torch reference.

PEFT is run as transformers' Trainer runs it with bf16=True: bf16 base weights, fp32
adapter weights, under bf16 autocast. A case that fails is reported with its error and
the others still run.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `kernels`, `model`, `scripts`
from kernels.references import swiglu_reference  # noqa: E402
from model.lora import LoRAConfig, LoRALinear, lora_mlp  # noqa: E402
from model.transformer import Ops  # noqa: E402
from scripts.bench.harness import median_ms, peak_bytes_above  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def nanotune_case(args, fused, nf4=False, dropout=0.0):
    """(forward fn, LoRA params) for nanotune's MLP: gate, up, down LoRALinear."""
    use_kernels = args.device == "cuda"
    lora = LoRAConfig(r=args.r, alpha=2.0 * args.r, dropout=dropout)
    shapes = [("gate_proj", args.hidden, args.inter), ("up_proj", args.hidden, args.inter),
              ("down_proj", args.inter, args.hidden)]
    projs = []
    for name, i, o in shapes:
        m = LoRALinear(i, o, False, lora, name=name).to(args.device)  # fp32 init, as from a checkpoint
        w = m.weight.detach().to(DTYPES[args.dtype])
        if nf4:
            from model.qlora import quantize_linear_
            quantize_linear_(m, w)
        else:
            m.weight = torch.nn.Parameter(w, requires_grad=False)
        with torch.no_grad():
            m.lora_B.normal_(0, 0.01)
        projs.append(m.train())
    gate, up, down = projs
    if fused:
        glu = Ops(use_kernels).glu("silu")
        fn = lambda x: lora_mlp(x, projs, glu)  # noqa: E731
    else:
        if use_kernels:
            from kernels.swiglu import swiglu as act
        else:
            act = swiglu_reference
        fn = lambda x: down(act(gate(x), up(x)))  # noqa: E731
    return fn, [p for m in projs for p in (m.lora_A, m.lora_B)]


def peft_case(args, dropout=0.0):
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    dtype = DTYPES[args.dtype]
    mlp = LlamaMLP(LlamaConfig(hidden_size=args.hidden, intermediate_size=args.inter, hidden_act="silu"))
    mlp = inject_adapter_in_model(LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=dropout,
                                             target_modules=["gate_proj", "up_proj", "down_proj"]), mlp)
    mlp = mlp.to(args.device, dtype).train()
    params = []
    for n, p in mlp.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()  # fp32 adapters, as get_peft_model(autocast_adapter_dtype=True) keeps them
            if "lora_B" in n:
                p.data.normal_(0, 0.01)
            params.append(p)
        else:
            p.requires_grad_(False)

    def fn(x):
        with torch.autocast(args.device, dtype=dtype, enabled=dtype != torch.float32):
            return mlp(x)
    return fn, params


def measure(args, fn, params):
    """(median ms, peak MiB or None) of forward + backward."""
    gen = torch.Generator(device=args.device).manual_seed(0)
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=dtype, generator=gen).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, device=args.device, dtype=dtype, generator=gen)

    def step():
        fn(x).backward(dy)

    to_none = [x] + params
    ms = median_ms(step, args.device, grad_to_none=to_none, warmup_ms=args.warmup, rep_ms=args.rep,
                   cpu_reps=args.cpu_reps)
    for t in to_none:
        t.grad = None
    peak = peak_bytes_above(step, args.device)
    return ms, None if peak is None else peak / 2 ** 20


CASES = {
    "nanotune fused": lambda a: nanotune_case(a, fused=True),
    "nanotune unfused": lambda a: nanotune_case(a, fused=False),
    "peft": lambda a: peft_case(a),
    "nanotune fused dropout=0.1": lambda a: nanotune_case(a, fused=True, dropout=0.1),
    "nanotune unfused dropout=0.1": lambda a: nanotune_case(a, fused=False, dropout=0.1),
    "peft dropout=0.1": lambda a: peft_case(a, dropout=0.1),
    "nanotune fused nf4": lambda a: nanotune_case(a, fused=True, nf4=True),
    "nanotune unfused nf4": lambda a: nanotune_case(a, fused=False, nf4=True),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (TinyLlama: 2048)")
    ap.add_argument("--inter", type=int, default=5632, help="MLP intermediate size (TinyLlama: 5632)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step, B*T")
    ap.add_argument("--r", type=int, default=16, help="LoRA rank")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation and base weight dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of: {', '.join(CASES)}")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=200, help="do_bench measuring time, ms")
    ap.add_argument("--cpu-reps", type=int, default=5, help="repetitions on CPU")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {list(CASES)}")

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = []
    for name in args.cases.split(","):
        row = {"case": name, "ms": None, "peak_mib": None, "error": None}
        try:
            torch.manual_seed(0)
            fn, params = CASES[name](args)
            row["ms"], row["peak_mib"] = measure(args, fn, params)
        except Exception as e:  # one broken case (e.g. peft not installed) must not stop the others
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            fn = params = None
            if args.device == "cuda":
                torch.cuda.empty_cache()
        results.append(row)
        print(f"{name}: {row}", file=sys.stderr)

    print(f"\nLoRA MLP forward+backward on {device_name}: hidden {args.hidden}, intermediate {args.inter}, "
          f"{args.tokens} tokens, {args.dtype}, r={args.r}\n")
    base = next((r["ms"] for r in results if r["case"] == "peft" and r["ms"]), None)
    print("| case | ms (median) | vs peft | peak MiB |")
    print("|---|---:|---:|---:|")
    for r in results:
        if r["error"]:
            print(f"| {r['case']} | error: {r['error'][:80]} | | |")
            continue
        speed = f"{base / r['ms']:.2f}x" if base else "-"
        mem = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        print(f"| {r['case']} | {r['ms']:.2f} | {speed} | {mem} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "config": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

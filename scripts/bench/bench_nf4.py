"""NF4 dequantization of one fused projection group, three ways, and the FP8 kernels, on the 7-9B shapes.

    python scripts/bench/bench_nf4.py                 # every group of llama-3.1-8b, qwen2.5-7b, gemma-2-9b
    python scripts/bench/bench_nf4.py --out nf4.json

For each group of projections that share an input (q|k|v, gate|up; down alone), the time to make its packed
[Σout, in] bf16 weight from NF4 with double-quantized absmax (triton.testing.do_bench, median):

  bitsandbytes + cat   each weight by bitsandbytes' `dequantize_4bit`, then concatenated (the fused LoRA path
                       before the kernel: dequantized weights written twice)
  bitsandbytes rows    each weight by `dequantize_4bit(..., out=)` into its rows of one buffer
  triton rows          each weight by kernels/nf4_dequantize.py into its rows of one buffer (the fused LoRA path)

and the triton rows' effective bandwidth: the bytes it must move (0.5 B of codes read and 2 B written a value,
plus the absmax codes and scales) over its time. Every way's values are checked bit-equal to bitsandbytes' first.

Then the FP8 kernels of `--fp8` (model/fp8.py) on the same groups, each checked bit-equal to its reference:
kernels/nf4_to_fp8.py making the group's e4m3 W (rows) and Wᵀ (transposed), one launch a group with the scales'
reciprocals taken once, as model/fp8.py runs it. Each is timed called from Python (eager: the launch's host
time, which a small group's kernel does not cover) and replayed from a CUDA graph (the GPU's time, as a step in
train.py's CUDA graphs sees it); GB/s over the graph's time. Then the activations of a
2 × 2048-token batch quantized as the fp8 GEMMs read them: x and dY row-major with a scale per token
(kernels/fp8_quantize.py); the MLP's H and [dG | dU], stored transposed, with one scale for the tensor (its
amax, then kernels/fp8_quantize_tensor.py: what model/fp8.py runs), and beside it with a scale per token (the
row-wise kernel reading across the strided dimension). GB/s over the bytes each must move: NF4 in, 1 B out a
value; x in, 1 B out a value, x read twice for one scale per tensor (amax, then quantize).
"""
import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`, `scripts`
from kernels.fp8_quantize import fp8_quantize_rows  # noqa: E402
from kernels.fp8_quantize_tensor import fp8_quantize_tensor  # noqa: E402
from kernels.nf4_to_fp8 import nf4_to_fp8  # noqa: E402
from kernels.references import (  # noqa: E402
    E4M3,
    fp8_quantize_rows_reference,
    fp8_quantize_tensor_reference,
    fp8_reciprocal,
    nf4_to_fp8_reference,
)
from model.qlora import NF4Weight  # noqa: E402
from scripts.bench.bench_qlora import model_config  # noqa: E402
from scripts.bench.harness import median_ms  # noqa: E402

SHAPES = ("llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b")
TOKENS = 4096  # the activations' rows: 2 × 2048


def groups(shape):
    """(name, [(out, in)] of the group's projections) of one layer of `shape`."""
    c = model_config(shape, smoke=False)
    H, q, kv = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return [("q|k|v", [(q, H), (kv, H), (kv, H)]), ("gate|up", [(c.intermediate_size, H)] * 2),
            ("down", [(H, c.intermediate_size)])]


def bench_group(shapes):
    weights = [NF4Weight(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    rows = torch.tensor([0] + [s[0] for s in shapes]).cumsum(0).tolist()
    buffer = torch.empty(rows[-1], shapes[0][1], device="cuda", dtype=torch.bfloat16)

    def into_rows(kernel):
        for w, a, b in zip(weights, rows, rows[1:]):
            w.dequantize(out=buffer[a:b], kernel=kernel)
        return buffer

    ways = {"bitsandbytes + cat": lambda: torch.cat([w.dequantize(kernel=False) for w in weights]),
            "bitsandbytes rows": lambda: into_rows(False), "triton rows": lambda: into_rows(True)}
    expected = ways["bitsandbytes + cat"]().clone()
    result = {}
    for name, fn in ways.items():
        if not torch.equal(fn().view(torch.int16), expected.view(torch.int16)):
            raise AssertionError(f"{name}: values differ from bitsandbytes'")
        result[name] = median_ms(fn, "cuda")
    moved = sum(sum(b.numel() * b.element_size() for b in w.buffers()) for w in weights) + buffer.numel() * 2
    result["triton GB/s"] = moved / result["triton rows"] / 1e6
    return result


def replayed(fn):
    """fn captured once in a CUDA graph (after a warm-up call that compiles its kernels): its replay."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # a capture begins on a side stream that has run its work once
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_fp8_weights(shapes):
    """(eager ms, graph ms, GB/s) for the group's e4m3 W [Σout, in], then for Wᵀ [in, Σout]."""
    weights = [NF4Weight(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    rows = torch.tensor([0] + [s[0] for s in shapes]).cumsum(0).tolist()
    total, K = rows[-1], shapes[0][1]
    group = [(w.data(), w.shape) for w in weights]

    def reference(scale, transposed):
        parts = [nf4_to_fp8_reference(w.data(), w.shape, scale if transposed else scale[a:b], transposed)
                 for w, a, b in zip(weights, rows, rows[1:])]
        return torch.cat(parts, 1 if transposed else 0)

    result = []
    for transposed in (False, True):
        out = torch.empty((K, total) if transposed else (total, K), dtype=E4M3, device="cuda")
        scale = torch.rand(K if transposed else total, device="cuda") * 0.05 + 0.01
        convert = partial(nf4_to_fp8, group, fp8_reciprocal(scale), out, transposed)
        if not torch.equal(convert().view(torch.uint8), reference(scale, transposed).view(torch.uint8)):
            raise AssertionError(f"nf4_to_fp8 (transposed={transposed}): values differ from the reference")
        eager, graph = median_ms(convert, "cuda"), median_ms(replayed(convert), "cuda")
        moved = sum(sum(b.numel() * b.element_size() for b in w.buffers()) for w in weights) + out.numel()
        result += [eager, graph, moved / graph / 1e6]
    return result


QUANTIZE = {"token": (fp8_quantize_rows, fp8_quantize_rows_reference, 3),  # (kernel, reference, bytes a value)
            "tensor": (fp8_quantize_tensor, fp8_quantize_tensor_reference, 5)}


def bench_fp8_quantize(width, transposed, scales):
    """(ms, GB/s) of quantizing a [TOKENS, width] bf16 activation, row-major or stored transposed, with one scale
    per token or per tensor (`scales`)."""
    x = torch.randn(width, TOKENS, device="cuda", dtype=torch.bfloat16).t() if transposed else \
        torch.randn(TOKENS, width, device="cuda", dtype=torch.bfloat16)
    kernel, reference, moved = QUANTIZE[scales]
    q, s = kernel(x)
    q_ref, s_ref = reference(x)
    if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)):
        raise AssertionError(f"{kernel.__name__} {tuple(x.shape)}: values differ from the reference")
    ms = median_ms(lambda: kernel(x), "cuda")
    return ms, x.numel() * moved / ms / 1e6


def activations(shape):
    """(name, width, stored transposed) of the activations one layer's fp8 GEMMs quantize."""
    c = model_config(shape, smoke=False)
    H, I, qkv = c.hidden_size, c.intermediate_size, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return [("x (q|k|v, gate|up), dY (o, down)", H, False), ("dY (q|k|v)", qkv, False), ("H (down)", I, True),
            ("[dG | dU] (gate|up)", 2 * I, True)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the rows as JSON to this path")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_nf4.py needs a CUDA GPU")
    print("| shape | group | bitsandbytes + cat ms | bitsandbytes rows ms | triton rows ms | triton GB/s |\n"
          "|---|---|---:|---:|---:|---:|", flush=True)
    out = []
    for shape in SHAPES:
        for group, shapes in groups(shape):
            r = {"shape": shape, "group": group, **bench_group(shapes)}
            out.append(r)
            print(f"| {shape} | {group} | {r['bitsandbytes + cat']:.3f} | {r['bitsandbytes rows']:.3f} | "
                  f"{r['triton rows']:.3f} | {r['triton GB/s']:.0f} |", flush=True)
    print("\n| shape | group | nf4→fp8 W eager ms | graph ms | GB/s | nf4→fp8 Wᵀ eager ms | graph ms | GB/s |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    fp8 = []
    for shape in SHAPES:
        for group, shapes in groups(shape):
            times = bench_fp8_weights(shapes)
            fp8.append({"shape": shape, "group": group, **dict(zip(
                ("W eager ms", "W graph ms", "W GB/s", "Wt eager ms", "Wt graph ms", "Wt GB/s"), times))})
            print(f"| {shape} | {group} | " + " | ".join(f"{t:.0f}" if i % 3 == 2 else f"{t:.3f}"
                                                         for i, t in enumerate(times)) + " |", flush=True)
    print(f"\n| shape | activation [{TOKENS}, width] | width | layout | one scale per | quantize ms | GB/s |\n"
          "|---|---|---:|---|---|---:|---:|", flush=True)
    for shape in SHAPES:
        for name, width, transposed in activations(shape):
            for scales in ("tensor", "token") if transposed else ("token",):  # the first: what model/fp8.py runs
                ms, gbs = bench_fp8_quantize(width, transposed, scales)
                fp8.append({"shape": shape, "activation": name, "width": width, "transposed": transposed,
                            "scales": scales, "ms": ms, "GB/s": gbs})
                print(f"| {shape} | {name} | {width} | {'transposed' if transposed else 'rows'} | {scales} | "
                      f"{ms:.3f} | {gbs:.0f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out, "fp8": fp8}, indent=1))


if __name__ == "__main__":
    main()

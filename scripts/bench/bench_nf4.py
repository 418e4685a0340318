"""NF4 dequantization of one fused projection group, three ways, on the 7-9B shapes.

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
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`, `scripts`
from model.qlora import NF4Weight  # noqa: E402
from scripts.bench.bench_qlora import model_config  # noqa: E402
from scripts.bench.harness import median_ms  # noqa: E402

SHAPES = ("llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b")


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
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()

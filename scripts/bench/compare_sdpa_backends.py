"""Attention kernels on nanotune training steps: for plain causal rows, the SDPA backend order that
model/transformer.py uses (CAUSAL_BACKENDS: cuDNN first) against flash first; for padded rows, flash
attention's variable-length kernels (what bf16 takes, `DocumentMask`) against a dense mask (what
`--dtype fp32` or a GPU without flash would take, SDPA's memory-efficient kernel).

    python scripts/bench/compare_sdpa_backends.py /tmp/nanotune-bench/tinyllama [more checkpoint folders]

Cases, bf16, LoRA r=16 on all projections, Triton kernels on:
  causal      batch 4 x 2048 random ids, no mask (the bench's step), checkpointing off and on
  padded      batch 4, each step a new length T in [150, 400]: one row of T tokens, the others
              of [T/2, T], right-padded to T with the padding a document of its own, as
              `train.py --no-packing` makes them

Each step is replayed from CUDA graphs, as train.py runs it, so the CPU cost of a backend's
call does not count, only its kernels. Reports the median of 10 steps after 3 warm-up steps,
real (unpadded) tokens per second, and which attention kernels ran. The order is switched by
rewriting the list model.transformer.CAUSAL_BACKENDS in place, the padded path by switching the
model's `varlen` test off, with a new step (new graphs) for each.
"""
import os
import sys
from itertools import repeat
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`, `scripts`
import model.transformer as transformer  # noqa: E402
from scripts.bench.harness import fixed_batch, gpu_folders, nanotune_step, padded_batches, time_steps  # noqa: E402

NANOTUNE = list(transformer.CAUSAL_BACKENDS)
FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
VARLEN = transformer.Transformer.varlen


def padded_lengths(rng, B=4):
    T = rng.randint(150, 400)
    return [T] + [rng.randint(T // 2, T) for _ in range(B - 1)]


def main():
    cases = [("off", "causal", "cuDNN first (nanotune)", NANOTUNE, True),
             ("off", "causal", "flash first", FLASH_FIRST, True),
             ("on", "causal", "cuDNN first (nanotune)", NANOTUNE, True),
             ("on", "causal", "flash first", FLASH_FIRST, True),
             ("on", "padded", "flash varlen (nanotune)", NANOTUNE, True),
             ("on", "padded", "dense mask", NANOTUNE, False)]
    for folder in gpu_folders(__doc__, "compare_sdpa_backends.py"):
        for ckpt, case, variant, order, varlen in cases:
            transformer.CAUSAL_BACKENDS[:] = order
            transformer.Transformer.varlen = VARLEN if varlen else (lambda self, device, dtype: False)
            name = f"{case} 4x{'2048' if case == 'causal' else '[150,400]'} ckpt {ckpt}"
            step = nanotune_step(folder, "cuda", ckpt, cuda_graphs="on")
            batches = (repeat(fixed_batch(step.vocab_size, 4, 2048, "cuda")) if case == "causal"
                       else padded_batches(step.vocab_size, padded_lengths, "cuda"))
            r = time_steps(step, batches, warmup=3, steps=10, device="cuda")
            eager = nanotune_step(folder, "cuda", ckpt)  # a replay shows no aten calls: which kernel runs
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                eager(next(batches))
            kernels = sorted({e.key.removeprefix("aten::_") for e in prof.key_averages()
                              if e.key.startswith("aten::_") and e.key.endswith("attention_forward")})
            print(f"{os.path.basename(folder)} {name} | {variant}: median {r['median_step_s'] * 1e3:.1f} ms,"
                  f" {r['tokens_per_s']:,.0f} tok/s | {', '.join(kernels)}", flush=True)
            del step, eager
            torch.cuda.empty_cache()
        transformer.CAUSAL_BACKENDS[:] = NANOTUNE
        transformer.Transformer.varlen = VARLEN


if __name__ == "__main__":
    main()

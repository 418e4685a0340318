"""Profile one nanotune LoRA training step on the GPU: where the time goes, and peak memory.

    python scripts/bench/profile_step.py /tmp/nanotune-bench/tinyllama
        [--ckpt off|on|on+offload] [--batch 4 --seqlen 2048]

The folder is a random-init checkpoint such as scripts/bench/bench.py builds. Prints the
step time (median after 3 warm-up steps), peak memory and torch.profiler's top CUDA kernels
for two profiled steps.
"""
import argparse
import sys
from itertools import repeat
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`, `scripts`
from scripts.bench.harness import CKPT_MODES, fixed_batch, nanotune_step, time_steps  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--ckpt", default="on", choices=CKPT_MODES)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps (the median is printed)")
    p.add_argument("--rows", type=int, default=30, help="profiler table rows")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: profile_step.py needs a CUDA GPU")
    step = nanotune_step(a.folder, "cuda", a.ckpt)
    batch = fixed_batch(step.vocab_size, a.batch, a.seqlen, "cuda")
    r = time_steps(step, repeat(batch), warmup=3, steps=a.steps, device="cuda")
    print(f"ckpt {a.ckpt}: step {r['median_step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, "
          f"peak {r['peak_mem_bytes'] / 2**30:.2f} GiB")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(batch)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()

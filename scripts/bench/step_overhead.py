"""Is a nanotune training step bound by the GPU or by the CPU that issues its work?

    python scripts/bench/step_overhead.py /tmp/nanotune-bench/tinyllama [more checkpoint folders]

For each folder (a random-init checkpoint such as scripts/bench/bench.py builds), at batch 1 x 64
tokens (almost no GPU work: the step time is the CPU's) and at batch 4 x 2048, with
checkpointing off and on, prints:

  step        median wall time of 10 steps (after 3 warm-up steps), synchronized
  CPU issue   how long Python takes to launch forward, backward and the optimizer step,
              each measured from an idle GPU without a final synchronize
  GPU kernel  the sum of the CUDA kernel times of one step (torch.profiler)

A step much longer than its GPU kernel time, with CPU issue close to the step, is CPU-bound:
fewer, larger kernels or less Python per layer will speed it up; faster kernels will not.
"""
import os
import sys
import time
from functools import partial
from itertools import repeat
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`, `scripts`
from scripts.bench.harness import cuda_kernel_ms, fixed_batch, gpu_folders, nanotune_step, time_steps  # noqa: E402


def issue_ms(step, batch):
    """(forward, backward, optimizer) CPU issue times in ms, each started from an idle GPU."""
    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t) * 1e3

    loss, fwd = timed(lambda: step.loss(batch))
    _, bwd = timed(loss.backward)
    _, opt = timed(lambda: (step.optimizer.step(), step.optimizer.zero_grad(set_to_none=True)))
    return fwd, bwd, opt


def main():
    for folder in gpu_folders(__doc__, "step_overhead.py"):
        for ckpt in ("off", "on"):
            step = nanotune_step(folder, "cuda", ckpt)
            for B, T in ((1, 64), (4, 2048)):
                batch = fixed_batch(step.vocab_size, B, T, "cuda")
                ms = time_steps(step, repeat(batch), warmup=3, steps=10, device="cuda")["median_step_s"] * 1e3
                fwd, bwd, opt = issue_ms(step, batch)
                gpu = cuda_kernel_ms(partial(step, batch))
                print(f"{os.path.basename(folder)} {B}x{T} ckpt {ckpt}: step {ms:.1f} ms | "
                      f"CPU issue fwd {fwd:.1f} + bwd {bwd:.1f} + opt {opt:.1f} ms | GPU kernel {gpu:.1f} ms",
                      flush=True)
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

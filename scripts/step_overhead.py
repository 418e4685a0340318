"""Is a nanotune training step bound by the GPU or by the CPU that issues its work?

    python scripts/step_overhead.py /tmp/nanotune-bench/tinyllama [more checkpoint folders]

For each folder (a random-init checkpoint such as scripts/bench.py builds), at batch 1 x 64
tokens (almost no GPU work: the step time is the CPU's) and at batch 4 x 2048, with
checkpointing off and on, prints:

  step        median wall time of 10 steps (after 3 warm-up steps), synchronized
  CPU issue   how long Python takes to launch forward, backward and the optimizer step,
              each measured from an idle GPU without a final synchronize
  GPU kernel  the sum of the CUDA kernel times of one step (torch.profiler)

A step much longer than its GPU kernel time, with CPU issue close to the step, is CPU-bound:
fewer, larger kernels or less Python per layer will speed it up; faster kernels will not.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import LoRAConfig, load_model  # noqa: E402
from model.lora import lora_parameters  # noqa: E402


def measure(model, opt, ids, targets):
    def step():
        model(ids, targets=targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    issue = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    loss = model(ids, targets=targets)
    issue.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    t = time.perf_counter()
    loss.backward()
    issue.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    t = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    issue.append(time.perf_counter() - t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    return statistics.median(times) * 1e3, [s * 1e3 for s in issue], gpu


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+")
    a = p.parse_args()
    for folder in a.folders:
        model, cfg = load_model(folder, dtype=torch.bfloat16, device="cuda", lora=LoRAConfig(r=16, alpha=16),
                                use_kernels=True)
        model.train()
        opt = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-4)
        for B, T in ((1, 64), (4, 2048)):
            ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
            targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
            for ckpt in (False, True):
                model.gradient_checkpointing = ckpt
                ms, (fwd, bwd, step), gpu = measure(model, opt, ids, targets)
                print(f"{os.path.basename(folder)} {B}x{T} ckpt {'on' if ckpt else 'off'}: step {ms:.1f} ms | "
                      f"CPU issue fwd {fwd:.1f} + bwd {bwd:.1f} + opt {step:.1f} ms | GPU kernel {gpu:.1f} ms",
                      flush=True)
        del model, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Profile one nanotune LoRA training step on the GPU: where the time goes, and peak memory.

    python scripts/profile_step.py /tmp/nanotune-bench/tinyllama [--ckpt off|on|on+offload] [--batch 4 --seqlen 2048]

The folder is a random-init checkpoint such as scripts/bench.py builds. Prints the
step time, peak memory and torch.profiler's top CUDA kernels for two profiled steps.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import LoRAConfig, load_model  # noqa: E402
from model.lora import lora_parameters  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--ckpt", default="on", choices=["off", "on", "on+offload"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=30, help="profiler table rows")
    a = p.parse_args()
    model, cfg = load_model(a.folder, dtype=torch.bfloat16, device="cuda", lora=LoRAConfig(r=16, alpha=16),
                            use_kernels=True)
    model.gradient_checkpointing = a.ckpt != "off"
    model.offload_activations = a.ckpt == "on+offload"
    model.train()
    params = [p for _, p in lora_parameters(model)]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seqlen), device="cuda")
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def step():
        loss = model(ids, targets=targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    ms = sorted(times)[len(times) // 2] * 1e3
    tok = a.batch * a.seqlen
    print(f"ckpt {a.ckpt}: step {ms:.1f} ms, {tok / ms * 1e3:,.0f} tokens/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()

"""The SDPA backend order that model/transformer.py uses (SDPA_BACKENDS: flash, memory-efficient,
cuDNN, math) against torch's own (cuDNN first on H100), on nanotune training steps.

    python scripts/compare_sdpa_backends.py /tmp/nanotune-bench/tinyllama [more checkpoint folders]

Cases, bf16, LoRA r=16 on all projections, Triton kernels on:
  causal      batch 4 x 2048 random ids, no mask (the bench's step), checkpointing off and on
  padded      batch 4, each step a new length in [150, 400]; rows right-padded to it, the
              padding a document of its own (a dense mask), as `train.py --no-packing` makes them

Reports the median of 10 steps after 3 warm-up steps, and which attention kernels ran.
The order is switched by rewriting the list model.transformer.SDPA_BACKENDS in place.
"""
import argparse
import os
import random
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model.transformer as transformer  # noqa: E402
from model import LoRAConfig, load_model  # noqa: E402
from model.lora import lora_parameters  # noqa: E402

ORDERS = {"torch default (cuDNN first)": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                          SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
          "nanotune (flash first)": list(transformer.SDPA_BACKENDS)}


def causal_batch(V, B=4, T=2048):
    ids = torch.randint(0, V, (B, T), device="cuda")
    return ids, None, None, torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def padded_batch(V, B=4):
    T = random.randint(150, 400)
    ids, _, _, targets = causal_batch(V, B, T)
    lengths = [T] + [random.randint(T // 2, T) for _ in range(B - 1)]
    pos = torch.zeros(B, T, dtype=torch.long)
    doc = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        pos[b, :n], pos[b, n:], doc[b, n:] = torch.arange(n), torch.arange(T - n), 1
        targets[b, n - 1:] = -100
    return ids, pos.cuda(), doc.cuda(), targets


def step(model, opt, batch):
    ids, pos, doc, targets = batch
    model(ids, pos, doc, targets=targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+")
    a = p.parse_args()
    random.seed(0)
    for folder in a.folders:
        model, cfg = load_model(folder, dtype=torch.bfloat16, device="cuda", lora=LoRAConfig(r=16, alpha=16),
                                use_kernels=True)
        model.train()
        opt = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-4)
        cases = [("causal 4x2048 ckpt off", False, causal_batch), ("causal 4x2048 ckpt on", True, causal_batch),
                 ("padded 4x[150,400] ckpt on", True, padded_batch)]
        for name, ckpt, make in cases:
            model.gradient_checkpointing = ckpt
            for order_name, order in ORDERS.items():
                transformer.SDPA_BACKENDS[:] = order
                times, tokens = [], 0
                for i in range(13):
                    batch = make(cfg.vocab_size)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    step(model, opt, batch)
                    torch.cuda.synchronize()
                    if i >= 3:
                        times.append(time.perf_counter() - t)
                        tokens += batch[0].numel()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    step(model, opt, make(cfg.vocab_size))
                kernels = sorted({e.key.removeprefix("aten::_") for e in prof.key_averages()
                                  if e.key.startswith("aten::_") and e.key.endswith("attention_forward")})
                print(f"{os.path.basename(folder)} {name} | {order_name}: median {statistics.median(times) * 1e3:.1f} ms,"
                      f" {tokens / sum(times):,.0f} tok/s | {', '.join(kernels)}", flush=True)
        transformer.SDPA_BACKENDS[:] = ORDERS["nanotune (flash first)"]
        del model, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

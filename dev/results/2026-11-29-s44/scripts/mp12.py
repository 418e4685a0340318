"""What is allocated at the peak of a graphed NF4 QLoRA step of a bench_qlora.py shape (its nanotune case): the
allocator's trace from before the model is built, replayed to the moment of most bytes allocated, and the live
blocks then grouped by the first frames of ours in their stack. The form of dev/results/2026-11-27-s25-h100/scripts/mempeak.py."""
import collections, os, sys
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config

shape, size, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
B, T = map(int, size.split("x"))
dev = torch.device("cuda")
torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
step = harness.nanotune_step(model_config(shape, False), dev, ckpt, quantize="nf4", cuda_graphs="on")
print(f"after build {torch.cuda.memory_allocated() / 2**20:.1f} MiB", flush=True)
b = harness.fixed_batch(step.vocab_size, B, T, dev)
for _ in range(4):
    step(b)
torch.cuda.synchronize()
print(f"{shape} {size} {ckpt}: max_memory_allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB", flush=True)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
events = snap["device_traces"][0]
live, total, best, best_live, best_i = {}, 0, 0, None, 0
def where(frames):
    ours = [f for f in frames if f["filename"].endswith(".py") and "/site-packages/" not in f["filename"]
            and "/lib/python3" not in f["filename"] and "/tmp/site" not in f["filename"]]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in ours[:4]) or "?"
for i, e in enumerate(events):
    if e["action"] == "alloc":
        live[e["addr"]] = (e["size"], e["frames"])
        total += e["size"]
        if total > best:
            best, best_live, best_i = total, dict(live), i
    elif e["action"] == "free_completed" and e["addr"] in live:
        total -= live.pop(e["addr"])[0]
print(f"replayed peak {best / 2**20:.1f} MiB at event {best_i} of {len(events)}")
print("the allocation that made the peak:", where(events[best_i]["frames"]), events[best_i]["size"] / 2**20, "MiB")
groups, counts = collections.Counter(), collections.Counter()
for size, frames in best_live.values():
    k = where(frames)
    groups[k] += size
    counts[k] += 1
for k, v in groups.most_common(40):
    print(f"{v / 2**20:9.2f} MiB {counts[k]:5d}x  {k}")

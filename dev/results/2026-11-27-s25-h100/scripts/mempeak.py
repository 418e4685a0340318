"""What is allocated at the peak of a graphed SmolLM2-135M 8 x 512 on+offload step (bench.py's nanotune case):
the allocator's trace from before the model is built, replayed to the moment of most bytes allocated, and the live
blocks then grouped by the first frame of ours in their stack."""
import collections, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench import SHAPES
from model.config import from_hf_config

shape, size, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
B, T = map(int, size.split("x"))
s = SHAPES[shape]
cfg = from_hf_config({**s.sizes, "architectures": [s.config_class.replace("Config", "ForCausalLM")]}, shape)
dev = torch.device("cuda")
torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
step = harness.nanotune_step(cfg, dev, ckpt, cuda_graphs="on")
b = harness.fixed_batch(step.vocab_size, B, T, dev)
for _ in range(4):
    step(b)
torch.cuda.synchronize()
print(f"{shape} {size} {ckpt}: max_memory_allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB", flush=True)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
events = snap["device_traces"][0]
live, total, best, best_live = {}, 0, 0, None
def where(frames):
    ours = [f for f in frames if f["filename"].endswith(".py") and "/site-packages/" not in f["filename"]
            and "/lib/python3" not in f["filename"]]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in ours[:3]) or "?"
for e in events:
    if e["action"] == "alloc":
        live[e["addr"]] = (e["size"], e["frames"])
        total += e["size"]
        if total > best:
            best, best_live = total, dict(live)
    elif e["action"] == "free_completed" and e["addr"] in live:
        total -= live.pop(e["addr"])[0]
print(f"replayed peak {best / 2**20:.1f} MiB over {len(events)} events")
groups = collections.Counter()
counts = collections.Counter()
for size, frames in best_live.values():
    k = where(frames)
    groups[k] += size
    counts[k] += 1
for k, v in groups.most_common(30):
    print(f"{v / 2**20:9.2f} MiB {counts[k]:5d}x  {k}")

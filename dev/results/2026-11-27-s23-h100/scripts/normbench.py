"""DoRA's norms of Qwen2.5-0.5B's 24 layers in one launch (kernels/dora_norm.py NormsTable, rank 16, bf16): the
tree's tiles (launch_config) against merge_config's (32 rows, 128 columns) and two more. Median of 20 launches (CUDA
events) after 3 warm-ups; max relative difference of inv to the tree's."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch
from kernels.dora_norm import NormsTable, _dora_norms_table_kernel, NUM_WARPS

dev, dt, r = torch.device("cuda"), torch.bfloat16, 16
layer = [((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)]
groups = []
for ends_sizes, fin in layer * 24:
    ends, acc = [], 0
    for s in ends_sizes:
        acc += s; ends.append(acc)
    groups.append((torch.randn(acc, fin, device=dev).to(dt), torch.randn(len(ends) * r, fin, device=dev) * 0.1,
                   torch.randn(acc, r, device=dev) * 0.1, torch.rand(acc, device=dev) + 0.5, ends, 2.0))
total = sum(g[0].numel() for g in groups)


def timed(fn):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); fn(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


table = NormsTable(groups)
ms = timed(table)
want = torch.cat([inv for _, inv in table()])
print(f"tree {table.config}: {ms:.3f} ms, {2 * total / ms / 1e9:.2f} TB/s", flush=True)
for bo, bi in ((32, 128), (32, 64), (64, 64), (16, 128)):
    t = NormsTable(groups)
    t.config = dict(BLOCK_O=bo, BLOCK_I=bi, BLOCK_R=16)
    blocks = []
    for n, (w, a, b, m, ends, _) in enumerate(groups):
        for begin, end in zip([0, *ends[:-1]], ends):
            blocks += [[n, f] for f in range(begin, end, bo)]
    t.blocks = torch.tensor(blocks, dtype=torch.int32, device=dev)
    ms = timed(t)
    got = torch.cat([inv for _, inv in t()])
    print(f"O{bo} I{bi}: {ms:.3f} ms, {2 * total / ms / 1e9:.2f} TB/s, max rel diff "
          f"{((got - want) / want).abs().max().item():.3g}", flush=True)

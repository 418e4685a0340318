"""The rollout's merge (kernels/dora_norm.py MergeTable) at Qwen2.5-0.5B's shapes (24 layers: q|k|v, o, gate|up,
down; rank 16; bf16): the tree's kernel against variants with alignment hints and wider column steps. Median of 20
launches (CUDA events) after 3 warm-ups; outputs compared with the tree's."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from kernels.dora_norm import MergeTable, NUM_WARPS, _rows, _table_program


@triton.jit
def _variant(groups_ptr, blocks_ptr, scales_ptr, out_ptr, ALIGNED: tl.constexpr, BLOCK_O: tl.constexpr,
             BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    group, first, w_ptr, a_ptr, b_ptr, m_addr, offset, IN, R, member, end = _table_program(groups_ptr, blocks_ptr,
                                                                                           out_ptr)
    if ALIGNED:
        w_ptr = tl.multiple_of(w_ptr, 16)
        a_ptr = tl.multiple_of(a_ptr, 16)
        IN = tl.multiple_of(IN, 16)
        offset = tl.multiple_of(offset, 16)
    _rows(w_ptr, a_ptr, b_ptr, m_addr.to(tl.pointer_type(tl.float32)), out_ptr, out_ptr, out_ptr + offset,
          first, end, member, IN, R, tl.load(scales_ptr + group), m_addr != 0, True, BLOCK_O, BLOCK_I, BLOCK_R)


dev, dt, r = torch.device("cuda"), torch.bfloat16, 16
shapes = [((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)] * 24
total = sum(sum(o) * i for o, i in shapes)
out = torch.empty(total, dtype=dt, device=dev)
members, start = [], 0
for outs, fin in shapes:
    w = torch.randn(sum(outs), fin, device=dev).to(dt)
    a = torch.randn(len(outs) * r, fin, device=dev) * 0.01
    b = torch.randn(sum(outs), r, device=dev) * 0.01
    first = 0
    for j, rows in enumerate(outs):
        view = out[start:start + rows * fin].view(rows, fin)
        members.append((w[first:first + rows], a[j * r:(j + 1) * r], b[first:first + rows], None, view, 2.0))
        first, start = first + rows, start + rows * fin
table = MergeTable(out, members)
nbytes = 2 * 2 * total  # W read, W' written (A, B small)


def timed(fn):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); fn(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


ms = timed(table)
want = out.clone()
print(f"tree: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, config {table.config}", flush=True)
for aligned in (False, True):
    for block_i in (32, 64, 128):
        cfg = dict(table.config, BLOCK_I=block_i)
        fn = lambda: _variant[(len(table.blocks),)](table.groups, table.blocks, table.scales, out, ALIGNED=aligned,
                                                    **cfg, num_warps=NUM_WARPS)
        out.zero_()
        ms = timed(fn)
        print(f"aligned={aligned} BLOCK_I={block_i}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, "
              f"equal {torch.equal(out, want)}", flush=True)

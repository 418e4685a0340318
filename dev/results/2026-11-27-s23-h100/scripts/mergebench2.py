"""The rollout's merge (kernels/dora_norm.py MergeTable) at Qwen2.5-0.5B's shapes (24 layers, rank 16, bf16): the
tree's kernel against variants of its merge-only body: the dot with W as accumulator (MODE 0) or added after it
(MODE 1), at tf32x3 or tf32, or the rank's outer products as fp32 FMAs (MODE 2); tiles and warps swept. Median of
20 launches (CUDA events) after 3 warm-ups; max |difference| to the tree's output."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from kernels.dora_norm import MergeTable, _table_program


@triton.jit
def _merge_var(groups_ptr, blocks_ptr, scales_ptr, out_ptr, MODE: tl.constexpr, PREC: tl.constexpr,
               BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    group, first, w_ptr, a_ptr, b_ptr, m_addr, offset, IN, R, member, end = _table_program(groups_ptr, blocks_ptr,
                                                                                           out_ptr)
    scale = tl.load(scales_ptr + group)
    rows = first + tl.arange(0, BLOCK_O)
    row_mask = rows < end
    ks = tl.arange(0, BLOCK_R)
    k_mask = ks < R
    w_rows = w_ptr + rows[:, None].to(tl.int64) * IN
    out_rows = out_ptr + offset + rows[:, None].to(tl.int64) * IN
    a_rows = a_ptr + (member * R + ks)[:, None].to(tl.int64) * IN
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * R + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                other=0.0) * scale
    for start in range(0, IN, BLOCK_I):
        cols = start + tl.arange(0, BLOCK_I)
        col_mask = cols < IN
        m2 = row_mask[:, None] & col_mask[None, :]
        w = tl.load(w_rows + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if MODE == 2:
            for r in tl.static_range(BLOCK_R):
                bc = tl.load(b_ptr + rows.to(tl.int64) * R + r, mask=row_mask & (r + 0 * rows < R), other=0.0) * scale
                ar = tl.load(a_ptr + (member * R + r).to(tl.int64) * IN + cols, mask=col_mask & (r + 0 * cols < R), other=0.0)
                w += bc[:, None] * ar[None, :]
            v = w
        else:
            a = tl.load(a_rows + cols[None, :], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if MODE == 0:
                v = tl.dot(b, a, acc=w, input_precision=PREC)
            else:
                v = w + tl.dot(b, a, input_precision=PREC)
        tl.store(out_rows + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=m2)


dev, dt, r = torch.device("cuda"), torch.bfloat16, 16
shapes = [((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)] * 24
total = sum(sum(o) * i for o, i in shapes)
out = torch.empty(total, dtype=dt, device=dev)
members, start = [], 0
for outs, fin in shapes:
    w = torch.randn(sum(outs), fin, device=dev).to(dt)
    a = torch.randn(len(outs) * r, fin, device=dev) * 0.1
    b = torch.randn(sum(outs), r, device=dev) * 0.1
    first = 0
    for j, rows in enumerate(outs):
        view = out[start:start + rows * fin].view(rows, fin)
        members.append((w[first:first + rows], a[j * r:(j + 1) * r], b[first:first + rows], None, view, 2.0))
        first, start = first + rows, start + rows * fin
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


table = MergeTable(out, members)
ms = timed(table)
want = out.float().clone()
print(f"tree: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, config {table.config}", flush=True)
for mode, prec in ((0, "tf32x3"), (0, "tf32"), (1, "tf32x3"), (1, "tf32"), (2, "ieee")):
    for bo, bi, warps, stages in ((64, 32, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 4, 3),
                                  (32, 64, 4, 4), (16, 128, 4, 3)):
        t2 = MergeTable(out, members)
        t2.config = dict(BLOCK_O=bo, BLOCK_I=bi, BLOCK_R=16)
        t2.blocks = torch.tensor([[n, f] for n, (w, *_) in enumerate(members) for f in range(0, w.shape[0], bo)],
                                 dtype=torch.int32, device=dev)
        fn = lambda: _merge_var[(len(t2.blocks),)](t2.groups, t2.blocks, t2.scales, out, MODE=mode, PREC=prec,
                                                   BLOCK_O=bo, BLOCK_I=bi, BLOCK_R=16, num_warps=warps,
                                                   num_stages=stages)
        out.zero_()
        try:
            ms = timed(fn)
        except Exception as e:
            print(f"mode {mode} {prec} O{bo} I{bi} w{warps} s{stages}: failed {str(e)[:100]}", flush=True)
            continue
        d = (out.float() - want).abs().max().item()
        print(f"mode {mode} {prec} O{bo} I{bi} w{warps} s{stages}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, "
              f"max diff {d:.3g}", flush=True)

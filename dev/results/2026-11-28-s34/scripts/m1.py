"""Session 34: the rollout's merge (kernels/dora_norm.py MergeTable, LoRA r 16, bf16, W separate from out) at
Qwen2.5-0.5B's and Qwen3-4B's shapes: the tree's launch against variants of its merge body: tiles, warps and
stages; W's next tile loaded before the current tile's dot (PREFETCH); programs of COLS column tiles each (a 2-D
grid, 0: the whole row). Median of 20 launches (CUDA events) after 3; max |difference| to the tree's output.
NCU=shape: one launch of the tree, for Nsight Compute."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from kernels.dora_norm import MergeTable


@triton.jit
def _merge_v(groups_ptr, blocks_ptr, scales_ptr, out_ptr, PREFETCH: tl.constexpr, COLS: tl.constexpr,
             OFFS32: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    block = blocks_ptr + tl.program_id(0) * 3
    group = tl.load(block)
    first = tl.load(block + 1)
    col0 = tl.load(block + 2)
    row = groups_ptr + group.to(tl.int64) * 10
    w_ptr = tl.load(row).to(tl.pointer_type(out_ptr.dtype.element_ty))
    a_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    b_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    offset = tl.load(row + 4)
    OUT = tl.load(row + 5).to(tl.int32)
    IN = tl.load(row + 6).to(tl.int32)
    R = tl.load(row + 7).to(tl.int32)
    scale = tl.load(scales_ptr + group)
    rows = first + tl.arange(0, BLOCK_O)
    row_mask = rows < OUT
    ks = tl.arange(0, BLOCK_R)
    k_mask = ks < R
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * R + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                other=0.0) * scale
    if OFFS32:  # one 64-bit base a program, 32-bit offsets within its rows
        w_base = w_ptr + first.to(tl.int64) * IN
        out_base = out_ptr + offset + first.to(tl.int64) * IN
        tile = tl.arange(0, BLOCK_O)[:, None] * IN
        a_tile = ks[:, None] * IN
        w_rows = w_base + tile
        out_rows = out_base + tile
        a_rows = a_ptr + a_tile
    else:
        w_rows = w_ptr + rows[:, None].to(tl.int64) * IN
        out_rows = out_ptr + offset + rows[:, None].to(tl.int64) * IN
        a_rows = a_ptr + ks[:, None].to(tl.int64) * IN
    stop = IN if COLS == 0 else tl.minimum(IN, col0 + COLS * BLOCK_I)
    if PREFETCH:
        cols = col0 + tl.arange(0, BLOCK_I)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & (cols < stop)[None, :], other=0.0)
        for start in range(col0, stop, BLOCK_I):
            cols = start + tl.arange(0, BLOCK_I)
            col_mask = cols < stop
            ncols = cols + BLOCK_I
            w_next = tl.load(w_rows + ncols[None, :], mask=row_mask[:, None] & (ncols < stop)[None, :], other=0.0)
            a = tl.load(a_rows + cols[None, :], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            v = tl.dot(b, a, acc=w.to(tl.float32), input_precision="tf32x3")
            tl.store(out_rows + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
            w = w_next
    else:
        for start in range(col0, stop, BLOCK_I):
            cols = start + tl.arange(0, BLOCK_I)
            col_mask = cols < stop
            w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            a = tl.load(a_rows + cols[None, :], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            v = tl.dot(b, a, acc=w, input_precision="tf32x3")
            tl.store(out_rows + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


SHAPES = {  # one layer's packed groups: ((rows of each member), in)
    "qwen2.5-0.5b": ([((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)], 24),
    "qwen3-4b": ([((4096, 1024, 1024), 2560), ((2560,), 4096), ((9728, 9728), 2560), ((2560,), 9728)], 36),
}
dev, dt, r = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16, 16


def build(name):
    layer, n = SHAPES[name]
    shapes = layer * n
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
    return out, members, 2 * 2 * total


def timed(fn):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); fn(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


if __name__ != "__main__":
    pass
elif os.environ.get("NCU"):
    out, members, _ = build(os.environ["NCU"])
    t = MergeTable(out, members)
    for _ in range(3):
        t()
    torch.cuda.synchronize()
    sys.exit()

VARIANTS = [  # (BLOCK_O, BLOCK_I, warps, stages, PREFETCH, COLS); call 3: the prefetching body's tiles
    (32, 128, 4, 3, 1, 0), (32, 64, 4, 3, 1, 0), (32, 64, 4, 2, 1, 0), (32, 64, 2, 3, 1, 0), (16, 128, 4, 3, 1, 0),
    (16, 128, 2, 3, 1, 0), (32, 128, 4, 2, 1, 0), (64, 64, 4, 3, 1, 0), (32, 128, 8, 3, 1, 0),
] if os.environ.get("CALL") == "3" else [
    (32, 128, 4, 3, 0, 0), (32, 128, 4, 1, 0, 0), (32, 128, 4, 2, 0, 0), (32, 128, 4, 4, 0, 0),
    (32, 128, 2, 3, 0, 0), (32, 128, 8, 3, 0, 0), (32, 256, 4, 3, 0, 0), (32, 256, 8, 3, 0, 0),
    (64, 128, 4, 3, 0, 0), (64, 128, 8, 3, 0, 0), (16, 256, 4, 3, 0, 0), (16, 128, 2, 3, 0, 0),
    (32, 128, 4, 3, 1, 0), (32, 128, 4, 1, 1, 0), (32, 256, 4, 1, 1, 0), (64, 128, 4, 1, 1, 0), (16, 256, 2, 1, 1, 0),
    (32, 128, 4, 3, 0, 2), (32, 128, 4, 3, 0, 4), (32, 128, 4, 1, 1, 4), (64, 128, 4, 1, 1, 2), (64, 64, 4, 3, 0, 4),
]
for name in (sys.argv[1:] or list(SHAPES)) if __name__ == "__main__" else []:
    out, members, nbytes = build(name)
    table = MergeTable(out, members)
    ms = timed(table)
    want = out.float().clone()
    print(f"{name} tree: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, config {table.config}, {sum(len(b) for b in table.blocks.values())} programs",
          flush=True)
    for bo, bi, warps, stages, pre, cols in VARIANTS:
        blocks = []
        for n, (w, *_) in enumerate(members):
            step = w.shape[1] if cols == 0 else cols * bi
            blocks += [[n, f, c] for f in range(0, w.shape[0], bo) for c in range(0, w.shape[1], step)]
        blocks = torch.tensor(blocks, dtype=torch.int32, device=dev)
        fn = lambda: _merge_v[(len(blocks),)](table.groups, blocks, table.scales, out, PREFETCH=pre, COLS=cols, OFFS32=0,
                                              BLOCK_O=bo, BLOCK_I=bi, BLOCK_R=16, num_warps=warps, num_stages=stages)
        out.zero_()
        try:
            ms = timed(fn)
        except Exception as e:
            print(f"  O{bo} I{bi} w{warps} s{stages} pre{pre} cols{cols}: failed {str(e)[:160]}", flush=True)
            continue
        d = (out.float() - want).abs().max().item()
        print(f"  O{bo} I{bi} w{warps} s{stages} pre{pre} cols{cols}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, "
              f"{len(blocks)} programs, max diff {d:.3g}", flush=True)
    del out, members, table
    torch.cuda.empty_cache()

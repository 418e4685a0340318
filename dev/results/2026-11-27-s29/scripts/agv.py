"""Session 29: variants of kernels/adapter_grads.py's loop (the q product chained through tl.dot's accumulator, and
issued before dB's), timed against the tree's kernel and cuBLAS at Qwen2.5-7B's and Llama-3.1-8B's MLPs (N 4096,
bf16, r 16). NCU=V: run variant V three times (for Nsight Compute)."""
import importlib, os, statistics, sys
sys.path.insert(0, os.getcwd())
import torch
import kernels.adapter_grads as ag
from kernels.references import adapter_grads_reference

SRC = open("kernels/adapter_grads.py").read()
DB = "        db = _dot(d, p, DTYPE, OPERAND, PRECISION)  # (BLOCK_F, R)\n"
ST = ("        tl.store(db_ptr + (token_block.to(tl.int64) * M * OUT + features[:, None]) * R + ranks[None, :], db,\n"
      "                 mask=feature_mask[:, None])\n")
Q = "        q += _dot(tl.trans(d), b, DTYPE, OPERAND, PRECISION)  # (BLOCK_T, R)\n"
QACC = "        q = tl.dot(tl.trans(d).to(OPERAND), b.to(DTYPE).to(OPERAND), q, input_precision=PRECISION)\n"
assert DB + ST + Q in SRC
VARIANTS = {"v0": SRC, "v1": SRC.replace(Q, QACC), "v2": SRC.replace(DB + ST + Q, QACC + DB + ST)}
mods = {}
for k, src in VARIANTS.items():
    path = f".gpu/agv_{k}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"agv_{k}", path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[k] = m
dev = torch.device("cuda")


def timed(fn, reps=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def inputs(I, N, r):
    F = 2 * I
    rows = torch.randn(F + 2 * r, N, device=dev).to(torch.bfloat16)
    p = torch.randn(N, 2 * r, device=dev).to(torch.bfloat16)
    b = torch.zeros(F, 2 * r, device=dev, dtype=torch.bfloat16)
    b[:I, :r] = torch.randn(I, r, device=dev); b[I:, r:] = torch.randn(I, r, device=dev)
    return F, rows, p, b


if os.environ.get("NCU"):
    F, rows, p, b = inputs(18944, 4096, 16)
    for _ in range(3):
        mods[os.environ["NCU"]].adapter_grads(rows[:F], p, b, 1.0, 16, rows[F:])
    torch.cuda.synchronize()
    sys.exit()
print(torch.cuda.get_device_name(), torch.__version__)
for name, I in (("qwen2.5-7b", 18944), ("llama-3.1-8b", 14336)):
    N, r = 4096, 16
    F, rows, p, b = inputs(I, N, r)
    dy = rows[:F].t()

    def cublas():
        dyb = torch.addmm(dy.new_empty(N, 2 * r), dy, b, beta=0, alpha=1.0)
        torch.mm(dy[:, :I].t(), p[:, :r], out_dtype=torch.float32)
        torch.mm(dy[:, I:].t(), p[:, r:], out_dtype=torch.float32)
        rows[F:] = dyb.t()

    q_ref = torch.empty(2 * r, N, dtype=torch.float64, device=dev)
    db_ref, _ = adapter_grads_reference(rows[:F].double(), p.double(), b.double(), 1.0, r, q_ref)
    out = [f"cuBLAS {timed(cublas):.1f}"]
    for rep in range(2):
        for k, m in mods.items():
            db, _ = m.adapter_grads(rows[:F], p, b, 1.0, r, rows[F:])
            e_db = ((db.double() - db_ref).abs().max() / db_ref.abs().max()).item()
            e_q = ((rows[F:].double() - q_ref).abs().max() / q_ref.abs().max()).item()
            out.append(f"{k} {timed(lambda: m.adapter_grads(rows[:F], p, b, 1.0, r, rows[F:])):.1f} us (dB {e_db:.1e} Q {e_q:.1e})")
    print(name, "; ".join(out), flush=True)

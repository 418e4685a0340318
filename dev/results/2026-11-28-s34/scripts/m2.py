"""Session 34, calls 2-3: kernels/dora_norm.py with W's next tile loaded before each dot (the tree) against HEAD's
(.mid), one process, alternating: MergeTable at Qwen2.5-0.5B's and Qwen3-4B's shapes (LoRA r 16, bf16), the same
with DoRA's m (Qwen2.5-0.5B), and NormsTable (DoRA's norms, Qwen2.5-0.5B). Median of 20 launches (CUDA events)
after 3, three rounds; outputs compared (equal expected: the same arithmetic)."""
import importlib.util, os, statistics, sys
sys.path.insert(0, os.getcwd())
import torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


new, old = load("kernels/dora_norm.py", "dn_new"), load(".mid/kernels/dora_norm.py", "dn_old")
SHAPES = {
    "qwen2.5-0.5b": ([((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)], 24),
    "qwen3-4b": ([((4096, 1024, 1024), 2560), ((2560,), 4096), ((9728, 9728), 2560), ((2560,), 9728)], 36),
}
dev, dt, r = torch.device("cuda"), torch.bfloat16, 16


def timed(fn):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); fn(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def merge_case(name, dora):
    layer, n = SHAPES[name]
    total = sum(sum(o) * i for o, i in layer * n)
    out = torch.empty(total, dtype=dt, device=dev)
    members, start = [], 0
    for outs, fin in layer * n:
        w = torch.randn(sum(outs), fin, device=dev).to(dt)
        a = torch.randn(len(outs) * r, fin, device=dev) * 0.1
        b = torch.randn(sum(outs), r, device=dev) * 0.1
        m = torch.rand(sum(outs), device=dev) + 0.5
        first = 0
        for j, rows in enumerate(outs):
            view = out[start:start + rows * fin].view(rows, fin)
            members.append((w[first:first + rows], a[j * r:(j + 1) * r], b[first:first + rows],
                            m[first:first + rows] if dora else None, view, 2.0))
            first, start = first + rows, start + rows * fin
    return out, (old.MergeTable(out, members), new.MergeTable(out, members)), 4 * total


def norms_case(name):
    layer, n = SHAPES[name]
    groups, total = [], 0
    for ends_sizes, fin in layer * n:
        ends, acc = [], 0
        for s in ends_sizes:
            acc += s; ends.append(acc)
        groups.append((torch.randn(acc, fin, device=dev).to(dt), torch.randn(len(ends) * r, fin, device=dev) * 0.1,
                       torch.randn(acc, r, device=dev) * 0.1, torch.rand(acc, device=dev) + 0.5, ends, 2.0))
        total += acc * fin
    return old.NormsTable(groups), new.NormsTable(groups), 2 * total


for case in (("merge", "qwen2.5-0.5b", False), ("merge", "qwen3-4b", False), ("merge dora", "qwen2.5-0.5b", True),
             ("norms", "qwen2.5-0.5b", None)):
    kind, name, dora = case
    if kind == "norms":
        t_old, t_new, nbytes = norms_case(name)
        a = [g.float().clone() for g, _ in sum([[x] for x in t_old()], [])]
        bnew = [g.float() for g, _ in t_new()]
        same = max(((x - y).abs() / x.abs().clamp_min(1e-30)).max().item() for x, y in zip(a, bnew))
        fns = (t_old, t_new)
    else:
        out, (t_old, t_new), nbytes = merge_case(name, dora)
        t_old(); want = out.clone(); out.zero_(); t_new()
        same = torch.equal(out, want)
        fns = (t_old, t_new)
    res = {"old": [], "new": []}
    for _ in range(3):
        for tag, fn in zip(("old", "new"), fns):
            res[tag].append(timed(fn))
    print(f"{kind} {name}: old {', '.join(f'{x:.3f}' for x in res['old'])} ms ({nbytes / min(res['old']) / 1e9:.2f} "
          f"TB/s), new {', '.join(f'{x:.3f}' for x in res['new'])} ms ({nbytes / min(res['new']) / 1e9:.2f} TB/s); "
          f"outputs equal: {same}", flush=True)
    torch.cuda.empty_cache()

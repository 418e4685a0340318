"""Session 34, call 4: NormsTable (DoRA's norms) of HEAD (.mid) and the tree against the float64 reference on the
GPU, at Qwen2.5-0.5B's 24 layers (r 16, bf16): the largest relative error of g and inv, and where."""
import importlib.util, os, sys
sys.path.insert(0, os.getcwd())
import torch
from kernels.references import dora_norms_reference


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


new, old = load("kernels/dora_norm.py", "dn_new"), load(".mid/kernels/dora_norm.py", "dn_old")
dev, dt, r = torch.device("cuda"), torch.bfloat16, 16
torch.manual_seed(0)
groups = []
for sizes, fin in [((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)] * 24:
    ends, acc = [], 0
    for s in sizes:
        acc += s; ends.append(acc)
    groups.append((torch.randn(acc, fin, device=dev).to(dt), torch.randn(len(ends) * r, fin, device=dev) * 0.1,
                   torch.randn(acc, r, device=dev) * 0.1, torch.rand(acc, device=dev) + 0.5, ends, 2.0))
for tag, mod in (("old", old), ("new", new), ("old", old), ("new", new)):
    res = mod.NormsTable(groups)()
    worst_g = worst_i = (0.0, None)
    for n, (group, (g, inv)) in enumerate(zip(groups, res)):
        ref_g, ref_inv = dora_norms_reference(*(t.double() for t in group[:4]), *group[4:], torch.float64)
        eg = ((g.double() - ref_g) / ref_g).abs()
        ei = ((inv.double() - ref_inv) / ref_inv).abs()
        if eg.max().item() > worst_g[0]:
            worst_g = (eg.max().item(), (n, eg.argmax().item(), g[eg.argmax()].item(), ref_g[eg.argmax()].item()))
        if ei.max().item() > worst_i[0]:
            worst_i = (ei.max().item(), (n, ei.argmax().item()))
    print(f"{tag}: g's largest relative error {worst_g}, inv's {worst_i}", flush=True)

"""Session 34, call 6: m2.py's norms comparison reported the tree's NormsTable unequal to HEAD's on the GPU while
n1.py found both at the same error against float64: m2's comparison again, element by element, with the
reference, five calls of each table (a race would differ between calls)."""
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
groups = []
for sizes, fin in [((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)] * 24:
    ends, acc = [], 0
    for s in sizes:
        acc += s; ends.append(acc)
    groups.append((torch.randn(acc, fin, device=dev).to(dt), torch.randn(len(ends) * r, fin, device=dev) * 0.1,
                   torch.randn(acc, r, device=dev) * 0.1, torch.rand(acc, device=dev) + 0.5, ends, 2.0))
t_old, t_new = old.NormsTable(groups), new.NormsTable(groups)
outs = {"old": [], "new": []}
for _ in range(5):
    for tag, t in (("old", t_old), ("new", t_new)):
        outs[tag].append(torch.cat([g.float() for g, _ in t()]))
ref = torch.cat([dora_norms_reference(*(x.double() for x in grp[:4]), *grp[4:], torch.float64)[0] for grp in groups])
for tag in ("old", "new"):
    runs = outs[tag]
    print(tag, "calls equal among themselves:", all(torch.equal(runs[0], x) for x in runs[1:]),
          "max rel err vs float64:", max(((x.double() - ref) / ref).abs().max().item() for x in runs))
d = (outs["old"][0] - outs["new"][0]).abs()
print("old vs new: equal", torch.equal(outs["old"][0], outs["new"][0]), "differing elements", int((d > 0).sum()),
      "of", d.numel(), "max |diff|", d.max().item())
i = int(d.argmax())
print("at", i, "old", outs["old"][0][i].item(), "new", outs["new"][0][i].item(), "ref", ref[i].item())

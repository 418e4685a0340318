"""train.py's run under torch.profiler (CUDA kernels), `active` steps after the `skip` first ones: the top kernels."""
import sys
import torch
sys.path.insert(0, ".")
import train  # noqa: E402
import step as step_module  # noqa: E402
from config import parse_args  # noqa: E402

skip, active = int(sys.argv[1]), int(sys.argv[2])
cfg = parse_args(sys.argv[3:])
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
calls = {"n": 0}
orig = step_module.GraphStep.__call__


def counted(self, *a, **k):
    calls["n"] += 1
    if calls["n"] == skip + 1:
        torch.cuda.synchronize()
        prof.start()
    if calls["n"] == skip + active + 1:
        torch.cuda.synchronize()
        prof.stop()
    return orig(self, *a, **k)


step_module.GraphStep.__call__ = counted
train.main(cfg)
print(f"profiled {active} steps (micro-step {skip + 1} to the optimizer step before micro-step {skip + active + 1})")
print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90))

"""train.py's run under torch.profiler (CUDA kernels): the top kernels of a whole short run."""
import sys
import torch
sys.path.insert(0, ".")
import train  # noqa: E402
from config import parse_args  # noqa: E402

cfg = parse_args(sys.argv[1:])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    train.main(cfg)
print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))

"""Data parallelism across processes (torchrun), and the collectives that keep every rank on the same path.

    with distributed(cfg, device_name) as (rank, world, device): ...
    if any_rank(flag, world, device): ...        # every rank takes the branch if one wants it
    n = sum_over_ranks(n, world, device)          # a count (the step's target tokens) over all ranks

With one process (no torchrun) rank is 0, world is 1, and the collectives return their input.
"""
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def distributed(cfg, name):
    """(rank, world_size, device) of this process; `name` is config.pick_device's. torchrun sets
    RANK/LOCAL_RANK/WORLD_SIZE and the process group lives until the run ends; otherwise one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield 0, 1, torch.device(name)
        return
    local = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        yield dist.get_rank(), world, torch.device(f"cuda:{local}" if use_cuda else "cpu")
    finally:
        dist.destroy_process_group()


def any_rank(flag, world, device):
    """`flag` or-ed over the ranks, so that all of them take the same branch (and meet in the same collectives)."""
    if world == 1:
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t)
    return bool(t)


def sum_over_ranks(x, world, device):
    """An int summed over the ranks (every rank joins, even one that adds 0); a tensor is summed in place."""
    if world == 1:
        return x
    if torch.is_tensor(x):
        dist.all_reduce(x)
        return x
    t = torch.tensor(x, device=device)
    dist.all_reduce(t)
    return int(t)


def gather(obj, world):
    """[the obj of every rank], by rank."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out

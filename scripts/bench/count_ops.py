"""Count the work-launching ops of one LoRA or DoRA training step on the CPU: a proxy for the kernels a small
model's step launches on the GPU, where each costs its launch (a few µs, even replayed from a CUDA graph).

    python scripts/bench/count_ops.py [--layers 2] [--top 0]

Builds a random-init tiny Llama (transformers), loads it with nanotune (fused LoRA, fp32), and profiles one
forward + backward of a fixed batch with torch.profiler, with and without gradient checkpointing, LoRA and DoRA.
An op counts when it is an outermost aten op (none of its ancestors is one) and it, or an op it calls, does work:
views, allocations and no-op casts launch nothing, so they are not counted. --top N prints the N most frequent
ops of each run.
"""
import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`
from model import LoRAConfig, load_model  # noqa: E402

NO_WORK = {  # ops that launch no kernel by themselves (views, allocations, no-op casts)
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
    "aten::slice", "aten::select", "aten::narrow", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
    "aten::expand", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::detach",
    "aten::alias", "aten::lift_fresh", "aten::empty", "aten::new_empty", "aten::empty_like", "aten::empty_strided",
    "aten::to",     "aten::contiguous", "aten::numpy_T", "aten::view_as", "aten::resolve_conj", "aten::resolve_neg",
    "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::set_",
    "aten::requires_grad_", "aten::_has_compatible_shallow_copy_type", "aten::detach_", "aten::flatten",
}


def tiny_llama(folder, layers):
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)


def work_ops(prof):
    """Names of the outermost aten ops that do work (see the module docstring), in order."""
    events = prof.events()
    names = []
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            nested = nested or parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if nested:
            continue
        stack, works = [e], False
        while stack and not works:
            op = stack.pop()
            works = op.name.startswith("aten::") and op.name not in NO_WORK
            stack.extend(op.cpu_children)
        if works:
            names.append(e.name)
    return names


def count(folder, dora, checkpointing):
    lora = LoRAConfig(r=8, alpha=16.0, dora=dora)
    model, _ = load_model(folder, lora=lora, gradient_checkpointing=checkpointing, use_kernels=False)
    model.train()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:  # as the eager step leaves them (zero_grad(set_to_none=True)): no accumulation kernels
            p.grad = None
        model(ids, targets=ids).backward()

    step()  # warm-up: lazy state is built outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return work_ops(prof)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--top", type=int, default=0, help="print the N most frequent ops of each run")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tiny_llama(folder, a.layers)
        print(f"{'':8}{'no checkpointing':>18}{'checkpointing':>15}")
        for name, dora in (("LoRA", False), ("DoRA", True)):
            runs = [count(folder, dora, ckpt) for ckpt in (False, True)]
            print(f"{name:8}{len(runs[0]):>18}{len(runs[1]):>15}")
            for ckpt, ops in zip(("off", "on"), runs):
                for op, n in collections.Counter(ops).most_common(a.top):
                    print(f"    {name} ckpt {ckpt}: {n:4} {op}")


if __name__ == "__main__":
    main()

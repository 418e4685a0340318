"""Count the ops one decoding step launches: the top-level aten ops of one one-token forward through a static KV
cache (the step a `GroupSampler` replays as a CUDA graph), on CPU in bf16, a proxy for the GPU's kernels.

    python scripts/bench/decode_ops.py [--layers 2] [--rows 16] [--r 16] [--kernels]

A decoding step of a small model replays one graph whose time is about its kernel count times a few µs, so the
count predicts the rollout's time (dev/perf-notes.md). Counted: the aten ops that no other aten op called, less
those that launch no work (views, reshapes, transposes, aliases, detach, a cast or contiguous() that returns its
input). Printed for the adapter path and the merged path (`MergedAdapters`), per layer (what a model of
2 × --layers layers launches more than one of --layers, divided by --layers: a step may fuse the end of one layer
with the start of the next) and for the whole step, with the op names of one layer and of the rest of the step. By
default the torch references run in place of the Triton kernels that a CUDA model uses (rms_norm, rope, the gated
activation): each of those is one kernel on the GPU where the reference is several ops here. --kernels runs
the model a CUDA GPU runs (the kernels, the decoding step's own path) in Triton's interpreter, and counts each
launch as one op (`triton::<kernel>`), not the interpreter's bookkeeping ops inside it.
"""
import argparse
import collections
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
if "--kernels" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before any kernel module is imported
from model import LoRAConfig, load_model  # noqa: E402
from model.generate import DecodeGraph, KVCache  # noqa: E402
from model.lora import MergedAdapters  # noqa: E402

NO_WORK = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::as_strided",
           "aten::alias", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::slice", "aten::select",
           "aten::expand", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow", "aten::permute",
           "aten::_unsafe_view", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::new_empty",
           "aten::empty_like", "aten::resolve_conj",
           "aten::resolve_neg", "aten::result_type", "aten::promote_types",
           "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"}
COPY_IF_NEEDED = {"aten::to", "aten::type_as", "aten::contiguous"}  # work only where they call a copy


def tiny_llama(folder, layers):
    """A random-init bf16 Llama checkpoint with grouped kv heads, saved by transformers (a measuring tool's
    dependency, as in bench.py)."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)


def is_op(name):
    return name.startswith(("aten::", "triton::"))


@contextlib.contextmanager
def triton_launches():
    """Inside the block, each launch of a Triton kernel in the interpreter runs in a `triton::<kernel>` profiler
    range, seen from a profile hook on the interpreter's launch (its GridExecutor call)."""
    from triton.runtime.interpreter import GridExecutor
    launch, ranges = GridExecutor.__call__.__code__, []

    def hook(frame, event, arg):
        if frame.f_code is launch and event == "call":
            ranges.append(record_function(f"triton::{frame.f_locals['self'].fn.__name__}").__enter__())
        elif frame.f_code is launch and event == "return":
            ranges.pop().__exit__(None, None, None)
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


def top_level(events):
    """The name of each top-level aten op or Triton launch that launches work."""
    out = []
    for e in events:
        if not is_op(e.name) or e.name in NO_WORK:
            continue
        if e.name in COPY_IF_NEEDED and not e.cpu_children:  # returned its input
            continue
        parent = e.cpu_parent
        while parent is not None and not is_op(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            out.append(e.name)
    return out


def count(model, rows, merged, kernels):
    """Counter of the top-level ops of one decoding step by name."""
    cache = KVCache(model.config, rows, 32, torch.bfloat16, "cpu")
    decode = DecodeGraph(model, cache, first=torch.zeros(rows, dtype=torch.long), graphed=False)
    with torch.no_grad(), (merged or contextlib.nullcontext()):
        decode(1, 0)  # the static cache is set up by the first call
        with profile(activities=[ProfilerActivity.CPU]) as prof, (triton_launches() if kernels else
                                                                  contextlib.nullcontext()):
            decode(2, 1)
    return collections.Counter(top_level(prof.events()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=16, help="rows decoded together (P x G)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank, on every projection")
    p.add_argument("--kernels", action="store_true", help="the Triton kernels (in the interpreter without a GPU), "
                   "each launch counted as one op")
    args = p.parse_args()
    models = []
    for layers in (args.layers, 2 * args.layers):
        with tempfile.TemporaryDirectory() as folder:
            tiny_llama(folder, layers)
            model, _ = load_model(folder, dtype=torch.bfloat16, lora=LoRAConfig(r=args.r, alpha=args.r),
                                  use_kernels=args.kernels)
        models.append(model.eval())
    n = args.layers
    for name, merged in (("adapter path", False), ("merged path", True)):
        counts = []
        for model in models:
            block = MergedAdapters(model) if merged else None
            if block is not None and not block.groups:
                break
            counts.append(count(model, args.rows, block, args.kernels))
        if len(counts) < 2:
            print(f"{name}: not taken here")
            continue
        one_layer = collections.Counter({k: (counts[1][k] - counts[0][k]) // n for k in counts[1]})
        outside = counts[0] - collections.Counter({k: v * n for k, v in one_layer.items()})
        print(f"{name}: {one_layer.total()} ops per layer, {counts[0].total()} in the step ({n} layers)")
        for what, ops in (("one layer", +one_layer), ("outside the layers", outside)):
            print(f"  {what}: " + ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()

"""Count the ops one decoding step launches: the top-level aten ops of one one-token forward through a static KV
cache (the step a `GroupSampler` replays as a CUDA graph), on CPU in bf16, a proxy for the GPU's kernels.

    python scripts/bench/decode_ops.py [--layers 2] [--rows 16] [--r 16] [--kernels]

A decoding step of a small model replays one graph whose time is about its kernel count times a few µs, so the
count predicts the rollout's time (dev/perf-notes.md). Counted: the aten ops that no other aten op called, less
those that launch no work (views, reshapes, transposes, aliases, detach, a cast or contiguous() that returns its
input). Printed for the adapter path and the merged path (`MergedAdapters`), per layer (the ops inside each
DecoderLayer) and for the whole step, with the op names of one layer and of the rest of the step. By default the
torch references run in place of the Triton kernels that a CUDA model uses (rms_norm, rope, the gated activation):
each of those is one kernel on the GPU where the reference is several ops here. --kernels runs the model a CUDA
GPU runs (the kernels, the decoding step's own attention path) in Triton's interpreter, and counts each launch
as one op (`triton::<kernel>`), not the interpreter's bookkeeping ops inside it.
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
    """(name, inside a layer) of each top-level aten op or Triton launch that launches work."""
    out = []
    for e in events:
        if not is_op(e.name) or e.name in NO_WORK:
            continue
        if e.name in COPY_IF_NEEDED and not e.cpu_children:  # returned its input
            continue
        parent, in_layer = e.cpu_parent, False
        while parent is not None and not is_op(parent.name):
            in_layer |= parent.name == "layer"
            parent = parent.cpu_parent
        if parent is None:
            out.append((e.name, in_layer))
    return out


def count(model, rows, merged, kernels):
    """The top-level ops of one decoding step: (per layer, in the whole step, Counter of one layer's names)."""
    cfg = model.config
    cache = KVCache(cfg, rows, 32, torch.bfloat16, "cpu")
    decode = DecodeGraph(model, cache, first=torch.zeros(rows, dtype=torch.long), graphed=False)
    spans = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: spans.append(record_function("layer").__enter__()))
        layer.register_forward_hook(lambda *_: spans.pop().__exit__(None, None, None))
    with torch.no_grad(), (merged or contextlib.nullcontext()):
        decode(1, 0)  # the static cache is set up by the first call
        with profile(activities=[ProfilerActivity.CPU]) as prof, (triton_launches() if kernels else
                                                                  contextlib.nullcontext()):
            decode(2, 1)
    ops = top_level(prof.events())
    layer_ops = collections.Counter(name for name, inside in ops if inside)
    outside = collections.Counter(name for name, inside in ops if not inside)
    n = cfg.n_layers
    one_layer = collections.Counter({k: v // n for k, v in layer_ops.items()})
    return sum(layer_ops.values()) / n, len(ops), one_layer, outside


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=16, help="rows decoded together (P x G)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank, on every projection")
    p.add_argument("--kernels", action="store_true", help="the Triton kernels (in the interpreter without a GPU), "
                   "each launch counted as one op")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tiny_llama(folder, args.layers)
        model, _ = load_model(folder, dtype=torch.bfloat16, lora=LoRAConfig(r=args.r, alpha=args.r),
                              use_kernels=args.kernels)
    model.eval()
    for name, merged in (("adapter path", None), ("merged path", MergedAdapters(model))):
        if merged is not None and not merged.groups:
            print(f"{name}: not taken here")
            continue
        per_layer, total, names, outside = count(model, args.rows, merged, args.kernels)
        print(f"{name}: {per_layer:g} ops per layer, {total} in the step ({args.layers} layers)")
        for what, counts in (("one layer", names), ("outside the layers", outside)):
            print(f"  {what}: " + ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in counts.most_common()))


if __name__ == "__main__":
    main()

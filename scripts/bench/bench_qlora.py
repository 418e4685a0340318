"""QLoRA at the sizes people fine-tune on one GPU: nanotune's NF4 LoRA step on 7-12B shapes, and its longest sequence.

    python scripts/bench/bench_qlora.py                        # every shape at 2 x 2048, checkpointing off / on /
                                                               # on+offload, then llama-3.1-8b at batch 1: 32k, 64k,
                                                               # 128k and the predicted longest
    python scripts/bench/bench_qlora.py --shapes qwen2.5-7b --ckpt on+offload --long-shapes none
    python scripts/bench/bench_qlora.py --shapes none --long 32768,65536 --out long.json
    python scripts/bench/bench_qlora.py --smoke                # tiny shapes on CPU: every case end to end
    python scripts/bench/bench_qlora.py --fp8 --long-shapes none   # the base GEMMs in fp8 (train.py's --fp8)
    python scripts/bench/bench_qlora.py --shapes gemma-2-9b --write-checkpoint /tmp/g9   # a checkpoint for the peers

The shapes are the real models' configs (SHAPES); the model is built in memory with stand-in weights and
quantized to NF4 with double quantization as it is built (`model.load.random_model`): nothing is written
or downloaded. The step is scripts/bench/harness.py's (LoRA r=16 alpha=16 on all 7 projections, bf16,
fused AdamW, random token ids), replayed from a CUDA graph on a GPU as train.py's default does, timed after
warm-up steps (2 + 5 at 2 x 2048, 1 + 1 for a long row), median; each case runs in its own process so that its
peak memory is its own. The peers (Unsloth, transformers + PEFT + bitsandbytes) need a checkpoint
on disk: shared/anchors/qlora_big.py writes Llama and Qwen2 ones and times them beside nanotune (its --run takes
any such folder); `--write-checkpoint DIR` writes one of any shape here (random bf16 weights, a word-level
tokenizer), e.g. Gemma-2-9B's or Gemma-3-12B's for `qlora_big.py --run DIR`.

Long rows run at batch 1 with checkpointing and offload (the long-context mode). After them, the longest
sequence that fits is predicted from their peak memory, which grows linearly in the length (weights and
optimizer state fixed, activations per token): `predict_longest` fits that line through the two longest
rows that ran, and one step at the predicted length (its optimizer state allocated first) confirms it.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from itertools import repeat
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`, `scripts`
from model.config import from_hf_config  # noqa: E402
from scripts.bench import harness  # noqa: E402
from scripts.bench.harness import CKPT_MODES, REPO  # noqa: E402

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
# config.json of each model, the keys that change its FLOPs or numerics.
SHAPES = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False),
    # the exact softcaps (attention 50, logits 30) and the 4096-token sliding window of every other layer
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=3584,
        intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=4096, rms_norm_eps=1e-6, max_position_embeddings=8192,
        tie_word_embeddings=True),
    # q/k norms, five 1024-token sliding layers to one global layer, two RoPE bases
    "gemma-3-12b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=3840,
        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=1024,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0), rms_norm_eps=1e-6, max_position_embeddings=131072,
        tie_word_embeddings=True),
}
# --smoke: every shape shrunk to seconds on CPU, its quirks kept (softcaps, windows shorter than the sequence)
SMOKE_SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=32,
                   sliding_window_pattern=2)
FULL = dict(batch=2, seqlen=2048, long=(32768, 65536, 131072), warmup=2, steps=5, long_warmup=1, long_steps=1)
SMOKE = dict(batch=2, seqlen=64, long=(64, 128), warmup=1, steps=2, long_warmup=1, long_steps=1)
LENGTH_STEP = 1024  # the predicted longest length is a multiple of this
HEADROOM = 0.97  # of the GPU's memory that the prediction fills: the allocator's fragmentation needs the rest
GiB = 1024 ** 3


def model_config(shape, smoke):
    """The ModelConfig of a shape (the keys a family does not read, such as Llama's sliding_window, are ignored)."""
    return from_hf_config({**SHAPES[shape], **SMOKE_SIZES} if smoke else SHAPES[shape], shape)


def predict_longest(rows, capacity_bytes, step=LENGTH_STEP, headroom=HEADROOM):
    """(length, bytes per token, fixed bytes): the longest multiple of `step` whose step fits in headroom ·
    capacity_bytes, on the line through the peak memory of the two longest rows that ran (dicts with seqlen
    and peak_mem_bytes, at batch 1), or None when fewer than two ran or memory does not grow with length."""
    ran = sorted((r for r in rows if r.get("status") == "ok" and r.get("peak_mem_bytes")), key=lambda r: r["seqlen"])
    if len(ran) < 2:
        return None
    a, b = ran[-2], ran[-1]
    per_token = (b["peak_mem_bytes"] - a["peak_mem_bytes"]) / (b["seqlen"] - a["seqlen"])
    if per_token <= 0:
        return None
    fixed = a["peak_mem_bytes"] - per_token * a["seqlen"]
    return math.floor((headroom * capacity_bytes - fixed) / per_token / step) * step, per_token, fixed


def write_checkpoint(shape, folder, smoke):
    """A random-init bf16 checkpoint of `shape` in `folder`, for the peers' harnesses: config.json, safetensors
    shards and a word-level tokenizer of exactly vocab_size tokens (the peers load one; they are fed token ids).
    The weights are transformers' own initialization, made on the GPU where there is one (seconds for 9B)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    spec = dict(SHAPES[shape], **(SMOKE_SIZES if smoke else {}))
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's ids: pad 0, eos 1, bos 2
    # by model_type, as transformers reads config.json: Gemma 3's text model is gemma3_text (Gemma3TextConfig), where
    # Gemma3Config is the multimodal wrapper
    config = transformers.AutoConfig.for_model(**spec, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), config.vocab_size)})
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                         bos_token="<bos>", unk_token="<unk>").save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {n / 1e9:.2f}B random bf16 weights and a {config.vocab_size}-token tokenizer in {folder}")


# ----------------------------------------------------------------------------- one case (a child process)

def run_case(shape, batch, seqlen, ckpt, smoke, warmup, steps, fp8=False) -> dict:
    """Build the NF4 model, then warm-up and timed steps; never raises (OOM and errors become a status).
    warmup 0: one step after the optimizer state is allocated, for the steady-state peak in one step."""
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = {"status": "ok", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    try:
        t0 = time.perf_counter()
        step = harness.nanotune_step(model_config(shape, smoke), device, ckpt, quantize="nf4", fp8=fp8,
                                     cuda_graphs="on" if device.type == "cuda" else "off")
        res["build_s"] = time.perf_counter() - t0
        if warmup == 0:
            step.init_optimizer_state()
        batches = repeat(harness.fixed_batch(step.vocab_size, batch, seqlen, device))
        res.update(harness.time_steps(step, batches, warmup=warmup, steps=steps, device=device))
    except torch.OutOfMemoryError as e:
        res.update(status="oom", reason=str(e).split("\n")[0][:300])
    except Exception as e:
        res.update(status="error", reason=f"{type(e).__name__}: {e}"[:500], traceback=traceback.format_exc()[-3000:])
    if device.type == "cuda":
        res.setdefault("peak_mem_bytes", torch.cuda.max_memory_allocated())
        res["capacity_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return res


def spawn(case: dict, smoke, timeout) -> dict:
    """`case` (shape, batch, seqlen, ckpt, warmup, steps) in a child process of this script; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case), "--json-out", out]
        cmd += ["--smoke"] if smoke else []
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "reason": f"killed after {timeout:.0f} s (time budget)"}
        if os.path.exists(out) and os.path.getsize(out):
            with open(out) as f:
                return json.load(f)
        killed = f"killed by signal {-p.returncode} (the host's out-of-memory killer, if 9)" if p.returncode < 0 else ""
        return {"status": "crashed", "reason": killed or f"exit code {p.returncode}",
                "traceback": "\n".join(p.stderr.strip().splitlines()[-15:])}


# ----------------------------------------------------------------------------- the parent

def row_line(r):
    size = f"{r['batch']}x{r['seqlen']}"
    shape = r["shape"] + (" fp8" if r.get("fp8") else "")
    if r["status"] != "ok":
        return f"| {shape} | {size} | {r['ckpt']} | {r['status']}: {r.get('reason', '')} | | |"
    peak = f"{r['peak_mem_bytes'] / GiB:.2f}" if r.get("peak_mem_bytes") else "-"
    return (f"| {shape} | {size} | {r['ckpt']} | {r['median_step_s'] * 1e3:.1f} | {r['tokens_per_s'] / 1e3:.2f}k "
            f"| {peak} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ", ".join(SHAPES)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {names}, or none")
    p.add_argument("--ckpt", default=",".join(CKPT_MODES), help="checkpointing modes of the 2 x 2048 rows")
    p.add_argument("--long-shapes", default="llama-3.1-8b", help="shapes of the batch-1 long rows, or none")
    p.add_argument("--long", help="their lengths, comma-separated (default 32768,65536,131072), or none")
    p.add_argument("--no-longest", action="store_true", help="skip the predicted longest length and its step")
    p.add_argument("--longest", type=int, default=None, help="one step at this length instead of the predicted "
                   "one (a length an earlier run predicted; give --long none to skip the rows it came from)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few steps: CPU is fine")
    p.add_argument("--fp8", action="store_true", help="the base GEMMs in fp8 (train.py's --fp8; a GPU of compute "
                   "capability 8.9+, or the CPU's torch._scaled_mm with --smoke)")
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds for the whole run")
    p.add_argument("--out", help="JSON of every row, rewritten after each")
    p.add_argument("--write-checkpoint", metavar="DIR", help="write a random bf16 checkpoint of the one shape of "
                   "--shapes to DIR (a new folder), for the peers (shared/anchors/qlora_big.py --run DIR), and stop")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        case = json.loads(args.child)
        with open(args.json_out, "w") as f:
            json.dump(run_case(**case, smoke=args.smoke), f)
        return 0

    sizes = SMOKE if args.smoke else FULL

    def pick(s):
        chosen = [] if s == "none" else s.split(",")
        unknown = [c for c in chosen if c not in SHAPES]
        if unknown:
            p.error(f"unknown shape(s) {unknown}; known: {names}")
        return chosen

    shapes, long_shapes = pick(args.shapes), pick(args.long_shapes)
    if args.write_checkpoint:
        if len(shapes) != 1:
            p.error(f"--write-checkpoint writes one shape: give --shapes one of {names}")
        if os.path.exists(args.write_checkpoint):
            p.error(f"--write-checkpoint {args.write_checkpoint}: it exists; give a new folder")
        write_checkpoint(shapes[0], args.write_checkpoint, args.smoke)
        return 0
    ckpts = args.ckpt.split(",")
    if any(c not in CKPT_MODES for c in ckpts):
        p.error(f"--ckpt {args.ckpt}: expected some of {','.join(CKPT_MODES)}")
    long = args.long or ",".join(map(str, sizes["long"]))
    lengths = [] if long == "none" else [int(t) for t in long.split(",")]
    deadline = time.monotonic() + args.time_budget
    rows = []

    def run(shape, batch, seqlen, ckpt, warmup=sizes["warmup"], steps=sizes["steps"]):
        case = dict(shape=shape, batch=batch, seqlen=seqlen, ckpt=ckpt, warmup=warmup, steps=steps, fp8=args.fp8)
        row = {**case, **spawn(case, args.smoke, deadline - time.monotonic())}
        rows.append(row)
        print(row_line(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"results": rows}, f, indent=1)
        return row

    print("| shape | B x T | ckpt | step ms | tokens/s | peak GiB |\n|---|---|---|---|---|---|", flush=True)
    for shape in shapes:
        for ckpt in ckpts:
            run(shape, sizes["batch"], sizes["seqlen"], ckpt)
    for shape in long_shapes:
        long_rows = [run(shape, 1, T, "on+offload", sizes["long_warmup"], sizes["long_steps"]) for T in lengths]
        capacity = next((r["capacity_bytes"] for r in long_rows if r.get("capacity_bytes")), None)
        if args.longest:
            run(shape, 1, args.longest, "on+offload", warmup=0, steps=1)
            continue
        if args.no_longest or capacity is None:
            continue
        predicted = predict_longest(long_rows, capacity)
        if predicted is None:
            print(f"{shape}: no prediction of the longest length (fewer than two long rows ran)", flush=True)
            continue
        T, per_token, fixed = predicted
        print(f"{shape}: predicted longest length {T} tokens ({per_token / 1024:.1f} KiB a token over "
              f"{fixed / GiB:.2f} GiB, {HEADROOM:.0%} of {capacity / GiB:.1f} GiB)", flush=True)
        run(shape, 1, T, "on+offload", warmup=0, steps=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

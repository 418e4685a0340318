"""Time rl.py's GRPO step: the rollout (sampling, decoding to text, rewards) and the update (collation, forward,
backward, optimizer step) separately, to put beside TRL's and Unsloth's GRPO (../shared/anchors/trl_methods.py)
on the same GPU.

    python scripts/bench/bench_grpo.py --shape smollm2-135m --tokenizer TOKENIZER_DIR --out OUT.json \
        [--prompts 2] [--num-generations 8] [--max-new-tokens 64] [--steps 10] [--warmup 3] [--ignore-eos]
    python scripts/bench/bench_grpo.py --model MODEL_DIR --out OUT.json ...

The step is rl.py's, built from the same modules (rollout.py, data/rollouts.py, grpo.py, step.py) and options
(rlconfig.RLConfig's defaults, the GPU's hardware defaults: LoRA r=16, alpha 16 on every projection, bf16,
packed rows of --max-len, CUDA graphs for the decoding and the update on CUDA), with beta 0, the dapo loss and one
update per batch of rollouts, as the peers' harness measures TRL. The prompts are the harness's: "What number
comes after N? Reply with the number only.", through the chat template where the tokenizer has one, else as text
followed by "Answer: "; the reward is exact_answer (the last number against N + 1). --shape builds a random
model of one of bench.py's SHAPES (cached under --cache-dir); its rollouts run to --max-new-tokens anyway, and
--ignore-eos makes every model's rows decode that many tokens.

Timing: each step's rollout and update between synchronizations, the median over the --steps steps after
--warmup (which hold the CUDA graphs' captures). Reported: ms a step, rollout ms, update ms, rollout tokens/s
(the completions' tokens over the rollout's time), and the decoding's bandwidth bound: per decoding step the
weights' bytes plus the KV cache's bytes of the step's positions (rows × (prompt + tokens so far)), over the GPU's
bandwidth (--bandwidth, by default 3.35e12 B/s on an H100, 4.8e12 on an H200), summed over --max-new-tokens
steps: the least time the rollout's decoding can take.
"""
import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import grpo  # noqa: E402
import rewards  # noqa: E402
from config import with_hardware_defaults  # noqa: E402
from data.rollouts import Prompt, collate  # noqa: E402
from model import load_model, load_tokenizer, read_config  # noqa: E402
from model.generate import GroupSampler, encode_prompt, stop_ids  # noqa: E402
from model.lora import lora_parameters  # noqa: E402
from rlconfig import RLConfig  # noqa: E402
from rollout import old_and_ref_logps, roll_out  # noqa: E402
from scripts.bench import bench, harness  # noqa: E402
from step import EagerStep, GraphStep, graphs_off_reason  # noqa: E402

BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # HBM bytes/s by device name (SXM), the first that matches


def make_prompts(tokenizer, n, seed=0):
    """n prompts of the peers' GRPO harness, each with its answer N + 1."""
    rng = random.Random(seed)
    chat = tokenizer.chat_template is not None
    out = []
    for _ in range(n):
        x = rng.randint(0, 999)
        q = f"What number comes after {x}? Reply with the number only."
        out.append(Prompt(q, encode_prompt(tokenizer, q if chat else q + "\nAnswer: ", raw=not chat), str(x + 1)))
    return out


def model_folder(a):
    """--model, or a random-init checkpoint of --shape (bench.py's SHAPES), made once under --cache-dir."""
    if a.model:
        return a.model
    folder = os.path.join(a.cache_dir, bench.cache_name(a.shape, a.smoke))
    key = os.path.join(folder, "bench_shape.json")
    if not os.path.isfile(key) or json.loads(Path(key).read_text()) != bench.shape_key(a.shape, a.smoke):
        bench.make_checkpoint(a.shape, folder, a.smoke)
    return folder


def decode_bound_s(model, cfg, rows, prompt_len, new_tokens, bandwidth):
    """The least time of `new_tokens` decoding steps of `rows` rows at `bandwidth` B/s: each step reads every
    weight and the keys and values of its rows' positions so far (prompt_len + the tokens before it)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_position = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * model.model.norm.weight.element_size()
    kv = sum(rows * (prompt_len + t) * per_position for t in range(new_tokens))
    return (new_tokens * weights + kv) / bandwidth


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model folder (with its tokenizer, or give --tokenizer)")
    src.add_argument("--shape", choices=sorted(bench.SHAPES), help="a random model of this shape")
    p.add_argument("--tokenizer", default=None, help="the tokenizer folder (default: the model's)")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "nanotune-bench"),
                   help="where --shape's checkpoints are kept (bench.py's cache)")
    p.add_argument("--smoke", action="store_true", help="--shape at its tiny smoke size (a CPU check)")
    p.add_argument("--out", required=True, help="the JSON results to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=2, help="P, prompts a step")
    p.add_argument("--num-generations", type=int, default=8, help="G, completions a prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=None, help="packed row length (default: rl.py's)")
    p.add_argument("--ignore-eos", action="store_true", help="every row decodes --max-new-tokens tokens")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bandwidth", type=float, default=None, help="the GPU's memory bandwidth in B/s (default: by "
                   "device name, " + ", ".join(f"{k} {v:.3g}" for k, v in BANDWIDTH.items()) + ")")
    p.add_argument("--profile", action="store_true", help="print the kernels of the last step's rollout "
                   "(torch.profiler): how many a decoding step launches, and the 25 that take the most time")
    p.add_argument("--nine-kernel-decoding", action="store_true", help="decode through Transformer.decode_layers' "
                   "nine kernels a layer, not model/decode.py's five (to compare the two)")
    a = p.parse_args()

    device = torch.device(a.device)
    folder = model_folder(a)
    tokenizer, mcfg = load_tokenizer(a.tokenizer or folder), read_config(folder)
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=a.prompts, num_generations=a.num_generations,
                                             max_new_tokens=a.max_new_tokens, max_len=a.max_len, beta=None,
                                             loss_type="dapo", num_iterations=1), device.type)
    total = a.warmup + a.steps
    prompts = make_prompts(tokenizer, a.prompts * total)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    stops = set() if a.ignore_eos else stop_ids(tokenizer, mcfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, mcfg = load_model(folder, dtype=dtype, device=device, lora=cfg.lora(), use_kernels=device.type == "cuda")
    if a.nine_kernel_decoding:
        model.ops.fused_decode = None
    params = [q for _, q in lora_parameters(model)]
    graphs = graphs_off_reason(cfg.cuda_graphs, device, 1) is None
    longest = max(len(q.ids) for q in prompts)
    sampler = GroupSampler(model, rows=a.prompts * a.num_generations, max_prompt_len=longest,
                           max_new_tokens=a.max_new_tokens, pad_id=pad_id, cuda_graph=graphs)
    objective = grpo.GRPOLoss(cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                              max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, device=device)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, fused=True)
    train_step = (GraphStep(model, device, params, cfg.max_len, print, loss_fn=objective) if graphs else
                  EagerStep(model, device, objective))
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    steps = []
    for i in range(total):  # rl.py's loop body, timed in two parts
        harness.synchronize(device)
        began = time.perf_counter()
        generator = torch.Generator(device).manual_seed(i)
        profiled = a.profile and i == total - 1
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) if profiled else contextlib.nullcontext() as prof:
            rollouts, stats = roll_out(sampler, prompts[i * a.prompts:(i + 1) * a.prompts], cfg, tokenizer, stops,
                                       [rewards.exact_answer], None, generator)
        harness.synchronize(device)
        rolled = time.perf_counter()
        micro = collate(rollouts, max_len=cfg.max_len, pad_id=pad_id, packing=cfg.packing, rows=cfg.batch_size,
                        device=device, fixed_shapes=graphs)
        old_and_ref_logps(model, micro, objective, cfg.num_iterations)
        count = sum(objective.count(b) for b in micro)
        loss_sum = torch.zeros((), device=device)
        for batch in micro:
            loss_sum += train_step(batch, count, 1.0)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
        optimizer.step()
        train_step.zero_grad(optimizer)
        objective.take(count)
        loss = loss_sum.item()
        harness.synchronize(device)
        done = time.perf_counter()
        steps.append({"rollout_s": rolled - began, "update_s": done - rolled, "step_s": done - began, "loss": loss,
                      "new_tokens": sum(len(r.completion) for r in rollouts), "reward": stats["reward"],
                      "micro_batches": len(micro)})

    timed = steps[a.warmup:]
    med = {k: statistics.median(s[k] for s in timed) for k in ("step_s", "rollout_s", "update_s")}
    new_tokens = statistics.mean(s["new_tokens"] for s in timed)  # a step's, all its completions'
    rows = a.prompts * a.num_generations
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = a.bandwidth or next((v for k, v in BANDWIDTH.items() if k in name), None)
    prompt_len = statistics.mean(len(q.ids) for q in prompts)
    bound = None if bandwidth is None else decode_bound_s(model, mcfg, rows, prompt_len, a.max_new_tokens, bandwidth)
    result = {"device": name, "model": a.model or a.shape, "prompts": a.prompts, "num_generations": a.num_generations,
              "max_new_tokens": a.max_new_tokens, "ignore_eos": a.ignore_eos, "max_len": cfg.max_len,
              "cuda_graphs": graphs, "prompt_len_mean": prompt_len, "step_new_tokens_mean": new_tokens,
              "step_ms_median": med["step_s"] * 1e3, "rollout_ms_median": med["rollout_s"] * 1e3,
              "update_ms_median": med["update_s"] * 1e3, "rollout_tokens_per_s": new_tokens / med["rollout_s"],
              "bandwidth_bytes_per_s": bandwidth, "decode_bound_ms": None if bound is None else bound * 1e3,
              "rollout_over_bound": None if bound is None else med["rollout_s"] / bound,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              "steps": steps, "versions": bench.versions()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    line = (f"GRPO {a.model or a.shape}, {a.prompts} prompts x {a.num_generations}, {new_tokens / rows:.1f} new "
            f"tokens a completion (at most {a.max_new_tokens}) on {name}: {med['step_s'] * 1e3:.1f} ms a step (rollout "
            f"{med['rollout_s'] * 1e3:.1f} ms, update {med['update_s'] * 1e3:.1f} ms), rollout "
            f"{new_tokens / med['rollout_s']:,.0f} tokens/s")
    if bound is not None:
        most = rows * a.max_new_tokens / bound
        line += (f"; decoding bound {bound * 1e3:.1f} ms ({most:,.0f} tokens/s at {bandwidth:.3g} B/s): rollout at "
                 f"{med['rollout_s'] / bound:.1f}x the bound")
    print(line)
    if a.profile:
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        launched = sum(e.count for e in kernels)
        print(f"the last rollout launched {launched} kernels, {launched / a.max_new_tokens:.0f} a decoding step "
              f"({launched / a.max_new_tokens / mcfg.n_layers:.1f} a layer)")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=80))


if __name__ == "__main__":
    main()

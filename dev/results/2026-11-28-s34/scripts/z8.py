"""Session 34, call 5: where bench_grpo.py's Qwen2.5-0.5B rollout goes besides the sampler: rl.py's step as
bench_grpo.py builds it (2 prompts x 8, 64 tokens, --ignore-eos), the rollout split into the sampler's call, the
texts' decoding, the rewards and the rest of roll_out; medians over 10 steps after 3."""
import os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts", "bench"))
import torch
import grpo, rewards
from config import with_hardware_defaults
from data.rollouts import collate
from model import load_model, load_tokenizer, read_config
from model.generate import GroupSampler
from model.lora import lora_parameters
from rlconfig import RLConfig
from rollout import old_and_ref_logps, completions, roll_out
from step import GraphStep
import bench_grpo

class A: pass
a = A(); a.model = None; a.shape = "qwen2.5-0.5b"; a.cache_dir = "/tmp/bc"; a.smoke = False
device = torch.device("cuda")
folder = bench_grpo.model_folder(a)
tokenizer, mcfg = load_tokenizer(".gpu/tok"), read_config(folder)
cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                         beta=None, loss_type="dapo", num_iterations=1), "cuda")
prompts = bench_grpo.make_prompts(tokenizer, 2 * 13)
pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
model, mcfg = load_model(folder, dtype=torch.bfloat16, device=device, lora=cfg.lora(), use_kernels=True)
params = [q for _, q in lora_parameters(model)]
longest = max(len(q.ids) for q in prompts)
sampler = GroupSampler(model, rows=16, max_prompt_len=longest, max_new_tokens=64, pad_id=pad_id, cuda_graph=True)
objective = grpo.GRPOLoss("dapo", epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, max_completion_length=64,
                          temperature=cfg.temperature, device=device)
optimizer = torch.optim.AdamW(params, lr=cfg.lr, fused=True)
train_step = GraphStep(model, device, params, cfg.max_len, print, loss_fn=objective)
model.train()
rows = []
for i in range(13):
    ps = prompts[i * 2:(i + 1) * 2]
    g = torch.Generator(device).manual_seed(i)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    ids, logps = sampler([p.ids for p in ps], 8, cfg.temperature, cfg.top_p, cfg.top_k, stop_ids=set(), generator=g)
    torch.cuda.synchronize(); t1 = time.perf_counter()
    texts = [tokenizer.decode(c) for c in ids]
    t2 = time.perf_counter()
    total, per_fn = rewards.score([rewards.exact_answer], None, [p.question for p in ps for _ in range(8)], texts,
                                  [p.answer for p in ps for _ in range(8)])
    t3 = time.perf_counter()
    g.manual_seed(i)
    torch.cuda.synchronize(); t4 = time.perf_counter()
    rollouts, stats = roll_out(sampler, ps, cfg, tokenizer, set(), [rewards.exact_answer], None, g)
    torch.cuda.synchronize(); t5 = time.perf_counter()
    micro = collate(rollouts, max_len=cfg.max_len, pad_id=pad_id, packing=cfg.packing, rows=cfg.batch_size,
                    device=device, fixed_shapes=True)
    count = sum(objective.count(b) for b in micro)
    for batch in micro:
        train_step(batch, count, 1.0)
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
    optimizer.step(); train_step.zero_grad(optimizer); objective.take(count)
    torch.cuda.synchronize()
    rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t5 - t4) * 1e3))
for name, k in (("sampler", 0), ("decode texts", 1), ("rewards", 2), ("roll_out whole", 3)):
    print(f"{name}: median {statistics.median(r[k] for r in rows[3:]):.2f} ms  ({', '.join(f'{r[k]:.1f}' for r in rows[3:])})")

"""nanotune RL: GRPO with verifiable rewards, sampling from the training model itself (docs/rl.md).

    python rl.py --model smollm2-135m --max-steps 16                  # builtin prompts, the answer rewards
    python rl.py --model ./my-model --data qa.jsonl --reward my_rewards.py:short_answer --num-generations 8

This file is the algorithm, top to bottom in the order it runs, as train.py is: device and dtype, data (the
prompts), model, optimizer, resume, the loop, finish. A step takes --batch-size prompts P, samples G completions
of each (--num-generations) from the model with its current adapters (model/generate.py `GroupSampler`, made
once: P×G rows through one static KV cache, one CUDA graph replayed per token on a GPU), scores them with the
reward functions (rewards.py), turns the rewards into group-relative advantages, and makes --num-iterations (μ)
optimizer updates with the clipped GRPO loss (grpo.py) over the rollouts, packed into rows as SFT packs examples
(data/rollouts.py), each update replayed from a CUDA graph on a GPU as train.py's steps are (step.py,
--cuda-graphs).
The old log-probs (the sampling policy's, which the ratio divides by) come from one no-grad forward over the same
batches before the first update, and the reference's (β > 0) from one with the adapters off: no second model.

The sampling generator of step s is seeded from (--seed, s), so a resumed run samples what the uninterrupted run
sampled: the checkpoint holds the weights, the optimizer and the prompts' position, and nothing else is needed.
"""
import sys
import time
from functools import partial

import torch
from tqdm import tqdm

import grpo
import rewards
from checkpoint import Checkpoints, same_model
from config import UserError, check_model_fit, choose_dtype, parse_args, pick_device, with_hardware_defaults
from data.rollouts import PromptBatches, collate, load_prompts
from lifecycle import StopSignals, command_line, save_after_failure
from masters import param_groups
from model import load_model, load_tokenizer, read_config, resolve
from model.generate import GroupSampler, stop_ids
from model.lora import lora_parameters
from precision import LossScaler, nonfinite_step
from rlconfig import RL_GROUPS, USAGE, RLConfig
from rollout import evaluate_rewards, log_rl_step, old_and_ref_logps, roll_out
from runlog import Progress, RunLog, peak_memory
from statefiles import fingerprint, position
from step import EagerStep, GraphStep, graphs_off_reason, shortest_bucket
from train import lr_at


def main(cfg) -> int:
    """Train with GRPO; returns the exit status, as train.py's main."""
    # ----------------------------------------------------------------------------- device and dtype
    device_name = pick_device(cfg)
    cfg, cpu_defaults = with_hardware_defaults(cfg, device_name)
    with RunLog(cfg) as run, StopSignals(say=True) as signals:
        log = tqdm.write
        device = torch.device(device_name)
        dtype, why = choose_dtype(cfg, device)
        use_kernels = device.type == "cuda" if cfg.kernels is None else cfg.kernels
        log(f"device {device}, dtype {dtype}: {why}; kernels {'on' if use_kernels else 'off (torch references)'}")
        if cpu_defaults:
            log(cpu_defaults)
        run.check()
        if cfg.eval_data and same_model(cfg.eval_data, cfg.data):
            run.warn(f"--eval-data is the training data ({cfg.data}): the eval reward then says how well the model "
                     "does on the prompts it trained on")
        try:  # the reward functions first: a broken --reward fails before anything slow
            reward_fns = [rewards.load_reward(s) for s in (cfg.reward or rewards.DEFAULT).split(",")]
            weight_spec = cfg.reward_weights or (None if cfg.reward else rewards.DEFAULT_WEIGHTS)
            weights = [float(w) for w in weight_spec.split(",")] if weight_spec else None
        except ValueError as e:
            raise UserError(str(e).replace("could not convert string to float", "--reward-weights: not a number")
                            ) from e
        if weights is not None and len(weights) != len(reward_fns):
            raise UserError(f"--reward-weights has {len(weights)} weights for {len(reward_fns)} rewards; give one "
                            "per --reward")

        # ----------------------------------------------------------------------------- data: the prompts
        path = resolve(cfg.model)
        tokenizer, mcfg = load_tokenizer(resolve(cfg.tokenizer) if cfg.tokenizer else path), read_config(path)
        check_model_fit(cfg, mcfg, tokenizer)
        if cfg.max_new_tokens >= cfg.max_len:
            raise UserError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in --max-len "
                            f"{cfg.max_len}; raise --max-len or lower --max-new-tokens")
        try:
            train_prompts, eval_prompts = load_prompts(tokenizer, **cfg.data_options(), log=log,
                                                       max_prompt_len=cfg.max_len - cfg.max_new_tokens)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(str(e)) from e
        eval_prompts = eval_prompts[:cfg.eval_batches * cfg.batch_size * cfg.num_generations]
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        stops = stop_ids(tokenizer, mcfg)
        batches = PromptBatches(train_prompts, batch_size=cfg.batch_size, seed=cfg.seed)
        max_steps = cfg.max_steps
        log(f"training {max_steps} steps of {cfg.batch_size} prompts x {cfg.num_generations} completions; "
            f"{len(train_prompts)} train / {len(eval_prompts)} eval prompts; rewards "
            f"{', '.join(rewards.reward_name(f) for f in reward_fns)}")
        ckpts = Checkpoints(cfg, warn=run.warn)
        ck = ckpts.find(fingerprint([(p.ids, [1]) for p in train_prompts]),
                        fingerprint([(p.ids, [1]) for p in eval_prompts]))

        # ----------------------------------------------------------------------------- model
        graphs_off = graphs_off_reason(cfg.cuda_graphs, device, 1)  # the decoding steps' and the updates'
        torch.manual_seed(cfg.seed)
        model, mcfg = load_model(path, dtype=dtype, device=device, lora=cfg.lora(), quantize=cfg.quantize,
                                 use_kernels=use_kernels, lora_seed=cfg.seed, fp8=cfg.fp8)
        params = [p for _, p in lora_parameters(model)]
        model.gradient_checkpointing = bool(cfg.gradient_checkpointing)
        ckpts.check_free_disk(model)
        log(f"model {cfg.model}: {mcfg.n_layers} layers, {sum(p.numel() for p in params) / 1e6:.2f}M trainable "
            f"LoRA parameters (r={cfg.lora_r}); loss {cfg.loss_type}, beta {cfg.beta or 0:g}, mu {cfg.num_iterations}")
        longest = max(len(p.ids) for p in train_prompts + eval_prompts)  # the sampler's cache fits every prompt
        sampler = GroupSampler(model, rows=cfg.batch_size * cfg.num_generations, max_prompt_len=longest,
                               max_new_tokens=cfg.max_new_tokens, pad_id=pad_id, cuda_graph=graphs_off is None)
        merged = sampler.merged.buffer  # the adapted weights with the adapters merged in, where the copy fits
        log("rollouts sample through the adapters (no merged copy: an fp8 base, or too little free memory)"
            if merged is None else f"rollouts sample from merged weights ({merged.nbytes / 2**30:.2f} GiB)")
        objective = grpo.GRPOLoss(cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                                  beta=cfg.beta or 0.0, importance=cfg.importance_sampling_level,
                                  max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature,
                                  device=device)

        # ----------------------------------------------------------------------------- optimizer and scaler
        groups = param_groups(lora_parameters(model), cfg.weight_decay, cfg.lora_plus_ratio)  # LoRA+: B's lr x ratio
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), fused=True)
        scaler = LossScaler(cfg.loss_scale, cfg.scale_growth_interval, enabled=dtype == torch.float16)

        # ----------------------------------------------------------------------------- resume
        step = ckpts.restore(ck, model, optimizer, scaler, batches)
        if step >= max_steps and ckpts.result_done():
            log(f"the run in {cfg.out_dir} is complete ({step} of {max_steps} steps, adapter in "
                f"{ckpts.result_folder}); nothing to do. Raise --max-steps (with --resume-anyway) to train on")
            return 0
        run.open(step, cfg)
        ckpts.set_aside_newer(step)

        # ----------------------------------------------------------------------------- the loop
        model.train()  # LoRA dropout in the updates; the sampler draws none
        progress = Progress(step, max_steps, log, bar=sys.stdout.isatty())
        log("CUDA graphs on" if graphs_off is None else f"CUDA graphs off: {graphs_off}")
        train_step = (EagerStep(model, device, objective) if graphs_off else
                      GraphStep(model, device, params, cfg.max_len, log,
                                shortest=shortest_bucket(max_steps * cfg.num_iterations), loss_fn=objective))
        evaluate = partial(evaluate_rewards, sampler, eval_prompts, cfg, tokenizer, stops, reward_fns, weights, log)
        signals.step, signals.stage, start = step, "training", None
        try:
            while step < max_steps:
                signals.step = step + 1
                if signals.due(step):
                    break
                start = position(batches)
                lr = lr_at(cfg, max_steps, step)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                progress.pause()
                if cfg.save_every and step % cfg.save_every == 0 and step > ckpts.saved_step:
                    ckpts.save(step, model, optimizer, scaler, batches)
                if cfg.eval_every and step % cfg.eval_every == 0 and eval_prompts:
                    run.log({"step": step, **evaluate()})
                progress.resume()

                # rollouts -> rewards -> advantages, then the batches with the old (and reference) log-probs
                began = time.perf_counter()
                generator = torch.Generator(device).manual_seed(cfg.seed * 1_000_003 + step)
                rollouts, stats = roll_out(sampler, next(batches), cfg, tokenizer, stops, reward_fns, weights,
                                           generator)
                rollout_time = time.perf_counter() - began  # the rewards read the decoded text: the GPU is done
                micro = collate(rollouts, max_len=cfg.max_len, pad_id=pad_id, packing=cfg.packing,
                                rows=cfg.batch_size, device=device, fixed_shapes=graphs_off is None)
                old_and_ref_logps(model, micro, objective, cfg.num_iterations)
                count = sum(objective.count(b) for b in micro)

                for _ in range(cfg.num_iterations):  # μ updates on the same rollouts
                    loss_sum = torch.zeros((), device=device)
                    for batch in micro:
                        loss_sum += train_step(batch, count, scaler.scale)  # forward, backward
                    scaler.unscale_(params)
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
                    applied = scaler.step(optimizer, loss_sum, grad_norm)
                    train_step.zero_grad(optimizer)
                    loss, norm, metrics = loss_sum.item(), grad_norm.item(), objective.take(count)  # a sync
                    if not applied:
                        log(nonfinite_step(scaler, optimizer, loss, norm, step + 1, cfg.max_skipped_steps,
                                           ckpts.next_steps))
                step += 1

                progress.advance(step)
                if step % cfg.log_every == 0 or step == max_steps:
                    log_rl_step(run, progress, {"step": step, "loss": loss, **stats, **metrics, "lr": lr,
                                                "grad_norm": norm, "step_time": time.perf_counter() - began,
                                                "rollout_time": rollout_time, **peak_memory(device)}, max_steps)

            # ----------------------------------------------------------------------------- finish
            progress.close()
            signals.stage = "saving"
            if step > ckpts.saved_step:
                ckpts.save(step, model, optimizer, scaler, batches)
            if step < max_steps:
                log(f"interrupted after step {step}: saved {ckpts.last}. To continue, run the same command with "
                    "--resume auto")
                return signals.exit_status()
            final = evaluate() if eval_prompts else None
            if final:
                run.log({"step": step, **final})
            adapter = ckpts.save_result(model, metrics=final)
            log(f"done: adapter in {adapter} (PEFT format), checkpoint {ckpts.last}")
            return 0
        except (OSError, torch.OutOfMemoryError) as e:
            raise save_after_failure(e, cfg, ckpts, step, model, optimizer, scaler, batches, start,
                                     model.gradient_checkpointing) from e


def cli(argv=None):
    """The command line, as train.py's (lifecycle.py, `command_line`)."""
    return command_line(main, lambda: parse_args(argv, RLConfig, RL_GROUPS, USAGE))


if __name__ == "__main__":
    sys.exit(cli())

"""nanotune: LoRA / QLoRA (and full, and preference) fine-tuning of Llama, Qwen and Gemma in one readable loop.

    python train.py --model tinyllama                     # the embedded dataset, defaults for the hardware
    python train.py --model ./my-model --data chats.jsonl --max-steps 500
    torchrun --nproc_per_node=2 train.py --model tinyllama  # data-parallel on 2 GPUs

This file is the training algorithm, top to bottom in the order it runs: device and dtype, data, model,
optimizer and scaler, resume, the loop, finish. Everything else is a module named for its job: config.py
(options), data/ (reading, templates, packing), model/ (the Transformer, LoRA), step.py (a micro-step, eager
or replayed from a CUDA graph), precision.py (fp16 loss scaling), memory.py (estimates), checkpoint.py,
runlog.py (the run folder's log and the console), lifecycle.py (signals, failures), evaluation.py.

Loss normalization: the loss of an optimizer step is Σ token losses over all its micro-batches (and all
ranks) / Σ target tokens over all of them. The count is taken before the micro-steps and passed into the
loss, so a micro-batch weighs by its tokens, whatever the padding or packing.

--method dpo, ipo, simpo or orpo trains on preference pairs instead (docs/preference.md): the same loop,
with the pairs' batches (data/preference.py) and their loss (preference.py) in place of loss_fn; the count
is then the step's pairs, and the step's loss the mean over them. What trains is LoRA's adapters, or with
--full the model's own weights (full.py), whose fp32 masters (masters.py) the optimizer steps; --dora,
--lora-plus-ratio, --lora-init (model/variants.py) and --train-embeddings / --add-tokens (model/embeddings.py)
change what the adapters are, not the loop. RL with verifiable rewards has its own loop: rl.py.
"""
import copy
import dataclasses
import math
import random
import sys
from contextlib import nullcontext

import torch
from tqdm import tqdm

import data
from checkpoint import Checkpoints, same_model
from config import UserError, check_model_fit, choose_dtype, parse_args, pick_device, run_length, with_hardware_defaults
from distributed import any_rank, distributed, sum_over_ranks
from evaluation import Samples, evaluate, log_eval
from full import train_filter, weight_counts
from lifecycle import StopSignals, command_line, save_after_failure
from masters import Masters, param_groups
from memory import choose_checkpointing, full_finetuning_fit, memory_warning, offload_line
from model import load_model, load_tokenizer, read_config, resolve
from model.embeddings import add_tokens, grown, train_embeddings_
from model.hub import push
from model.weights import trainable_parameters
from precision import LossScaler, nonfinite_step
from preference import num_pairs, reference_logps
from runlog import Progress, RunLog, log_step, peak_memory
from statefiles import fingerprint, position
from step import EagerStep, GraphStep, WarmStart, graphs_off_reason, shortest_bucket


def main(cfg) -> int:
    """Train; returns the exit status: 0 when the run is complete, 128 + the signal's number (130 for Ctrl-C)
    when a signal stopped it early, after its checkpoint."""
    # ----------------------------------------------------------------------------- device and dtype
    device_name = pick_device(cfg)
    cfg, cpu_defaults = with_hardware_defaults(cfg, device_name)
    with (distributed(cfg, device_name) as (rank, world, device), RunLog(cfg, rank) as run,
          StopSignals(say=rank == 0) as signals):
        log = tqdm.write if rank == 0 else (lambda *a, **k: None)  # tqdm.write: a line above a progress bar
        dtype, why = choose_dtype(cfg, device)
        use_kernels = device.type == "cuda" if cfg.kernels is None else cfg.kernels
        log(f"device {device}, dtype {dtype}: {why}; kernels {'on' if use_kernels else 'off (torch references)'}")
        if cpu_defaults:
            log(cpu_defaults)
        run.check()  # every input is checked before the slow work, and nothing is written before they pass
        if cfg.eval_data and same_model(cfg.eval_data, cfg.data):
            run.warn(f"--eval-data is the training data ({cfg.data}): the eval loss then says how well the model "
                     "memorized it, not how it does on new examples")

        # ----------------------------------------------------------------------------- data
        path = resolve(cfg.model)  # a hub model is downloaded once, here
        tokenizer, mcfg = load_tokenizer(resolve(cfg.tokenizer) if cfg.tokenizer else path), read_config(path)
        check_model_fit(cfg, mcfg, tokenizer)
        tokenizer, new_ids = add_tokens(tokenizer, cfg.new_tokens())  # --add-tokens (model/embeddings.py)
        mcfg = grown(mcfg, tokenizer.vocab_size)  # a row for every token
        objective = cfg.objective(device)  # --method dpo, ipo, simpo, orpo: a preference loss; sft: None (loss_fn)
        step_loss, count = (objective, num_pairs) if objective else (loss_fn, data.num_targets)
        try:
            if objective:  # pairs, each two examples in a row: chosen, rejected
                (train_enc, eval_enc), eval_rows = data.load_pairs(tokenizer, **cfg.data_options(), log=log), []
            else:
                train_enc, eval_enc, eval_rows = data.load_datasets(tokenizer, **cfg.data_options(), log=log,
                                                                    with_rows=True)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(str(e)) from e
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        batches = (data.PairBatches if objective else data.Batches)(
            train_enc, batch_size=cfg.batch_size, max_len=cfg.max_len, pad_id=pad_id, packing=cfg.packing,
            seed=cfg.seed, rank=rank, world_size=world)
        eval_sets = (data.pair_eval_batches if objective else data.eval_batches)(
            eval_enc, batch_size=cfg.batch_size, max_len=cfg.max_len, pad_id=pad_id,
            packing=cfg.packing)[:cfg.eval_batches]
        max_steps, lines = run_length(cfg, len(batches))  # --max-steps, or --num-epochs over these batches
        for line in lines:
            log(line)
        run_cfg = dataclasses.replace(cfg, max_steps=max_steps, num_epochs=None)  # what this run does
        ckpts = Checkpoints(run_cfg, rank, world, warn=run.warn, tokenizer=tokenizer if new_ids else None)
        ck = ckpts.find(fingerprint(train_enc), fingerprint(eval_enc or []))  # verified before the slow work

        # ----------------------------------------------------------------------------- model
        graphs_off = graphs_off_reason(cfg.cuda_graphs, device, world)
        shortest = shortest_bucket(max_steps * cfg.grad_accum)  # how short batches are padded for the graphs
        train = train_filter(cfg.train_modules, mcfg) if cfg.full else None  # --full: the base weights that train
        if cfg.full:  # refuses, before the loading, a run whose weights and optimizer cannot fit the GPU
            log(full_finetuning_fit(mcfg, weight_counts(mcfg, train), dtype, device, world))
        # The first step's one-time costs, paid while the model loads. Not where --gradient-checkpointing asks
        # for less memory: the warm-up's copy of the model would raise the process's peak during the loading.
        warm = None if cfg.gradient_checkpointing else WarmStart.start(
            mcfg, batches.peek(), device, dtype, lora=cfg.lora(), train=train, quantize=cfg.quantize,
            use_kernels=use_kernels,
            max_len=None if graphs_off else cfg.max_len, shortest=shortest, log=log,
            loss_fn=copy.copy(step_loss))  # a copy: the warm-up's preference metrics are not the run's
        torch.manual_seed(cfg.seed + rank)  # dropout, different on each rank (the LoRA init has its own generator)
        random.seed(cfg.seed + rank)
        model, mcfg = load_model(path, dtype=dtype, device=device, lora=cfg.lora(), quantize=cfg.quantize,
                                 use_kernels=use_kernels, lora_seed=cfg.seed,
                                 offload_activations=cfg.offload_activations, train=train, fp8=cfg.fp8)
        if cfg.train_embeddings or new_ids:  # fp32 embeddings, grown to the tokenizer, new rows at the mean row
            mcfg = train_embeddings_(model, tokenizer.vocab_size, new_ids, all_rows=cfg.train_embeddings)
            log(f"embeddings: {mcfg.vocab_size} rows ({len(new_ids)} new), training "
                f"{'every row' if cfg.train_embeddings else 'the new rows'} in fp32")
        masters = Masters(trainable_parameters(model))  # fp32 masters of bf16/fp16 weights; LoRA's are fp32 already
        checkpointing, why = choose_checkpointing(cfg, mcfg, dtype, use_kernels, device, world)
        model.gradient_checkpointing = checkpointing
        log(f"gradient checkpointing {'on' if checkpointing else 'off'}: {why}")
        if checkpointing and (line := offload_line(model, cfg, dtype, device)):
            log(line)
        ckpts.check_free_disk(model)
        what = "model" if cfg.full else "adapter"  # the run's result: out/model/ or out/adapter/
        trained = (f"weights ({cfg.train_modules or 'all'})" if cfg.full else
                   f"LoRA parameters (r={cfg.lora_r} on {cfg.lora_targets})")
        log(f"model {cfg.model}: {mcfg.n_layers} layers, {sum(p.numel() for p in masters.params) / 1e6:.2f}M trainable "
            f"{trained}; {len(train_enc)} train / {len(eval_enc)} "
            f"eval examples, {len(batches)} batches per epoch{' (packed)' if cfg.packing else ' (padded)'}")
        if cfg.dora and cfg.lora_dropout:
            log("DoRA with --lora-dropout runs on the unfused LoRA path (the fused Functions carry DoRA without it)")
        if cfg.quantize:
            from model.qlora import nf4_bytes  # imports bitsandbytes: only for --quantize nf4
            log(f"base weights quantized to NF4 ({nf4_bytes(model) / 2**30:.2f} GiB)")
        if warning := memory_warning(cfg, mcfg, dtype, use_kernels, device, checkpointing):  # CUDA only
            log(warning)
        if cfg.precompute_ref:  # DPO, IPO: the reference's log-probs once per pair, not a forward per step
            batches.ref_logps = reference_logps(model, data.pair_eval_batches(
                train_enc, batch_size=cfg.batch_size, max_len=cfg.max_len, pad_id=pad_id, packing=cfg.packing),
                device, rank, world, log)
        samples = (Samples(cfg, tokenizer, mcfg, eval_rows, log)  # answers to prompts: SFT rows only
                   if cfg.sample_every and not objective and rank == 0 else None)

        # ----------------------------------------------------------------------------- optimizer and scaler
        groups = param_groups(masters.named(), cfg.weight_decay, cfg.lora_plus_ratio)  # LoRA+: B's lr x ratio
        optimizer = masters.optimizer(groups, cfg.lr, use_kernels)  # fused AdamW; skips NaN/inf steps on the device
        scaler = LossScaler(cfg.loss_scale, cfg.scale_growth_interval, enabled=dtype == torch.float16)

        # ----------------------------------------------------------------------------- resume
        step = ckpts.restore(ck, model, optimizer, scaler, batches)
        if step >= max_steps and ckpts.result_done():
            log(f"the run in {cfg.out_dir} is complete ({step} of {max_steps} steps, {what} in "
                f"{ckpts.result_folder}); nothing to do. Raise --max-steps (with --resume-anyway) to train on")
            return 0
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else None
        forward = ddp if ddp is not None else model
        run.open(step, dataclasses.replace(run_cfg, gradient_checkpointing=checkpointing))  # lock; train_config.json
        ckpts.set_aside_newer(step)

        # ----------------------------------------------------------------------------- the loop
        model.train()
        progress = Progress(step, max_steps, log, bar=rank == 0 and sys.stdout.isatty())
        warmed = warm is not None and warm.join()  # in the timed window: what the loading did not hide
        log("CUDA graphs on" if graphs_off is None else f"CUDA graphs off: {graphs_off}")
        train_step = (EagerStep(forward, device, step_loss) if graphs_off else
                      GraphStep(forward, device, masters.weights, cfg.max_len, log, warmed, shortest, step_loss))
        score = objective.evaluate if objective else evaluate
        tokens, start = 0, None
        signals.step, signals.stage = step, "training"  # a signal now stops the run after its step
        try:
            while step < max_steps:
                signals.step = step + 1
                if any_rank(signals.due(step), world, device):
                    break
                start = position(batches)  # where an out-of-memory step rewinds to
                lr = lr_at(cfg, max_steps, step)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                progress.pause()  # checkpoints, evals and samples are not training time
                if cfg.save_every and step % cfg.save_every == 0 and step > ckpts.saved_step:
                    ckpts.save(step, model, optimizer, scaler, batches)
                if cfg.eval_every and step % cfg.eval_every == 0 and eval_sets:
                    log_eval(step, score(model, eval_sets, device), run, log)
                if samples and samples.due(step):
                    samples.log(step, model, run, log)
                progress.resume()

                micro = [next(batches) for _ in range(cfg.grad_accum)]
                num_targets = sum_over_ranks(sum(count(b) for b in micro), world, device)  # tokens, or pairs
                if num_targets == 0:  # the same on every rank
                    log(f"warning: step {step + 1} has no target tokens (every label masked); skipping it")
                    step += 1
                    continue
                loss_sum = torch.zeros((), device=device)
                for i, batch in enumerate(micro):
                    # DDP all-reduces the gradients in the last micro-step's backward only. A rank without
                    # targets here still runs backward (zero grads): the all-reduce needs every rank.
                    with ddp.no_sync() if ddp is not None and i < len(micro) - 1 else nullcontext():
                        loss_sum += train_step(batch, num_targets, scaler.scale * world)  # forward, backward
                tokens += sum(b["input_ids"].numel() for b in micro) * world

                grad_norm = masters.unscale_and_clip_(scaler, cfg.grad_clip)  # of the fp16 loss scale's unscaled grads
                loss_sum = sum_over_ranks(loss_sum, world, device)  # every rank decides alike
                applied = scaler.step(optimizer, loss_sum, grad_norm)  # skipped if NaN/inf
                train_step.zero_grad(masters)
                loss, norm = loss_sum.item(), grad_norm.item()
                pref = objective.take(num_targets, lambda t: sum_over_ranks(t, world, device)) if objective else {}
                if not applied:  # fp16 backs the loss scale off; bf16 and fp32 stop here
                    log(nonfinite_step(scaler, optimizer, loss, norm, step + 1, cfg.max_skipped_steps,
                                       ckpts.next_steps))
                step += 1

                progress.advance(step)
                if step % cfg.log_every == 0 or step == max_steps:
                    log_step(run, progress, {
                        "step": step, "loss": loss, "lr": lr, "grad_norm": norm,
                        "tokens_per_s": progress.tokens_per_s(tokens), **peak_memory(device),
                        "loss_scale": scaler.scale, "pairs" if objective else "target_tokens": num_targets,
                        "skipped": not applied, **pref},
                        max_steps, scaler.enabled)
                    tokens = 0

            # ----------------------------------------------------------------------------- finish
            progress.close()
            signals.stage = "saving"  # a signal from here on only says to wait
            if step > ckpts.saved_step:
                ckpts.save(step, model, optimizer, scaler, batches)
            if step < max_steps:
                log(f"interrupted after step {step}: saved {ckpts.last}. To continue, run the same command with "
                    "--resume auto")
                return signals.exit_status()
            final = score(model, eval_sets, device) if eval_sets else None
            log_eval(step, final, run, log)
            if samples:
                samples.log(step, model, run, log, final=True)
            result = ckpts.save_result(model, metrics=final)
            log(f"done: {what} in {result} ({'Hugging Face' if cfg.full else 'PEFT'} format), checkpoint {ckpts.last}")
            if cfg.push_to_hub and rank == 0:
                log(f"pushed the {what} to {push(result, cfg.push_to_hub)}")
            return 0
        except (OSError, torch.OutOfMemoryError) as e:  # a write that failed (disk full), or a step too big
            raise save_after_failure(e, cfg, ckpts, step, model, optimizer, scaler, batches, start,
                                     checkpointing) from e


def loss_fn(model, batch, num_targets):
    """The loss that a step differentiates: the batch's token losses (cross-entropy of each target token,
    from the model's fused head, which never holds the B×T×V logits), summed, over the target count of the
    whole optimizer step (a 0-dim fp32 tensor), so that every target token of the step weighs alike, whatever
    its micro-batch, padding or packing. Edit it to try another objective.
    A CUDA graph captures this function and replays it: tensor operations only, no host syncs (.item(),
    print, a Python branch on a tensor's value) and no Python number that changes from step to step."""
    token_loss_sum = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], targets=batch["targets"],
                           docs=batch.get("docs"), reduction="sum")
    return token_loss_sum / num_targets.clamp(min=1)  # a step without targets: loss 0, gradients 0


def lr_at(cfg, max_steps, step):
    """Linear warm-up, then cosine from lr down to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def cli(argv=None):
    """The command line (--config FILE, then the options over it): exit status 0, 2 for bad input (one line), or
    128 + a signal's number (lifecycle.py, `command_line`)."""
    return command_line(main, lambda: parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())

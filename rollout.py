"""What rl.py's loop calls for one GRPO step besides the update: the rollouts and their rewards, the old and
reference log-probs of the collated batches, the step's console line, and the held-out reward evaluation.

    sampler = GroupSampler(model, rows=P * G, max_prompt_len=M, max_new_tokens=N, pad_id=pad_id)  # once a run
    rollouts, stats = roll_out(sampler, prompts, cfg, tokenizer, stops, reward_fns, weights, generator)
    old_and_ref_logps(model, batches, objective, mu)  # batch["old_logps"] for μ > 1, "ref_logps" for β > 0
    result = evaluate_rewards(sampler, eval_prompts, cfg, tokenizer, stops, reward_fns, weights, log)
"""
import torch

import grpo
import rewards
from data.rollouts import Rollout
from evaluation import one_line
from model.lora import adapters_disabled

SHOWN = 3  # greedy held-out samples printed at each evaluation


def completions(sampler, prompts, cfg, tokenizer, stops, G, generator=None, temperature=None):
    """(completion ids, their log-probs, their texts) of G samples of each prompt (row p*G + g), from the run's
    model/generate.py GroupSampler (which samples without LoRA dropout, in train mode too). The text leaves out a
    final stop token."""
    ids, logps = sampler([p.ids for p in prompts], G, cfg.temperature if temperature is None else temperature,
                         cfg.top_p, cfg.top_k, stop_ids=stops, generator=generator)
    texts = [tokenizer.decode(c[:-1] if c and c[-1] in stops else c) for c in ids]
    return ids, logps, texts


def roll_out(sampler, prompts, cfg, tokenizer, stops, reward_fns, weights, generator):
    """(the step's rollouts with their advantages, the step's TRL-named reward statistics)."""
    G = cfg.num_generations
    ids, _, texts = completions(sampler, prompts, cfg, tokenizer, stops, G, generator)
    total, per_fn = rewards.score(reward_fns, weights, [p.question for p in prompts for _ in range(G)], texts,
                                  [p.answer for p in prompts for _ in range(G)])
    advantages = grpo.group_advantages(total, G, cfg.scale_rewards)
    groups = total.view(-1, G)
    stats = {"reward": float(total.mean()), "reward_std": float(total.std()) if len(total) > 1 else 0.0,
             **{f"rewards/{name}/mean": float(r.mean()) for name, r in per_fn.items()},
             "frac_reward_zero_std": float((groups.std(dim=1) == 0).float().mean()),
             "completions/mean_length": sum(map(len, ids)) / len(ids)}
    rollouts = [Rollout(prompts[i // G].ids, c, float(a)) for i, (c, a) in enumerate(zip(ids, advantages,
                                                                                          strict=True))]
    return rollouts, stats


@torch.no_grad()
def old_and_ref_logps(model, batches, objective, updates):
    """batch["old_logps"]: the current policy's log-probs of the target tokens, which every one of `updates` > 1
    updates divides by (the policy that sampled). With one update the batches go without them: the loss takes
    the policy's own detached log-probs (grpo.GRPOLoss), the same values, and this forward is saved.
    batch["ref_logps"]: the log-probs with the adapters off, where the loss has a KL term (β > 0)."""
    for batch in batches:
        shape = batch["targets"].shape
        if updates > 1:
            batch["old_logps"] = grpo.token_logps(model, batch, objective.temperature).view(shape)
        else:
            batch.pop("old_logps", None)
        if objective.beta > 0:
            with adapters_disabled(model):
                batch["ref_logps"] = grpo.token_logps(model, batch, objective.temperature).view(shape)


def log_rl_step(run, progress, rec, max_steps):
    """The step's console line (or the progress bar's postfix) with the metrics' names, and its metrics.jsonl
    record."""
    rec = {**rec, "tokens_per_s": 0.0}  # Progress.show's bar reads it; an RL step's rate is its rollouts'
    names = ["loss", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "kl"]
    names += [k for k in rec if k.startswith("rewards/")]
    line = " | ".join(f"{k} {rec[k]:.4g}" for k in names if k in rec)
    progress.show(rec, f"step {rec['step']}/{max_steps} | {line} | lr {rec['lr']:.2e}{progress.eta(rec['step'])}")
    del rec["tokens_per_s"]
    run.log(rec)


def evaluate_rewards(sampler, prompts, cfg, tokenizer, stops, reward_fns, weights, log):
    """{"eval_reward", "eval_pass@1"}: the mean reward of the greedy answers to the held-out prompts, and the share
    of them that exact_answer counts right (where every prompt has a reference); the first SHOWN are printed."""
    texts = []
    for i in range(0, len(prompts), sampler.rows):  # one prompt a row of the training rollouts' sampler
        texts += completions(sampler, prompts[i:i + sampler.rows], cfg, tokenizer, stops, 1, temperature=0.0)[2]
    questions, answers = [p.question for p in prompts], [p.answer for p in prompts]
    total, _ = rewards.score(reward_fns, weights, questions, texts, answers)
    result = {"eval_reward": float(total.mean())}
    if all(a is not None for a in answers):
        result["eval_pass@1"] = sum(rewards.exact_answer(questions, texts, answers)) / len(prompts)
    log(f"eval: reward {result['eval_reward']:.4f}" + (f", pass@1 {result['eval_pass@1']:.1%}"
                                                       if "eval_pass@1" in result else "") + " (greedy)")
    for q, t, a in list(zip(questions, texts, answers, strict=True))[:SHOWN]:
        log(f"sample: {one_line(q)} -> {one_line(t)} (expected: {one_line(a, 40)})")
    return result


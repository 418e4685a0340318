"""The GRPO objective over a batch of rollouts: group-relative advantages, the clipped policy-gradient loss with
its DAPO, GRPO and Dr. GRPO normalizations, GSPO's sequence-level ratio, and the KL to the reference.

    advantages = group_advantages(rewards, G)        # (P*G,): each completion's reward against its group's
    objective = GRPOLoss("dapo", beta=0.0, device=d)  # rl.py builds it from its options
    loss = objective(model, batch, count)            # a loss_fn for step.py: Σ token losses / the step's count
    objective.count(batch)                           # this micro-batch's share of that count
    objective.take(count, reduce)                    # the step's TRL-named metrics (kl, clip_ratio/...)

A rollout is one document of a batch (prompt + completion, per-document positions, as SFT packs examples); only
its completion tokens have targets. batch["seq_ids"] (B, T) numbers each token's rollout within the micro-batch
(padding reads 0 and has no target), batch["seq_lengths"] (N,) holds each rollout slot's completion-token count (0
for an empty completion), batch["rollout_mask"] (N,) is False for a padding slot (no rollout: the slots are padded
to a fixed count for a CUDA graph, see data/rollouts.py), batch["advantages"] (N,) the advantage (0 in a padding
slot), batch["old_logps"] (B, T) the sampling policy's
log-probability of each target token (left out with one update per batch of rollouts: the policy's own, detached)
and batch["ref_logps"] (B, T) the reference's (β > 0 only), both 0 where there is no target. The model's fused
head gives each target token's log-probability without the B×T×V logits (`token_logps`), so packed and padded
batches give the same numbers.

With G completions o_1..o_G of a prompt q, r_i their rewards, π_θ the policy, π_old the policy that sampled them
(π_θ itself, detached, under one update per batch), π_ref the reference (the base: the adapters off), t a token
of o_i, and every probability taken over logits / temperature (as the sampler's):
    advantage    A_i = (r_i - mean(r)) / (std(r) + 1e-4)   (unbiased std over the group; "none": r_i - mean(r))
    ratio        w_it = π_θ(o_it | q, o_i<t) / π_old(o_it | q, o_i<t)                          ("token")
                 w_it = exp(Σ_t log w_it / |o_i|), one value for all of o_i's tokens            ("sequence", GSPO)
    token loss   ℓ_it = -min(w_it A_i, clip(w_it, 1 - ε_low, 1 + ε_high) A_i) + β w_it k3_it
    KL (k3)      k3_it = exp(log π_ref - log π_θ) - (log π_ref - log π_θ) - 1   (Schulman's unbiased estimator)
                 The factor w_it (TRL's use_bias_correction_kl, its default; DeepSeek-V3.2) makes the term an
                 estimate of KL(π_θ || π_ref) from tokens that π_old sampled, unbiased in value and gradient (w
                 is 1 on policy, but its gradient is not 0); use_bias_correction_kl=False gives the GRPO
                 paper's β k3_it.
    loss         "dapo"     Σ_i Σ_t ℓ_it / Σ_i |o_i|                   token-level over the whole step
                 "grpo"     (1/N) Σ_i (Σ_t ℓ_it / |o_i|)                 the mean over each sequence, then over them
                 "dr_grpo"  Σ_i Σ_t ℓ_it / (N × max_completion_length)  a constant normalizer
where the sums run over every rollout of the step (all its micro-batches and ranks), N is their count (empty
completions included: they add 0 to the sum, as in TRL; padding slots not) and |o_i| their completion-token count.
The caller passes that step-wide denominator (`count`), as SFT's loss divides by the step's target tokens.
A step is CUDA-graph capturable (step.py's GraphStep), as preference.Objective's: it never syncs with the host,
its shapes are the batch's, and its metric sums add into a buffer on the device (`sums`) that `take` reads.
References: GRPO, Shao et al. 2024 "DeepSeekMath" (the advantage, the per-sequence mean, k3); DAPO, Yu et al.
2025 (clip-higher ε_high > ε_low, the token-level loss); Dr. GRPO, Liu et al. 2025 "Understanding R1-Zero-Like
Training" (no std scaling, the constant normalizer); GSPO, Zheng et al. 2025 (the sequence-level ratio, with a
much smaller clip range, about 3e-4 / 4e-4). The conventions (what each loss type divides by, the clip metrics,
the KL term inside the clipped loss) are those of TRL's GRPOTrainer, which the tests use as an oracle.

Metrics, as TRL names them: kl (β > 0: the mean of the KL term, w k3 or k3, over the step's completion tokens),
clip_ratio/low_mean (the share of completion tokens whose ratio is below 1 - ε_low with A < 0: the clipped ones),
clip_ratio/high_mean (above 1 + ε_high with A > 0), clip_ratio/region_mean (either); under "sequence" the clip
shares are over rollouts, as in TRL. They are step-wide means (TRL averages its micro-batches' means, which
equals this when they hold the same number of tokens). TRL's entropy and the per-sequence clip_ratio/low_min and
/high_max are not computed: the fused head gives no entropy, and a min or max over ranks needs a collective other
than the sum.
"""
import torch

from data.batches import IGNORE_INDEX

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
IMPORTANCE = ("token", "sequence")
SCALES = ("group", "none")
METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def group_advantages(rewards, G, scale="group"):
    """(P*G,) fp32: each reward minus the mean of its group of G (consecutive entries), over the group's unbiased
    std + 1e-4 ("group", GRPO) or not scaled ("none", Dr. GRPO). A group whose rewards are all equal gets 0."""
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; the scales are {', '.join(SCALES)}")
    if G < 2 or rewards.dim() != 1 or len(rewards) % G:
        raise ValueError(f"group_advantages needs groups of G >= 2 rewards each; got {len(rewards)} rewards in "
                         f"groups of {G}: use --num-generations 2 or more")
    groups = rewards.float().view(-1, G)  # (P, G)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (groups.std(dim=1, keepdim=True) + 1e-4)
    return advantages.reshape(-1)


def token_logps(model, batch, temperature=1.0):
    """(B * T,) fp32: log π(target | context) of each target token, over the logits divided by `temperature` (after
    Gemma's final softcap, as TRL and the sampler divide them), 0 where there is no target. From the fused head
    (reduction="none"): the B×T×V logits never exist."""
    losses = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], targets=batch["targets"],
                   docs=batch.get("docs"), reduction="none", temperature=temperature)
    return -losses


class GRPOLoss:
    """The clipped GRPO objective, as the loss_fn of step.py, with its metrics. See the module docstring.

    loss_type: "dapo" (the default, as TRL's), "grpo" or "dr_grpo"; epsilon_low / epsilon_high: the clip range
    (DAPO's clip-higher 0.2 / 0.28); beta: the weight of the KL to the reference (0: none, and no ref_logps);
    importance: "token" or "sequence" (GSPO); max_completion_length: Dr. GRPO's constant (its loss only);
    temperature: the sampler's, which the log-probs divide the logits by; use_bias_correction_kl: weight the KL
    term by the ratio w (TRL's default), else the plain k3 of the GRPO paper."""

    def __init__(self, loss_type="dapo", *, epsilon_low=0.2, epsilon_high=0.28, beta=0.0, importance="token",
                 max_completion_length=None, temperature=1.0, use_bias_correction_kl=True, device="cpu"):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss type {loss_type!r}; the loss types are {', '.join(LOSS_TYPES)}")
        if importance not in IMPORTANCE:
            raise ValueError(f"unknown importance sampling level {importance!r}; the levels are "
                             f"{', '.join(IMPORTANCE)}")
        if loss_type == "dr_grpo" and not (max_completion_length and max_completion_length > 0):
            raise ValueError("the dr_grpo loss divides by rollouts × max_completion_length: give "
                             "max_completion_length (the --max-new-tokens of the rollouts)")
        if not (0 <= epsilon_low < 1 and epsilon_high >= 0):
            raise ValueError(f"the clip range must have 0 <= epsilon_low < 1 and epsilon_high >= 0; got "
                             f"{epsilon_low} and {epsilon_high}")
        if beta < 0 or not temperature > 0:
            raise ValueError(f"beta must be >= 0 and temperature > 0; got beta={beta}, temperature={temperature}")
        self.loss_type, self.importance = loss_type, importance
        self.epsilon_low, self.epsilon_high, self.beta = epsilon_low, epsilon_high, beta
        self.max_completion_length, self.temperature = max_completion_length, temperature
        self.use_bias_correction_kl = use_bias_correction_kl
        # The step's metric sums and their denominators (see `take`), on the step's device: a buffer of fixed
        # address, into which a captured step adds at every replay.
        self.sums = torch.zeros(6, dtype=torch.float32, device=device)

    def __copy__(self):
        """The same loss with sums of its own (a CUDA graph's warm-up's metrics are not the run's: step.py)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, sums=torch.zeros_like(self.sums))
        return new

    def count(self, batch):
        """This micro-batch's share of the step's normalizer: its completion tokens ("dapo"), its rollouts
        ("grpo", empty completions included, as TRL's mean; padding slots not), or rollouts ×
        max_completion_length ("dr_grpo")."""
        if self.loss_type == "dapo":
            return int(batch["seq_lengths"].sum())
        n = int(batch["rollout_mask"].sum())
        return n if self.loss_type == "grpo" else n * self.max_completion_length

    def __call__(self, model, batch, count):
        """Σ of the micro-batch's token losses (per-sequence means under "grpo") / count, the step's normalizer
        summed over all micro-batches and ranks (a 0-dim fp32 tensor); adds the metric sums into self.sums."""
        total, sums = self.losses(token_logps(model, batch, self.temperature), batch)
        self.sums.add_(sums)
        return total / count.clamp(min=1)  # a step without completion tokens: loss 0, gradients 0

    def losses(self, logps, batch):
        """(the micro-batch's loss sum, a 0-dim tensor; its metric sums) from logps (B * T,), the policy's
        log-probs of the target tokens (`token_logps`). Separate from __call__ so that the tests can feed it
        log-probs of their own."""
        mask = batch["targets"].reshape(-1) != IGNORE_INDEX  # (B*T,) the completion tokens
        seq = batch["seq_ids"].reshape(-1)  # (B*T,)
        lengths = batch["seq_lengths"].to(logps.device, torch.float32)  # (N,)
        n = len(lengths)
        seq_advantages = batch["advantages"].to(logps.device, torch.float32)  # (N,)
        advantages = seq_advantages[seq]  # (B*T,)
        # Where there is no target every term is 0, so exp and the clip see finite values and the gradient there
        # is 0, never NaN (a 0 upstream gradient times exp(inf) would be).
        # Without "old_logps" (one update per batch of rollouts) the policy that sampled is this one: its own
        # log-probs, detached, as TRL's with num_iterations 1. The ratio is then 1, its gradient the policy's.
        old = batch["old_logps"].reshape(-1).float() if "old_logps" in batch else logps.detach()
        log_ratio = torch.where(mask, logps - old, 0.0)  # (B*T,)
        if self.importance == "sequence":
            seq_ratio = torch.exp(per_sequence(log_ratio, seq, n) / lengths.clamp(min=1))  # (N,)
            ratio = seq_ratio[seq]
            clip_sums = self.clip_counts(seq_ratio.detach(), seq_advantages).sum(dim=1)  # over the rollouts
        else:
            ratio = torch.exp(log_ratio)
            clip_sums = (self.clip_counts(ratio.detach(), advantages) * mask).sum(dim=1)  # over the tokens
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        token_loss = -torch.minimum(ratio * advantages, clipped * advantages)  # (B*T,)
        kl_sum = torch.zeros((), device=logps.device)
        if self.beta > 0:
            d = torch.where(mask, batch["ref_logps"].reshape(-1).float() - logps, 0.0)
            kl = torch.exp(d) - d - 1  # (B*T,) k3, 0 where there is no target
            if self.use_bias_correction_kl:
                kl = kl * ratio
            token_loss = token_loss + self.beta * kl
            kl_sum = torch.where(mask, kl.detach(), 0.0).sum()
        token_loss = torch.where(mask, token_loss, 0.0)
        if self.loss_type == "grpo":
            total = (per_sequence(token_loss, seq, n) / lengths.clamp(min=1)).sum()
        else:
            total = token_loss.sum()
        counts = torch.stack([mask.sum(), batch["rollout_mask"].sum()]).float()
        return total, torch.cat([kl_sum[None], clip_sums, counts])  # (6,): see `take`

    def clip_counts(self, ratio, advantages):
        """(3, *ratio.shape) fp32: 1 where the clip is active, as TRL counts it: low (ratio < 1 - ε_low, A < 0),
        high (ratio > 1 + ε_high, A > 0), and either (the region)."""
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        return torch.stack([low, high, low | high]).float()

    def take(self, count, reduce=lambda t: t):
        """{metric: the step's mean}, and the sums start again from 0 for the next step. count: the step's
        normalizer, as passed to __call__ (the metrics are means over their own denominators, so it only tells
        whether the step had anything to count: a loop reads every objective alike, see preference.Objective).
        reduce: sums the metrics over the ranks (distributed.sum_over_ranks)."""
        # Σ kl, Σ clipped low, high, region, completion tokens, rollouts
        kl, low, high, region, tokens, rollouts = reduce(self.sums).tolist()
        self.sums.zero_()
        if not count:
            return {}
        clip_over = max(rollouts if self.importance == "sequence" else tokens, 1)
        metrics = dict(zip(METRICS, (kl / max(tokens, 1), low / clip_over, high / clip_over, region / clip_over)))
        if self.beta == 0:
            del metrics["kl"]
        return metrics


def per_sequence(values, seq, n):
    """(n,) fp32: the sum of values (B * T,) over each rollout's tokens (seq: each token's rollout)."""
    return torch.zeros(n, dtype=torch.float32, device=values.device).index_add_(0, seq, values.float())

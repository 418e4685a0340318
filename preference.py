"""Preference tuning: the DPO, IPO, SimPO and ORPO losses over a batch of (chosen, rejected) pairs.

    objective = Objective("dpo", beta=0.1, device=device)  # train.py builds it from --method and its options
    loss = objective(model, batch, num_pairs)     # a loss_fn for step.py: Σ pair losses / the step's pairs
    objective.take(num_pairs, reduce)             # the step's TRL-named metrics, averaged over its pairs
    objective.evaluate(model, eval_sets, device)  # the same metrics over the eval pairs, prefixed eval_
    batches.ref_logps = reference_logps(model, pair_eval_batches(...), device)  # --precompute-ref (DPO, IPO)

A pair is two documents of one batch (data/preference.py): its chosen and its rejected completion, each after
the same prompt. batch["seq_ids"] (B, T) numbers each token's document within the micro-batch, 2p for pair p's
chosen side, 2p + 1 for its rejected side (padding reads 0, and has no target); batch["seq_lengths"] (2S,)
holds each side's count of completion tokens (its targets), 0 in the pair slots after the batch's pairs (a slot
without a pair is masked: `data.preference.with_sequences`). The model's fused head gives each target token's
loss without the B×T×V logits (reduction="none"); a side's log-probability is the sum of minus those losses
over its tokens (`sequence_logps`, one index_add), so packed and padded batches give the same numbers.

With π the policy (the model with its adapters), π_ref the base (the adapters off: model/lora.py,
`adapters_disabled`, under no_grad; or its log-probabilities computed once per pair before training,
`reference_logps`, which the batches then carry as "ref_logps" (2S,): --precompute-ref), log π(y|x) the sum
over the completion's tokens, |y| their count, σ the logistic function, w / l the chosen / rejected completion:
    DPO    -(1-ε) log σ(β h) - ε log σ(-β h),  h = log π(w)/π_ref(w) - log π(l)/π_ref(l)
           (Rafailov et al. 2023; ε: --label-smoothing, the conservative DPO of Mitchell 2023)
    IPO    (h' - 1/(2β))²,  h' = log π(w)/π_ref(w) / |w| - log π(l)/π_ref(l) / |l|
           (Azar et al. 2023; the per-token normalization of TRL's DPOTrainer)
    SimPO  -(1-ε) log σ(β (m - γ/β)) - ε log σ(-β (m - γ/β)),  m = log π(w)/|w| - log π(l)/|l|
           (Meng et al. 2024; reference-free)
    ORPO   -log π(w)/|w| - λ log σ(log odds(w) - log odds(l)),  log odds(y) = a - log(1 - e^a), a = log π(y)/|y|
           (Hong et al. 2024; reference-free; the NLL is over the chosen completion's tokens)
The loss of a step is the mean of the pair losses over every pair of the step (all its micro-batches and
ranks), as SFT's is the mean over target tokens: the caller passes the step's pair count.

Metrics, as TRL names them (per pair, averaged): rewards/chosen and rewards/rejected (β log π/π_ref for DPO
and IPO, β log π/|y| for SimPO, λ log π/|y| for ORPO, as TRL's trainers log them), rewards/margins (their
difference), rewards/accuracies (the share of pairs whose chosen reward is the higher), logps/chosen and
logps/rejected (the summed log-probability of the completion's tokens, whatever the loss normalizes).
A step is CUDA-graph capturable (step.py's GraphStep): its shapes are fixed per bucket (the pair slots), it never
syncs with the host, and the metrics are detached sums added into a buffer on the device (`sums`, made before any
capture) that `take` reads once per step. The reference forward runs inside the graph: `adapters_disabled` is
read when the forward's kernels are issued, so a capture records the base model's kernels for it, and every
replay runs those.
"""
import time

import torch
import torch.nn.functional as F

from distributed import sum_over_ranks
from model.lora import adapters_disabled

METHODS = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0}  # ORPO's weight is --orpo-lambda
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def sequence_logps(token_losses, seq_ids, n_seqs):
    """(n_seqs,) fp32: each document's summed log-probability, minus the sum of its tokens' losses.
    token_losses (B * T,): 0 where a token has no target, so padding and prompt tokens add nothing."""
    return torch.zeros(n_seqs, dtype=torch.float32, device=token_losses.device).index_add_(
        0, seq_ids.reshape(-1), -token_losses.float())


def pair_losses(method, logps, lengths, ref_logps=None, *, beta=None, label_smoothing=0.0, gamma=0.5, lam=0.1):
    """(losses, chosen rewards, rejected rewards), each (P,), of P pairs.

    logps, lengths, ref_logps: (2P,) each, chosen at even indices, rejected at odd (ref_logps: DPO and IPO only).
    lengths: each side's completion-token count, at least 1 (`Objective` masks pairs without one)."""
    chosen, rejected = logps[0::2], logps[1::2]
    n_chosen, n_rejected = lengths[0::2], lengths[1::2]
    if method in ("dpo", "ipo"):
        ratio_c, ratio_r = chosen - ref_logps[0::2], rejected - ref_logps[1::2]
        if method == "dpo":
            h = beta * (ratio_c - ratio_r)
            losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
        else:
            losses = (ratio_c / n_chosen - ratio_r / n_rejected - 1 / (2 * beta)) ** 2
        return losses, beta * ratio_c.detach(), beta * ratio_r.detach()
    mean_c, mean_r = chosen / n_chosen, rejected / n_rejected
    if method == "simpo":
        h = beta * (mean_c - mean_r) - gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
        return losses, beta * mean_c.detach(), beta * mean_r.detach()
    if method == "orpo":
        log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
        return -mean_c - lam * F.logsigmoid(log_odds), lam * mean_c.detach(), lam * mean_r.detach()
    raise ValueError(f"unknown preference method {method!r}; the methods are {', '.join(METHODS)}")


def log1mexp(a):
    """log(1 - e^a) for a < 0, accurate near 0 (log of -expm1). a is kept below 0: a completion whose every token
    has probability 1 in fp32 has a = 0, where the odds are infinite."""
    return torch.log(-torch.expm1(a.clamp(max=-1e-6)))


def num_pairs(batch):
    """How many pairs of `batch` count in the loss: those with a completion token on both sides."""
    lengths = batch["seq_lengths"]
    return int(((lengths[0::2] > 0) & (lengths[1::2] > 0)).sum())


class Objective:
    """A preference loss, as the loss_fn of step.py, with its metrics. See the module docstring."""

    def __init__(self, method, *, beta=None, label_smoothing=0.0, gamma=0.5, lam=0.1, device="cpu"):
        if method not in METHODS:
            raise ValueError(f"unknown preference method {method!r}; the methods are {', '.join(METHODS)}")
        self.method = method
        self.options = {"beta": DEFAULT_BETA.get(method) if beta is None else beta,
                        "label_smoothing": label_smoothing, "gamma": gamma, "lam": lam}
        # The step's metric sums over its pairs, on the step's device: a buffer of fixed address, into which a
        # captured step adds at every replay.
        self.sums = torch.zeros(len(METRICS), dtype=torch.float32, device=device)

    def __copy__(self):
        """The same loss with sums of its own (a warm-up's metrics are not the run's: step.py, train.py)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, sums=torch.zeros_like(self.sums))
        return new

    def __call__(self, model, batch, num_pairs):
        """Σ pair losses of the micro-batch / num_pairs (the step's pair count, a 0-dim fp32 tensor); adds the
        micro-batch's metric sums into self.sums."""
        losses, sums = self.losses(model, batch)
        self.sums.add_(sums)
        return losses.sum() / num_pairs.clamp(min=1)  # a step without pairs: loss 0, gradients 0

    def losses(self, model, batch):
        """(the pair losses (S,), 0 for a slot without a pair with a completion token on both sides; their metric
        sums). The reference log-probabilities are the batch's "ref_logps" where it carries them."""
        lengths = batch["seq_lengths"].float()  # (2S,)
        valid = (lengths[0::2] > 0) & (lengths[1::2] > 0)  # (S,)
        logps = self.logps(model, batch)
        ref = batch.get("ref_logps")
        if ref is None and self.method not in REFERENCE_FREE:
            base = getattr(model, "module", model)  # under DDP, the model itself: no gradient sync for the reference
            with torch.no_grad(), adapters_disabled(base):
                ref = self.logps(base, batch)
        # A pair without completion tokens gets stand-in values, so that nothing in it is 0/0 or log 0: its loss is
        # then masked to 0, and its gradient is 0, never NaN.
        pairs = torch.stack([valid, valid], 1).reshape(-1)  # (2S,) each side's pair is valid
        logps = torch.where(pairs, logps, -1.0)
        ref = None if ref is None else torch.where(pairs, ref, -1.0)
        losses, chosen, rejected = pair_losses(self.method, logps, lengths.clamp(min=1), ref, **self.options)
        losses = torch.where(valid, losses, 0.0)
        v = valid.float()
        sums = torch.stack([(chosen * v).sum(), (rejected * v).sum(), ((chosen - rejected) * v).sum(),
                            ((chosen > rejected).float() * v).sum(), (logps[0::2].detach() * v).sum(),
                            (logps[1::2].detach() * v).sum()])
        return losses, sums

    @staticmethod
    def logps(model, batch):
        """(2P,): each side's summed log-probability, from the fused head's per-token losses."""
        token_losses = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], targets=batch["targets"],
                             docs=batch.get("docs"), reduction="none")  # (B * T,)
        return sequence_logps(token_losses, batch["seq_ids"], len(batch["seq_lengths"]))

    def take(self, num_pairs, reduce=lambda t: t):
        """{metric: the step's mean over its num_pairs pairs}, read once; the sums start again from 0 for the next
        step. reduce: sums the metrics over the ranks (distributed.sum_over_ranks, in place)."""
        metrics = dict(zip(METRICS, (reduce(self.sums) / max(num_pairs, 1)).tolist()))
        self.sums.zero_()
        return metrics

    @torch.no_grad()
    def evaluate(self, model, eval_sets, device):
        """{"eval_loss", "eval_rewards/...", "eval_logps/..."}: means over every pair of the eval batches."""
        model.eval()
        loss_sum, sums, n = 0.0, 0, 0
        for batch in eval_sets:
            b = {k: v.to(device) for k, v in batch.items()}
            losses, s = self.losses(model, b)
            loss_sum, sums, n = loss_sum + float(losses.sum()), sums + s, n + num_pairs(batch)
        model.train()
        if n == 0:
            raise ValueError("the eval batches hold no pair with completion tokens on both sides, so there is no "
                             "eval loss to report; check the eval data's chosen and rejected answers")
        return {"eval_loss": loss_sum / n, **{f"eval_{k}": v for k, v in zip(METRICS, (sums / n).tolist())}}


@torch.no_grad()
def reference_logps(model, batches, device, rank=0, world=1, log=print):
    """(2N,) fp32 on the CPU: the reference log-probabilities (the base model: adapters off) of the N pairs of
    `batches`, which hold every pair once, in order (data.pair_eval_batches), chosen and rejected in turn; for
    PairBatches.ref_logps (--precompute-ref). Each rank computes every world-th batch, and the ranks sum their
    parts. A batch's pairs fill its first pair slots, and each has a completion token on both sides
    (data.load_pairs drops the others), so they are the first 2 · num_pairs(batch) sides."""
    start = time.perf_counter()
    counts = [2 * num_pairs(b) for b in batches]
    out = torch.zeros(sum(counts), dtype=torch.float32, device=device)
    base = getattr(model, "module", model)
    with adapters_disabled(base):
        for i, (batch, n) in enumerate(zip(batches, counts)):
            if i % world == rank:
                first = sum(counts[:i])
                b = {k: v.to(device) for k, v in batch.items()}
                out[first:first + n] = Objective.logps(base, b)[:n]
    out = sum_over_ranks(out, world, device).cpu()
    log(f"reference log-probabilities of {len(out) // 2} pairs precomputed in {time.perf_counter() - start:.1f}s "
        "(the base model, adapters off; computed again at every start of a run, resumed ones too)")
    return out

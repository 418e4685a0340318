"""The GRPO objective (grpo.py): the loss and its gradients against a float64 reference written from the papers
for each loss type, with and without clipping, KL, token and sequence ratios; group advantages; packed == padded;
empty completions and a step without completion tokens; log-probs at a temperature (Gemma 2's final softcap
too) against transformers' logits; and TRL's GRPOTrainer._compute_loss on the same model, adapter weights,
completions, advantages and old log-probs."""
import copy

import pytest
import torch

import grpo
from data.batches import IGNORE_INDEX, _row, _stack, pad_batch
from model import LoRAConfig, load_model
from model.lora import lora_parameters
from tests.helpers import USE_KERNELS, assert_close, randomize_lora_b, rel_err
from tests.tiny_models import save_tiny

# (loss type, importance, beta, the KL's ratio factor): every loss type, the KL on (with and without the factor)
# and off, both ratios.
CASES = [("dapo", "token", 0.0, True), ("dapo", "sequence", 0.04, True), ("grpo", "token", 0.04, False),
         ("grpo", "sequence", 0.0, True), ("dr_grpo", "token", 0.0, True), ("dr_grpo", "token", 0.04, True)]
MAX_COMPLETION = 12


def eps(importance):
    """The clip range of each ratio: DAPO's clip-higher for tokens, GSPO's much smaller one for sequences."""
    return (0.2, 0.28) if importance == "token" else (3e-4, 4e-4)


def reference_loss(loss_type, rollouts, advantages, beta, correction, importance, eps_low, eps_high, max_len):
    """The step's loss in float64, one rollout at a time, written from the formulas of the module docstring.
    rollouts: [(logps, old, ref)] of each rollout's completion tokens (each (n_i,), n_i may be 0)."""
    total = torch.zeros((), dtype=torch.float64)
    for (lp, old, ref), a in zip(rollouts, advantages):
        n = len(lp)
        w = torch.exp(lp - old) if importance == "token" else torch.exp((lp - old).sum() / max(n, 1)).expand(n)
        terms = -torch.min(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a)
        if beta:
            terms = terms + beta * (w if correction else 1) * (torch.exp(ref - lp) - (ref - lp) - 1)
        total = total + (terms.sum() / max(n, 1) if loss_type == "grpo" else terms.sum())
    n_tokens = sum(len(lp) for lp, _, _ in rollouts)
    return total / {"dapo": n_tokens, "grpo": len(rollouts), "dr_grpo": len(rollouts) * max_len}[loss_type]


def random_batch(seed, lengths, prompt=3, rows=3, width=24):
    """A batch of rollouts laid out several to a row (documents of `prompt` + n_i tokens), with per-rollout
    advantages: (batch, {"flat index of each rollout's completion tokens"}). Token ids are never read here."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.full((rows, width), IGNORE_INDEX)
    seq_ids = torch.zeros(rows, width, dtype=torch.long)
    where, row, used = [], 0, 0
    for i, n in enumerate(lengths):
        if used + prompt + n > width:
            row, used = row + 1, 0
        seq_ids[row, used:used + prompt + n] = i
        targets[row, used + prompt - 1:used + prompt - 1 + n] = 7  # a document's last token predicts nothing
        where.append(row * width + used + prompt - 1 + torch.arange(n))
        used += prompt + n
    batch = {"targets": targets, "seq_ids": seq_ids, "seq_lengths": torch.tensor(lengths),
             "rollout_mask": torch.ones(len(lengths), dtype=torch.bool),
             "advantages": torch.randn(len(lengths), generator=g)}
    return batch, where


@pytest.mark.parametrize("clipping", [False, True])
@pytest.mark.parametrize("loss_type,importance,beta,correction", CASES)
def test_loss_and_gradients_match_a_float64_reference(loss_type, importance, beta, correction, clipping):
    """GRPOLoss.losses in fp32 equals the formulas in float64, and so does the gradient of the log-probs; the
    clipping is active (some ratios outside the range) or not, as asked. Tokens without a target hold garbage
    log-probs, which must get gradient 0. An empty completion is among the rollouts."""
    lengths = [5, 0, 3, 7, 1, 4, 6, 2]
    batch, where = random_batch(0, lengths)
    g = torch.Generator().manual_seed(1)
    mask = batch["targets"].reshape(-1) != IGNORE_INDEX
    logps64 = torch.where(mask, -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3, 50.0).requires_grad_()
    spread = (0.5 if importance == "token" else 2e-3) if clipping else (0.01 if importance == "token" else 1e-5)
    old = torch.where(mask, logps64.detach() + spread * torch.randn(mask.shape, generator=g, dtype=torch.float64), 0)
    ref = torch.where(mask, logps64.detach() + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64), 0)
    batch.update(old_logps=old.float().view(3, -1), ref_logps=ref.float().view(3, -1))
    eps_low, eps_high = eps(importance)
    expected = reference_loss(loss_type, [(logps64[i], old[i], ref[i]) for i in where], batch["advantages"].double(),
                              beta, correction, importance, eps_low, eps_high, MAX_COMPLETION)
    expected.backward()

    objective = grpo.GRPOLoss(loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                              importance=importance, max_completion_length=MAX_COMPLETION,
                              use_bias_correction_kl=correction)
    logps = logps64.detach().float().requires_grad_()
    count = torch.tensor(float(objective.count(batch)))
    total, sums = objective.losses(logps, batch)
    objective.sums = sums
    (total / count).backward()
    assert rel_err(total / count, expected) < 1e-5
    assert rel_err(logps.grad, logps64.grad) < 1e-5
    assert not logps.grad[~mask].any()
    metrics = objective.take(count)
    assert (metrics["clip_ratio/region_mean"] > 0) == clipping
    assert set(metrics) == set(grpo.METRICS[beta == 0:])  # kl only with the KL term


def test_group_advantages():
    """(r - group mean) / (unbiased group std + 1e-4), or r - group mean; an all-equal group gets 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0])
    for scale in grpo.SCALES:
        out = grpo.group_advantages(rewards, 4, scale)
        for g in range(3):
            r = rewards[4 * g:4 * g + 4].double()
            expected = (r - r.mean()) / ((r.std(unbiased=True) + 1e-4) if scale == "group" else 1)
            assert_close(out[4 * g:4 * g + 4], expected, atol=1e-6, rtol=1e-6)
    assert not grpo.group_advantages(rewards, 4)[4:8].any()
    with pytest.raises(ValueError, match="G >= 2"):
        grpo.group_advantages(rewards, 5)


def test_options_are_checked():
    """A bad loss type, ratio level or clip range, or dr_grpo without its constant, is one clear error."""
    with pytest.raises(ValueError, match="loss types are dapo, grpo, dr_grpo"):
        grpo.GRPOLoss("ppo")
    with pytest.raises(ValueError, match="levels are token, sequence"):
        grpo.GRPOLoss(importance="tokens")
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo.GRPOLoss("dr_grpo")
    with pytest.raises(ValueError, match="clip range"):
        grpo.GRPOLoss(epsilon_low=1.5)


# ----------------------------------------------------------------------------- on a model

@pytest.fixture(scope="module")
def policy(run_model):
    """The tiny run model with random adapters (B != 0, so gradients reach every LoRA weight)."""
    model, _ = load_model(run_model, lora=LoRAConfig(r=4, alpha=8.0))
    randomize_lora_b(model, std=0.2)
    return model


def rollouts(n, seed=0, vocab=200):
    """n random rollouts (ids, mask): a prompt, then a completion of 0 to 6 tokens (the first one empty)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, vocab, (0 if i == 0 else int(torch.randint(1, 7, (1,), generator=g)),),
                          generator=g).tolist()
        out.append((prompt + c, [False] * len(prompt) + [True] * len(c)))
    return out


def packed(encoded, width):
    """The rollouts packed in order into rows of `width` tokens, several to a row, with their sequences."""
    rows, counts, docs, used = [], [], [], 0
    for ids, mask in encoded:
        if used + len(ids) > width:
            rows.append(_row(docs, width, 0))
            counts.append(len(docs))
            docs, used = [], 0
        docs.append((ids, mask))
        used += len(ids)
    rows.append(_row(docs, width, 0))
    counts.append(len(docs))
    return with_sequences(_stack(rows, width), torch.tensor(counts))



def with_sequences(batch, n_docs):
    """batch with "seq_ids" (each token's rollout in the micro-batch, 0 for padding), "seq_lengths" (N,) and
    "rollout_mask" (N,), the layout data/rollouts.py's collate gives; n_docs (B,): how many of a row's first
    documents are rollouts."""
    doc_ids, targets = batch["doc_ids"], batch["targets"]
    offset = torch.cumsum(n_docs, 0) - n_docs  # (B,) the row's first rollout in the micro-batch
    is_doc = doc_ids < n_docs[:, None]
    seq_ids = torch.where(is_doc, doc_ids + offset[:, None], 0)
    lengths = torch.bincount(seq_ids[is_doc & (targets != IGNORE_INDEX)], minlength=int(n_docs.sum()))
    return {**batch, "seq_ids": seq_ids, "seq_lengths": lengths, "rollout_mask": torch.ones(len(lengths), dtype=bool)}

def with_rollout_data(batch, advantages):
    """batch with its advantages and old / reference log-probs that depend only on each token's rollout and
    position (so that any layout of the same rollouts gets the same values), 0 where there is no target."""
    mask = batch["targets"] != IGNORE_INDEX
    wave = torch.sin(batch["seq_ids"] * 7.0 + batch["position_ids"] * 1.3)
    return {**batch, "advantages": advantages, "old_logps": torch.where(mask, -2.0 + 0.4 * wave, 0.0),
            "ref_logps": torch.where(mask, -2.5 + 0.3 * wave, 0.0)}


def loss_and_grads(model, objective, batch):
    model.zero_grad()
    count = torch.tensor(float(objective.count(batch)))
    loss = objective(model, batch, count)
    loss.backward()
    return loss.detach(), [p.grad.clone() for _, p in lora_parameters(model)], objective.take(count)


@pytest.mark.parametrize("loss_type,importance,beta,correction", CASES)
def test_packed_equals_padded(policy, loss_type, importance, beta, correction):
    """Rollouts packed several to a row (per-document positions) give the loss, gradients and metrics of the same
    rollouts one per row, padded; an empty completion among them changes nothing."""
    encoded = rollouts(7)
    advantages = torch.randn(7, generator=torch.Generator().manual_seed(3))
    pack = with_rollout_data(packed(encoded, 24), advantages)
    pad = with_rollout_data(with_sequences(pad_batch(encoded, pad_id=0), torch.ones(7, dtype=torch.long)),
                            advantages)
    assert len(pack["input_ids"]) < 7 and torch.equal(pack["seq_lengths"], pad["seq_lengths"])
    assert pad["seq_lengths"][0] == 0
    eps_low, eps_high = eps(importance)
    objective = grpo.GRPOLoss(loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                              importance=importance, max_completion_length=MAX_COMPLETION, temperature=0.8,
                              use_bias_correction_kl=correction)
    loss_p, grads_p, metrics_p = loss_and_grads(policy, objective, pack)
    loss_q, grads_q, metrics_q = loss_and_grads(policy, objective, pad)
    assert rel_err(loss_p, loss_q) < 1e-5
    for a, b in zip(grads_p, grads_q):
        assert b.abs().max() > 0 and rel_err(a, b) < 1e-4
    assert metrics_p.keys() == metrics_q.keys()
    for k in metrics_p:
        assert metrics_p[k] == pytest.approx(metrics_q[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_no_completion_token_gives_zero_loss_and_gradients(policy, loss_type):
    """A step whose rollouts all have empty completions: loss 0 and gradients 0, finite, with the KL on."""
    encoded = [(ids, [False] * len(ids)) for ids, _ in rollouts(3)]
    batch = with_rollout_data(with_sequences(pad_batch(encoded, pad_id=0), torch.ones(3, dtype=torch.long)),
                              torch.tensor([1.0, -1.0, 0.5]))
    objective = grpo.GRPOLoss(loss_type, beta=0.1, max_completion_length=MAX_COMPLETION)
    loss, grads, _ = loss_and_grads(policy, objective, batch)
    assert loss.item() == 0.0
    assert all(torch.isfinite(g).all() and not g.any() for g in grads)


def test_metric_sums_stay_in_one_buffer(policy):
    """The metric sums add into one buffer of fixed address, as a CUDA graph's replays add into it, which `take`
    reads and zeroes; a copy of the loss (a graph's warm-up runs one) adds into a buffer of its own."""
    batch = with_rollout_data(with_sequences(pad_batch(rollouts(3), pad_id=0), torch.ones(3, dtype=torch.long)),
                              torch.tensor([1.0, -1.0, 0.5]))
    objective = grpo.GRPOLoss("dapo", beta=0.1)
    buffer = objective.sums
    count = torch.tensor(float(objective.count(batch)))
    with torch.no_grad():
        objective(policy, batch, count)
        once = buffer.clone()
        warm_up = copy.copy(objective)
        warm_up(policy, batch, count)
        objective(policy, batch, count)
    assert objective.sums is buffer and torch.equal(buffer, 2 * once) and torch.equal(warm_up.sums, once)
    assert objective.take(count)["kl"] > 0 and not buffer.any()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("use_kernels", USE_KERNELS)
def test_token_logps_at_a_temperature_match_transformers(tmp_path, family, use_kernels):
    """token_logps at temperature T is log_softmax(logits / T) of transformers' logits (after Gemma 2's final
    softcap, as TRL divides them), gathered at the targets, 0 elsewhere; through the Triton head and the torch
    reference alike."""
    hf = save_tiny(family, str(tmp_path))
    model, _ = load_model(str(tmp_path), use_kernels=use_kernels)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    batch = with_sequences(pad_batch([(ids[0].tolist(), [False] * 4 + [True] * 7),
                                      (ids[1, :6].tolist(), [False] * 2 + [True] * 4)], pad_id=0),
                           torch.ones(2, dtype=torch.long))
    targets = batch["targets"]
    mask = targets != IGNORE_INDEX
    with torch.no_grad():
        logits = hf(batch["input_ids"], attention_mask=(batch["doc_ids"] == 0).long()).logits
        for T in (1.0, 0.6):
            expected = torch.log_softmax(logits.double() / T, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            out = grpo.token_logps(model, batch, T).view_as(targets)
            assert_close(out[mask], expected[mask], atol=2e-5, rtol=1e-5, name=f"T={T}")
            assert not out[~mask].any()


# ----------------------------------------------------------------------------- TRL as the oracle

PROMPT = 5  # every prompt has this many tokens: TRL left-pads prompts, and its forward takes no position ids


@pytest.fixture(scope="module")
def trl_setup(run_model, policy, tmp_path_factory):
    """(TRL's GRPOTrainer at temperature 0.7 with the policy's adapter weights in its PEFT model, TRL's inputs of
    four rollouts (prompt, completion: 6, 3, 1 and 0 tokens, advantages, old and reference log-probs), our batch
    of the same rollouts, padded one per row)."""
    pytest.importorskip("trl")
    import transformers as tf
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer
    hf = tf.AutoModelForCausalLM.from_pretrained(run_model, attn_implementation="eager", dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=6, temperature=0.7)
    trainer = GRPOTrainer(model=hf, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4),
                          processing_class=tf.AutoTokenizer.from_pretrained(run_model),
                          peft_config=LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", lora_dropout=0.0))
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    peft = trainer.model
    params = dict(peft.named_parameters())
    with torch.no_grad():
        for n, p in lora_parameters(policy):
            params[f"base_model.model.{n}.default.weight"].copy_(p)
    g = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids = torch.randint(3, 200, (4, PROMPT), generator=g), torch.randint(3, 200, (4, 6),
                                                                                                 generator=g)
    lengths = [6, 3, 1, 0]
    completion_mask = (torch.arange(6) < torch.tensor(lengths)[:, None]).long()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -0.7, 0.4, -1.2]),
              "num_items_in_batch": completion_mask.sum()}
    with torch.no_grad():  # the current log-probs, moved: the first two rollouts' ratios leave the clip range on
        logps, _, _ = trainer._get_per_token_logps_and_entropies(  # the side of their advantage's sign
            peft, torch.cat([prompt_ids, completion_ids], 1), torch.cat([inputs["prompt_mask"], completion_mask], 1), 6)
    shift = torch.tensor([-1.0, 1.0, 0.0, 0.0])[:, None]
    inputs["old_per_token_logps"] = (logps + 0.3 * (torch.randn(logps.shape, generator=g) + shift)) * completion_mask
    inputs["ref_per_token_logps"] = (logps + 0.5 * torch.randn(logps.shape, generator=g)) * completion_mask
    encoded = [(prompt_ids[i].tolist() + completion_ids[i, :n].tolist(), [False] * PROMPT + [True] * n)
               for i, n in enumerate(lengths)]
    batch = with_sequences(pad_batch(encoded, pad_id=0), torch.ones(4, dtype=torch.long))
    at = torch.zeros(4, PROMPT + 6, 2)  # (old, ref) at each token's position in our rows: completion token j is
    at[:, PROMPT - 1:PROMPT + 5] = torch.stack([inputs["old_per_token_logps"], inputs["ref_per_token_logps"]], -1)
    width = batch["targets"].shape[1]  # predicted at position PROMPT - 1 + j
    batch.update(advantages=inputs["advantages"], old_logps=at[:, :width, 0], ref_logps=at[:, :width, 1])
    return trainer, peft, inputs, batch


@pytest.mark.parametrize("loss_type,importance,beta,correction", [
    ("dapo", "token", 0.0, True), ("grpo", "token", 0.04, False), ("dr_grpo", "token", 0.04, True),
    ("grpo", "sequence", 0.0, True), ("dapo", "sequence", 0.04, True)])
def test_matches_trl(trl_setup, policy, loss_type, importance, beta, correction):
    """On the same model, adapter weights, completions, advantages and old / reference log-probs, the loss and the
    metrics equal TRL GRPOTrainer._compute_loss's (at temperature 0.7, with and without KL and its ratio factor)."""
    trainer, peft, inputs, batch = trl_setup
    trainer.loss_type, trainer.beta, trainer.importance_sampling_level = loss_type, beta, importance
    trainer.args.use_bias_correction_kl = correction
    eps_low, eps_high = eps(importance)
    trainer.epsilon_low, trainer.epsilon_high = eps_low, eps_high
    trainer._metrics["train"] = type(trainer._metrics["train"])(list)
    with torch.no_grad():
        expected = trainer._compute_loss(peft, inputs)
    objective = grpo.GRPOLoss(loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta, importance=importance,
                              max_completion_length=6, temperature=0.7, use_bias_correction_kl=correction)
    count = torch.tensor(float(objective.count(batch)))
    with torch.no_grad():
        loss = objective(policy, batch, count)
    metrics = objective.take(count)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    assert metrics["clip_ratio/region_mean"] > 0  # the clipping is exercised
    for k, v in metrics.items():
        assert v == pytest.approx(trainer._metrics["train"][k][-1], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("loss_type,importance,beta,correction", CASES)
def test_one_update_without_old_logps_equals_the_detached_policy(policy, loss_type, importance, beta, correction):
    """With one update per batch of rollouts the batch carries no old_logps: the loss divides by the policy's own
    detached log-probs, and gives the loss, gradients and metrics of a batch whose old_logps are those values."""
    encoded = rollouts(5)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.0])
    batch = with_rollout_data(with_sequences(pad_batch(encoded, pad_id=0), torch.ones(5, dtype=torch.long)),
                              advantages)
    objective = grpo.GRPOLoss(loss_type, importance=importance, beta=beta, use_bias_correction_kl=correction,
                              max_completion_length=MAX_COMPLETION)
    with torch.no_grad():
        own = grpo.token_logps(policy, batch, objective.temperature).view(batch["targets"].shape)
    given = loss_and_grads(policy, objective, {**batch, "old_logps": own})
    left_out = loss_and_grads(policy, objective, {k: v for k, v in batch.items() if k != "old_logps"})
    assert_close(left_out[0], given[0], atol=1e-6, rtol=1e-5)
    for a, b in zip(left_out[1], given[1]):
        assert_close(a, b, atol=1e-7, rtol=1e-5)
    assert left_out[2].keys() == given[2].keys()

"""Preference tuning (preference.py, data/preference.py, --method): each loss against a float64 reference with
its gradients, packed == padded, a batch without completion tokens, the reference model (adapters off), TRL's
DPOTrainer, CPOTrainer (SimPO) and ORPOTrainer on the same model and adapter weights, the data formats and what
is dropped, and an end-to-end run whose resume is exact."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

import data
import preference
import step
import train
from data.preference import PairBatches, pack_pairs, pad_pairs, with_sequences
from model import LoRAConfig, load_model
from model.lora import adapters_disabled, lora_parameters
from tests.helpers import randomize_lora_b, read_metrics, rel_err, untimed

OPTIONS = {"dpo": {"beta": 0.1, "label_smoothing": 0.1}, "ipo": {"beta": 0.1}, "simpo": {"beta": 2.0, "gamma": 0.5,
           "label_smoothing": 0.1}, "orpo": {"lam": 0.1}}


def reference_losses(method, logps, lengths, ref, beta=0.1, label_smoothing=0.0, gamma=0.5, lam=0.1):
    """The pair losses written out from the papers, in float64, one pair at a time."""
    out = []
    for p in range(len(logps) // 2):
        c, r, nc, nr = logps[2 * p], logps[2 * p + 1], lengths[2 * p], lengths[2 * p + 1]
        if method == "dpo":
            h = beta * ((c - ref[2 * p]) - (r - ref[2 * p + 1]))
            out.append(-(1 - label_smoothing) * torch.log(torch.sigmoid(h))
                       - label_smoothing * torch.log(torch.sigmoid(-h)))
        elif method == "ipo":
            out.append(((c - ref[2 * p]) / nc - (r - ref[2 * p + 1]) / nr - 1 / (2 * beta)) ** 2)
        elif method == "simpo":
            h = beta * (c / nc - r / nr) - gamma
            out.append(-(1 - label_smoothing) * torch.log(torch.sigmoid(h))
                       - label_smoothing * torch.log(torch.sigmoid(-h)))
        else:
            pc, pr = torch.exp(c / nc), torch.exp(r / nr)
            out.append(-c / nc - lam * torch.log(torch.sigmoid(torch.log(pc / (1 - pc)) - torch.log(pr / (1 - pr)))))
    return torch.stack(out)


@pytest.mark.parametrize("method", preference.METHODS)
def test_losses_match_a_float64_reference(method):
    """pair_losses in fp32 equals the papers' formulas in float64, and so do the gradients of the log-probs."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (16,), generator=g).double()
    logps64 = (-lengths * torch.rand(16, generator=g, dtype=torch.float64) * 2).requires_grad_()
    ref64 = logps64.detach() + torch.randn(16, generator=g, dtype=torch.float64)
    expected = reference_losses(method, logps64, lengths, ref64, **OPTIONS[method])
    expected.sum().backward()
    logps = logps64.detach().float().requires_grad_()
    losses, _, _ = preference.pair_losses(method, logps, lengths.float(), ref64.float(), **OPTIONS[method])
    losses.sum().backward()
    assert rel_err(losses, expected) < 1e-5
    assert rel_err(logps.grad, logps64.grad) < 1e-5


@pytest.fixture(scope="module")
def policy(run_model):
    """The tiny run model with random adapters (B != 0, so the policy differs from the reference)."""
    model, _ = load_model(run_model, lora=LoRAConfig(r=4, alpha=8.0))
    randomize_lora_b(model, std=0.2)
    return model


def sides(n, seed=0, prompt=5, vocab=300):
    """n random pairs, flat: each side a prompt shared by the pair and a completion of its own length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        for _ in range(2):
            c = torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            out.append((p + c, [False] * prompt + [True] * len(c)))
    return out


def loss_and_grads(model, method, batch):
    model.zero_grad()
    objective = preference.Objective(method, **OPTIONS[method], device=batch["input_ids"].device)
    loss = objective(model, batch, torch.tensor(float(preference.num_pairs(batch))))
    loss.backward()
    return loss.detach(), [p.grad.clone() for _, p in lora_parameters(model)], objective.take(1)


@pytest.mark.parametrize("method", preference.METHODS)
def test_packed_equals_padded(policy, method):
    """Pairs packed into rows (per-document positions) give the loss, the gradients and the metrics of the same
    pairs padded one side per row."""
    encoded = sides(5)
    rows, pairs = pack_pairs(encoded, 48, pad_id=0)
    assert len(pairs) > 1 and int(pairs.max()) > 1  # several rows, several pairs in a row
    packed = with_sequences(rows, 2 * pairs)
    loss_p, grads_p, metrics_p = loss_and_grads(policy, method, packed)
    loss_q, grads_q, metrics_q = loss_and_grads(policy, method, pad_pairs(encoded, pad_id=0))
    assert rel_err(loss_p, loss_q) < 1e-5
    for a, b in zip(grads_p, grads_q):
        assert rel_err(a, b) < 1e-4
    assert metrics_p.keys() == set(preference.METRICS)
    for k in metrics_p:
        assert metrics_p[k] == pytest.approx(metrics_q[k], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("method", preference.METHODS)
def test_no_completion_token_gives_zero_loss_and_gradients(policy, method):
    """A batch whose sides have no target: loss 0 and gradients 0, finite (no 0/0, no log 0)."""
    encoded = [(ids, [False] * len(ids)) for ids, _ in sides(2)]
    batch = pad_pairs(encoded, pad_id=0)
    assert preference.num_pairs(batch) == 0
    loss, grads, _ = loss_and_grads(policy, method, batch)
    assert loss.item() == 0.0
    assert all(torch.isfinite(g).all() and not g.any() for g in grads)


def trimmed(batch):
    """`batch` without its pair slots that hold no pair (and so as with_sequences made it before it had slots)."""
    n = 2 * preference.num_pairs(batch)
    return {**batch, **{k: batch[k][:n] for k in ("seq_lengths", "ref_logps") if k in batch}}


@pytest.mark.parametrize("method", preference.METHODS)
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_empty_pair_slots_change_nothing(policy, method, layout):
    """A micro-batch has a power of two of pair slots (one shape per bucket for the CUDA graphs); the slots without a
    pair leave the loss, the gradients and the metrics as they are without them, and num_pairs does not count them."""
    encoded = sides(3)
    if layout == "packed":
        rows, pairs = pack_pairs(encoded, 96, pad_id=0)
        batch = with_sequences(rows, 2 * pairs)
    else:
        batch = pad_pairs(encoded, pad_id=0)
    assert batch["seq_lengths"].shape == (8,) and not batch["seq_lengths"][6:].any()
    assert preference.num_pairs(batch) == 3
    loss, grads, metrics = loss_and_grads(policy, method, batch)
    loss_t, grads_t, metrics_t = loss_and_grads(policy, method, trimmed(batch))
    assert rel_err(loss, loss_t) < 1e-6
    for a, b in zip(grads, grads_t):
        assert rel_err(a, b) < 1e-6
    for k in metrics:
        assert metrics[k] == pytest.approx(metrics_t[k], rel=1e-6, abs=1e-7)


def pair_batches(encoded, packing, ref_logps=None):
    batches = PairBatches(encoded, batch_size=2, max_len=48, pad_id=0, packing=packing, seed=3)
    batches.ref_logps = ref_logps
    return batches


@pytest.mark.parametrize("method", ["dpo", "ipo"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_precomputed_reference_equals_the_reference_forward(policy, method, packing):
    """--precompute-ref: the reference log-probabilities computed once per pair (in eval batches, adapters off) and
    carried by the training batches give the loss, the gradients and the metrics of the reference forward at every
    step, for every batch of an epoch (shuffled: each pair's log-probabilities go with that pair)."""
    encoded = sides(7, seed=1)
    evals = data.pair_eval_batches(encoded, batch_size=2, max_len=48, pad_id=0, packing=packing)
    lines = []
    ref = preference.reference_logps(policy, evals, torch.device("cpu"), log=lines.append)
    assert ref.shape == (14,) and "reference log-probabilities of 7 pairs precomputed in" in lines[0]
    plain, precomputed = pair_batches(encoded, packing), pair_batches(encoded, packing, ref)
    for _ in range(len(plain)):
        batch, batch_r = next(plain), next(precomputed)
        assert "ref_logps" not in batch and batch_r["ref_logps"].shape == batch_r["seq_lengths"].shape
        loss, grads, metrics = loss_and_grads(policy, method, batch)
        loss_r, grads_r, metrics_r = loss_and_grads(policy, method, batch_r)
        assert rel_err(loss_r, loss) < 1e-5
        for a, b in zip(grads_r, grads):
            assert rel_err(a, b) < 1e-5
        assert abs(metrics["rewards/margins"]) > 1e-3  # the reference differs from the policy
        for k in metrics:
            assert metrics_r[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("precomputed", [False, True], ids=["reference-forward", "precomputed-reference"])
def test_graph_body_of_a_preference_step_matches_eager(policy, packing, precomputed):
    """What a CUDA graph records for a DPO step (step.py's GraphStep body, uncaptured on the CPU), on the batch
    padded to its length bucket, twice in a row: the eager step's loss, its gradients accumulated, and its metrics
    accumulated in the Objective's buffer (read once by take)."""
    encoded = sides(4, seed=2)
    ref = None
    if precomputed:
        evals = data.pair_eval_batches(encoded, batch_size=2, max_len=48, pad_id=0, packing=packing)
        ref = preference.reference_logps(policy, evals, torch.device("cpu"), log=lambda *a: None)
    batch = next(pair_batches(encoded, packing, ref))
    n = preference.num_pairs(batch)
    params = [p for _, p in lora_parameters(policy)]
    loss, want, metrics = loss_and_grads(policy, "dpo", batch)
    objective = preference.Objective("dpo", **OPTIONS["dpo"])
    body = step.GraphStep(policy, torch.device("cpu"), params, max_len=128, loss_fn=objective)
    padded = step.pad_to_bucket(batch, 128)
    assert padded["seq_ids"].shape == padded["input_ids"].shape == (len(batch["input_ids"]), 128)
    assert padded["seq_lengths"] is batch["seq_lengths"]
    g = SimpleNamespace(batch={**padded, "docs": None}, num_targets=torch.tensor(float(n)),
                        loss_mult=torch.tensor(1.0))
    policy.zero_grad()
    for p in params:
        p.grad = torch.zeros_like(p)
    for times in (1, 2):
        got = body._step(g)
        assert rel_err(got, loss) < 1e-5
        for p, w in zip(params, want):
            assert rel_err(p.grad, times * w) < 1e-5
    twice = objective.take(2)  # loss_and_grads took the sums over 1
    for k in metrics:
        # rewards and margins are beta times differences of log-prob sums of hundreds of nats, each rounded in fp32
        # (padded and unpadded GEMMs round alike only to about 1e-7 of those sums): their error is absolute
        assert twice[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-5), k
    assert not objective.sums.any()  # take starts the next step's sums from 0


def test_a_graph_per_pair_slot_count(monkeypatch):
    """GraphStep captures micro-batches of one row shape but other pair-slot counts as graphs of their own (a graph
    reads buffers of fixed shapes), and keeps seq_ids, seq_lengths and ref_logps in the batch it captures."""
    graph = step.GraphStep(None, torch.device("cpu"), [], max_len=48, warmed=True)
    captured = []

    def capture(batch, num_pairs, loss_mult):  # what each new shape is captured with, no GPU
        captured.append({k: tuple(v.shape) for k, v in batch.items() if k in ("seq_ids", "seq_lengths", "ref_logps")})
        return SimpleNamespace(load=lambda *a: None, graph=SimpleNamespace(replay=lambda: None), loss=None)

    monkeypatch.setattr(graph, "_capture", capture)
    two = pad_pairs(sides(2), pad_id=0, ref_logps=torch.zeros(4))
    four = {**two, "seq_lengths": torch.cat([two["seq_lengths"], torch.zeros(4, dtype=torch.long)]),
            "ref_logps": torch.zeros(8)}  # the same pairs in 4 slots
    for batch in (two, four, two, four):
        graph(batch, 2, 1.0)
    assert captured == [{"seq_ids": (4, 48), "seq_lengths": (4,), "ref_logps": (4,)},
                        {"seq_ids": (4, 48), "seq_lengths": (8,), "ref_logps": (8,)}]


def test_a_copy_of_the_objective_has_sums_of_its_own(policy):
    """The warm-ups (step.py's, WarmStart's) run a copy of the loss: its metrics never reach the run's."""
    import copy
    objective = preference.Objective("dpo")
    clone = copy.copy(objective)
    batch = pad_pairs(sides(2), pad_id=0)
    with torch.no_grad():
        clone(policy, batch, torch.tensor(2.0))
    assert clone.sums.any() and not objective.sums.any()
    assert clone.method == objective.method and clone.options == objective.options


def test_adapters_disabled_is_the_base_model(run_model, policy):
    """Inside adapters_disabled the model computes as the base without adapters; after it, as before."""
    base, _ = load_model(run_model)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = policy(ids)
        with adapters_disabled(policy):
            off = policy(ids)
        assert torch.equal(policy(ids), adapted)
        assert rel_err(off, base(ids)) < 1e-6
        assert rel_err(adapted, base(ids)) > 1e-3  # the adapters do change the output


# ----------------------------------------------------------------------------- TRL as the oracle

@pytest.fixture(scope="module")
def trl_setup(run_model, policy, tmp_path_factory):
    """(TRL's DPO collator batch of two pairs, the PEFT model with the policy's adapter weights, our batch of the
    same tokens, padded)."""
    pytest.importorskip("trl")
    import transformers as tf
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer
    hf = tf.AutoModelForCausalLM.from_pretrained(run_model, attn_implementation="eager", dtype=torch.float32)
    rows = [{"prompt": "Q: 12+30=", "chosen": " 42", "rejected": " 41, I think"},
            {"prompt": "Name a color:", "chosen": " blue", "rejected": " the number seven"}]
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], per_device_train_batch_size=2,
                     use_cpu=True, bf16=False)
    trainer = DPOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tf.AutoTokenizer.from_pretrained(run_model),
                         peft_config=LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", lora_dropout=0.0))
    peft = trainer.model
    assert "ref" not in peft.peft_config  # the reference is the base with the adapter off, as ours
    params = dict(peft.named_parameters())
    with torch.no_grad():
        for n, p in lora_parameters(policy):
            params[f"base_model.model.{n}.default.weight"].copy_(p)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    n = len(batch["input_ids"]) // 2  # TRL's rows: the chosen sides, then the rejected ones
    encoded = []
    for p in range(n):
        for row in (p, p + n):
            length = int(batch["attention_mask"][row].sum())
            encoded.append((batch["input_ids"][row, :length].tolist(),
                            batch["completion_mask"][row, :length].bool().tolist()))
    return trainer, batch, peft, pad_pairs(encoded, pad_id=0)


def ours(policy, method, batch, **options):
    objective = preference.Objective(method, **options)
    with torch.no_grad():
        losses, _ = objective.losses(policy, batch)
        loss = objective(policy, batch, torch.tensor(float(preference.num_pairs(batch))))
    return loss, losses, objective.take(preference.num_pairs(batch))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_and_ipo_match_trl(trl_setup, policy, loss_type):
    """On the same batch and weights, the loss and the metrics equal TRL DPOTrainer's (beta 0.1)."""
    trainer, batch, peft, our_batch = trl_setup
    trainer.loss_types, trainer._metrics["train"] = [loss_type], type(trainer._metrics["train"])(list)
    with torch.no_grad():
        expected = trainer._compute_loss(peft, batch, False)
    loss, _, metrics = ours(policy, "dpo" if loss_type == "sigmoid" else "ipo", our_batch, beta=0.1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    assert abs(metrics["rewards/margins"]) > 1e-3  # the adapters make the policy differ from the reference
    for k in preference.METRICS:
        assert metrics[k] == pytest.approx(trainer._metrics["train"][k][-1], rel=1e-4, abs=1e-6), k


def trl_logps(peft, our_batch, trl_batch):
    """(chosen, rejected) per-token mean log-probs of the completions, by TRL's get_batch_logps over the PEFT
    model's logits (labels: the completion tokens only)."""
    from trl.experimental.cpo import CPOTrainer
    labels = trl_batch["input_ids"].masked_fill(trl_batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        logits = peft(input_ids=trl_batch["input_ids"], attention_mask=trl_batch["attention_mask"]).logits
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    return logps.chunk(2)


def test_simpo_matches_trl_cpo(trl_setup, policy):
    """SimPO equals trl.experimental.cpo.CPOTrainer(loss_type="simpo", cpo_alpha=0): loss and rewards."""
    from trl.experimental.cpo import CPOTrainer
    _, batch, peft, our_batch = trl_setup
    chosen, rejected = trl_logps(peft, our_batch, batch)
    fake = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.0,
                           accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(fake, chosen, rejected)
    loss, _, metrics = ours(policy, "simpo", our_batch, beta=2.0, gamma=0.5)
    assert loss.item() == pytest.approx(losses.mean().item(), rel=1e-4)
    assert metrics["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), rel=1e-4)
    assert metrics["rewards/margins"] == pytest.approx((chosen_rewards - rejected_rewards).mean().item(), rel=1e-4)


def test_orpo_terms_match_trl(trl_setup, policy):
    """ORPO's odds-ratio term equals trl.experimental.orpo.ORPOTrainer's (its beta is our lambda); the NLL term is
    over the chosen completion (TRL's is over prompt + chosen), so it is compared with the completion's mean
    log-prob from TRL's get_batch_logps."""
    from trl.experimental.orpo import ORPOTrainer
    _, batch, peft, our_batch = trl_setup
    chosen, rejected = trl_logps(peft, our_batch, batch)
    fake = SimpleNamespace(beta=0.1, accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(fake, chosen, rejected)
    _, with_odds, metrics = ours(policy, "orpo", our_batch, lam=0.1)
    _, nll, _ = ours(policy, "orpo", our_batch, lam=0.0)
    assert (with_odds - nll).tolist() == pytest.approx((-losses).tolist(), rel=1e-4)
    assert nll.tolist() == pytest.approx((-chosen).tolist(), rel=1e-4)
    assert metrics["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), rel=1e-4)
    assert metrics["rewards/rejected"] == pytest.approx(rejected_rewards.mean().item(), rel=1e-4)


# ----------------------------------------------------------------------------- data


def test_pair_formats(run_model):
    """Text, chat and implicit-prompt rows become (prompt, completion) sides; the loss is on the completions."""
    assert data.pair_sides({"prompt": "Q:", "chosen": " a", "rejected": " b"})[0] == {"prompt": "Q:",
                                                                                    "completion": " a"}
    assert data.pair_sides({"chosen": "Q: 1+1= 2", "rejected": "Q: 1+1= 3"}) == (
        {"prompt": "Q: 1+1=", "completion": " 2"}, {"prompt": "Q: 1+1=", "completion": " 3"})
    user = {"role": "user", "content": "hi"}
    chosen, rejected = data.pair_sides({"chosen": [user, {"role": "assistant", "content": "hello"}],
                                        "rejected": [user, {"role": "assistant", "content": "go away"}]})
    assert chosen["prompt"] == [user] and rejected["completion"] == [{"role": "assistant", "content": "go away"}]


def write_pairs(path, rows):
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_malformed_row_is_named_and_drops_are_counted(run_model, tmp_path):
    """A row in no pair format is named with its line; empty sides and over-long prompts are dropped and counted."""
    from model import load_tokenizer
    tok = load_tokenizer(run_model)
    bad = write_pairs(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"text": "x"}])
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: expected a preference pair"):
        data.load_pairs(tok, data=bad, log=lambda *a: None)
    rows = [{"prompt": "Q:", "chosen": " yes", "rejected": " no"}] * 3 + [
        {"prompt": "Q:", "chosen": " ", "rejected": " no"}, {"prompt": "long " * 40, "chosen": " a", "rejected": " b"}]
    lines = []
    train_enc, _ = data.load_pairs(tok, data=write_pairs(tmp_path / "p.jsonl", rows), max_len=64, log=lines.append)
    assert len(train_enc) == 6
    assert any("3 pairs of 5; dropped 1 with an empty side, 1 whose prompts leave no room" in s for s in lines), lines


def test_a_long_pair_is_cut_to_fit():
    """Both sides together fit max_len: the longer completion is cut first, the prompt kept."""
    pair = [([1] * 4 + [5] * 20, [False] * 4 + [True] * 20), ([1] * 4 + [6] * 3, [False] * 4 + [True] * 3)]
    (c, mc), (r, _) = data.preference.fit_pair(pair, 20)
    assert len(c) + len(r) == 20 and r == pair[1][0] and c[:4] == [1] * 4 and mc.count(True) == 9
    assert data.preference.fit_pair(pair, 9) is None


# ----------------------------------------------------------------------------- end to end


def test_dpo_run_writes_trl_metrics_and_resumes_exactly(run_model, tmp_path):
    """train.py --method dpo trains, logs TRL's metric names (train and eval_), and a resume from its middle
    checkpoint reproduces the uninterrupted run's records exactly."""
    rows = [{"prompt": f"Q: {a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a * b + 1} or so"}
            for a in range(6) for b in range(4)]
    pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
    held_out = write_pairs(tmp_path / "eval.jsonl", rows[:4])
    out = tmp_path / "out"
    argv = ["--model", run_model, "--data", pairs, "--eval-data", held_out, "--out-dir", str(out), "--device", "cpu",
            "--dtype", "fp32", "--no-kernels", "--max-len", "64", "--batch-size", "2", "--max-steps", "4",
            "--warmup-steps", "1", "--eval-every", "2", "--save-every", "2", "--keep-checkpoints", "0",
            "--eval-batches", "1", "--lr", "3e-3", "--method", "dpo", "--lora-dropout", "0.1"]
    assert train.cli(argv) == 0
    full = read_metrics(out)
    steps = [r for r in full if "loss" in r and "step" in r and "eval_loss" not in r]
    evals = [r for r in full if "eval_loss" in r]
    assert len(steps) == 4 and len(evals) == 3
    assert all(k in steps[-1] for k in preference.METRICS) and steps[-1]["pairs"] > 0
    assert all(f"eval_{k}" in evals[-1] for k in preference.METRICS)
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # B = 0 at the start: the policy is the reference
    shutil.rmtree(out / "adapter")
    assert train.cli(argv + ["--resume", str(out / "checkpoints" / "step-0000002")]) == 0
    assert untimed(read_metrics(out)) == untimed(full)


def test_precompute_ref_run_matches_the_reference_forward_and_resumes_exactly(run_model, tmp_path, capsys):
    """train.py --method dpo --precompute-ref: the header says how long the reference took; the run's records equal
    those of the run without it (to fp32 rounding); a resume from its middle checkpoint reproduces them exactly."""
    rows = [{"prompt": f"Q: {a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a * b + 1} or so"}
            for a in range(6) for b in range(4)]
    pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
    argv = ["--model", run_model, "--data", pairs, "--eval-fraction", "0", "--device", "cpu", "--dtype", "fp32",
            "--no-kernels", "--max-len", "64", "--batch-size", "2", "--max-steps", "4", "--warmup-steps", "1",
            "--save-every", "2", "--keep-checkpoints", "0", "--lr", "3e-3", "--method", "dpo"]
    assert train.cli(argv + ["--out-dir", str(tmp_path / "plain")]) == 0
    out = tmp_path / "pre"
    assert train.cli(argv + ["--out-dir", str(out), "--precompute-ref"]) == 0
    assert "reference log-probabilities of 24 pairs precomputed in" in capsys.readouterr().out
    plain, full = untimed(read_metrics(tmp_path / "plain")), untimed(read_metrics(out))
    steps = [r for r in full if "loss" in r]
    assert len(steps) == 4 and steps[-1]["rewards/margins"] != 0
    for a, b in zip(steps, [r for r in plain if "loss" in r]):
        assert a.keys() == b.keys()
        for k in preference.METRICS + ("loss", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    shutil.rmtree(out / "adapter")
    assert train.cli(argv + ["--out-dir", str(out), "--precompute-ref", "--resume",
                             str(out / "checkpoints" / "step-0000002")]) == 0
    assert untimed(read_metrics(out)) == full


def test_method_options_are_checked():
    from config import UserError, parse_args
    with pytest.raises(UserError, match="--train-on-inputs trains prompts"):
        parse_args(["--method", "dpo", "--train-on-inputs"])
    with pytest.raises(UserError, match="--beta must be > 0"):
        parse_args(["--method", "dpo", "--beta", "0"])
    assert parse_args(["--method", "simpo"]).objective().options["beta"] == 2.0
    with pytest.raises(UserError, match="--method simpo has no reference model: drop --precompute-ref"):
        parse_args(["--method", "simpo", "--precompute-ref"])
    assert parse_args(["--method", "ipo", "--precompute-ref", "--cuda-graphs", "on"]).precompute_ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", preference.METHODS)
def test_fused_path_on_gpu_matches_the_reference(run_model, method):
    """On CUDA, the Triton kernels (the fused head's per-token losses, the fused LoRA) in bf16 give the loss, the
    gradients and the metrics of the torch references in fp32 on the same packed pairs, within bf16's rounding."""
    encoded = sides(6)
    rows, pairs = pack_pairs(encoded, 48, pad_id=0)
    batch = {k: v.cuda() for k, v in with_sequences(rows, 2 * pairs).items()}
    results = []
    for dtype, kernels in ((torch.bfloat16, True), (torch.float32, False)):
        model, _ = load_model(run_model, dtype=dtype, device="cuda", lora=LoRAConfig(r=4, alpha=8.0),
                              use_kernels=kernels)
        randomize_lora_b(model, std=0.2)  # a fixed seed: the same adapters in both models
        results.append(loss_and_grads(model, method, batch))
    (loss_k, grads_k, metrics_k), (loss_r, grads_r, metrics_r) = results
    assert rel_err(loss_k, loss_r) < 3e-2
    for a, b in zip(grads_k, grads_r):
        assert rel_err(a, b) < 5e-2
    for k in metrics_r:
        assert metrics_k[k] == pytest.approx(metrics_r[k], rel=5e-2, abs=2e-2), k


def micro_steps(run_step, objective, params, micro):
    """Each micro-step's loss, then the step's gradients and metrics, of the optimizer step over `micro`."""
    for p in params:
        p.grad.zero_()
    n = sum(preference.num_pairs(b) for b in micro)
    losses = [float(run_step(b, n, 1.0)) for b in micro]
    return losses, [p.grad.clone() for p in params], objective.take(n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("ckpt", ["off", "on"])
@pytest.mark.parametrize("precomputed", [False, True], ids=["reference-forward", "precomputed-reference"])
def test_graphed_dpo_step_matches_eager(run_model, dtype, packing, ckpt, precomputed):
    """A DPO micro-step replayed from a CUDA graph (step.GraphStep; the reference forward, adapters off, inside the
    graph, or the batch's precomputed reference) gives the eager step's losses, gradients and metrics, over optimizer
    steps of two micro-batches, across changes of pair-slot bucket (several graphs), and in replays of a graph; the
    warm-up before the first capture adds nothing to the metrics."""
    dev = torch.device("cuda")
    model, _ = load_model(run_model, dtype=dtype, device=dev, lora=LoRAConfig(r=4, alpha=8.0), use_kernels=True)
    randomize_lora_b(model, std=0.2)
    model.gradient_checkpointing = ckpt == "on"
    model.train()
    params = [p for _, p in lora_parameters(model)]
    for p in params:
        p.grad = torch.zeros_like(p)
    encoded = sides(12, seed=4)
    ref = None
    if precomputed:
        evals = data.pair_eval_batches(encoded, batch_size=2, max_len=48, pad_id=0, packing=packing)
        ref = preference.reference_logps(model, evals, dev, log=lambda *a: None)
    batches = pair_batches(encoded, packing, ref)
    micro = [next(batches) for _ in range(len(batches))]
    one = pad_pairs(encoded[:2], pad_id=0, ref_logps=None if ref is None else ref[:2])  # 1 slot: another bucket
    micro = [step.pad_to_bucket(b, 48) for b in micro + [one] + micro[:3]]  # the graph's shapes, also eager
    objective_e, objective_g = (preference.Objective("dpo", **OPTIONS["dpo"], device=dev) for _ in range(2))
    eager = step.EagerStep(model, dev, objective_e)
    graph = step.GraphStep(model, dev, params, max_len=48, loss_fn=objective_g, warmed=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i in range(0, len(micro) - 1, 2):
        loss_e, grads_e, metrics_e = micro_steps(eager, objective_e, params, micro[i:i + 2])
        loss_g, grads_g, metrics_g = micro_steps(graph, objective_g, params, micro[i:i + 2])
        assert loss_g == pytest.approx(loss_e, rel=tol, abs=tol)
        for a, b in zip(grads_g, grads_e):
            assert rel_err(a, b) < tol
        assert abs(metrics_e["rewards/margins"]) > 1e-3
        for k in metrics_e:
            assert metrics_g[k] == pytest.approx(metrics_e[k], rel=tol, abs=tol), k
    assert len(graph.graphs) >= 2 and not graph.failed  # captured (several buckets), not fallen back to eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precompute", [[], ["--precompute-ref"]], ids=["reference-forward", "precomputed-reference"])
def test_dpo_run_with_cuda_graphs_matches_eager_run(run_model, tmp_path, capsys, precompute):
    """train.py --method dpo on a GPU replays its steps from CUDA graphs (the header says so), and its records equal
    those of the same run with --cuda-graphs off."""
    rows = [{"prompt": f"Q: {a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a * b + 1} or so"}
            for a in range(6) for b in range(4)]
    pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
    argv = ["--model", run_model, "--data", pairs, "--eval-fraction", "0", "--device", "cuda", "--dtype", "fp32",
            "--max-len", "64", "--batch-size", "2", "--grad-accum", "2", "--max-steps", "4", "--warmup-steps", "1",
            "--lr", "3e-3", "--method", "dpo", *precompute]
    records = {}
    for mode in ("on", "off"):
        assert train.cli(argv + ["--out-dir", str(tmp_path / mode), "--cuda-graphs", mode]) == 0
        records[mode] = [r for r in read_metrics(tmp_path / mode) if "loss" in r]
        assert ("CUDA graphs on" if mode == "on" else "CUDA graphs off") in capsys.readouterr().out
    assert len(records["on"]) == 4
    for a, b in zip(records["on"], records["off"]):
        for k in preference.METRICS + ("loss", "grad_norm", "pairs"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k

"""RL rollouts: batched sampling of G completions per prompt (model/generate.py `sample_groups`) against greedy
`generate` and the full forward, and their collation into training batches (data/rollouts.py)."""
from types import SimpleNamespace

import pytest
import torch

import grpo
import step
from data.batches import IGNORE_INDEX
from data.rollouts import Rollout, collate
from model import LoRAConfig, load_model
from model.generate import GroupSampler, generate, sample_groups, sample_tokens
from model.lora import MergedAdapters, lora_parameters
from tests.helpers import assert_close, interpreter, randomize_lora_b
from tests.tiny_models import save_tiny

PROMPTS = [[3, 17, 9, 40, 2], [5, 6], [7, 100, 21, 8, 99, 31, 4, 12]]  # different lengths: left padding


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def tiny(request, tmp_path_factory):
    """A tiny model with random LoRA adapters (the rollouts run under them); gemma2: softcaps and a window (8)
    shorter than prompt + completion."""
    folder = str(tmp_path_factory.mktemp(request.param))
    save_tiny(request.param, folder)
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    return model.eval()


def reference_logps(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token, from one full forward of prompt + completion alone."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1:-1].float() / temperature  # (n, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_temperature_zero_is_greedy_generate(tiny):
    """At temperature 0 every sample of a prompt is greedy `generate`'s answer to that prompt alone."""
    out, logps = sample_groups(tiny, PROMPTS, 2, max_new_tokens=10, temperature=0.0)
    assert len(out) == 6 and all(len(lp) == len(c) for c, lp in zip(out, logps, strict=True))
    for i, prompt in enumerate(PROMPTS):
        want = generate(tiny, prompt, max_new_tokens=10)
        assert out[2 * i] == out[2 * i + 1] == want


@pytest.mark.parametrize("merged", [True, False])
def test_sampler_draws_no_dropout_in_train_mode(llama_folder, monkeypatch, merged):
    """A model in train mode with LoRA dropout samples what it samples in eval mode, on the merged weights and on
    the adapter path (no merge: as for NF4 and fp8 bases), and stays in train mode: the rollouts need no
    model.eval() and model.train() around them."""
    if not merged:
        monkeypatch.setattr("model.lora.free_memory", lambda device: 0)
    model, _ = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8, dropout=0.5))
    randomize_lora_b(model)

    def draw():
        sampler = GroupSampler(model, rows=6, max_prompt_len=8, max_new_tokens=8)
        assert bool(sampler.merged.groups) == merged
        return sampler(PROMPTS, 2, temperature=1.0, generator=torch.Generator().manual_seed(0))

    model.eval()
    evaluated = draw()
    model.train()
    assert draw() == evaluated
    assert all(m.training for m in model.modules())
    with torch.no_grad():  # the test's control: in train mode the adapter path draws dropout
        ids = torch.tensor([PROMPTS[2]])
        assert not torch.equal(model(ids), model.eval()(ids))


def test_an_nf4_base_samples_from_its_merged_weights(llama_folder):
    """A QLoRA (NF4) model's sampler dequantizes its base into the merged buffers, merges the adapters there, and
    samples what the NF4 adapter path generates: at temperature 0 each prompt's samples are `generate`'s answer to
    it alone, with log-probs of the full forward of the NF4 model."""
    model, _ = load_model(llama_folder, quantize="nf4", lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    model.eval()
    sampler = GroupSampler(model, rows=6, max_prompt_len=8, max_new_tokens=10)
    assert sampler.merged.groups and all(p.nf4 is not None for p, _ in sampler.merged.views)
    out, logps = sampler(PROMPTS, 2, temperature=0.0)
    for i, prompt in enumerate(PROMPTS):
        want = generate(model, prompt, max_new_tokens=10)
        assert out[2 * i] == out[2 * i + 1] == want
        assert_close(torch.tensor(logps[2 * i]), reference_logps(model, prompt, want, 1.0), atol=1e-5, rtol=1e-5,
                     name=f"prompt {i}'s log-probs")


def test_same_seed_same_samples(tiny):
    """A seeded generator gives the same samples; another seed others; the G samples of a prompt differ."""
    def draw(seed):
        return sample_groups(tiny, PROMPTS, 4, max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.95,
                             generator=torch.Generator().manual_seed(seed))
    first = draw(0)
    assert draw(0) == first
    assert draw(1)[0] != first[0]
    assert len({tuple(c) for c in first[0][:4]}) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logps_equal_the_full_forward(tiny, temperature):
    """Each sampled token's log-prob from the decoder (left-padded batched prefill, static cache) equals
    log_softmax(logits / T) of a full forward of its prompt and completion alone, in fp32."""
    out, logps = sample_groups(tiny, PROMPTS, 3, max_new_tokens=12, temperature=temperature,
                               generator=torch.Generator().manual_seed(0))
    for i, (completion, lp) in enumerate(zip(out, logps, strict=True)):
        want = reference_logps(tiny, PROMPTS[i // 3], completion, temperature)
        assert_close(torch.tensor(lp), want, atol=1e-5, rtol=1e-5, name=f"row {i} log-probs")


@interpreter
def test_logps_with_the_decoding_kernels(tmp_path):
    """With the kernels (the GPU's decoding path: rope into the cache, attention over it from each row's first
    slot), each sampled token's log-prob equals the full forward's, for left-padded prompts, in fp32, with Gemma 2's
    softcap and window (8)."""
    save_tiny("gemma2", str(tmp_path))
    model, _ = load_model(str(tmp_path), use_kernels=True, lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    model.eval()
    plain, _ = load_model(str(tmp_path), lora=LoRAConfig(r=4, alpha=8))  # the reference, without the interpreter
    plain.load_state_dict(model.state_dict())
    out, logps = sample_groups(model, PROMPTS, 2, max_new_tokens=4, temperature=1.0,  # the window passed at 9
                               generator=torch.Generator().manual_seed(0))
    assert max(len(c) for c in out) == 4
    for i, (completion, lp) in enumerate(zip(out, logps, strict=True)):
        want = reference_logps(plain.eval(), PROMPTS[i // 2], completion, 1.0)
        assert_close(torch.tensor(lp), want, atol=1e-5, rtol=1e-5, name=f"row {i} log-probs")


def test_the_next_rollout_samples_from_the_updated_adapters(llama_folder):
    """A sampler decodes with merged weights, refreshed at every call: after an optimizer step on the adapters its
    log-probs are those of the full forward under the new adapters, and differ from the step before's."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    model.eval()
    sampler = GroupSampler(model, rows=4, max_prompt_len=8, max_new_tokens=6)
    assert sampler.merged.groups

    def rollout():
        return sampler(PROMPTS[:2], 2, temperature=1.0, generator=torch.Generator().manual_seed(0))

    before = rollout()
    params = [p for _, p in lora_parameters(model)]
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    model(ids, targets=ids).backward()
    torch.optim.SGD(params, lr=1.0).step()
    out, logps = rollout()
    for i, (completion, lp) in enumerate(zip(out, logps, strict=True)):
        want = reference_logps(model, PROMPTS[i // 2], completion, 1.0)
        assert_close(torch.tensor(lp), want, atol=1e-5, rtol=1e-5, name=f"row {i} log-probs")
    assert (out, logps) != before


def test_a_decoding_step_runs_plain_gemms_and_copies_no_kv_heads(llama_folder):
    """A sampler's decoding step with merged adapters runs one GEMM per projection group (q|k|v, o, gate|up, down)
    and attends over the cached k and v without repeating their grouped heads."""
    from torch.profiler import profile
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8))
    model.eval()
    sampler = GroupSampler(model, rows=2, max_prompt_len=4, max_new_tokens=2)
    sampler([[3, 4]], 2, temperature=0.0)  # sets the cache up
    with torch.no_grad(), sampler.merged, profile() as prof:
        sampler.decode(5, 4, torch.tensor([2, 2]))
    ops = [e.name for e in prof.events()]
    gemms = sum(ops.count(f"aten::{name}") for name in ("mm", "addmm", "addmm_"))  # what linear and matmul call
    assert gemms == 4 * cfg.n_layers + 1  # and the head
    assert "aten::repeat_interleave" not in ops


NINE = {"aten::linear": 3, "aten::mm": 1, "triton::_rope_into_cache_kernel": 1, "triton::_decode_attention_kernel": 1,
        "triton::_add_rms_norm_kernel": 2, "triton::_swiglu_forward_kernel": 1}
FIVE = {"triton::_decode_qkv_kernel": 1, "triton::_decode_attention_kernel": 1, "triton::_decode_linear_kernel": 2,
        "triton::_decode_swiglu_kernel": 1}


@pytest.mark.parametrize("fused, want", [(True, FIVE), (False, NINE)], ids=["five", "nine"])
@interpreter
def test_a_decoding_step_with_the_kernels_launches_five_or_nine_kernels_a_layer(tmp_path, fused, want):
    """The GPU's merged decoding step (kernels on), counted as scripts/bench/decode_ops.py counts it: a layer is
    the five fused kernels of model/decode.py (norm + q | k | v + RoPE + cache write, attention, o + add, norm +
    gate | up + SwiGLU, down + add), or without them 4 GEMMs, RoPE into the cache, the decode attention, 2 fused
    add + norms and SwiGLU; nothing else."""
    from scripts.bench.decode_ops import count, tiny_llama
    steps = []
    for layers in (1, 2):
        tiny_llama(str(tmp_path / str(layers)), layers)
        model, _ = load_model(str(tmp_path / str(layers)), dtype=torch.bfloat16, use_kernels=True,
                              lora=LoRAConfig(r=4, alpha=8))
        if not fused:
            model.ops.fused_decode = None
        steps.append(count(model.eval(), 2, MergedAdapters(model), kernels=True))
    layer = steps[1] - steps[0]
    assert layer == want, layer


def test_rows_stop_at_a_stop_id(tiny):
    """Each row ends at its first stop id, or runs to max_new_tokens; the rows after it are unchanged (the same
    draws), so each stopped row is the free row cut after its first stop id."""
    free, _ = sample_groups(tiny, PROMPTS, 4, max_new_tokens=10, temperature=1.0,
                            generator=torch.Generator().manual_seed(5))
    stop = free[0][2]
    out, logps = sample_groups(tiny, PROMPTS, 4, max_new_tokens=10, temperature=1.0, stop_ids={stop},
                               generator=torch.Generator().manual_seed(5))
    for row, want in zip(out, free, strict=True):
        assert row == (want[:want.index(stop) + 1] if stop in want else want)
    assert len(out[0]) == 3 and len(logps[0]) == 3


def test_a_reused_sampler_samples_what_a_fresh_one_samples(tiny):
    """One GroupSampler serves a run: a call after one with longer prompts and completions (whose keys and values
    stay in the cache, before the new prompts' slots and after the current token) gives exactly the tokens and
    log-probs of the same call to a fresh sampler, with the same seed."""
    def sampler():
        return GroupSampler(tiny, rows=8, max_prompt_len=10, max_new_tokens=9)
    reused = sampler()
    reused([PROMPTS[2], PROMPTS[0]], 4, temperature=1.0, generator=torch.Generator().manual_seed(1))
    short = [[5, 6], [3, 17, 9]]
    got = reused(short, 4, temperature=1.0, generator=torch.Generator().manual_seed(2))
    want = sampler()(short, 4, temperature=1.0, generator=torch.Generator().manual_seed(2))
    assert got == want
    assert got[0] != reused(short, 4, temperature=1.0, generator=torch.Generator().manual_seed(3))[0]


def test_a_sampler_takes_fewer_rows_than_it_holds(tiny):
    """A call with fewer prompts than the sampler's rows (the held-out prompts, G = 1, a short last batch) fills
    the rest with copies and returns the prompts' own samples: at temperature 0, greedy `generate`'s answers."""
    sampler = GroupSampler(tiny, rows=6, max_prompt_len=8, max_new_tokens=7)
    out, logps = sampler(PROMPTS, 1, temperature=0.0)
    assert out == [generate(tiny, p, max_new_tokens=7) for p in PROMPTS]
    assert [len(lp) for lp in logps] == [len(c) for c in out]
    with pytest.raises(ValueError, match="holds 6 rows; 3 prompts x 4 samples need 12"):
        sampler(PROMPTS, 4)
    with pytest.raises(ValueError, match="a prompt of 9 tokens does not fit the sampler's 8"):
        sampler([list(range(3, 12))], 1)


def test_top_k_and_top_p_cut_the_distribution():
    """top_k=1 and a tiny top_p leave only the argmax; the log-prob is the uncut distribution's at T."""
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [1.0, 0.0, 0.5, 4.0]])
    g = torch.Generator().manual_seed(0)
    for kw in ({"top_k": 1}, {"top_p": 1e-3}):
        tokens, logps = sample_tokens(logits, 2.0, generator=g, **kw)
        assert tokens.tolist() == [1, 3]
        assert_close(logps, torch.log_softmax(logits / 2.0, -1)[[0, 1], [1, 3]], atol=1e-6, rtol=1e-6)
    draws = {tuple(sample_tokens(logits, 1.0, top_k=2, generator=g)[0].tolist()) for _ in range(40)}
    assert {t[0] for t in draws} == {1, 2} and {t[1] for t in draws} <= {3, 0}


def training_logps(model, batch, temperature):
    """The training forward's log-prob of each target token (B, T) at `temperature` (grpo.token_logps)."""
    with torch.no_grad():
        return grpo.token_logps(model, batch, temperature).view(batch["targets"].shape)


def sampled_rollouts(model, G=3, max_new_tokens=9, seed=0, temperature=1.0):
    out, logps = sample_groups(model, PROMPTS, G, max_new_tokens, temperature=temperature,
                               generator=torch.Generator().manual_seed(seed))
    return [Rollout(PROMPTS[i // G], c, advantage=i - 4.0, old_logps=lp)
            for i, (c, lp) in enumerate(zip(out, logps, strict=True))]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_collated_logps_equal_the_training_forward(tiny, packing, temperature):
    """The sampler's log-probs, placed by the collation at the target positions, equal the training forward's over
    the collated batch (packed rows with several rollouts each, or padded), in fp32; every completion token and
    only those are targets, each under its rollout's seq_id, length and advantage."""
    rollouts = sampled_rollouts(tiny, temperature=temperature)
    batches = collate(rollouts, max_len=40, pad_id=0, packing=packing, rows=2)
    n = 0
    for batch in batches:
        is_target = batch["targets"] != IGNORE_INDEX
        assert_close(batch["old_logps"], training_logps(tiny, batch, temperature), atol=1e-5, rtol=1e-5,
                     name="old_logps")
        N = len(batch["seq_lengths"])
        assert torch.bincount(batch["seq_ids"][is_target], minlength=N).tolist() == batch["seq_lengths"].tolist()
        assert batch["seq_lengths"].tolist() == [len(r.completion) for r in rollouts[n:n + N]]
        assert batch["advantages"].tolist() == [r.advantage for r in rollouts[n:n + N]]
        assert batch["targets"][is_target].tolist() == sum((r.completion for r in rollouts[n:n + N]), [])
        assert "ref_logps" not in batch
        n += N
    assert n == len(rollouts)
    if packing:
        assert max(len(b["seq_lengths"]) for b in batches) > len(batches[0]["input_ids"]), "several per row"


def test_collation_refuses_a_rollout_longer_than_max_len():
    with pytest.raises(ValueError, match="does not fit --max-len 6; raise --max-len or lower --max-new-tokens"):
        collate([Rollout([1, 2, 3, 4], [5, 6, 7])], max_len=6, pad_id=0)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_packed_and_padded_batches_give_the_same_loss(tiny, loss_type):
    """GRPOLoss over the packed batches equals its value over the padded ones, and so do the LoRA gradients: the
    layout changes nothing but the cost (old log-probs shifted so that the ratios are not all 1)."""
    rollouts = [r._replace(old_logps=[lp + 0.05 * (j % 3) for j, lp in enumerate(r.old_logps)])
                for r in sampled_rollouts(tiny)]
    results = []
    for packing in (True, False):
        objective = grpo.GRPOLoss(loss_type)
        batches = collate(rollouts, max_len=40, pad_id=0, packing=packing, rows=2)
        count = torch.tensor(sum(objective.count(b) for b in batches))
        tiny.zero_grad()
        loss = sum(objective(tiny, b, count) for b in batches)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in tiny.parameters() if p.grad is not None])
        results.append((loss.detach(), grads, objective.take(count)))
    tiny.zero_grad()
    assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5, name="loss")
    assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-4, name="LoRA gradients")
    assert results[0][2] == pytest.approx(results[1][2])


# (loss type, importance, beta, updates μ): with μ > 1 the batches carry old_logps, with β > 0 ref_logps
FIXED_CASES = [("dapo", "token", 0.0, 1), ("grpo", "sequence", 0.04, 2), ("dr_grpo", "token", 0.04, 2)]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("loss_type,importance,beta,mu", FIXED_CASES)
def test_fixed_shape_batches_give_the_same_loss(tiny, packing, loss_type, importance, beta, mu):
    """The batches of collate(fixed_shapes=True), padded further to their length bucket as GraphStep pads them and
    run through what its graph records (its `_step`, uncaptured on the CPU), give the loss, LoRA gradients and
    metrics of the unpadded batches: padding rows and rollout slots add nothing, and the step's normalizer counts
    rollouts, not slots. Row and slot counts are powers of two (rows at most `rows`)."""
    rollouts = [r._replace(old_logps=[lp + 0.05 * (j % 3) for j, lp in enumerate(r.old_logps)],
                           ref_logps=[lp - 0.1 * (j % 2) for j, lp in enumerate(r.old_logps)])
                for r in sampled_rollouts(tiny)]
    if mu == 1:  # one update per batch: the loss takes the policy's own log-probs
        rollouts = [r._replace(old_logps=None) for r in rollouts]
    if beta == 0:
        rollouts = [r._replace(ref_logps=None) for r in rollouts]
    eps_low, eps_high = (0.2, 0.28) if importance == "token" else (3e-4, 4e-4)
    params = [p for _, p in lora_parameters(tiny)]
    results, shapes = [], []
    for fixed in (False, True):
        objective = grpo.GRPOLoss(loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                                  importance=importance, max_completion_length=9)
        batches = collate(rollouts, max_len=40, pad_id=0, packing=packing, rows=6, fixed_shapes=fixed)
        if mu == 1:
            batches = [{k: v for k, v in b.items() if k != "old_logps"} for b in batches]
        count = torch.tensor(float(sum(objective.count(b) for b in batches)))
        for p in params:
            p.grad = torch.zeros_like(p)
        if fixed:
            body = step.GraphStep(tiny, torch.device("cpu"), params, max_len=40, loss_fn=objective)
            loss = sum(body._step(SimpleNamespace(batch={**step.pad_to_bucket(b, 40), "docs": None},
                                                  num_targets=count, loss_mult=torch.tensor(1.0)))
                       for b in batches)
        else:
            loss = sum(objective(tiny, b, count) for b in batches)
            loss.backward()
        shapes.append([(len(b["input_ids"]), len(b["seq_lengths"])) for b in batches])
        results.append((loss.detach(), [p.grad.clone() for p in params], objective.take(count)))
    for p in params:
        p.grad = None
    assert all(rows & (rows - 1) == 0 or rows == 6 for rows, _ in shapes[1])
    assert all(slots & (slots - 1) == 0 for _, slots in shapes[1])
    assert shapes[1] != shapes[0], "the case pads something"
    assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-5, name="loss")
    for a, b in zip(results[1][1], results[0][1], strict=True):
        assert_close(a, b, atol=1e-7, rtol=1e-4, name="LoRA gradients")
    assert results[0][1][0].abs().max() > 0
    assert results[1][2].keys() == results[0][2].keys()
    for k in results[0][2]:
        assert results[1][2][k] == pytest.approx(results[0][2][k], rel=1e-5, abs=1e-7), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("error:CUDA graph capture")  # the fallback warns so: here it must not happen
def test_graphed_sampling_matches_eager(llama_folder):
    """On CUDA, batched sampling that replays a CUDA graph per step gives the eager decoder's samples and log-probs
    (fp32, one seed), with LoRA adapters, and the capture does not fall back."""
    model, _ = load_model(llama_folder, device="cuda", use_kernels=True, lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    model.eval()
    runs = [sample_groups(model, PROMPTS, 4, max_new_tokens=12, temperature=1.0, cuda_graph=graphed,
                          generator=torch.Generator(device="cuda").manual_seed(3)) for graphed in (True, False)]
    assert runs[0][0] == runs[1][0]
    assert_close(torch.tensor(sum(runs[0][1], [])), torch.tensor(sum(runs[1][1], [])), atol=1e-4, rtol=1e-4)

"""rl.py's GPU paths: the GRPO update replayed from CUDA graphs (step.GraphStep over collate's fixed shapes) gives
the eager update's losses, gradients and metrics; one GroupSampler, reused across rollouts, samples on its CUDA
graph what it samples eagerly; and rl.py with --cuda-graphs on records what it records with them off."""
import json

import pytest
import torch

import grpo
import rl
import step
from data.batches import IGNORE_INDEX
from data.rollouts import Rollout, collate
from model import LoRAConfig, load_model
from model.generate import GroupSampler
from model.lora import lora_parameters
from rollout import old_and_ref_logps
from tests.helpers import randomize_lora_b, read_metrics, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[3, 17, 9, 40, 2], [5, 6], [7, 100, 21, 8, 99, 31, 4, 12]]  # different lengths: left padding
# (loss type, importance, beta, updates μ): with μ > 1 the batches carry old_logps, with β > 0 ref_logps
CASES = [("dapo", "token", 0.0, 1), ("grpo", "token", 0.04, 2), ("dr_grpo", "token", 0.04, 2),
         ("dapo", "sequence", 0.0, 2), ("grpo", "sequence", 0.04, 1)]


VOWEL = '''def vowel(prompts, completions, references):
    return [1.0 if c[:1] and c[:1] in "aeiouAEIOU" else 0.0 for c in completions]
'''


@pytest.fixture(scope="module")
def policy(run_model):
    """The tiny run model on the GPU, fp32, with random adapters (B != 0: gradients reach every LoRA weight)."""
    model, _ = load_model(run_model, device="cuda", use_kernels=True, lora=LoRAConfig(r=4, alpha=8.0))
    randomize_lora_b(model, std=0.2)
    return model


def micro_steps(run_step, objective, params, micro, count):
    """Each micro-step's loss, then the update's gradients and metrics, over the micro-batches `micro`."""
    for p in params:
        p.grad.zero_()
    losses = [float(run_step(b, count, 1.0)) for b in micro]
    return losses, [p.grad.clone() for p in params], objective.take(count)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("loss_type,importance,beta,mu", CASES)
@pytest.mark.filterwarnings("error:CUDA graph capture")  # the decoder's fallback warns so: not here
def test_graphed_grpo_update_matches_eager(policy, packing, loss_type, importance, beta, mu):
    """Over two steps of rollouts (other lengths: other row, slot and document buckets, several graphs) and μ
    updates each, the GRPO micro-steps replayed from CUDA graphs give the eager steps' losses, gradients and
    metrics (old log-probs moved off the policy's, so that ratios leave the clip range)."""
    dev = torch.device("cuda")
    params = [p for _, p in lora_parameters(policy)]
    for p in params:
        p.grad = torch.zeros_like(p)
    sampler = GroupSampler(policy, rows=12, max_prompt_len=8, max_new_tokens=10)
    policy.eval()
    steps = []
    for seed in (0, 1):
        out, _ = sampler(PROMPTS, 4, temperature=1.0, generator=torch.Generator(dev).manual_seed(seed))
        steps.append([Rollout(PROMPTS[i // 4], c, advantage=(i % 4) - 1.5) for i, c in enumerate(out)])
    policy.train()
    eps_low, eps_high = (0.2, 0.28) if importance == "token" else (3e-4, 4e-4)
    objective_e, objective_g = (grpo.GRPOLoss(loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                                              importance=importance, max_completion_length=10, temperature=0.8,
                                              device=dev) for _ in range(2))
    eager = step.EagerStep(policy, dev, objective_e)
    graph = step.GraphStep(policy, dev, params, max_len=40, loss_fn=objective_g, warmed=True)
    for rollouts in steps:
        micro = collate(rollouts, max_len=40, pad_id=0, packing=packing, rows=2, device=dev, fixed_shapes=True)
        old_and_ref_logps(policy, micro, objective_e, mu)
        for b in micro:
            if "old_logps" in b:
                wave = 0.3 * torch.sin(b["seq_ids"] * 7.0 + b["position_ids"] * 1.3)
                b["old_logps"] = torch.where(b["targets"] != IGNORE_INDEX, b["old_logps"] + wave, 0.0)
        count = sum(objective_e.count(b) for b in micro)
        for _ in range(mu):
            loss_e, grads_e, metrics_e = micro_steps(eager, objective_e, params, micro, count)
            loss_g, grads_g, metrics_g = micro_steps(graph, objective_g, params, micro, count)
            assert loss_g == pytest.approx(loss_e, rel=1e-5, abs=1e-6)
            for a, b in zip(grads_g, grads_e, strict=True):
                assert rel_err(a, b) < 1e-5
            assert metrics_g.keys() == metrics_e.keys()
            for k in metrics_e:
                assert metrics_g[k] == pytest.approx(metrics_e[k], rel=1e-5, abs=1e-6), k
    assert len(graph.graphs) >= 1 and not graph.failed  # captured, not fallen back to eager


@pytest.mark.filterwarnings("error:CUDA graph capture")
def test_a_reused_sampler_on_a_cuda_graph_matches_eager(policy):
    """One GroupSampler over three calls (longer prompts, then shorter ones, then greedy with fewer rows than it
    holds) replays one CUDA graph of its decoding step, captured once, and one of its prefill for each count of
    prompts, and samples the eager sampler's tokens and log-probs (fp32, the same seeds); its second call samples
    what a fresh sampler samples."""
    policy.eval()
    dev = torch.device("cuda")
    calls = [(PROMPTS, 4, 1.0, 0), ([[5, 6], [3, 17, 9]], 4, 1.0, 1), (PROMPTS, 1, 0.0, 2)]

    def run(sampler, prompts, G, temperature, seed):
        return sampler(prompts, G, temperature=temperature, generator=torch.Generator(dev).manual_seed(seed))
    runs = {}
    for graphed in (True, False):
        sampler = GroupSampler(policy, rows=12, max_prompt_len=8, max_new_tokens=12, cuda_graph=graphed)
        runs[graphed] = [run(sampler, *call) for call in calls]
        if graphed:
            replays = [sampler.decode.replay, *(prefill.replay for prefill in sampler.prefills.values())]
            assert sorted(sampler.prefills) == [2, 3]
            assert all(r.graph is not None and not r.failed for r in replays)
    for (tokens_g, logps_g), (tokens_e, logps_e) in zip(runs[True], runs[False], strict=True):
        assert tokens_g == tokens_e
        assert rel_err(torch.tensor(sum(logps_g, [])), torch.tensor(sum(logps_e, []))) < 1e-4
    fresh = GroupSampler(policy, rows=12, max_prompt_len=8, max_new_tokens=12)
    assert run(fresh, *calls[1]) == runs[True][1]
    policy.train()


def test_rl_run_with_cuda_graphs_matches_eager_run(run_model, tmp_path, capsys):
    """rl.py on a GPU decodes and updates from CUDA graphs (the header says so), and its first step's records (the
    same weights, the same samples) equal those of the same run with --cuda-graphs off; every step's loss is
    finite and close."""
    data, reward = tmp_path / "data.jsonl", tmp_path / "rewards.py"
    data.write_text("".join(json.dumps({"prompt": f"Say {i % 7}", "completion": str(i % 7)}) + "\n"
                            for i in range(40)))
    reward.write_text(VOWEL)
    argv = ["--model", run_model, "--data", str(data), "--reward", f"{reward}:vowel", "--device", "cuda", "--dtype",
            "fp32", "--num-generations", "4", "--batch-size", "2", "--max-new-tokens", "6", "--max-len", "64",
            "--lora-r", "4", "--lr", "0.03",
            "--max-steps", "3", "--eval-every", "0", "--save-every", "0", "--num-iterations", "2", "--beta", "0.04"]
    records = {}
    for mode in ("on", "off"):
        assert rl.cli(argv + ["--out-dir", str(tmp_path / mode), "--cuda-graphs", mode]) == 0
        assert ("CUDA graphs on" if mode == "on" else "CUDA graphs off: --cuda-graphs off") in capsys.readouterr().out
        records[mode] = [r for r in read_metrics(tmp_path / mode) if "loss" in r]
    on, off = records["on"], records["off"]
    assert len(on) == len(off) == 3
    for k in ("reward", "completions/mean_length"):
        assert on[0][k] == off[0][k], k
    assert any(r["loss"] != 0 for r in off) and any(r["kl"] > 0 for r in off)
    for a, b in zip(on, off, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-5)

"""The benchmark tools of scripts/bench/: the harness's batches and timing, bench.py's command
line and peers table, and bench.py --smoke end to end on CPU (a padded table case, and the
train.py mode); bench_qlora.py's shapes, its prediction of the longest length, and its --smoke."""
import json
import math
import os
import subprocess
import sys
from itertools import repeat
from pathlib import Path

import pytest
import torch

from scripts.bench import bench, bench_qlora, harness

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- harness


def test_fixed_batch_targets_are_the_next_ids():
    b = harness.fixed_batch(100, 3, 7, "cpu")
    assert b.input_ids.shape == (3, 7) and b.tokens == 21 and b.mask is None and b.doc_ids is None
    assert torch.equal(b.targets[:, :-1], b.input_ids[:, 1:]) and (b.targets[:, -1] == -100).all()
    assert torch.equal(harness.fixed_batch(100, 3, 7, "cpu").input_ids, b.input_ids)  # the same for every case


def test_padded_batches_pad_like_no_packing():
    lengths = iter([[5, 9, 2], [4, 4, 1]])
    batches = harness.padded_batches(50, lambda rng: next(lengths), "cpu")
    b = next(batches)
    assert b.input_ids.shape == (3, 9) and b.tokens == 16
    assert b.mask.sum(1).tolist() == [5, 9, 2]
    assert (b.targets[b.mask == 0] == -100).all() and (b.doc_ids[b.mask == 0] == 1).all()
    # within a row: the next id is the target, and the row's last real token predicts nothing
    assert torch.equal(b.targets[0, :4], b.input_ids[0, 1:5]) and b.targets[0, 4] == -100
    assert torch.equal(b.position_ids[0, :5], torch.arange(5))
    assert next(batches).input_ids.shape == (3, 4)  # a new shape every step


def test_padded_batches_repeat_for_the_same_seed():
    sample = lambda rng: [rng.randint(3, 30) for _ in range(4)]  # noqa: E731
    a, b = harness.padded_batches(50, sample, "cpu"), harness.padded_batches(50, sample, "cpu")
    for _ in range(3):
        x, y = next(a), next(b)
        assert torch.equal(x.input_ids, y.input_ids) and x.tokens == y.tokens


def test_time_steps_counts_real_tokens():
    batches = iter([harness.Batch(torch.zeros(1, 1), torch.zeros(1, 1), tokens=n) for n in (7, 10, 30)])
    r = harness.time_steps(lambda b: torch.tensor(1.0), batches, warmup=1, steps=2, device="cpu")
    assert r["step_tokens"] == [10, 30] and len(r["step_times_s"]) == 2
    assert r["tokens_per_s"] == pytest.approx(40 / sum(r["step_times_s"]))  # varying tokens: sum / sum
    same = repeat(harness.Batch(torch.zeros(1, 1), torch.zeros(1, 1), tokens=8))
    r = harness.time_steps(lambda b: torch.tensor(1.0), same, warmup=0, steps=3, device="cpu")
    assert r["tokens_per_s"] == pytest.approx(8 / r["median_step_s"])  # fixed tokens: the median step


# ----------------------------------------------------------------------------- bench.py command line and tables


@pytest.mark.parametrize("argv, message", [
    (["--padded", "600-100"], "LO-HI"),
    (["--padded", "100-600", "--seqlen", "64"], "drop --seqlen"),
    (["--step-opts", "bogus=1"], "fused_lora, use_kernels"),
    (["--nanotune-opts", "--batch-size 8"], "needs --train"),
    (["--train", "--batch", "2"], "--nanotune-opts"),
    (["--ckpt", "auto"], "needs --train"),
])
def test_bench_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bench_step_opts_become_keyword_arguments():
    assert bench.parse_args(["--step-opts", "use_kernels=false,fused_lora=true"]).step_opts == {
        "use_kernels": False, "fused_lora": True}


def test_nanotune_step_with_dora_trains_the_magnitudes(tmp_path):
    """--step-opts dora=true times a DoRA step: the magnitudes are among the weights the step trains."""
    from tests.tiny_models import save_tiny
    save_tiny("llama", str(tmp_path))
    assert bench.parse_args(["--step-opts", "dora=true"]).step_opts == {"dora": True}
    step = harness.nanotune_step(str(tmp_path), "cpu", dora=True)
    magnitudes = [p for n, p in step.model.named_parameters() if n.endswith("lora_magnitude_vector")]
    assert len(magnitudes) == 7 * step.model.config.n_layers
    before = [m.detach().clone() for m in magnitudes]
    step(harness.fixed_batch(step.vocab_size, 2, 9, "cpu"))
    assert all(not torch.equal(m, b) for m, b in zip(magnitudes, before))


def test_peers_table_puts_peer_rows_beside_nanotune(tmp_path):
    def peer(**kw):
        return {"config": "D", "name": "SmolLM2-135M", "ckpt": True, "batch": 8, "status": "ok", "attn": "sdpa",
                "tokens_per_s": 1000.0, "step_s_median": 4.096, "peak_gib": 2.0, **kw}
    (tmp_path / "results.json").write_text(json.dumps({"env": {}, "matmul": None, "rows": [
        peer(liger=False), peer(liger=True, tokens_per_s=2000.0), peer(liger=False, config="A", status="OOM")]}))
    (tmp_path / "unsloth_results.json").write_text(json.dumps({"env": {}, "rows": [peer(tokens_per_s=4000.0)]}))
    (tmp_path / "log.json").write_text("[1, 2]")  # not a results file: passed over
    peers = bench.peer_rows(str(tmp_path))
    assert sorted((p["shape"], p["case"], p["status"]) for p in peers) == [
        ("smollm2-135m", "hf", "ok"), ("smollm2-135m", "hf+liger", "ok"), ("smollm2-135m", "unsloth", "ok"),
        ("tinyllama", "hf", "error")]
    ours = [{"shape": "smollm2-135m", "case": "nanotune", "status": "ok", "batch": 8, "seqlen": 512, "ckpt": "on",
             "tokens_per_s": 8000.0, "peak_mem_bytes": 2**30},
            {"shape": "smollm2-135m", "case": "nanotune", "status": "ok", "batch": 8, "seqlen": 512, "ckpt": "off",
             "tokens_per_s": 9999.0}]
    lines = bench.peers_table(ours, peers)
    assert len(lines) == 4
    by_peer = {line.split(" | ")[3]: line for line in lines if line.startswith("| smollm2-135m")}
    assert by_peer["hf"].rstrip(" |").endswith("8.00x") and "8x512" in by_peer["hf"]
    assert by_peer["hf+liger"].rstrip(" |").endswith("4.00x")
    assert by_peer["unsloth"].rstrip(" |").endswith("2.00x")
    assert "OOM" in next(line for line in lines if line.startswith("| tinyllama"))


# ----------------------------------------------------------------------------- bench.py --smoke, end to end


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bench"))  # the tiny checkpoint is built once for both runs


def run_script(script, *argv, timeout=900):
    """The stdout of scripts/bench/`script` run with argv, as a user runs it; it must exit 0."""
    proc = subprocess.run([sys.executable, f"scripts/bench/{script}", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_bench(*argv):
    return run_script("bench.py", "--smoke", *argv)


@pytest.mark.slow
def test_make_checkpoint_writes_the_checkpoint_and_stops(tmp_path):
    """--make-checkpoint SHAPE alone writes SHAPE's checkpoint under --cache-dir and runs no benchmark."""
    stdout = run_bench("--make-checkpoint", "smollm2-135m", "--cache-dir", tmp_path, "--shapes", "smollm2-135m")
    assert "| shape |" not in stdout and not (tmp_path / "bench.json").exists()
    assert json.loads((tmp_path / "smoke-smollm2-135m" / "bench_shape.json").read_text()) == \
        bench.shape_key("smollm2-135m", True)


def test_bench_smoke_padded_case(cache_dir):
    out = os.path.join(cache_dir, "padded.json")
    stdout = run_bench("--shapes", "smollm2-135m", "--cases", "nanotune", "--ckpt", "off", "--padded", "20-40",
                       "--cache-dir", cache_dir, "--out", out)
    (row,) = json.load(open(out))["results"]
    assert row["status"] == "ok", row
    assert row["seqlen"] == "[20,40]" and len(row["step_tokens"]) == 2
    assert all(2 * 20 <= n <= 2 * 40 for n in row["step_tokens"])  # batch 2, rows of 20 to 40 real tokens
    assert row["tokens_per_s"] == pytest.approx(sum(row["step_tokens"]) / sum(row["step_times_s"]))
    assert "| smollm2-135m | 2x[20,40] | nanotune |" in stdout


@pytest.mark.slow
def test_bench_smoke_train_mode(cache_dir):
    out = os.path.join(cache_dir, "train.json")
    stdout = run_bench("--train", "--shapes", "smollm2-135m", "--train-packing", "off", "--cache-dir", cache_dir,
                       "--out", out)
    (row,) = json.load(open(out))["train"]
    assert row["status"] == "ok", row
    assert row["tokens_per_s"] > 0 and row["loss_final"] > 0 and row["wall_s"] > 0
    assert "--no-packing" in row["command"] and "--max-steps 2 --log-every 2" in row["command"]
    assert "gradient-checkpointing" not in row["command"], "auto leaves the choice to train.py"
    assert "| smollm2-135m | off | auto | 2 | ok |" in stdout


@pytest.mark.slow
def test_bench_smoke_every_case_trains(cache_dir):
    """Each case's step is a training step: forward, backward and the update, so the loss moves (a step without
    its backward, timing the forward alone, is refused by the harness and would leave the loss where it was)."""
    out = os.path.join(cache_dir, "cases.json")
    run_bench("--shapes", "smollm2-135m", "--cases", "nanotune,hf", "--ckpt", "off", "--cache-dir", cache_dir,
              "--out", out)
    rows = json.load(open(out))["results"]
    assert sorted(r["case"] for r in rows) == ["hf", "nanotune"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["loss_final"] < r["loss_first"], r


def test_bench_dpo_times_a_dpo_run(run_model, tmp_path):
    """scripts/bench/bench_dpo.py runs train.py --method dpo on pairs of the asked lengths, one pair a row, and
    reports a step time from train.py's own count: padded tokens a step = pairs x the row length."""
    out = tmp_path / "dpo.json"
    run_script("bench_dpo.py", "--model", run_model, "--out", out, "--pairs-per-step", "2", "--prompt-len", "24",
               "--completion-len", "16", "--steps", "2", "--warmup", "1", "--", "--device", "cpu", "--dtype", "fp32",
               timeout=600)
    r = json.loads(out.read_text())
    assert r["tokens_per_s_padded"] == pytest.approx(2 * r["max_len"] / r["step_s_median"])
    assert r["tokens_per_s_real"] < r["tokens_per_s_padded"] and r["loss_first"] == pytest.approx(0.6931, abs=1e-3)
    assert "data: 22 pairs of 22" in r["header"]


def test_bench_grpo_times_rollout_and_update(run_model, tmp_path):
    """scripts/bench/bench_grpo.py runs rl.py's step on the harness's prompts: with --ignore-eos every completion has
    --max-new-tokens tokens; the step's median time is about its parts' (medians of their own), and the decoding
    bound at a given bandwidth is the weights' and the KV cache's bytes of every decoding step over it."""
    out = tmp_path / "grpo.json"
    stdout = run_script("bench_grpo.py", "--model", run_model, "--out", out, "--device", "cpu", "--prompts", "2",
                        "--num-generations", "2", "--max-new-tokens", "3", "--steps", "2", "--warmup", "1",
                        "--ignore-eos", "--bandwidth", "1e9", "--profile", timeout=600)
    r = json.loads(out.read_text())
    assert [s["new_tokens"] for s in r["steps"]] == [2 * 2 * 3] * 3
    assert r["rollout_tokens_per_s"] == pytest.approx(12 / (r["rollout_ms_median"] / 1e3))
    assert all(s["step_s"] == pytest.approx(s["rollout_s"] + s["update_s"]) for s in r["steps"])
    weights = sum(os.path.getsize(os.path.join(run_model, f)) for f in os.listdir(run_model)
                  if f.endswith(".safetensors"))
    assert 3 * weights / 1e9 < r["decode_bound_ms"] / 1e3 < 3 * 2 * weights / 1e9 + 1e-3  # fp32, LoRA, KV
    assert "ms a step (rollout" in stdout and "a decoding step (" in stdout and not r["cuda_graphs"]


# ----------------------------------------------------------------------------- bench_qlora.py


FULL_6TH = ["sliding", "full", "sliding"]  # Gemma 3's layers 4 to 6: every sixth layer attends globally


def test_qlora_shapes_keep_their_quirks():
    """The 7-12B shapes translate into the ModelConfigs of the real models, at full size and in --smoke."""
    for smoke in (False, True):
        cfgs = {name: bench_qlora.model_config(name, smoke) for name in bench_qlora.SHAPES}
        assert cfgs["llama-3.1-8b"].rope_scaling["rope_type"] == "llama3" and not cfgs["llama-3.1-8b"].qkv_bias
        assert cfgs["qwen2.5-7b"].qkv_bias
        gemma2, gemma3 = cfgs["gemma-2-9b"], cfgs["gemma-3-12b"]
        assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
        assert gemma2.layer_types[:2] == ["sliding", "full"]
        assert gemma3.qk_norm and gemma3.rope_local_theta == 10000.0
        assert gemma3.layer_types[:2] == ["sliding", "full"] if smoke else gemma3.layer_types[4:7] == FULL_6TH
    full = bench_qlora.model_config("llama-3.1-8b", False)
    assert (full.hidden_size, full.n_layers, full.vocab_size) == (4096, 32, 128256)


def test_predict_longest_fits_the_line_of_the_two_longest_rows():
    GiB = 1024 ** 3
    rows = [{"seqlen": 32768, "status": "ok", "peak_mem_bytes": 12 * GiB},
            {"seqlen": 65536, "status": "ok", "peak_mem_bytes": 18 * GiB},
            {"seqlen": 131072, "status": "oom", "peak_mem_bytes": 79 * GiB}]  # an OOM row says nothing of the line
    length, per_token, fixed = bench_qlora.predict_longest(rows, 80 * GiB, step=1024, headroom=1.0)
    assert per_token == 6 * GiB / 32768 and fixed == 6 * GiB
    assert length == 403456  # (80 - 6) GiB at 6 GiB per 32768 tokens: 404,138 tokens, down to a multiple of 1024
    assert bench_qlora.predict_longest(rows[:1], 80 * GiB) is None


@pytest.mark.slow
def test_bench_qlora_smoke(tmp_path):
    """bench_qlora.py --smoke end to end on CPU: an NF4 model built in memory trains, at 2 x T and at batch 1."""
    out = tmp_path / "qlora.json"
    stdout = run_script("bench_qlora.py", "--smoke", "--shapes", "gemma-2-9b", "--ckpt", "on+offload", "--long", "96",
                        "--out", out, timeout=600)
    rows = json.loads(out.read_text())["results"]
    assert [(r["shape"], r["batch"], r["seqlen"], r["ckpt"]) for r in rows] == [
        ("gemma-2-9b", 2, 64, "on+offload"), ("llama-3.1-8b", 1, 96, "on+offload")]
    for r in rows:
        assert r["status"] == "ok", r
        assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_final"]), r
    # two updates move the 2 x T row's loss; the batch-1 row times one step after its warm-up, and one update of
    # B from zero moves a random model's loss by about one fp32 ulp, so only its finiteness is checked
    assert rows[0]["loss_final"] < rows[0]["loss_first"] - 1e-4, rows[0]
    assert "| gemma-2-9b | 2x64 | on+offload |" in stdout


@pytest.mark.parametrize("shape", sorted(bench_qlora.SHAPES))
def test_write_checkpoint_gives_what_the_peers_load(tmp_path, shape):
    """--write-checkpoint: a checkpoint whose config.json nanotune reads as the shape's own config (Gemma 2's
    softcaps, Gemma 3's text model, windows and RoPE bases kept) with a tokenizer of exactly vocab_size tokens, which
    transformers loads; an existing folder is refused before writing."""
    import dataclasses

    from transformers import AutoTokenizer

    from model import read_config
    folder = tmp_path / shape
    bench_qlora.write_checkpoint(shape, str(folder), smoke=True)
    written, built = read_config(str(folder)), bench_qlora.model_config(shape, smoke=True)
    assert (written.bos_token_id, written.eos_token_id, written.pad_token_id) == (2, 1, 0)
    # transformers writes the scaling's dict with its base beside it (rope_parameters)
    scaling = {k: written.rope_scaling[k] for k in built.rope_scaling} if built.rope_scaling else written.rope_scaling
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert dataclasses.replace(written, rope_scaling=scaling, **ids) == built
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == written.vocab_size and (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    with pytest.raises(SystemExit):
        bench_qlora.main(["--shapes", shape, "--write-checkpoint", str(folder), "--smoke"])


def test_qlora_fp8_case_runs():
    """bench_qlora.py --fp8: the NF4 step with the base GEMMs in fp8 (the CPU's torch._scaled_mm)."""
    row = bench_qlora.run_case("llama-3.1-8b", 1, 32, "off", smoke=True, warmup=0, steps=1, fp8=True)
    assert row["status"] == "ok", row


def test_fp8_curve_smoothing():
    from scripts.bench.fp8_curve import smoothed
    assert smoothed([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected: no pull toward 0
    assert smoothed([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.25 * 1 + 0.5 * 3) / 0.75])

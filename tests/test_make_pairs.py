"""scripts/make_pairs.py: preference pairs from rows and a model's greedy answers, and its answer accuracy."""
import json

import pytest
import torch

import data
import train
from data.preference import sides
from model import LoRAConfig, load_model, load_tokenizer
from model.adapters import save_adapter
from model.generate import generate, stop_ids
from scripts import make_pairs
from tests.helpers import read_metrics
from tests.tiny_models import make_run_folder

MAX_NEW = 6


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """A tiny model folder whose tokenizer has no chat template: pairs in plain text."""
    return make_run_folder(str(tmp_path_factory.mktemp("plain")), family="tinyllama", chat_template=False)


def greedy(model_dir, rows):
    """The tiny model's greedy answer to each row, as text without the stop token, by model.generate directly."""
    tok = load_tokenizer(model_dir)
    model, cfg = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    stops = stop_ids(tok, cfg)
    return [tok.decode([t for t in generate(model, data.held_out_prompt(row, tok)[1], MAX_NEW, stop_ids=stops)
                        if t not in stops]) for row in rows]


@pytest.mark.parametrize("template", ["chat", "plain"])
def test_pairs_hold_the_reference_and_the_models_greedy_answer(template, run_model, plain_model, tmp_path, capsys):
    """chosen is the row's answer and rejected the model's greedy answer (model.generate on the prompt SFT renders);
    a row that the model already answers exactly is dropped and counted; train.py renders a pair's chosen side
    into the same tokens as SFT renders the row; and train.py --method dpo trains on the file."""
    model_dir = run_model if template == "chat" else plain_model
    rows = data.builtin_dataset("eval")[:5]
    answers = greedy(model_dir, rows)
    rows[1] = {**rows[1], "output": answers[1].strip()}  # the model already answers this one exactly
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "pairs.jsonl"
    make_pairs.main(["--model", model_dir, "--data", str(source), "--max-new-tokens", str(MAX_NEW), "--out", str(out),
                     "--device", "cpu"])
    assert "4 pairs of 5 rows" in capsys.readouterr().out

    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    kept = [i for i in range(5) if i != 1]
    assert len(pairs) == 4 and all(sorted(p) == ["chosen", "prompt", "rejected"] for p in pairs)
    tok = load_tokenizer(model_dir)
    for i, pair in zip(kept, pairs):
        text = lambda side: side[0]["content"] if template == "chat" else side  # noqa: E731
        assert isinstance(pair["prompt"], list if template == "chat" else str)
        assert text(pair["chosen"]) == rows[i]["output"]
        assert text(pair["rejected"]) == answers[i]
        chosen, _ = sides(pair)
        assert data.encode_example(chosen, tok) == data.encode_example(rows[i], tok)

    run = tmp_path / "run"
    argv = ["--model", model_dir, "--data", str(out), "--eval-data", str(out), "--out-dir", str(run), "--device",
            "cpu", "--dtype", "fp32", "--no-kernels", "--max-len", "256", "--batch-size", "2", "--max-steps", "1",
            "--method", "dpo", "--eval-batches", "1"]
    assert train.cli(argv) == 0
    assert "data: 4 pairs of 4" in capsys.readouterr().out
    assert any("eval_rewards/accuracies" in r for r in read_metrics(run))


def test_score_counts_exact_answers_with_and_without_the_adapter(run_model, tmp_path, capsys):
    """--score: the base model's exact answers, then the adapter's; an adapter that changes nothing (B = 0)
    scores as the base, and a row whose answer is the model's own counts as right."""
    rows = data.builtin_dataset("eval")[:3]
    answers = greedy(run_model, rows)
    rows[0] = {**rows[0], "output": answers[0]}
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, _ = load_model(run_model, dtype=torch.float32, device=torch.device("cpu"), lora=LoRAConfig(r=4))
    save_adapter(model, tmp_path / "adapter")  # B = 0: the base model's answers
    make_pairs.main(["--model", run_model, "--data", str(source), "--max-new-tokens", str(MAX_NEW), "--device", "cpu",
                     "--score", str(tmp_path / "adapter")])
    assert "on 3 rows" in (line := capsys.readouterr().out) and "base 1/3" in line and "adapter 1/3" in line, line


@pytest.mark.parametrize("argv, match", [
    (["--split", "eval", "--data", "rows.jsonl", "--out", "p.jsonl"], "--split picks a split of the builtin"),
    ([], "--out FILE.jsonl is required"),
    (["--out", "exists.jsonl"], "exists; pass --overwrite"),
])
def test_bad_options_are_one_line_before_any_work(argv, match, tmp_path, monkeypatch, capsys):
    """Bad options stop the script with one error line before the model loads (the model here does not exist)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exists.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        make_pairs.run_tool(lambda: make_pairs.main(["--model", str(tmp_path / "no-model"), *argv]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and match in err, err

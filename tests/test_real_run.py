"""scripts/real_run.py, the real-model GRPO and DPO runs, end to end with --quick on a tiny model (so that the GPU
run does not fail on a typo), and scripts/plot.py's choice of curves for an RL run's records."""
import pytest

from scripts import plot, real_run
from tests.helpers import read_metrics, run_script
from tests.tiny_models import make_run_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_run_folder(str(tmp_path_factory.mktemp("real") / "model"), family="tinyllama")


def test_real_rl_runs_and_reports_pass_at_1(tiny, tmp_path):
    """`real_run.py rl --quick` runs rl.py on builtin:arithmetic, held out at step 0 and at the end, and prints
    the summary line with pass@1 before and after."""
    out = tmp_path / "rl"
    r = run_script("real_run.py", "rl", "--model", tiny, "--out", out, "--quick", "--", "--max-len", "256")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "eval_pass@1" in r] == [0, 2, 4]
    assert "rl on builtin:arithmetic: 4 steps" in r.stdout and "held-out pass@1" in r.stdout
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_real_dpo_builds_pairs_trains_and_scores(tiny, tmp_path):
    """`real_run.py dpo --quick` builds train and eval pairs from the model's answers, trains DPO on them with the
    eval pairs held out, and reports the preference accuracy and the answer accuracy before and after."""
    out = tmp_path / "dpo"
    r = run_script("real_run.py", "dpo", "--model", tiny, "--out", out, "--quick")
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(len((out / f"{s}_pairs.jsonl").read_text().splitlines()) == 4 for s in ("train", "eval"))
    assert "held-out preference accuracy (eval_rewards/accuracies)" in r.stdout
    assert "answer accuracy on 4 rows of builtin:eval" in r.stdout
    assert "eval_rewards/accuracies" in read_metrics(out / "dpo")[0]


def test_a_failing_step_stops_the_run(tmp_path, capsys):
    """A script that fails stops real_run.py with one line naming it, before the next command runs."""
    with pytest.raises(SystemExit, match="error: rl.py failed"):
        real_run.main(["rl", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"), "--quick"])


def test_plot_draws_reward_and_pass_at_1_for_an_rl_run():
    """An RL run's records (rl.py: `reward` per step, `eval_pass@1` at evals) give the reward curve and the
    held-out pass@1; an SFT run's give the loss curves, as before."""
    rl_rows = [{"step": 0, "eval_reward": 0.1, "eval_pass@1": 0.0}, {"step": 1, "loss": 0.0, "reward": 0.25},
               {"step": 2, "loss": 0.0, "reward": 0.5}, {"step": 2, "eval_reward": 0.9, "eval_pass@1": 0.75}]
    assert plot.curves(rl_rows) == (True, [(1, 0.25), (2, 0.5)], [(0, 0.0), (2, 0.75)])
    sft_rows = [{"step": 1, "loss": 2.0}, {"step": 1, "eval_loss": 2.5}]
    assert plot.curves(sft_rows) == (False, [(1, 2.0)], [(1, 2.5)])

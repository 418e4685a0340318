"""Uploads to the hub (huggingface_hub.HfApi monkeypatched: nothing reaches the network), the
checks that run before any slow work, and the merge tool's --push-to-hub."""
import os

import pytest

from model import LoRAConfig, load_model
from model.adapters import save_adapter
from model.hub import check_push, push
from tests.helpers import randomize_lora_b, run_script_here
from tests.tiny_models import make_run_folder


def test_push_folder_and_file(hub, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("a")
    assert push(str(tmp_path / "folder"), "me/adapter") == "https://huggingface.co/me/adapter"
    assert [c[0] for c in hub] == ["create_repo", "upload_folder"]
    assert hub[0][1] == ("me/adapter",) and hub[0][2]["exist_ok"] is True
    assert hub[1][2]["folder_path"] == str(tmp_path / "folder") and hub[1][2]["repo_id"] == "me/adapter"
    hub.clear()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    push(str(tmp_path / "m.gguf"), "me/model-gguf", card="# card\n")
    assert [c[0] for c in hub] == ["create_repo", "upload_file", "upload_file"]
    assert hub[1][2]["path_in_repo"] == "m.gguf" and hub[1][2]["path_or_fileobj"] == str(tmp_path / "m.gguf")
    assert hub[2][2]["path_in_repo"] == "README.md" and hub[2][2]["path_or_fileobj"] == b"# card\n"


def test_push_errors_say_how_to_fix(hub, monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    def refuse(self, *args, **kwargs):
        e = HfHubHTTPError.__new__(HfHubHTTPError)  # built without an HTTP response; the message is what matters
        Exception.__init__(e, "403 Forbidden: You don't have the rights to create a model under this namespace")
        raise e

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", refuse)
    with pytest.raises(ValueError, match=r"cannot push to 'me/x' \(403 Forbidden.*\); log in with `hf auth login` "
                                         r"\(or set HF_TOKEN\)") as info:
        push(str(tmp_path), "me/x")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="'not a repo' is not a hub repo id: give it as user/name"):
        check_push("not a repo")
    with pytest.raises(ValueError, match="is not a hub repo id"):
        check_push("a/b/c")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ValueError, match="not logged in to the hub; log in with `hf auth login` .or set HF_TOKEN."):
        check_push("me/x")


def test_merge_push_to_hub(hub, monkeypatch, tmp_path, capsys):
    folder = make_run_folder(str(tmp_path / "base"), family="tinyllama")
    model, _ = load_model(folder, lora=LoRAConfig(r=4))
    randomize_lora_b(model)
    save_adapter(model, str(tmp_path / "adapter"), base_model=folder)
    run_script_here(monkeypatch, "merge.py", "--model", folder, "--adapter", tmp_path / "adapter", "--out",
               tmp_path / "merged", "--push-to-hub", "me/tuned")
    assert [c[0] for c in hub] == ["create_repo", "upload_folder"]
    assert hub[1][2]["folder_path"] == str(tmp_path / "merged")
    assert os.path.isfile(tmp_path / "merged" / "README.md") and os.path.isfile(tmp_path / "merged" / "config.json")
    assert capsys.readouterr().out.splitlines()[-1] == "pushed to https://huggingface.co/me/tuned"


def test_bad_push_target_is_refused_before_the_merge(hub, monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_script_here(monkeypatch, "merge.py", "--model", "no-such-model", "--adapter", tmp_path, "--out",
                   tmp_path / "merged", "--push-to-hub", "not/a/repo")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: --push-to-hub 'not/a/repo' is not a hub repo id")
    assert not (tmp_path / "merged").exists() and not hub

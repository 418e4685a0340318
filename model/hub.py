"""The Hugging Face hub: model names to local folders (download), back to hub repo ids, model
cards, and uploads.

    resolve("tinyllama")          -> the local snapshot folder (downloaded once, then from the hub cache)
    resolve("./my-model.gguf")    -> "./my-model.gguf"
    base_model_id("tinyllama")    -> "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    base_model_id("./folder")     -> "/abs/path/folder"
    push("out/adapter", "me/my-adapter")   -> "https://huggingface.co/me/my-adapter"

A model is named by a short name (`NAMED_MODELS`), a hub repo id ("user/name"), a local
folder with config.json and *.safetensors, or a local .gguf file.
"""
import json
import os
import re
from contextlib import contextmanager

from model.config import NAMED_MODELS
from model.weights import is_gguf

# Files fetched from the hub: config, tokenizer and safetensors only (never .bin/.pth).
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def hub_repo(name: str) -> str:
    """The hub repo id of a short name or a repo id; anything else is refused, listing the short names."""
    if name in NAMED_MODELS:
        return NAMED_MODELS[name]
    if name.count("/") == 1 and not os.path.exists(name) and not name.startswith((".", "/")):
        return name
    known = ", ".join(sorted(NAMED_MODELS))
    raise ValueError(f"unknown model {name!r}: not a local folder, a .gguf file, a known short name or a hub "
                     f"repo id (user/name). Known short names: {known}")


def _local(name_or_path) -> bool:
    return is_gguf(name_or_path) or os.path.isdir(name_or_path)


def resolve(name_or_path: str) -> str:
    """The local model folder (downloading from the hub if needed), or the .gguf path itself."""
    if is_gguf(name_or_path):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"no GGUF file at {name_or_path!r}")
        return name_or_path
    if os.path.isdir(name_or_path):
        return name_or_path
    repo = hub_repo(name_or_path)
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    local = "or pass a local folder with config.json and *.safetensors: --model /path/to/folder"
    try:
        with quiet_hub_warnings():
            return huggingface_hub.snapshot_download(repo, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"cannot download {repo!r}: the hub is unreachable (offline, or HF_HUB_OFFLINE=1) and it is not in "
            f"the local hub cache. Download it where there is network (`hf download {repo}`), {local}") from e
    except RepositoryNotFoundError as e:  # also gated and private repositories
        raise ValueError(
            f"cannot download {repo!r}: the hub has no such repository, or it is private or gated and this "
            f"machine is not logged in. Check the id on huggingface.co; for a gated model accept its licence "
            f"there, then `hf auth login` (or set HF_TOKEN); {local}") from e
    except HfHubHTTPError as e:
        raise ValueError(f"cannot download {repo!r}: the hub answered with an error ({e}). Try again later, "
                         f"{local}") from e


@contextmanager
def quiet_hub_warnings():
    """huggingface_hub's logger at ERROR for the duration (through its own verbosity setting): offline, its
    retries log "Retrying in 8s [Retry 5/5]" lines before the error that `resolve` turns into one line of
    its own. Its progress bars are not log records and stay."""
    from huggingface_hub.utils import logging as hub_logging
    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(level)


def base_model_id(name_or_path: str) -> str:
    """What an adapter records as its base model: the hub repo id for a short name, a repo id or a
    folder of the hub cache (what `resolve` returns for those); the absolute path of any other
    local folder or .gguf file. No network."""
    if not _local(name_or_path):
        return hub_repo(name_or_path)
    path = os.path.abspath(name_or_path)
    parts = path.split(os.sep)
    for i, part in enumerate(parts[:-1]):  # the hub cache's layout: .../models--{org}--{name}/snapshots/{rev}
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/")
    return path


# ----------------------------------------------------------------------------- model cards

RELATIONS = ("adapter", "finetune", "quantized")  # how a card's model derives from its base (hub tags)


def _yaml(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a YAML string


def model_card(base_model: str | None, relation: str, library_name: str | None = None, dataset: str | None = None,
               options: dict | None = None, metrics: dict | None = None, usage: str | None = None) -> str:
    """A README.md model card: YAML front matter as the hub reads it (base_model, library_name,
    tags), then the base model, dataset, training options and final eval figures, and how to use it.
    base_model: a hub repo id or a local path (from `base_model_id`), or None; only a repo id goes
    into the front matter, where the hub expects one. relation: "adapter", "finetune" or "quantized"."""
    assert relation in RELATIONS, relation
    on_hub = base_model is not None and not os.path.isabs(base_model)
    tags = ["nanotune", "text-generation"] + (["lora"] if relation == "adapter" else [])
    if relation == "quantized":
        tags.append("gguf")
    if on_hub:
        tags.append(f"base_model:{relation}:{base_model}")
    front = (["---"] + ([f"base_model: {_yaml(base_model)}"] if on_hub else [])
             + ([f"library_name: {library_name}"] if library_name else [])
             + ["pipeline_tag: text-generation", "tags:"] + [f"- {_yaml(t)}" for t in tags] + ["---", ""])
    what = {"adapter": "A LoRA adapter", "finetune": "A fine-tune", "quantized": "A GGUF file of a fine-tune"}[relation]
    of = f" of `{base_model}`" if base_model else ""
    body = [f"# {what}{of}", "", f"{what}{of}, trained with nanotune (LoRA / QLoRA).", ""]
    if base_model:
        body.append(f"- **Base model:** `{base_model}`")
    if dataset:
        body.append(f"- **Dataset:** `{dataset}`")
    for heading, table in (("Training options", options), ("Evaluation", metrics)):
        if table:
            body += ["", f"## {heading}", "", "| | |", "|---|---|"]
            body += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in table.items()]
    if usage:
        body += ["", "## Use", "", usage]
    return "\n".join(front + body) + "\n"


# ----------------------------------------------------------------------------- upload

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_LOGIN = "log in with `hf auth login` (or set HF_TOKEN) with a token that can write to it"


def check_push(repo: str):
    """Refuse a malformed repo id or a machine without a hub token: before any slow work."""
    if not _REPO_ID.match(repo) or "--" in repo or ".." in repo:
        raise ValueError(f"--push-to-hub {repo!r} is not a hub repo id: give it as user/name (or org/name)")
    import huggingface_hub
    if huggingface_hub.get_token() is None:
        raise ValueError(f"cannot push to {repo!r}: this machine is not logged in to the hub; {_LOGIN}")


def push(path: str, repo: str, card: str | None = None) -> str:
    """Upload a folder (its files at the repo's root) or one file to the hub model repo `repo`,
    creating it if needed, with `card` as its README.md. Returns the repo's URL."""
    check_push(repo)
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    failures = (HfHubHTTPError, HFValidationError, OSError)  # OSError: no token, and requests' network errors
    try:
        import httpx  # huggingface_hub >= 1.0 talks to the hub through httpx
        failures += (httpx.HTTPError,)
    except ImportError:
        pass
    api = huggingface_hub.HfApi()
    try:
        url = api.create_repo(repo, repo_type="model", exist_ok=True)
        if os.path.isdir(path):
            api.upload_folder(repo_id=repo, folder_path=path, commit_message="Upload with nanotune")
        else:
            api.upload_file(repo_id=repo, path_or_fileobj=path, path_in_repo=os.path.basename(path),
                            commit_message="Upload with nanotune")
        if card is not None:
            api.upload_file(repo_id=repo, path_or_fileobj=card.encode(), path_in_repo="README.md",
                            commit_message="Model card")
    except failures as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot push to {repo!r} ({reason}); {_LOGIN}, and check the repo id") from e
    return str(url)

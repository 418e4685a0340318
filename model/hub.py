"""The Hugging Face hub: model names to local folders (download), and back to hub repo ids.

    resolve("tinyllama")          -> the local snapshot folder (downloaded once, then from the hub cache)
    resolve("./my-model.gguf")    -> "./my-model.gguf"
    base_model_id("tinyllama")    -> "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    base_model_id("./folder")     -> "/abs/path/folder"

A model is named by a short name (`NAMED_MODELS`), a hub repo id ("user/name"), a local
folder with config.json and *.safetensors, or a local .gguf file.
"""
import os

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

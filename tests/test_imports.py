"""The project's own modules import each other without a circle (counting imports inside
functions too), a model built without the Triton kernels does not import them, and building a model
does not import torch._dynamo."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("model", "kernels", "data")


def project_modules():
    """Module name -> file, for the packages and the top-level scripts of the repository."""
    found = {}
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            found[name[:-3]] = os.path.join(ROOT, name)
    for pkg in PACKAGES + ("scripts",):
        for name in os.listdir(os.path.join(ROOT, pkg)):
            if name.endswith(".py"):
                mod = pkg if name == "__init__.py" else f"{pkg}.{name[:-3]}"
                found[mod] = os.path.join(ROOT, pkg, name)
    return found


def imports_of(path, modules):
    """The project modules that the file at `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from model.lora import x` imports model.lora; `from model import lora` imports model.lora too
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def find_cycle(graph):
    """One import circle as a list of modules, or None."""
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_circle():
    modules = project_modules()
    graph = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    assert graph["model.gguf"] and graph["model.load"], "the walk finds the imports"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"], "the search finds circles"
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_model_without_kernels_imports_no_triton_kernel():
    """Ops(use_kernels=False) takes the torch references; the Triton kernel functions are imported
    only for a model that uses them."""
    code = ("import sys; from model.transformer import Ops; ops = Ops(use_kernels=False); "
            "print(ops.rms_norm.__name__, ops.glu('silu').function.func.__name__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["rms_norm_reference", "swiglu_reference"]


def test_building_a_model_imports_no_dynamo():
    """A model built on the meta device, as the loaders build it, does not import torch._dynamo (seconds of
    import, once per process): no weight draws a random init there. step.py's warm start builds its copy while
    the loader builds the model; an import that one thread runs, the other waits for."""
    code = ("import sys, torch; from model.config import ModelConfig; from model.lora import LoRAConfig; "
            "from model.transformer import Transformer\n"
            "with torch.device('meta'):\n"
            "    Transformer(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, n_layers=2, n_heads=4, "
            "n_kv_heads=2, head_dim=8, pad_token_id=0), lora=LoRAConfig(r=4))\n"
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]


def test_gguf_tests_skip_without_the_gguf_package():
    """The optional gguf package missing: tests/test_gguf.py is skipped, not an error at collection
    (under -m gpu too, which collects every file)."""
    code = ("import sys; sys.modules['gguf'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'gpu', 'tests/test_gguf.py']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode in (0, 5), r.stdout[-2000:]  # 5: nothing selected, nothing failed
    assert "skipped" in r.stdout and "error" not in r.stdout.lower(), r.stdout[-2000:]

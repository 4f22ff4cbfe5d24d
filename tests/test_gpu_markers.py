"""`make test-gpu` runs exactly the tests marked `gpu` (`pytest -m gpu`), and `make test` runs
everything: so every test that needs CUDA must carry the marker (else the GPU target misses
it), and the default target must deselect nothing. Pure AST and text checks."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _decorators(fn: ast.FunctionDef) -> list[str]:
    return [ast.unparse(d) for d in fn.decorator_list]


def test_every_test_that_needs_cuda_is_marked_gpu():
    needs_cuda, unmarked = [], []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            decorators = _decorators(node)
            if any("torch.cuda" in d for d in decorators):
                needs_cuda.append(node.name)
                if "pytest.mark.gpu" not in decorators:
                    unmarked.append(f"{path.name}::{node.name}")
    assert needs_cuda, "no CUDA test found: the check above looks in the wrong place"
    assert not unmarked, f"tests that skip without CUDA but lack @pytest.mark.gpu: {unmarked}"


def _pytest_args(makefile: str, target: str) -> str:
    """The arguments after `-m pytest` in the recipe of `target`."""
    recipe = re.search(rf"^{target}:.*\n\t(.+)$", makefile, re.MULTILINE).group(1)
    return recipe.split("-m pytest", 1)[1]


def test_make_test_gpu_selects_the_gpu_marker_and_make_test_deselects_nothing():
    makefile = (ROOT / "Makefile").read_text()
    assert "-m gpu" in _pytest_args(makefile, "test-gpu")
    default = _pytest_args(makefile, "test")
    assert "-m " not in default and "--deselect" not in default and " -k" not in default
    assert '"gpu: ' in (ROOT / "pyproject.toml").read_text()  # the marker is registered

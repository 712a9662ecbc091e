"""Every code block in the README, on every page of docs/ and in the docstrings the API reference
renders runs as written.

A ```python block runs in this process; a page's blocks run in order in one namespace, so a later
block may use what an earlier one defined (a docstring's blocks likewise). A ```python ranks=2 block
runs on two local gloo ranks: every page's and docstring's two-rank blocks run in one pair of workers
(one `run_local` call), each page in a namespace of its own, each rank in the test's temporary
directory. A ```python torchrun=2 block is a whole script, run as its user would start it:
under torchrun, on two CPU ranks (a trainer's example: Lightning, Accelerate). Commands and other
text go in ```bash or ```text fences, which are not run; any other fence is refused, so no example
escapes its test."""

import ast
import contextlib
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsecomm

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
REFERENCE = sorted((ROOT / "docs" / "reference").glob("*.md"))
RUN_HERE, RUN_ON_TWO_RANKS, RUN_WITH_TORCHRUN = "python", "python ranks=2", "python torchrun=2"
NOT_RUN = ("bash", "text")
FENCE = re.compile(r"^( *)```([^`\n]*)\n(.*?)^\1```[ \t]*$", flags=re.DOTALL | re.MULTILINE)
README_SETUP = (
    "python3 -m venv .venv && .venv/bin/pip install -r requirements/lock.txt -e . && .venv/bin/sparsecomm train",
    "python3 -m venv .venv && .venv/bin/pip install -r requirements/lock.txt -e . && bash scripts/check",
)


def fences(page: Path | str, text: str | None = None) -> list[tuple[str, str]]:
    """(info string, source) of every fenced block on ``page`` (or in ``text``); the source is
    padded with blank lines so that a traceback's line numbers are the text's own."""
    text = Path(page).read_text() if text is None else text
    found = []
    for match in FENCE.finditer(text):
        indent, info, body = match.group(1), match.group(2).strip(), match.group(3)
        lines = [line[len(indent):] if line.startswith(indent) else line for line in body.splitlines()]
        first_line = text.count("\n", 0, match.start(3))
        found.append((info, "\n" * first_line + "\n".join(lines) + "\n"))
    return found


def blocks(page: Path, info: str) -> list[str]:
    return [source for kind, source in fences(page) if kind == info]


def documented() -> dict[str, object]:
    """Every object a reference page renders (``::: dotted.name``), by name."""
    names = [name for page in REFERENCE for name in re.findall(r"^::: *(\S+)", page.read_text(), flags=re.M)]
    found = {}
    for name in names:
        module, _, attribute = name.rpartition(".")
        found[name] = getattr(importlib.import_module(module), attribute)
    return found


def docstrings() -> dict[str, str]:
    """The docstrings the reference renders with code in them: each rendered function's and
    class's, and its public methods' and properties'."""
    found = {}
    for name, obj in documented().items():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # a module attribute's docstring is not kept at run time: see test_attribute_examples
        found[name] = inspect.getdoc(obj) or ""
        for member, value in vars(obj).items() if inspect.isclass(obj) else ():
            if not member.startswith("_"):
                function = value.fget if isinstance(value, property) else value
                found[f"{name}.{member}"] = inspect.getdoc(function) or ""
    return {name: doc for name, doc in found.items() if "```" in doc}


def run_page(page: str, sources: list[str]) -> str:
    """Run a page's blocks in order in one namespace; what they printed."""
    printed = io.StringIO()
    namespace: dict[str, object] = {"__name__": "__main__"}
    with contextlib.redirect_stdout(printed):
        for source in sources:
            exec(compile(source, page, "exec"), namespace)
    return printed.getvalue()


def run_pages(rank: int, world: int, pages: list[tuple[str, list[str]]], directory: str) -> dict[str, str]:
    os.chdir(directory)  # the examples write their checkpoints here
    return {page: run_page(page, sources) for page, sources in pages}


def test_the_readme_fits_a_screen_and_keeps_its_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for command in README_SETUP:
        assert command in text


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_fence_runs_or_is_plainly_not_python(page):
    kinds = {info for info, _ in fences(page)}
    assert kinds <= {RUN_HERE, RUN_ON_TWO_RANKS, RUN_WITH_TORCHRUN, *NOT_RUN}, f"{page}: fences {sorted(kinds)}"
    assert page.read_text().count("```") == 2 * len(fences(page)), f"{page}: an unmatched fence"


def test_no_commit_hashes_in_the_readme_or_docs():
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", page.read_text())
                  if re.search(r"[a-f]", word) and re.search(r"[0-9]", word)]
        assert not hashes, f"{page} names commits: {hashes}"


def test_every_public_name_has_a_reference_entry_with_an_example():
    entries = documented()
    rendered = {id(obj) for obj in entries.values()}
    assert [name for name in sparsecomm.__all__ if id(getattr(sparsecomm, name)) not in rendered] == []
    examples = docstrings()
    for name, obj in entries.items():
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert name in examples, f"{name}'s docstring has no example"


def test_docstring_examples_say_how_they_run():
    for name, doc in docstrings().items():
        kinds = {info for info, _ in fences(name, doc)}
        assert kinds <= {RUN_HERE, RUN_ON_TWO_RANKS, *NOT_RUN}, f"{name}: fences {sorted(kinds)}"
        assert doc.count("```") == 2 * len(fences(name, doc)), f"{name}: an unmatched fence"


@pytest.mark.parametrize("page", [page for page in PAGES if blocks(page, RUN_HERE)],
                         ids=lambda page: str(page.relative_to(ROOT)))
def test_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(str(page), blocks(page, RUN_HERE))


def test_docstring_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, doc in docstrings().items():
        run_page(name, [source for info, source in fences(name, doc) if info == RUN_HERE])


def test_attribute_examples_run(tmp_path, monkeypatch):
    """A module attribute's docstring (`PRESETS`) lives in its module's source only."""
    import griffe

    monkeypatch.chdir(tmp_path)
    package = griffe.load("sparsecomm", search_paths=[str(ROOT / "src")])
    for name, obj in documented().items():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            docstring = package[name.removeprefix("sparsecomm.")].docstring
            doc = docstring.value if docstring is not None else ""
            run_page(name, [source for info, source in fences(name, doc) if info == RUN_HERE])


def test_two_rank_examples_run_on_two_local_ranks(tmp_path):
    from sparsecomm.launch import run_local

    pages = [(str(page), blocks(page, RUN_ON_TWO_RANKS)) for page in PAGES if blocks(page, RUN_ON_TWO_RANKS)]
    assert len(pages) >= 4, "the DDP, custom-loop, checkpoint and transport examples at least"
    pages += [(name, [source for info, source in fences(name, doc) if info == RUN_ON_TWO_RANKS])
              for name, doc in docstrings().items() if f"```{RUN_ON_TWO_RANKS}" in doc]
    outputs = run_local(2, run_pages, pages, str(tmp_path))
    for rank_output in outputs:
        assert set(rank_output) == {page for page, _ in pages}
        assert "compression_ratio" in rank_output[str(README)], "the README's DDP example prints its summary"


SAVE_PARAMETERS = """
import os as _os
torch.save([_p.detach() for _p in model.parameters()], f"parameters-{_os.environ['RANK']}.pt")
"""
"""appended to a torchrun example: each rank saves its ``model``'s parameters, for the ranks to be compared"""


@pytest.mark.parametrize("page", [page for page in PAGES if blocks(page, RUN_WITH_TORCHRUN)],
                         ids=lambda page: str(page.relative_to(ROOT)))
def test_trainer_examples_train_under_torchrun(page, tmp_path):
    """Each rank prints the reducer's summary after 30 steps: the hook ran and compressed, and the
    ranks end with the same parameters."""
    (source,) = blocks(page, RUN_WITH_TORCHRUN)
    script = tmp_path / "train.py"
    script.write_text(source + SAVE_PARAMETERS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    summaries = [ast.literal_eval(found) for found in re.findall(r"\{'steps': .*?\}", done.stdout)]
    assert [summary["steps"] for summary in summaries] == [30, 30], done.stdout
    assert all(summary["compression_ratio"] > 1 for summary in summaries), summaries
    first, second = (torch.load(tmp_path / f"parameters-{rank}.pt") for rank in range(2))
    assert len(first) == 4 and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

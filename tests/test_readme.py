"""The README's Python examples run as written (```python blocks; ```py marks fragments that need a
running torch.distributed job)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "bytes instead of 4000000" in printed and "nnz=" in printed


def run_block(rank: int, world: int, block: str, directory: str) -> str:
    import contextlib
    import io
    import os

    os.chdir(directory)  # the examples write their checkpoints here
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(README), "exec"), {})
    return printed.getvalue()


def test_distributed_examples_run_on_two_local_ranks(tmp_path):
    from sparsecomm.launch import run_local

    blocks = re.findall(r"```python ranks=2\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 3, "the DDP, custom-loop and transport examples"
    for block in blocks:
        outputs = run_local(2, run_block, block, str(tmp_path))
        assert all("compression_ratio" in out or "CallRecord(transport=" in out for out in outputs), block[:80]
    assert (tmp_path / "checkpoint.pt").is_file()

"""``gnnpar train gpt`` with a pipe axis, through the one trainer loop and the checkpoint
package: a pipelined run equals the same run without a pipeline, and a checkpoint written on
pipe=2 resumes on pipe=4, and without a pipeline, to the parameters of uninterrupted runs on
those grids (float64, ≤ 1e-12 relative); HF GPT-2 (``--model hf-gpt2``) pipelined equals it
without a pipeline. One world of 8 forked ranks runs every command
(tests/cli_world.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_world import run_commands
from tests.test_checkpoint_train import REL, _same


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _argv(out: Path, steps: int, grid: str, *extra: str) -> list[str]:
    return ["train", "gpt", "--steps", str(steps), "--n-layer", "4", "--n-embd", "16",
            "--n-head", "2", "--batch-size", "16", "--block-size", "8", "--vocab-size", "300",
            "--warmup", "2", "--eval-every", "2", "--val-batches", "1", "--sample-tokens", "3",
            "--dtype", "float64", "--grid", grid, "--grad-accum", "8", "--nprocs", "8",
            "--out", str(out), "--quiet", *extra]  # fmt: skip


def test_pipelined_gpt_resumes_on_another_pipe_and_without_one_and_equals_no_pipeline(
    tmp_path,
):
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    straight, flat, unpiped = tmp_path / "straight", tmp_path / "flat", tmp_path / "unpiped"
    hf_piped, hf_flat = tmp_path / "hf-piped", tmp_path / "hf-flat"
    hf = ("--model", "hf-gpt2")
    from transformers import GPT2LMHeadModel  # noqa: F401 - imported once, before the fork

    codes = run_commands(8, [
        _argv(saved, 2, "pipe=2,data=2,x=2", "--schedule", "1f1b", "--zero-stage", "3"),
        ("copy", saved, resumed),
        _argv(resumed, 4, "pipe=4,data=2", "--schedule", "gpipe", "--zero-stage", "0",
              "--resume"),
        _argv(straight, 4, "pipe=4,data=2", "--schedule", "gpipe", "--zero-stage", "0"),
        _argv(flat, 4, "data=2,x=2,y=2", "--zero-stage", "0"),
        ("copy", saved, unpiped),
        _argv(unpiped, 4, "data=2,x=2,y=2", "--zero-stage", "0", "--resume"),
        _argv(hf_piped, 2, "pipe=2,data=2,x=2", "--schedule", "1f1b", "--zero-stage", "3", *hf),
        _argv(hf_flat, 2, "data=2,x=2,y=2", "--zero-stage", "0", *hf),
    ])  # fmt: skip
    assert codes == [[0, 0, 0, 0, 0, 0, 0]] * 8
    err = _same(resumed, straight)
    assert err <= REL, f"pipe=2 -> pipe=4: {err:.3g}"
    err = _same(straight, flat)
    assert err <= REL, f"pipe=4 against no pipeline: {err:.3g}"
    err = _same(unpiped, flat)
    assert err <= REL, f"pipe=2 -> no pipeline: {err:.3g}"
    err = _same(hf_piped, hf_flat)
    assert err <= REL, f"hf-gpt2 on pipe=2 against no pipeline: {err:.3g}"

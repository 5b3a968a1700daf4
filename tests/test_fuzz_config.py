"""Config parsing under random input: TOML files, flag values and dataset options. Every case
is a correctly parsed config or one clean line (exit 2, or argparse's SystemExit 2), never a
traceback of another kind."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gnnpar.cli import main
from gnnpar.train.config import ConfigError
from gnnpar.train.spec import specs

FAST = settings(max_examples=15, deadline=None)
TASKS = sorted(name for name, spec in specs().items() if spec.listed)
#: Every config key of every task, and a few that are none.
KEYS = sorted({f.name for spec in specs().values() for f in dataclasses.fields(spec.config)})
KEY = st.one_of(st.sampled_from(KEYS), st.sampled_from(["hiden", "lr ", "", "x.y"]))
SCALAR = st.one_of(
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
)
VALUE = st.one_of(SCALAR, st.lists(st.integers(-5, 5), max_size=3))


@pytest.fixture(autouse=True)
def _plain_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _run_cli(argv: list[str]) -> tuple[int, str]:
    """``main(argv)``: its exit code (argparse's SystemExit included) and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def _assert_clean(code: int, err: str, argparse_prog: str | None = None) -> None:
    """Exit 0, or exit 2 with one line: gnnpar's error, or (given ``argparse_prog``) that
    parser's own, with no usage block before it."""
    # lines end at "\n" only: a value the user typed may hold "\r" or other breaks
    lines = err.strip("\n").split("\n")
    assert "Traceback" not in err
    if code == 0:
        return
    assert code == 2, err
    starts = ("gnnpar train: error: ", *([f"{argparse_prog}: error: "] if argparse_prog else []))
    assert len(lines) == 1 and lines[0].startswith(starts), err


@FAST
@given(task=st.sampled_from(TASKS), table=st.dictionaries(KEY, VALUE, max_size=4))
def test_random_toml_files(task, table):
    text = "".join(f"{json.dumps(k)} = {_toml_value(v)}\n" for k, v in table.items())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.toml"
        path.write_text(text, encoding="utf-8")
        code, err = _run_cli(["train", task, "--config", str(path), "--print-config"])
    _assert_clean(code, err)


@FAST
@given(task=st.sampled_from(TASKS), data=st.binary(max_size=60))
def test_random_bytes_as_a_toml_file(task, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.toml"
        path.write_bytes(data)
        code, err = _run_cli(["train", task, "--config", str(path), "--print-config"])
    _assert_clean(code, err)


@FAST
@given(
    task=st.sampled_from(TASKS),
    key=st.sampled_from(KEYS),
    text=st.one_of(st.text(max_size=10), st.sampled_from(["nan", "inf", "-1", "1e999", "0"])),
)
@example(task="gcn", key="batch_size", text="\n0")  # argparse's error had a line break (found)
def test_random_flag_values(task, key, text):
    code, err = _run_cli(["train", task, f"--{key.replace('_', '-')}={text}", "--print-config"])
    _assert_clean(code, err, argparse_prog=f"gnnpar train {task}")


_PAIR = st.tuples(
    st.one_of(st.sampled_from(["num_nodes", "seed", "num_classes", "feat_dim", "root"]),
              st.text(max_size=6)),
    st.one_of(st.text(max_size=8), st.integers(-3, 10**6).map(str)),
)  # fmt: skip


@FAST
@given(
    dataset=st.sampled_from(["sbm", "rmat", "karate", "citeseer", "no-such-dataset"]),
    pairs=st.lists(_PAIR, max_size=3),
)
@example(dataset="sbm", pairs=[("a\nb", "1")])  # a key with a line break (found by the search)
def test_random_dataset_options(dataset, pairs):
    from gnnpar.train.loop import check_dataset_options

    options = ",".join(f"{k}={v}" for k, v in pairs)
    cfg = SimpleNamespace(dataset=dataset, dataset_options=options)
    try:
        check_dataset_options(cfg)
    except ConfigError as err:
        assert "\n" not in str(err) and str(err).startswith("config key 'dataset")


@FAST
@given(
    dataset=st.sampled_from(["sbm", "karate", "citeseer"]),
    text=st.text(alphabet="ab_-=, 19.", max_size=24),
)
def test_random_dataset_options_text(dataset, text):
    """``--dataset-options TEXT`` as every command reads it: options or one line."""
    from gnnpar.data.options import check_dataset, split_options

    try:
        options = check_dataset(dataset, split_options(text))
    except ValueError as err:
        assert "\n" not in str(err)
        return
    assert "root" not in options and all("," not in k for k in options)

"""Property-based tests of the checkpoint readers (``checkpoint.load`` into a model and
``checkpoint.consolidate``): truncated files, flipped bits and edited manifest values end in
one clear FormatError/CheckpointError (both ValueErrors) naming the checkpoint, or in a load
equal to what was written; never another exception, never silently changed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnnpar
from gnnpar import checkpoint
from gnnpar.verified import meta_digest
from tests.fuzz_folders import check_outcome, flip_bit, truncate

FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    return model, opt


def _read(folder: Path, grid) -> dict[str, torch.Tensor]:
    """What both readers make of ``folder``: the consolidated state and a loaded model's."""
    full = checkpoint.consolidate(folder)
    model, opt = _model(seed=1)  # other values: the load must overwrite every one
    checkpoint.load(folder, grid, model, opt)
    out = {f"full/{k}": v for k, v in full.items()}
    out.update({f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()})
    for i, state in enumerate(opt.state.values()):
        out.update({f"opt/{i}/{k}": v.clone() for k, v in state.items() if torch.is_tensor(v)})
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    grid = gnnpar.init()
    model, opt = _model()
    root = tmp_path_factory.mktemp("ckpt")
    checkpoint.save(root, 3, grid, model, opt)
    (folder,) = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return grid, folder, _read(folder, grid), names


def _outcome(pristine, mutate) -> None:
    grid, folder, want, _ = pristine
    check_outcome(folder, lambda copy: _read(copy, grid), want, mutate)


@FUZZ
@given(data=st.data())
def test_truncated_file(pristine, data):
    _outcome(pristine, truncate(data, data.draw(st.sampled_from(pristine[3]))))


@FUZZ
@given(data=st.data())
def test_flipped_bit(pristine, data):
    _outcome(pristine, flip_bit(data, data.draw(st.sampled_from(pristine[3]))))


def _paths(value, prefix=()):
    """Every leaf of a JSON value, as a path of keys and indices."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))
    else:
        yield prefix


@FUZZ
@given(data=st.data(), reseal=st.booleans())
def test_edited_manifest_value(pristine, data, reseal):
    """An edited leaf of the manifest — a plausible one (a number moved a little, another
    string) — with the meta checksum left alone or recomputed by the editor."""
    manifest = json.loads((pristine[1] / "manifest.json").read_text())
    leaves = [p for p in _paths(manifest) if p and p[0] != "meta_xxh3_64"]
    path = data.draw(st.sampled_from(leaves))

    def edit(copy: Path) -> None:
        doc = json.loads((copy / "manifest.json").read_text())
        node = doc
        for key in path[:-1]:
            node = node[key]
        old = node[path[-1]]
        if isinstance(old, bool) or old is None:
            new = data.draw(st.sampled_from([True, False, None, 0]))
        elif isinstance(old, (int, float)):
            new = old + data.draw(st.sampled_from([-2, -1, 1, 2, 7]))
        else:
            new = data.draw(st.sampled_from(["", "x", f"{old}x", "float64", "rank-00001.pt"]))
        node[path[-1]] = new
        if reseal:
            doc["meta_xxh3_64"] = meta_digest(doc["meta"])
        (copy / "manifest.json").write_text(json.dumps(doc))

    _outcome(pristine, edit)


def _resealed(pristine, edit) -> str:
    """The one-line error that reading a copy whose manifest ``edit`` changed (and whose meta
    checksum was recomputed) gives, or "" when it reads as written."""
    grid, folder, want, _ = pristine
    errors = []

    def mutate(copy: Path) -> None:
        doc = json.loads((copy / "manifest.json").read_text())
        edit(doc["meta"])
        doc["meta_xxh3_64"] = meta_digest(doc["meta"])
        (copy / "manifest.json").write_text(json.dumps(doc))

    def read(copy: Path):
        try:
            return _read(copy, grid)
        except ValueError as err:
            errors.append(str(err))
            raise

    check_outcome(folder, read, want, mutate)
    return errors[0] if errors else ""


def test_a_flipped_transposed_flag_is_refused(pristine):
    """A box marked as stored transposed holds the same number of elements and passes every
    structural check; only the entry's digest of what its values mean catches it (the case
    the fuzz test above once drew: a resealed chunk entry of '2.weight' with index 4 set)."""

    def flip(meta):
        (chunk,) = meta["pieces"]["rank-00000.pt"]["2.weight"]
        chunk[4] = 1

    assert "does not hold the values its layout and digest describe" in _resealed(pristine, flip)


def test_a_checkpoint_without_its_digests_is_refused(pristine):
    def drop(meta):
        del meta["digests"]["rank-00000.pt"]["2.bias"]

    assert "entry '2.bias' of 'rank-00000.pt' has no digest" in _resealed(pristine, drop)

    def drop_all(meta):
        del meta["digests"]

    assert "has no digest" in _resealed(pristine, drop_all)

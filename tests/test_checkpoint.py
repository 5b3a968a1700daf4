"""The one checkpoint format: layout arithmetic, resume onto other grids and shardings
(float64, continuing exactly like an uninterrupted run on the new grid), consolidation into
the plain models, damaged and foreign files, and the ``gnnpar ckpt`` commands.

Trainer-level resumes (``gnnpar train ... --resume`` on another grid) are in
``tests/test_checkpoint_train.py``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import gnnpar
from gnnpar import checkpoint, tensor
from gnnpar.checkpoint.chunks import box_range, concat, copy_overlap, restrict
from gnnpar.models.fullgraph import parallelize_fullgraph
from gnnpar.models.fullgraph.model import FullGraphGNN
from gnnpar.testing import run_distributed
from tests.fullgraph_utils import make_source, normalise, serial_model, small_graph

F64 = torch.float64
REL = 1e-12  # float64 equality (relative to the largest magnitude of the tensor)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of ``b``."""
    a, b = a.detach(), b.detach()
    if not b.numel():
        return 0.0
    return float((a.to(b.dtype) - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def _worst(state: dict, ref: dict) -> float:
    if list(state) != list(ref):
        raise AssertionError(f"keys differ: {list(state)} vs {list(ref)}")
    return max(_rel(state[k], ref[k]) for k in ref)


# ------------------------------------------------------------------------- layout arithmetic
def _box(full: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def test_chunks_equal_index_arithmetic():
    """Pieces built as [a, b) of boxes laid end to end (transposed or not), restricted again
    (a ZeRO shard of a tensor-parallel piece), then copied through overlaps: every element
    lands where brute-force flattening puts it, for 0-D to 3-D tensors."""
    rnd = random.Random(0)
    for _ in range(1500):
        nd = rnd.choice([0, 1, 2, 3])
        shape = tuple(rnd.randint(1, 5) for _ in range(nd))
        full = torch.arange(math.prod(shape), dtype=F64).view(shape)
        boxes = []
        for _ in range(rnd.randint(1, 3)):
            off = tuple(rnd.randint(0, s - 1) for s in shape)
            sizes = tuple(rnd.randint(1, s - o) for s, o in zip(shape, off, strict=True))
            boxes.append(("k", off, sizes))
        tr = nd == 2 and rnd.random() < 0.5
        flat = torch.cat(
            [(_box(full, o, s).t() if tr else _box(full, o, s)).reshape(-1) for _, o, s in boxes]
        )
        a = rnd.randint(0, flat.numel())
        b = rnd.randint(a, flat.numel() + 3)  # past the end: padding holds no chunk
        piece = flat[a:b]
        chunks = concat(boxes, a, b, transposed=tr)
        assert sum(c.numel for c in chunks) == piece.numel()
        built = torch.full_like(piece, -1.0)
        for c in chunks:
            c.view(built).copy_(_box(full, c.offsets, c.sizes))
        assert torch.equal(built, piece), (shape, boxes, a, b, tr)
        a2 = rnd.randint(0, piece.numel())
        b2 = rnd.randint(a2, piece.numel())
        part = torch.full((b2 - a2,), -1.0, dtype=F64)
        for c in restrict(chunks, a2, b2):
            c.view(part).copy_(_box(full, c.offsets, c.sizes))
        assert torch.equal(part, piece[a2:b2])
        whole = box_range("k", (0,) * nd, shape, 0, math.prod(shape))
        moved = torch.full_like(piece, -1.0)
        n = sum(copy_overlap(moved, c, full.reshape(-1), s) for c in chunks for s in whole)
        assert n == piece.numel() and torch.equal(moved, piece)


def test_an_entry_digest_is_its_documented_hash():
    """An entry's digest is XXH3-64 over, for each chunk, ``json.dumps([key, offsets,
    sizes])`` and the box's values in the full tensor's row-major order, written out here:
    checkpoints of every release verify against it, whichever way it is computed (a
    snapshot hashes each entry inside the training step, from its chunks, not their JSON)."""
    import json

    import xxhash

    from gnnpar.checkpoint.validate import entry_digest

    def formula(chunks, flat):
        h = xxhash.xxh3_64()
        for c in chunks:
            h.update(json.dumps([c.key, list(c.offsets), list(c.sizes)]).encode())
            box = flat[c.at : c.at + c.numel]
            if c.transposed:
                box = box.view(tuple(reversed(c.sizes))).t()
            h.update(box.contiguous().view(torch.uint8).numpy())
        return h.hexdigest()

    g = torch.Generator().manual_seed(0)
    layouts = [
        concat([("model/w", (3, 5), (3, 5))], 2, 11),  # a flat range: three boxes
        concat([("model/w", (0, 0), (4, 6))], transposed=True),
        concat([("optim/exp_avg/a", (), ()), ("model/\u00e9\"b", (0,), (7,))], 0, 6),
    ]
    for chunks in layouts:
        flat = torch.randn(sum(c.numel for c in chunks) + 2, dtype=torch.float64, generator=g)
        want = formula(chunks, flat)
        assert entry_digest(chunks, flat) == want
        assert entry_digest([c.to_json() for c in chunks], flat) == want


def test_chunks_of_a_flat_range_are_few():
    """A flat range of a box is at most 2·ndim − 1 boxes (a partial first row, whole rows,
    a partial last row, recursively), so manifests stay small."""
    assert len(box_range("k", (0, 0, 0), (4, 5, 6), 7, 101)) <= 5
    assert box_range("k", (2, 3), (4, 5), 0, 20)[0].sizes == (4, 5)  # whole box: one chunk


# ------------------------------------------------------------------------ full-graph resume
FG_DIMS = {"gcn": [7, 5, 5, 3], "sage": [7, 4, 4, 3]}  # 3 layers: every role rotation


def _fullgraph(kind: str, grid, seed: int = 0, algorithm: str = "3d"):
    a, x, y, train = small_graph()
    ref = serial_model(kind, FG_DIMS[kind], dropout=0.5, seed=seed)
    source = make_source(normalise(a, kind), x, y, train, permute=True)
    par = parallelize_fullgraph(ref, grid, source, algorithm=algorithm)
    groups: dict[int, list] = {}
    for name, p in par.named_parameters():
        groups.setdefault(int(name.rsplit(".", 1)[1]), []).append(p)
    opt = torch.optim.Adam(
        [{"params": ps, "weight_decay": 5e-4 if i == 0 else 0.0} for i, ps in groups.items()],
        lr=0.01,
    )
    return par, opt


def _fullgraph_steps(par, opt, start: int, stop: int) -> None:
    features = par.input_features()
    par.train()
    for step in range(start, stop):
        opt.zero_grad(set_to_none=True)
        par.loss(par(features, dropout_seed=100 + step)).backward()
        opt.step()


def _fullgraph_world(folder: str, kind: str) -> dict:
    """x2y2z2 trains 2 epochs and saves; x1y2z4 (and the 2D x4y2) resume it from a different
    initialisation for 2 more; each is compared with 4 uninterrupted epochs on its grid."""
    out = {}
    grid = gnnpar.init(x=2, y=2, z=2)
    par, opt = _fullgraph(kind, grid)
    _fullgraph_steps(par, opt, 0, 2)
    checkpoint.save(folder, 2, grid, par, opt)
    gnnpar.release(grid)
    for shape, algorithm in (({"x": 1, "y": 2, "z": 4}, "3d"), ({"x": 4, "y": 2}, "2d")):
        grid = gnnpar.init(**shape)
        par, opt = _fullgraph(kind, grid, seed=7, algorithm=algorithm)
        found = checkpoint.load(folder, grid, par, opt)
        if found is None or found.step != 2:
            raise AssertionError(f"load found {found}")
        _fullgraph_steps(par, opt, 2, 4)
        resumed = par.full_weights()
        par, opt = _fullgraph(kind, grid, algorithm=algorithm)
        _fullgraph_steps(par, opt, 0, 4)
        straight = par.full_weights()
        out[grid.describe()] = max(
            _rel(r[k], s[k]) for r, s in zip(resumed, straight, strict=True) for k in s
        )
        gnnpar.release(grid)
    return out


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_fullgraph_resumes_on_other_grids_and_one_rank(tmp_path, kind):
    folder = str(tmp_path / "ckpt")
    results = run_distributed(_fullgraph_world, 8, folder, kind, timeout=600)
    for res in results:
        for where, err in res.items():
            assert err <= REL, f"{kind} resumed on {where}: differs by {err:.3g}"
    grid = gnnpar.init()  # one rank
    par, opt = _fullgraph(kind, grid, seed=7)
    assert checkpoint.load(folder, grid, par, opt).step == 2
    _fullgraph_steps(par, opt, 2, 4)
    resumed = par.full_weights()
    par, opt = _fullgraph(kind, grid)
    _fullgraph_steps(par, opt, 0, 4)
    for r, s in zip(resumed, par.full_weights(), strict=True):
        for k in s:
            assert _rel(r[k], s[k]) <= REL, f"{kind} resumed on one rank: {k}"
    # the consolidated state dict loads strictly into the plain model, which then computes
    # what the parallel model computes
    full = checkpoint.consolidate(folder)
    plain = FullGraphGNN(*_plain_args(kind), dropout=0.5, kind=kind).double()
    plain.load_state_dict(full, strict=True)
    par, _ = _fullgraph(kind, grid, seed=7)
    checkpoint.load(folder, grid, par, None)
    a, x, _, _ = small_graph()
    from tests.fullgraph_utils import serial_adj

    par.eval()
    plain.eval()
    got = par(par.input_features())
    want = plain(serial_adj(normalise(a, kind)), x)
    ids = par.source.node_ids(par.output_order, par.logits_rows)
    assert _rel(got, want[ids]) <= REL


def _plain_args(kind: str) -> tuple[int, int, int, int]:
    dims = FG_DIMS[kind]
    return dims[0], dims[1], dims[-1], len(dims) - 1


# ------------------------------------------------------------------ GPT: TP and ZeRO resume
VOCAB = 37


def _gpt_cfg():
    from gnnpar.models.gpt.model import GPTConfig

    return GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=6, dropout=0.0)


def _gpt(grid, seed: int = 0, stage: int = 0):
    """Our GPT in float64, tensor-parallel over the grid and sharded over data."""
    from gnnpar.models.gpt.model import GPT, Block
    from gnnpar.shard import by_type, shard

    torch.manual_seed(seed)
    model = tensor.parallelize(GPT(_gpt_cfg()).to(F64), grid)
    dp = shard(model, grid, stage, units=by_type(Block))
    return model, dp, dp.attach(torch.optim.AdamW(dp.parameters(), lr=0.01, weight_decay=0.1))


_IDS = torch.randint(0, VOCAB, (6, 8, 9), generator=torch.Generator().manual_seed(5))


def _gpt_steps(grid, model, handle, opt, start: int, stop: int) -> None:
    """AdamW steps on a global batch of 8 sequences split over data × z (the GPT task's
    split), gradients averaged over it by ``gnnpar.shard``."""
    shards = grid.size("data") * grid.size("z")
    index = grid.rank("z") + grid.size("z") * grid.rank("data")
    rows = slice(8 * index // shards, 8 * (index + 1) // shards)
    for step in range(start, stop):
        x, y = _IDS[step, rows, :-1], _IDS[step, rows, 1:]
        tensor.cross_entropy(model(x), y, model.lm_head).backward()
        opt.step()
        opt.zero_grad()


def _gpt_world(folder: str) -> dict:
    out = {}
    # tensor parallel + data (stage 0): data=2,x=2 -> data=1,x=2,y=2
    # ZeRO-2 pieces of tensor-parallel pieces: data=2,x=2 -> data=2,z=2 stage 3, data=4 stage 1
    for name, stage in (("tp", 0), ("zero", 2)):
        grid = gnnpar.init(data=2, x=2)
        model, handle, opt = _gpt(grid, stage=stage)
        _gpt_steps(grid, model, handle, opt, 0, 2)
        checkpoint.save(f"{folder}/{name}", 2, grid, handle, opt)
        gnnpar.release(grid)
    for name, shape, stage in (
        ("tp", {"data": 1, "x": 2, "y": 2}, 0),
        ("zero", {"data": 2, "z": 2}, 3),
        ("zero", {"data": 4}, 1),
    ):
        grid = gnnpar.init(**shape)
        model, handle, opt = _gpt(grid, seed=9, stage=stage)
        found = checkpoint.load(f"{folder}/{name}", grid, handle, opt)
        if found is None or found.step != 2:
            raise AssertionError(f"load found {found}")
        _gpt_steps(grid, model, handle, opt, 2, 4)
        resumed = handle.full_state_dict()
        model, handle, opt = _gpt(grid, stage=stage)
        _gpt_steps(grid, model, handle, opt, 0, 4)
        out[f"{name} -> {grid.describe()} stage {stage}"] = _worst(
            resumed, handle.full_state_dict()
        )
        gnnpar.release(grid)
    return out


def test_gpt_resumes_across_tensor_and_data_grids_and_stages(tmp_path):
    folder = str(tmp_path)
    for res in run_distributed(_gpt_world, 4, folder, timeout=600):
        for where, err in res.items():
            assert err <= REL, f"{where}: differs by {err:.3g}"
    grid = gnnpar.init()
    for name in ("tp", "zero"):
        model, handle, opt = _gpt(grid, seed=9)
        assert checkpoint.load(f"{folder}/{name}", grid, handle, opt).step == 2
        _gpt_steps(grid, model, handle, opt, 2, 4)
        resumed = handle.full_state_dict()
        model, handle, opt = _gpt(grid)
        _gpt_steps(grid, model, handle, opt, 0, 4)
        assert _worst(resumed, handle.full_state_dict()) <= REL, name
        # consolidated: strict into the plain GPT, same outputs
        from gnnpar.models.gpt.model import GPT

        plain = GPT(_gpt_cfg()).to(F64)
        plain.load_state_dict(checkpoint.consolidate(f"{folder}/{name}"), strict=True)
        model, handle, opt = _gpt(grid, seed=9)
        checkpoint.load(f"{folder}/{name}", grid, handle, None)
        x = _IDS[0, :, :-1]
        assert _rel(model(x), plain(x)) <= REL


# ------------------------------------------------------------- Hugging Face GPT-2 (library)
def _tiny_hf():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=12, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(F64)


def _hf_world(folder: str) -> dict:
    grid = gnnpar.init(x=2, y=2)
    model = tensor.parallelize(_tiny_hf(), grid)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = _IDS[0, :2, :-1]
    model(x).logits.sum().backward()
    opt.step()
    checkpoint.save(folder, 1, grid, model, opt)
    full = tensor.full_state_dict(model, grid)
    logits = model(x).logits  # rank 0: the first chunk of the (vocabulary-sharded) logits
    return {"full": {k: v.tolist() for k, v in full.items()}, "logits": logits.tolist()}


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None,
    reason="transformers is a dev extra (make test installs it)",
)
def test_hf_gpt2_checkpoint_consolidates_into_the_plain_model(tmp_path):
    out = run_distributed(_hf_world, 4, str(tmp_path), timeout=300)[0]
    full = checkpoint.consolidate(tmp_path)
    want = {k: torch.tensor(v, dtype=F64) for k, v in out["full"].items()}
    assert _worst(full, want) == 0.0  # bit for bit: nothing but copies
    plain = _tiny_hf()
    plain.load_state_dict(full, strict=True)
    got = torch.tensor(out["logits"], dtype=F64)
    assert _rel(plain(_IDS[0, :2, :-1]).logits[..., : got.shape[-1]], got) <= REL
    # and it resumes on one rank (a grid that shares nothing with x=2,y=2)
    grid = gnnpar.init()
    model = tensor.parallelize(_tiny_hf(), grid)
    assert checkpoint.load(tmp_path, grid, model, torch.optim.AdamW(model.parameters())).step == 1
    assert _worst(tensor.full_state_dict(model, grid), dict(full)) == 0.0


# ------------------------------------------------------------ damaged, foreign, malicious
def _plain(hidden: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(5, 3)).sum().backward()
    opt.step()
    return model, opt


def _two_checkpoints(tmp_path):
    grid = gnnpar.init()
    model, opt = _plain()
    checkpoint.save(tmp_path, 1, grid, model, opt)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    checkpoint.save(tmp_path, 2, grid, model, opt, extra={"note": "second"})
    return grid, model


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys, damage):
    grid, _ = _two_checkpoints(tmp_path)
    rank_file = tmp_path / "step-000002" / "rank-00000.pt"
    data = bytearray(rank_file.read_bytes())
    if damage == "truncate":
        rank_file.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
        rank_file.write_bytes(data)
    else:
        rank_file.unlink()
    model, opt = _plain(seed=3)
    found = checkpoint.load(tmp_path, grid, model, opt)
    assert found.step == 1
    err = capsys.readouterr().err
    assert str(rank_file) in err and "previous checkpoint" in err and err.count("\n") == 1
    first, _ = _plain()
    assert torch.equal(model[0].weight, first[0].weight)
    # both damaged: one clear error naming the directory
    (tmp_path / "step-000001" / "rank-00000.pt").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint in"):
        checkpoint.load(tmp_path, grid, model, opt)


class _Evil:
    """Unpickling this would create a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_rank_file_is_refused_and_runs_nothing(tmp_path):
    import json

    from gnnpar.verified import file_entry

    grid, model = _two_checkpoints(tmp_path)
    folder = tmp_path / "step-000002"
    marker = tmp_path / "pwned"
    torch.save({"0.weight": _Evil(str(marker))}, folder / "rank-00000.pt")
    # the attacker also fixes the manifest, so size and checksum match
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["rank-00000.pt"] = file_entry(folder / "rank-00000.pt")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for action in (
        lambda: checkpoint.load(tmp_path, grid, *_plain()),
        lambda: checkpoint.consolidate(tmp_path),
    ):
        with pytest.raises(checkpoint.FormatError) as err:
            action()
        assert str(folder / "rank-00000.pt") in str(err.value) and "\n" not in str(err.value)
        assert "refused" in str(err.value)
        assert not marker.exists()


def test_checkpoint_of_another_model_is_one_line_naming_the_tensor(tmp_path):
    grid, _ = _two_checkpoints(tmp_path)
    model, opt = _plain(hidden=6)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(tmp_path, grid, model, opt)
    text = str(err.value)
    assert "'0.weight'" in text and "[4, 3]" in text and "[6, 3]" in text and "\n" not in text
    other = torch.nn.Sequential(torch.nn.Linear(3, 4))  # same first layer, no second
    with pytest.raises(checkpoint.CheckpointError, match="holds tensor '2.weight'"):
        checkpoint.load(tmp_path, grid, other, None)
    # nothing was written into the model before the check
    fresh, _ = _plain(hidden=6)
    assert torch.equal(model[0].weight, fresh[0].weight)


def test_checkpoints_of_the_old_formats_are_refused(tmp_path):
    import json

    old = tmp_path / "step-000003"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    torch.save({"w": torch.ones(2)}, old / "rank-00000.pt")
    grid = gnnpar.init()
    for path in (tmp_path, old):
        with pytest.raises(checkpoint.FormatError, match="older gnnpar"):
            checkpoint.load(path, grid, *_plain())
        with pytest.raises(checkpoint.FormatError, match="older gnnpar"):
            checkpoint.consolidate(path)


def test_empty_directory_loads_nothing_and_keep_prunes(tmp_path):
    grid = gnnpar.init()
    model, opt = _plain()
    assert checkpoint.load(tmp_path / "none", grid, model, opt) is None
    for step in range(1, 5):
        checkpoint.save(tmp_path, step, grid, model, opt, keep=2)
    assert checkpoint.complete_steps(tmp_path) == [3, 4]
    assert (tmp_path / "latest").read_text().strip() == "step-000004"
    assert not list(tmp_path.glob(".tmp-*"))


def test_ckpt_commands(tmp_path, capsys):
    from gnnpar.cli import main

    _two_checkpoints(tmp_path / "run" / "checkpoints")
    out = tmp_path / "full.pt"
    assert main(["ckpt", "consolidate", str(tmp_path / "run"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    model, _ = _plain()
    model.load_state_dict(state, strict=True)
    assert main(["ckpt", "consolidate", str(tmp_path / "run"), str(out)]) == 2  # exists
    assert main(["ckpt", "consolidate", "--overwrite", str(tmp_path / "run"), str(out)]) == 0
    assert main(["ckpt", "consolidate", str(tmp_path / "nothing"), str(out) + "x"]) == 2
    capsys.readouterr()
    assert main(["ckpt", "info", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "step 2" in text and "0.weight" in text and "[4, 3]" in text and "exp_avg" in text

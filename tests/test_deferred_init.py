"""Deferred initialisation: a GPT (ours, tied and untied) or transformers' GPT-2 built on the
meta device and parallelized holds, bit for bit, the pieces of the same model built eagerly
from the same seed and then sliced, on grid shapes of 1, 2, 4 and 8 ranks, in float32 and
float64; the generator is left where the eager build leaves it; a pretrained Hugging Face
folder (safetensors and pytorch_model.bin) loads slice by slice to the pieces of eager loading;
a training step after deferred init equals one after eager init; and a build whose restore
loads every value (``values=False``) makes the same pieces without drawing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import gnnpar
from gnnpar import tensor
from gnnpar.models.gpt.model import GPT, GPTConfig
from gnnpar.testing import grid_shapes, run_distributed

HAVE_HF = importlib.util.find_spec("transformers") is not None
F64 = torch.float64
VOCAB, BLOCK, EMBD, HEADS = 37, 9, 24, 8  # heads split over any axis up to 8; 9 rows of wpe
SEED = 1234

# The first AdamW step imports torch._dynamo, and transformers and fake tensors take seconds
# to import: do it once here so forked ranks inherit them instead of each paying for them.
_warm = torch.zeros(1, requires_grad=True)
_warm.grad = torch.zeros(1)
torch.optim.AdamW([_warm]).step()
tensor.record_init(lambda: torch.nn.Linear(2, 2))
if HAVE_HF:
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401


def _gpt(tie: bool):
    cfg = GPTConfig(
        vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=HEADS, n_embd=EMBD, tie_weights=tie
    )
    return lambda: GPT(cfg)


def _hf_config(**kw):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=BLOCK, n_embd=EMBD, n_layer=2, n_head=HEADS,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw,
    )  # fmt: skip


def _hf():
    from transformers import GPT2LMHeadModel

    cfg = _hf_config()
    return lambda: GPT2LMHeadModel(cfg)


def _variants(hf: bool) -> list[tuple[str, object, torch.dtype]]:
    out = [
        ("gpt tied", _gpt(True), torch.float32),
        ("gpt untied", _gpt(False), F64),
        ("gpt tied", _gpt(True), F64),
        ("gpt untied", _gpt(False), torch.float32),
    ]
    if hf:
        out += [("hf-gpt2", _hf(), torch.float32), ("hf-gpt2", _hf(), F64)]
    return out


def _eager_and_deferred(make, dtype, grid):
    """(eager model sliced, deferred model, generator states after each build)."""
    torch.manual_seed(SEED)
    eager = make().to(dtype)
    after_eager = torch.random.get_rng_state()
    eager_full = {k: v.clone() for k, v in eager.state_dict().items()}
    tensor.parallelize(eager, grid)
    with torch.device("meta"):
        meta = make().to(dtype)
    torch.manual_seed(SEED)
    deferred = tensor.parallelize(meta, grid)
    return eager, eager_full, deferred, after_eager, torch.random.get_rng_state()


def _check_equal(make, dtype, grid, tag):
    eager, full, deferred, rng_eager, rng_deferred = _eager_and_deferred(make, dtype, grid)
    tag = f"{tag} {dtype} on {grid.describe()}"
    if not torch.equal(rng_eager, rng_deferred):
        raise AssertionError(f"{tag}: the generator is not where the eager build leaves it")
    a, b = eager.state_dict(), deferred.state_dict()
    if list(a) != list(b):
        raise AssertionError(f"{tag}: keys differ")
    for k in a:
        if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
            raise AssertionError(f"{tag}: piece {k} differs from slicing the eager model")
    # Independently of the slicing code: the pieces gathered are the eager full tensors.
    for k, v in tensor.full_state_dict(deferred, grid).items():
        if not torch.equal(v, full[k]):
            raise AssertionError(f"{tag}: {k} gathered differs from the eager model")
    head = deferred.lm_head
    wte = deferred.transformer.wte if hasattr(deferred, "transformer") else deferred.wte
    tied = getattr(deferred.config, "tie_weights", None) or getattr(
        deferred.config, "tie_word_embeddings", False
    )
    if tied != (head.weight is wte.weight):
        raise AssertionError(f"{tag}: tie not kept")
    if any(t.is_meta for t in deferred.state_dict().values()):
        raise AssertionError(f"{tag}: meta tensors left")


def _check_training_step(grid):
    """One AdamW step (ZeRO-1 over data) after deferred init equals one after eager init."""
    from gnnpar.shard import shard

    ids = torch.randint(0, VOCAB, (4, BLOCK + 1), generator=torch.Generator().manual_seed(3))
    idx = grid.rank("z") + grid.size("z") * grid.rank("data")
    n = grid.size("z") * grid.size("data")
    x, y = ids[idx::n, :-1], ids[idx::n, 1:]
    results = []
    built = _eager_and_deferred(_gpt(True), F64, grid)
    for model in (built[0], built[2]):
        dp = shard(model, grid, stage=1)
        opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-2))
        torch.manual_seed(7)
        loss = tensor.cross_entropy(model(x), y, model.lm_head)
        loss.backward()
        dp.clip_grad_norm_(0.5)
        opt.step()
        results.append((loss.detach(), model.state_dict()))
    (la, sa), (lb, sb) = results
    if not torch.equal(la, lb) or any(not torch.equal(sa[k], sb[k]) for k in sa):
        raise AssertionError(f"{grid.describe()}: a step after deferred init differs")


def _check_left_to_a_restore(grid):
    """``values=False`` (a restart's build, whose restore loads every value): the pieces of
    the initialised model (names, shapes, dtypes, the tie) with no draw made; loading the
    initialised model's state then gives its outputs."""
    with torch.device("meta"):
        ref, left = _gpt(True)(), _gpt(True)()
    torch.manual_seed(SEED)
    ref = tensor.parallelize(ref, grid)
    drawn = torch.get_rng_state()
    left = tensor.parallelize(left, grid, values=False)
    if not torch.equal(torch.get_rng_state(), drawn):
        raise AssertionError(f"{grid.describe()}: values=False drew from the generator")
    want = {k: (v.shape, v.dtype) for k, v in ref.state_dict().items()}
    have = {k: (v.shape, v.dtype) for k, v in left.state_dict().items()}
    if have != want or any(p.is_meta for p in left.parameters()):
        raise AssertionError(f"{grid.describe()}: values=False made other pieces")
    if left.lm_head.weight is not left.wte.weight:
        raise AssertionError(f"{grid.describe()}: values=False untied the head")
    left.load_state_dict(ref.state_dict())
    ids = torch.arange(2 * BLOCK).remainder(VOCAB).view(2, BLOCK)
    if not torch.equal(left(ids), ref(ids)):
        raise AssertionError(f"{grid.describe()}: the loaded model differs")


def _check_pretrained(folder: Path, grid):
    """A pretrained folder loads slice by slice (the train task's path) to the pieces of
    eager loading (from_pretrained, then parallelize)."""
    from transformers import GPT2LMHeadModel

    from gnnpar.models.gpt.task import GPTTaskConfig, build_model, parallel_model

    eager = tensor.parallelize(GPT2LMHeadModel.from_pretrained(folder / "st"), grid)
    want = eager.state_dict()
    for sub in ("st", "bin"):
        cfg = GPTTaskConfig(model="hf-gpt2", pretrained=str(folder / sub))
        plain, _ = build_model(cfg, VOCAB)
        got = parallel_model(plain, cfg, grid).state_dict()
        for k in want:
            if not torch.equal(got[k], want[k]):
                raise AssertionError(f"{sub} on {grid.describe()}: {k} differs from eager loading")


def _world(world: int, hf: bool, folder: str | None) -> int:
    variants = _variants(hf)
    shapes = grid_shapes(world, ("x", "y", "z"))
    if world == 2:
        shapes.append({"data": 2})
    checked = 0
    per_shape = -(-len(variants) // len(shapes))  # every variant on every world, few per shape
    for i, shape in enumerate(shapes):
        grid = gnnpar.init(**shape)
        for j in range(per_shape):
            tag, make, dtype = variants[(i * per_shape + j) % len(variants)]
            _check_equal(make, dtype, grid, tag)
            checked += 1
        gnnpar.release(grid)
    if world == 4:
        for shape in ({"data": 2, "x": 2}, {"x": 2, "z": 2}):
            grid = gnnpar.init(**shape)
            _check_training_step(grid)
            _check_left_to_a_restore(grid)
            if folder is not None:
                _check_pretrained(Path(folder), grid)
            gnnpar.release(grid)
    return checked


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_deferred_pieces_equal_sliced_eager_model(world, tmp_path):
    folder = None
    if world == 4 and HAVE_HF:
        folder = tmp_path / "pretrained"
        _write_pretrained(folder)
    out = run_distributed(_world, world, world, HAVE_HF, folder and str(folder), timeout=300)
    assert len(set(out)) == 1 and out[0] >= len(_variants(HAVE_HF))


def _write_pretrained(folder: Path) -> None:
    """A tiny GPT-2 in Hugging Face layout twice: safetensors (save_pretrained) and a
    pytorch_model.bin, with values no seeded init gives (so a load that does nothing fails)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(99)
    model = GPT2LMHeadModel(_hf_config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p))
    model.save_pretrained(folder / "st")
    (folder / "bin").mkdir(parents=True)
    model.config.save_pretrained(folder / "bin")
    torch.save(model.state_dict(), folder / "bin" / "pytorch_model.bin")


def test_deferred_errors_are_clear(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid = gnnpar.init()
    with pytest.raises(ValueError, match="init= is for a model on the meta device"):
        tensor.parallelize(_gpt(True)(), grid, init=_gpt(True))
    with torch.device("meta"):
        bare = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no .config to rebuild it from; pass init="):
        tensor.parallelize(bare, grid)
    with torch.device("meta"):
        meta = _gpt(True)()
    with pytest.raises(ValueError, match=r"ties \[\('lm_head.weight', 'wte.weight'\)\], the rec"):
        tensor.parallelize(meta, grid, init=_gpt(False))
    small = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=HEADS, n_embd=EMBD)
    with pytest.raises(ValueError, match="differs from the model to initialise"):
        tensor.parallelize(meta, grid, init=lambda: GPT(small))
    with torch.device("meta"):
        half = _gpt(True)()
    half.ln_f.weight = torch.nn.Parameter(torch.ones(EMBD))
    with pytest.raises(ValueError, match="partly on the meta device"):
        tensor.parallelize(half, grid)
    # A recorded program can be reused; the bare model then materialises too.
    program = tensor.record_init(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4))
    torch.manual_seed(0)
    out = tensor.parallelize(bare, grid, init=program)
    assert torch.equal(out[0].weight.view(4, 4), ref[0].weight)
    # Left to a restore: buffers have no checkpoint to come from.
    with torch.device("meta"):
        normed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"cannot leave \['1.running_mean'.*buffers need"):
        tensor.parallelize(normed, grid, values=False)

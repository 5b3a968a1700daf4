"""Generation with a KV cache (gnnpar.models.gpt.generation, ``gnnpar generate``): greedy
tokens equal transformers' ``generate`` on the same Llama weights; with the cache, tokens
and (float64) logits equal the no-cache path's at every step, chunked prompts included; on
tensor-parallel grids of 2 and 4 ranks the tokens equal the serial model's, for GPT and
Llama, each rank caching only its heads; top-k and top-p draws stay in their sets and agree
over ranks; the command from a run folder (1 rank, a grid, a real ``--nprocs`` launch) and
from a Hugging Face folder, and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gnnpar
from gnnpar import tensor
from gnnpar.errors import UserError
from gnnpar.models.gpt import generation
from gnnpar.models.gpt.generation import generate, kv_caches, sample_next
from gnnpar.models.gpt.hf_llama import llama_config_from_hf, llama_state_from_hf
from gnnpar.models.gpt.llama import Llama, LlamaConfig
from gnnpar.models.gpt.model import GPT, GPTConfig
from gnnpar.models.gpt.model import generate as generate_without_cache
from gnnpar.testing import run_distributed
from tests.test_llama import hf_llama

transformers = pytest.importorskip("transformers", reason="a dev extra: make test installs it")

F64 = torch.float64
VOCAB = 37
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind.\n" * 300


def _ours_from_hf(hf) -> Llama:
    cfg = LlamaConfig(**llama_config_from_hf(hf.config.to_dict()))
    ours = Llama(cfg).to(hf.dtype).eval()
    state = llama_state_from_hf(hf.state_dict(), cfg, "hf")
    ours.load_state_dict({k: v if isinstance(v, torch.Tensor) else v[:] for k, v in state.items()})
    return ours


def _tiny_gpt(**kw) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=12, n_layer=2, n_head=4, n_embd=16, **kw)
    torch.manual_seed(0)
    return GPT(cfg).to(F64)


def _tiny_llama(**kw) -> Llama:
    sizes = {"n_head": 4, "n_kv_head": 2, "n_embd": 16, **kw}
    cfg = LlamaConfig(vocab_size=VOCAB, block_size=12, n_layer=2, ffn_hidden=22, **sizes)
    torch.manual_seed(0)
    model = Llama(cfg).to(F64)
    with torch.no_grad():  # unit norms and small weights give near-uniform logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _prompts(batch: int = 2, t: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------- (a) transformers
@pytest.mark.parametrize("tie,kv", [(False, 2), (True, 3), (False, 6)])
def test_greedy_tokens_equal_transformers_generate(tie, kv):
    hf = hf_llama(tie, kv)
    ours = _ours_from_hf(hf)
    ids = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                       eos_token_id=None, pad_token_id=0)  # fmt: skip
    got = generate(ours, ids, 24, greedy=True)
    assert want.shape == (3, 29) and torch.equal(got, want)
    # an end token that one sequence produces early: that one is padded with it, as
    # transformers pads with pad_token_id = eos, and generation stops when all are done
    eos = int(want[0, 8])
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                       eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    got = generate(ours, ids, 24, greedy=True, eos=eos)
    assert torch.equal(got, want)


# ---------------------------------------------------------------- (b) cache vs none
@pytest.mark.parametrize("make", [_tiny_gpt, _tiny_llama], ids=["gpt", "llama"])
def test_cache_gives_the_tokens_and_logits_of_the_whole_sequence(make):
    """Greedy and sampled, within block_size (12) and past it (where both run the last 12
    tokens without a cache), the tokens are equal and the float64 logits at every step
    agree to rounding."""
    model = make()
    ids = _prompts(3, 4)
    for options in ({"greedy": True}, {"temperature": 0.9, "top_k": 6, "top_p": 0.9}):
        runs = []
        for cache in (True, False):
            gen = torch.Generator().manual_seed(5)
            runs.append(generate(model, ids, 14, cache=cache, generator=gen, return_logits=True,
                                 **options))  # fmt: skip
        (a, la), (b, lb) = runs
        assert a.shape == (3, 18) and torch.equal(a, b), options
        assert la.shape == (3, 14, VOCAB) and la.dtype == F64
        assert (la - lb).abs().max() <= 1e-12 * lb.abs().max(), options
        # the first step is the prompt's forward, identical with and without the cache
        assert torch.equal(la[:, 0], lb[:, 0])
    assert model.training and all(m.kv_cache is None for m in generation._cacheable(model))


@pytest.mark.parametrize("make", [_tiny_gpt, _tiny_llama], ids=["gpt", "llama"])
def test_a_prompt_fed_in_pieces_through_the_cache_equals_one_forward(make):
    model = make().eval()
    ids = _prompts(2, 10)
    want = model(ids)
    with torch.no_grad(), kv_caches(model, capacity=4) as caches:  # grows past 4
        pieces = [model(ids[:, a:b], pos=torch.arange(a, b)) for a, b in ((0, 4), (4, 5), (5, 10))]
        assert all(c.length == 10 for c in caches)
    got = torch.cat(pieces, dim=1)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_the_old_no_cache_generate_draws_the_same_tokens():
    """The trainer's end-of-run sample (model.generate, no cache) is unchanged: the same
    draws as the new call, with or without the cache, past block_size too."""
    model = _tiny_gpt()
    ids = _prompts(2, 3)
    old = generate_without_cache(model, ids, 15, 12, 0.8, 5, torch.Generator().manual_seed(3))
    for cache in (True, False):
        new = generate(model, ids, 15, temperature=0.8, top_k=5, cache=cache,
                       generator=torch.Generator().manual_seed(3))  # fmt: skip
        assert torch.equal(new, old)
    method = model.generate(ids, 15, 0.8, 5, torch.Generator().manual_seed(3))
    assert torch.equal(method, old)


# ----------------------------------------------------------------- (d) top-k, top-p
def test_top_k_and_top_p_draw_only_from_their_sets():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen, dtype=F64) * 3
    probs = torch.softmax(logits.float(), -1)
    ranked = probs.argsort(-1, descending=True)
    for k, p in [(5, None), (None, 0.5), (None, 0.9), (8, 0.7), (1, None), (None, 1e-6)]:
        allowed = torch.zeros_like(probs, dtype=torch.bool)
        for row in range(64):
            kept = ranked[row][: k or 50]
            if p is not None:  # the smallest likeliest set whose mass reaches p (of the top k)
                sub = probs[row, kept] / probs[row, kept].sum()
                n = int((sub.cumsum(0) < p).sum()) + 1
                kept = kept[:n]
            allowed[row, kept] = True
        seen = torch.zeros_like(allowed)
        for _ in range(40):
            tok = sample_next(logits, top_k=k, top_p=p, generator=gen)[:, 0]
            seen[torch.arange(64), tok] = True
        assert not (seen & ~allowed).any(), (k, p)
        if k == 1 or p == 1e-6:
            assert torch.equal(seen, allowed)  # the likeliest token only: greedy
    greedy = sample_next(logits, greedy=True)
    assert torch.equal(greedy[:, 0], logits.argmax(-1))
    for bad, message in [({"top_k": 0}, "top_k must be"), ({"top_p": 0.0}, "top_p must lie"),
                         ({"temperature": 0.0}, "temperature must be positive")]:  # fmt: skip
        with pytest.raises(UserError, match=message):
            sample_next(logits, **bad)


def test_generated_tokens_lie_in_the_sets_of_their_own_logits():
    model = _tiny_llama()
    gen = torch.Generator().manual_seed(2)
    ids, logits = generate(model, _prompts(4, 2), 10, temperature=1.3, top_k=4, top_p=0.6,
                           generator=gen, return_logits=True)  # fmt: skip
    new = ids[:, 2:]
    scaled = logits.float() / 1.3
    rank = (scaled > scaled.gather(-1, new[..., None])).sum(-1)  # likelier tokens than it
    assert (rank < 4).all()
    probs = torch.softmax(scaled.masked_fill(scaled < scaled.topk(4).values[..., -1:], -1e30), -1)
    before = (probs * (probs > probs.gather(-1, new[..., None]))).sum(-1)
    assert (before < 0.6).all()


def test_bad_calls_are_one_line_errors():
    model = _tiny_gpt()
    for kwargs, message in [
        ({"ids": torch.tensor([[1, VOCAB]])}, f"token id {VOCAB} is outside"),
        ({"ids": torch.zeros(3, dtype=torch.int64)}, "ids must be a \\(batch, tokens\\)"),
        ({"ids": torch.zeros(1, 2)}, "integer token ids"),
        ({"max_new_tokens": -1}, "0 or more"),
        ({"eos": VOCAB}, "eos 37 is outside"),
    ]:
        call = {"ids": _prompts(1, 2), "max_new_tokens": 2, **kwargs}
        with pytest.raises(UserError, match=message):
            generate(model, call.pop("ids"), call.pop("max_new_tokens"), **call)
    with pytest.raises(UserError, match="no attention layer that keeps a KV cache"):
        with kv_caches(torch.nn.Sequential(torch.nn.Linear(2, 2))):
            pass
    assert torch.equal(generate(model, _prompts(1, 2), 0), _prompts(1, 2))


# ------------------------------------------------------------ (c) tensor parallelism
def _local_heads(model) -> int:
    """Heads (key-value heads for Llama) this rank's fused q/k/v projection holds."""
    attn = model.blocks[0].attn
    width = getattr(attn.qkv, "local_out_features", attn.qkv.out_features)
    per = 3 * attn.head_dim if isinstance(model, GPT) else (attn.group + 2) * attn.head_dim
    return width // per


def _generation_world(shapes: list[dict[str, int]]) -> list:
    """On each grid: GPT and Llama, greedy and sampled, parallel against serial. Each rank
    of a tensor-parallel group seeds its generator with its rank in the group: the group's
    first rank decides; data replicas are independent, each seeded 0 here."""
    out = []
    for shape in shapes:
        grid = gnnpar.init(**shape)
        seed = grid.rank("tensor")
        for make in (_tiny_gpt, _tiny_llama):
            serial = make()
            parallel = tensor.parallelize(make(), grid)
            ids = _prompts(2, 3)
            for options in ({"greedy": True}, {"temperature": 0.9, "top_k": 6, "top_p": 0.85}):
                want, want_logits = generate(
                    serial, ids, 13, generator=torch.Generator().manual_seed(0),
                    return_logits=True, **options,
                )  # fmt: skip
                got, logits = generate(
                    parallel, ids, 13, generator=torch.Generator().manual_seed(seed),
                    return_logits=True, **options,
                )  # fmt: skip
                if not torch.equal(got, want):
                    raise AssertionError(f"{grid.describe()} {make.__name__} {options}: {got}")
                if not (logits - want_logits).abs().max() <= 1e-10 * want_logits.abs().max():
                    raise AssertionError(f"{grid.describe()} {make.__name__}: logits differ")
                out.append(got.tolist())
            # each rank caches only the heads it holds
            full = serial.config.n_head if make is _tiny_gpt else serial.config.n_kv_head
            split = grid.size("tensor") > 1 and _local_heads(parallel) < full
            with torch.no_grad(), kv_caches(parallel) as caches:
                parallel.eval()(ids)
                cached = caches[0]._keys.shape[1]
            if cached != _local_heads(parallel) or not split:
                raise AssertionError(f"{grid.describe()}: {cached} cached heads of {full}")
    return out


def test_parallel_generation_equals_serial_on_2_and_4_ranks():
    two = run_distributed(_generation_world, 2, [{"x": 2}])
    four = run_distributed(
        _generation_world, 4, [{"x": 2, "y": 2}, {"data": 2, "x": 2}, {"y": 2, "z": 2}]
    )
    for world in (two, four):
        assert all(r == world[0] for r in world)  # every rank, the same tokens
    assert four[0][:4] == two[0]  # and the same as on 2 ranks (and on one: checked inside)


# ------------------------------------------------------------------------ (e) command
def _train_argv(text: Path, out: Path) -> list[str]:
    return ["train", "gpt", "--model", "llama", "--data", str(text), "--vocab-size", "300",
            "--block-size", "16", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
            "--n-embd", "16", "--ffn-hidden", "22", "--batch-size", "4", "--steps", "3",
            "--eval-every", "0", "--sample-tokens", "0", "--quiet", "--dtype", "float64",
            "--grid", "x=1", "--zero-stage", "0", "--lr", "3e-2", "--out", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    from gnnpar.cli import main

    folder = tmp_path_factory.mktemp("generate")
    (folder / "text.txt").write_text(TEXT)
    assert main(_train_argv(folder / "text.txt", folder / "run")) == 0
    return folder


def _library_tokens(run: Path, ids: list[int], n: int, **options) -> list[int]:
    """What generate() gives on the run's consolidated model, on one process."""
    from gnnpar.checkpoint import consolidate
    from gnnpar.checkpoint.consolidate import open_checkpoint
    from gnnpar.models.gpt.hf_llama import LLAMA_SIZES

    info = open_checkpoint(run).meta["info"]
    names = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", *LLAMA_SIZES)
    model = Llama(LlamaConfig(**{k: info[k] for k in names})).to(F64)
    model.load_state_dict(consolidate(run))
    gen = torch.Generator().manual_seed(options.pop("seed", 0))
    return generate(model, torch.tensor([ids]), n, generator=gen, **options)[0, len(ids) :].tolist()


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_command_on_a_run_folder_on_one_rank_and_a_grid(llama_run, monkeypatch, capsys):
    from gnnpar.cli import main
    from tests.cli_world import run_commands

    run = llama_run / "run"
    monkeypatch.chdir(llama_run)  # the run's text (its tokenizer) is named from here
    sample = ["--ids", "5,6,7", "--max-new-tokens", "10", "--top-k", "8", "--top-p", "0.9",
              "--temperature", "1.5", "--seed", "4"]  # fmt: skip
    assert main(["generate", str(run), *sample, "--json", "one.json"]) == 0
    one = _json(llama_run / "one.json")
    want = _library_tokens(run, [5, 6, 7], 10, top_k=8, top_p=0.9, temperature=1.5, seed=4)
    assert one["new_ids"] == want and one["prompt_ids"] == [5, 6, 7] and one["text"] is None
    assert capsys.readouterr().out.strip() == ",".join(map(str, [5, 6, 7, *want]))
    greedy = ["--ids", "5,6,7", "--max-new-tokens", "12", "--greedy"]
    assert main(["generate", str(run), *greedy, "--no-cache", "--json", "none.json"]) == 0
    capsys.readouterr()
    assert _json(llama_run / "none.json")["new_ids"] == _library_tokens(run, [5, 6, 7], 12,
                                                                        greedy=True)  # fmt: skip
    # a text prompt, with the run's tokenizer (the BPE cache of its text)
    assert main(["generate", str(run), "--prompt", "To be", "--max-new-tokens", "6",
                 "--greedy", "--json", "text.json"]) == 0  # fmt: skip
    text = _json(llama_run / "text.json")
    from gnnpar.data.text import load_corpus

    tok = load_corpus(llama_run / "text.txt", 300).tokenizer
    assert text["prompt_ids"] == tok.encode("To be").ids
    assert text["text"] == tok.decode(text["prompt_ids"] + text["new_ids"])
    assert capsys.readouterr().out.startswith("To be")
    # on a grid of 2 ranks, and of 4 (data=2,x=2): the same tokens
    x2 = ["generate", str(run), *sample, "--grid", "x=2", "--json", "x2.json"]
    d2x2 = ["generate", str(run), *greedy, "--grid", "data=2,x=2", "--json", "d2x2.json"]
    assert run_commands(2, [x2]) == [[0]] * 2
    assert run_commands(4, [d2x2]) == [[0]] * 4
    assert _json(llama_run / "x2.json")["new_ids"] == one["new_ids"]
    assert _json(llama_run / "d2x2.json")["new_ids"] == _json(llama_run / "none.json")["new_ids"]


def test_command_launches_its_ranks_with_nprocs(llama_run, monkeypatch):
    from gnnpar.cli import main

    monkeypatch.chdir(llama_run)
    argv = ["generate", "run", "--ids", "1,2", "--max-new-tokens", "5", "--greedy", "--nprocs",
            "2", "--json", "launched.json"]  # fmt: skip
    assert main(argv) == 0
    got = _json(llama_run / "launched.json")
    assert got["grid"]["x"] == 2
    assert got["new_ids"] == _library_tokens(llama_run / "run", [1, 2], 5, greedy=True)


def test_command_on_a_hugging_face_folder(tmp_path, capsys):
    from gnnpar.cli import main
    from gnnpar.data.text import load_corpus

    (tmp_path / "text.txt").write_text(TEXT)
    tok = load_corpus(tmp_path / "text.txt", 300).tokenizer
    hf = hf_llama(vocab=tok.get_vocab_size(), seed=3)
    hf.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    prompt = tok.encode("whether 'tis").ids
    ids = torch.tensor([prompt])
    eos = hf.generation_config.eos_token_id
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                       do_sample=False, pad_token_id=eos)[0, len(prompt) :].tolist()  # fmt: skip
    out = tmp_path / "out.json"
    argv = ["generate", str(tmp_path / "hf"), "--prompt", "whether 'tis", "--greedy",
            "--max-new-tokens", "12", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    got = _json(out)
    assert got["prompt_ids"] == prompt and got["new_ids"] == want and got["sampling"]["eos"] == eos
    assert capsys.readouterr().out.strip() == tok.decode(prompt + want).strip()


def test_command_errors_are_one_line(llama_run, tmp_path, capsys, monkeypatch):
    from gnnpar.cli import main

    monkeypatch.chdir(llama_run)
    (tmp_path / "empty").mkdir()
    cases = [
        (["nope", "--ids", "1"], "nope: no such file or directory"),
        ([str(tmp_path / "empty"), "--ids", "1"], "neither a gnnpar run folder"),
        (["run", "--ids", "1,x"], "give token ids as 1,2,3"),
        (["run", "--ids", "900"], "token id 900 is outside the model's vocabulary"),
        (["run", "--ids", "1", "--top-p", "1.5"], "top_p must lie in (0, 1]"),
        (["run", "--ids", "1", "--temperature", "0"], "temperature must be positive"),
        (["run", "--ids", "1", "--grid", "x=2"], "--grid x=2 does not fit 1 process"),
        (["run", "--ids", "1", "--grid", "pipe=2"], "not pipe"),
        (["run", "--ids", "1", "--eos", "9999"], "--eos 9999 is outside"),
        (["run", "--prompt", "a", "--tokenizer", "nope.json"], "nope.json: no such file"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    with pytest.raises(SystemExit):  # argparse's own one line, exit status 2
        main(["generate", "run", "--ids", "1", "--prompt", "a"])
    assert "not allowed with argument --ids" in capsys.readouterr().err

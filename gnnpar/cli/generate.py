"""``gnnpar generate SOURCE``: text from a trained ``gpt`` or ``llama`` run, or from a Hugging
Face ``LlamaForCausalLM`` folder, with a KV cache (:mod:`gnnpar.models.gpt.generation`), on
one process or tensor-parallel over ``--nprocs`` local ranks (``--grid``, default x = all
of them); under torchrun, Slurm or MPI each rank runs it as launched."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from gnnpar.errors import UserError

__all__ = ["add_generate_command"]

#: Grid axes generation runs on: tensor parallelism (x, y, z) and replicas (data).
AXES = ("x", "y", "z", "data")
DTYPES = ("auto", "float32", "float64", "bfloat16")


@dataclasses.dataclass
class _Source:
    """What SOURCE holds: its kind (``run``: a gnnpar checkpoint; ``hf``: a Hugging Face
    folder), the model (``gpt`` or ``llama``), its sizes and dtype, and its own end token."""

    kind: str
    path: Path
    model: str
    sizes: Any
    dtype: Any
    eos: int | None = None


def _same_everywhere(err: BaseException) -> BaseException:
    """``err``, marked as raised alike by every rank (rank 0 alone reports it)."""
    err.same_on_every_rank = True
    return err


# -------------------------------------------------------------------------- the source
def _torch_dtype(name: Any, where: str) -> Any:
    import torch

    dtype = getattr(torch, str(name), None) if name else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UserError(f"{where}: dtype {name!r} is not a floating-point torch dtype")
    return dtype


def _run_source(path: Path) -> _Source:
    """A gnnpar checkpoint (a run folder, its checkpoints/ or a step folder): the model and
    sizes its info records, the dtype it was saved in."""
    from gnnpar.checkpoint.consolidate import open_checkpoint
    from gnnpar.models.gpt.hf_llama import recorded_config

    meta = open_checkpoint(path).meta
    info = meta.get("info") or {}
    if info.get("task") != "gpt" or info.get("model") not in ("gpt", "llama"):
        what = f"{info.get('task', 'unknown')} run" if info.get("task") != "gpt" else ""
        what = what or f"gpt run of model {info.get('model', 'unknown')!r}"
        raise UserError(f"{path}: a {what}; generate runs gpt runs of model gpt or llama")
    if info.get("peft"):
        raise UserError(
            f"{path}: a {info['peft']} run's checkpoint holds its adapters only; write the "
            "model with them folded in (gnnpar ckpt export-hf RUN OUT --merge) and generate "
            "from OUT"
        )
    cfg = recorded_config(meta, str(path))
    stored = meta["tensors"].get("model/wte.weight", {}).get("dtype", "float32")
    return _Source("run", path, info["model"], cfg, _torch_dtype(stored, str(path)))


def _hf_source(path: Path) -> _Source:
    """A Hugging Face LlamaForCausalLM folder: its config's sizes, dtype and end token."""
    from gnnpar.models.gpt.hf_llama import llama_config_from_hf, read_hf_config
    from gnnpar.models.gpt.llama import LlamaConfig

    hf = read_hf_config(path)
    cfg = LlamaConfig(**llama_config_from_hf(hf, str(path / "config.json")))
    if not (path / "model.safetensors").is_file() and not (path / "pytorch_model.bin").is_file():
        raise UserError(f"{path} has no model.safetensors or pytorch_model.bin")
    stored = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    eos = eos if isinstance(eos, int) and 0 <= eos < cfg.vocab_size else None
    return _Source("hf", path, "llama", cfg, _torch_dtype(stored, str(path / "config.json")), eos)


def _source(text: str) -> _Source:
    path = Path(text)
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", text)
    if (path / "config.json").is_file():
        return _hf_source(path)
    from gnnpar.checkpoint.protocol import candidates

    if path.is_dir() and (candidates(path) or candidates(path / "checkpoints")):
        return _run_source(path)
    raise UserError(
        f"{path} is neither a gnnpar run folder (with checkpoints/) nor a Hugging Face "
        "Llama folder (config.json and model.safetensors)"
    )


# ---------------------------------------------------------------------- the tokenizer
def _tokenizer_at(text: str) -> Any:
    """A tokenizer file (tokenizers' JSON) or a folder (:func:`load_tokenizer`)."""
    from gnnpar.data.text import load_tokenizer

    path = Path(text)
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            raise UserError(f"--tokenizer {path}: not a tokenizers JSON file ({err})") from None
    if path.is_dir():
        return load_tokenizer(path)
    raise FileNotFoundError(2, "No such file or directory", text)


def _tokenizer(args: argparse.Namespace, src: _Source) -> Any:
    """The tokenizer of a text prompt: ``--tokenizer``, else the HF folder's, else the run's
    (:func:`~gnnpar.models.gpt.hf_llama.run_tokenizer`: its pretrained folder's, or the BPE
    trained on its text)."""
    if args.tokenizer:
        return _tokenizer_at(args.tokenizer)
    if src.kind == "hf":
        from gnnpar.data.text import load_tokenizer

        try:
            return load_tokenizer(src.path)
        except FileNotFoundError:
            raise UserError(
                f"{src.path} has no tokenizer.json (or vocab.json and merges.txt): give "
                "--tokenizer FILE, or the prompt as --ids"
            ) from None
    from gnnpar.models.gpt.hf_llama import run_tokenizer

    tokenizer = run_tokenizer(src.path)
    if tokenizer is None:
        raise UserError(
            f"{src.path}: the run's tokenizer is not found from here (its config.toml names "
            "the text it was trained on, or a pretrained folder): run from where it trained, "
            "or give --tokenizer or --ids"
        )
    return tokenizer


def _prompt_ids(args: argparse.Namespace, src: _Source) -> tuple[list[int], Any]:
    """The prompt's token ids and the tokenizer (None for ``--ids``)."""
    vocab = src.sizes.vocab_size
    if args.ids is not None:
        try:
            ids = [int(w) for w in args.ids.replace(" ", ",").split(",") if w]
        except ValueError:
            raise UserError(f"--ids {args.ids!r}: give token ids as 1,2,3") from None
        tokenizer = _tokenizer_at(args.tokenizer) if args.tokenizer else None
    else:
        tokenizer = _tokenizer(args, src)
        ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise UserError("the prompt has no tokens")
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise UserError(f"token id {bad} is outside the model's vocabulary of {vocab} ids")
    return ids, tokenizer


# ------------------------------------------------------------------------- the checks
def _grid_shape(args: argparse.Namespace, world: int) -> dict[str, int]:
    """The grid of ``--grid`` (default: x = every process) on ``world`` processes, every
    axis of :func:`gnnpar.init` given."""
    from gnnpar.grid import parse_grid_spec

    shape = parse_grid_spec(args.grid) if args.grid is not None else {"x": world}
    other = sorted(set(shape) - set(AXES))
    if other:
        raise UserError(
            f"--grid {args.grid}: generation runs on the axes {', '.join(AXES)}, not {other[0]}"
        )
    shape = {"x": 1, "y": 1, "z": 1, **shape}
    tensor = shape["x"] * shape["y"] * shape["z"]
    shape.setdefault("data", world // tensor if world % tensor == 0 else 0)
    if tensor * shape["data"] != world:
        raise UserError(f"--grid {args.grid} does not fit {world} process(es)")
    return shape


def _plain(src: _Source, shape: dict[str, int]) -> Any:
    """The source's model on the meta device (sizes, no memory), checked to split over the
    grid ``shape`` as :func:`gnnpar.tensor.parallelize` will split it."""
    import torch

    from gnnpar.grid import GridShape
    from gnnpar.tensor import plan_styles

    if src.model == "gpt":
        from gnnpar.models.gpt.model import GPT as Model
    else:
        from gnnpar.models.gpt.llama import Llama as Model
    with torch.device("meta"):
        plain = Model(src.sizes)
    plan_styles(plain, GridShape(**shape))
    return plain


def _eos(args: argparse.Namespace, src: _Source) -> int | None:
    if args.eos is None:
        return src.eos
    if args.eos.lower() == "none":
        return None
    try:
        eos = int(args.eos)
    except ValueError:
        raise UserError(f"--eos {args.eos!r}: give a token id or none") from None
    if not 0 <= eos < src.sizes.vocab_size:
        raise UserError(f"--eos {eos} is outside the model's vocabulary")
    return eos


@dataclasses.dataclass
class _Request:
    src: _Source
    plain: Any
    ids: list[int]
    tokenizer: Any
    eos: int | None
    shape: dict[str, int]
    dtype: Any


def _checked(args: argparse.Namespace, world: int) -> _Request:
    """Everything about the command that can be checked without a process group, each
    problem one line (the same on every rank)."""
    from gnnpar.models.gpt.generation import check_sampling

    try:
        if args.nprocs < 1:
            raise UserError(f"--nprocs must be at least 1, got {args.nprocs}")
        if args.max_new_tokens < 0:
            raise UserError(f"--max-new-tokens must be 0 or more, got {args.max_new_tokens}")
        check_sampling(args.greedy, args.temperature, args.top_k, args.top_p)
        shape = _grid_shape(args, world)
        src = _source(args.source)
        plain = _plain(src, shape)
        ids, tokenizer = _prompt_ids(args, src)
        dtype = src.dtype if args.dtype == "auto" else _torch_dtype(args.dtype, "--dtype")
        return _Request(src, plain, ids, tokenizer, _eos(args, src), shape, dtype)
    except (UserError, OSError) as err:
        raise _same_everywhere(err) from None


# ------------------------------------------------------------------------- the model
def _model(req: _Request, grid: Any) -> Any:
    """The source's model, tensor-parallel on ``grid``, each rank holding its pieces."""
    import torch

    from gnnpar.tensor import load_full_state_dict, parallelize

    torch.manual_seed(0)  # the values are replaced by the source's
    model = parallelize(req.plain.to(req.dtype), grid)
    if req.src.kind == "hf":
        from gnnpar.models.gpt.task import load_pretrained

        load_pretrained(model, req.src.path, grid)
    else:
        from gnnpar.checkpoint import consolidate

        load_full_state_dict(model, consolidate(req.src.path), grid)
    return model.eval()


def _generate(args: argparse.Namespace) -> int:
    from gnnpar.launch import detect_launch, under_launcher

    launching = args.nprocs > 1 and not under_launcher()
    launch = detect_launch()
    world = args.nprocs if launching else (1 if launch is None else launch.world_size)
    req = _checked(args, world)
    if launching:
        from gnnpar.launch import launch_local, strip_nprocs

        return launch_local(args.nprocs, strip_nprocs(args.argv), agent=args.launch_agent)
    import torch

    import gnnpar
    from gnnpar.models.gpt.generation import generate

    grid = gnnpar.init(**req.shape)
    model = _model(req, grid)
    start = time.perf_counter()
    ids = torch.tensor([req.ids])
    out = generate(
        model, ids, args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, generator=torch.Generator().manual_seed(args.seed),
        eos=req.eos, cache=not args.no_cache,
    )[0].tolist()  # fmt: skip
    seconds = time.perf_counter() - start
    gnnpar.shutdown(grid)
    if grid.global_rank == 0:
        _report(args, req, out, seconds, grid)
    return 0


def _report(args: argparse.Namespace, req: _Request, out: list[int], seconds: float, grid: Any):
    """Rank 0: the text (or the ids) on stdout, a line of timing on stderr, ``--json``."""
    new = out[len(req.ids) :]
    text = req.tokenizer.decode(out) if req.tokenizer is not None else None
    print(text if text is not None else ",".join(map(str, out)), flush=True)
    rate = f" ({len(new) / seconds:.1f} tokens/s)" if seconds > 0 and new else ""
    cache = "no KV cache" if args.no_cache else "KV cache"
    print(
        f"gnnpar generate: {len(new)} new tokens in {seconds:.2f} s{rate}, {cache}, "
        f"{grid.describe()}",
        file=sys.stderr,
        flush=True,
    )
    if args.json:
        from gnnpar.atomic import write_json

        doc = {
            "source": str(args.source),
            "model": req.src.model,
            "prompt_ids": req.ids,
            "new_ids": new,
            "text": text,
            "sampling": {
                "greedy": args.greedy,
                "temperature": args.temperature,
                "top_k": args.top_k,
                "top_p": args.top_p,
                "seed": args.seed,
                "eos": req.eos,
            },  # fmt: skip
            "cache": not args.no_cache,
            "grid": grid.shape,
            "seconds": seconds,
        }
        write_json(args.json, doc, indent=1)


def add_generate_command(subparsers: Any) -> None:
    """Register ``gnnpar generate`` on an argparse sub-parsers object."""
    p = subparsers.add_parser(
        "generate",
        help="text from a trained gpt or llama run, or a Hugging Face Llama folder (KV cache, "
        "tensor-parallel with --nprocs)",
        description=(
            "Continue a prompt with the model of SOURCE: a gnnpar train gpt run (model gpt or "
            "llama; its newest checkpoint, from any grid) or a Hugging Face LlamaForCausalLM "
            "folder (config.json, model.safetensors). Prints the text (the prompt and its "
            "continuation; with --ids, the token ids). With --nprocs N the model is split "
            "tensor-parallel over N local ranks (--grid; default x=N)."
        ),
    )
    p.add_argument(
        "source", metavar="SOURCE",
        help="a run folder of gnnpar train gpt (or its checkpoints/ or a step folder), or a "
        "Hugging Face Llama folder",
    )  # fmt: skip
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt as text (encoded with the tokenizer)")
    prompt.add_argument("--ids", help="the prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens to add (default: 50)")
    p.add_argument("--greedy", action="store_true", help="take the likeliest token each step")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="divide the logits by this (default: 1.0)"
    )
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    p.add_argument(
        "--top-p", type=float, default=None,
        help="sample from the likeliest tokens whose probability reaches p (nucleus)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    p.add_argument(
        "--eos", default=None, metavar="ID",
        help="stop at this token id, or none (default: the Hugging Face config's "
        "eos_token_id; none for a run)",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", default=None, metavar="PATH",
        help="a tokenizer.json (or a folder with one) instead of the source's",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto",
        help="the model's dtype (default auto: the checkpoint's or the config's)",
    )  # fmt: skip
    p.add_argument(
        "--no-cache", action="store_true",
        help="run every step over the whole sequence (no KV cache; for comparison)",
    )  # fmt: skip
    p.add_argument("--nprocs", type=int, default=1, help="local processes to start")
    p.add_argument(
        "--grid", default=None,
        help="grid of x, y, z and data, e.g. x=2 or x=2,y=2 (default: x = every process)",
    )  # fmt: skip
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    p.set_defaults(func=_generate)

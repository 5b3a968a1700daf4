"""``gnnpar ckpt consolidate | info | export-hf``: offline tools over any gnnpar checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_ckpt_commands"]


def _write_state(out: Path, state: dict) -> None:
    """A plain state dict as ``.pt`` (tensors only: loads with ``weights_only=True``) or, for
    a ``.safetensors`` name, in that format (tied tensors stored once per key)."""
    from gnnpar.atomic import atomic_write

    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise SystemExit(
                "error: writing .safetensors needs the safetensors package (pip install "
                "safetensors); or give OUT a .pt name"
            ) from None
        plain = {k: v.contiguous().clone() for k, v in state.items()}
        atomic_write(out, lambda tmp: save_file(plain, tmp))
        return
    from gnnpar.verified import torch_save

    atomic_write(out, lambda tmp: torch_save(state, tmp))


def _writable(out: Path, overwrite: bool) -> Path:
    """``out``, checked: not inside a verified folder (a step folder of the checkpoint read:
    a file written there would replace or add to what its manifest lists), and not an
    existing file unless ``overwrite``."""
    from gnnpar.errors import UserError
    from gnnpar.verified import MANIFEST

    inside = next((p for p in out.resolve().parents if (p / MANIFEST).is_file()), None)
    if inside is not None:
        raise UserError(
            f"{out} lies inside {inside}, a folder whose manifest lists its own files: "
            "write the state dict elsewhere"
        )
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    return out


def _consolidate(args: argparse.Namespace) -> int:
    from gnnpar.checkpoint import consolidate, consolidate_inputs, open_checkpoint
    from gnnpar.errors import UserError

    out = _writable(Path(args.out), args.overwrite)
    kept = list(open_checkpoint(args.path).meta.get("inputs", []))
    extra = None if args.inputs is None else _writable(Path(args.inputs), args.overwrite)
    if extra is not None and not kept:
        raise UserError(f"checkpoint {args.path} keeps no tensors beside its state dict")
    state = consolidate(args.path)
    _write_state(out, state)
    numel = sum(t.numel() for k, t in state.items())
    print(f"wrote {out}: {len(state)} tensors, {numel:,} numbers (plain state dict)")
    if extra is not None:
        inputs = consolidate_inputs(args.path)
        _write_state(extra, inputs)
        print(f"wrote {extra}: {', '.join(inputs)} (kept beside the state dict)")
    elif kept:
        print(f"the checkpoint also keeps {', '.join(kept)} beside the state dict (learnt "
              "featureless rows): --inputs FILE writes them")  # fmt: skip
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from gnnpar.models.gpt.hf_llama import export_hf

    out = export_hf(args.path, args.out, args.overwrite, args.merge, args.adapters)
    files = sorted(f.name for f in out.iterdir())
    what = "peft LoRA adapters" if args.adapters else "LlamaForCausalLM"
    print(f"wrote {out}: {', '.join(files)} ({what})")
    return 0


def _info(args: argparse.Namespace) -> int:
    from gnnpar.checkpoint import describe

    print(describe(args.path))
    return 0


def add_ckpt_commands(subparsers: Any) -> None:
    """Register ``gnnpar ckpt consolidate | info | export-hf`` on an argparse sub-parsers object."""
    from gnnpar.train.config import plain_text

    ckpt = subparsers.add_parser(
        "ckpt",
        help="checkpoints: one plain state dict, or a summary",
        description=plain_text(__doc__),
    )
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    where = (
        "a run folder, its checkpoints/ directory (the newest complete checkpoint is used) or "
        "one step folder"
    )
    p = sub.add_parser(
        "consolidate",
        help="write the plain model's full state dict from any checkpoint",
        description=(
            "Assemble the full state dict of the plain model (our GCN/SAGE/GPT, or a Hugging "
            "Face model parallelized with gnnpar.tensor) from a checkpoint written on any grid, "
            "with any sharding, by gnnpar train or the library. Needs no process group. OUT "
            "ending in .pt is a torch.save file of tensors only (torch.load(..., "
            "weights_only=True) reads it); .safetensors needs the safetensors package."
        ),
    )
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help=where)
    p.add_argument("out", metavar="OUT", help="output file (.pt or .safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--inputs",
        default=None,
        metavar="FILE",
        help="also write the tensors the checkpoint keeps beside the state dict (a full-graph "
        "run's learnt featureless rows and their node ids) to FILE",
    )
    p.set_defaults(func=_consolidate)
    p = sub.add_parser(
        "export-hf",
        help="write a llama run as a Hugging Face LlamaForCausalLM folder",
        description=(
            "Write the llama model of a checkpoint written on any grid as a folder that "
            "transformers' LlamaForCausalLM.from_pretrained loads (config.json and "
            "model.safetensors, in the checkpoint's dtype, and the run's tokenizer.json where "
            "its run folder names it). Needs no process group."
        ),
    )
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help=where)
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: fold the adapters into the base model it recorded",
    )
    p.add_argument(
        "--adapters",
        action="store_true",
        help="a LoRA run: write the adapters unmerged, in peft's format (adapter_config.json, "
        "adapter_model.safetensors)",
    )
    p.set_defaults(func=_export_hf)
    p = sub.add_parser(
        "info",
        help="step, grid, run, tensors and sizes of a checkpoint",
        description="Print what a checkpoint holds. Needs no process group.",
    )
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help=where)
    p.set_defaults(func=_info)

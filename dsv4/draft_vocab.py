"""A draft vocabulary: the tokens the MTP may propose (FR-Spec; SGLang's `--speculative-token-map`).

A draft vocabulary restricts the MTP's draft head (a large part of what a draft reads on a
model with a large vocabulary) to the most frequent tokens of some text: the MTP's logits
outside it are -inf, so its draft distribution q is zero there. The output is the target's
exactly (greedy verification compares with the target's argmax; rejection sampling's
residual covers the tokens outside the set); only acceptance can drop.

The file, `draft_vocab.json` in a checkpoint directory (used by default) or any path given to
`--draft-vocab`, is a JSON object `{"format": "dsv4-draft-vocab", "version": 1, "vocab_size",
"token_ids" (most frequent first), "coverage", "source"}`. `dsv4 draft-vocab` writes one
from text files (`build`); `read` checks one (every id in 0..vocab_size-1, no repeats, at
least one) and raises `DraftVocabError` with a one-line reason.
Details: docs/quantization.md, 'dsv4/draft_vocab.py'.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

FILE = "draft_vocab.json"
FORMAT = "dsv4-draft-vocab"
VERSION = 1
MAX_BYTES = 64 << 20  # a list of ids for any real vocabulary is a few MB


class DraftVocabError(ValueError):
    """A draft vocabulary file that cannot be used (one line)."""


def resolve(setting: str | None, model_dir: str | Path) -> Path | None:
    """`--draft-vocab`: "auto" (or None) -> the checkpoint's `draft_vocab.json` if it has one;
    "off" -> None (the full vocabulary); anything else -> that file (checked to exist)."""
    text = "auto" if setting is None else str(setting).strip()
    if text == "off":
        return None
    if text == "auto":
        p = Path(model_dir).absolute() / FILE
        return p if p.is_file() else None
    p = Path(text).expanduser()
    if not p.is_file():
        raise DraftVocabError(f"--draft-vocab {setting}: no such file (give a file from 'dsv4 draft-vocab', "
                              f"auto or off)")
    return p.absolute()


def read(path: str | Path, vocab_size: int) -> list[int]:
    """The token ids of the draft vocabulary in `path` (most frequent first), checked
    against a model of `vocab_size` tokens."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_BYTES:
            raise DraftVocabError(f"draft vocabulary {p}: over {MAX_BYTES >> 20} MiB")
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise DraftVocabError(f"draft vocabulary {p}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftVocabError(f"draft vocabulary {p}: not JSON ({e})") from None
    except RecursionError:
        raise DraftVocabError(f"draft vocabulary {p}: not JSON (nested too deeply)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DraftVocabError(f"draft vocabulary {p}: not a {FORMAT} file (write one with 'dsv4 draft-vocab')")
    if data.get("version", VERSION) != VERSION:
        raise DraftVocabError(f"draft vocabulary {p}: version {data.get('version')!r} of its format; this dsv4 "
                              f"reads version {VERSION}")
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise DraftVocabError(f"draft vocabulary {p}: 'token_ids' must be a non-empty list of token ids")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise DraftVocabError(f"draft vocabulary {p}: token id {bad[0]!r} is not in 0..{vocab_size - 1} "
                              f"(the model's vocabulary)")
    if len(set(ids)) != len(ids):
        raise DraftVocabError(f"draft vocabulary {p}: token ids repeat")
    stored = data.get("vocab_size")
    if stored is not None and stored != vocab_size:
        raise DraftVocabError(f"draft vocabulary {p} was made for a vocabulary of {stored} tokens, "
                              f"the model has {vocab_size}")
    return ids


def build(texts: Iterable[list[int]], vocab_size: int, size: int, source: str = "",
          always: Iterable[int] = ()) -> dict[str, Any]:
    """The `size` most frequent token ids of the tokenised `texts` (an iterable of token
    lists, read once; ties: lower id first; tokens never seen fill up in id order; `always`
    first, e.g. the end-of-sequence token), as the file's JSON object with the share of the
    texts' tokens it covers."""
    if not 1 <= size <= vocab_size:
        raise DraftVocabError(f"a draft vocabulary of {size} tokens: use 1..{vocab_size} (the model's vocabulary)")
    counts: Counter[int] = Counter()
    for ids in texts:
        counts.update(ids)
    total = sum(counts.values())
    order = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))
    first = set(order)
    order += sorted((t for t in counts if t not in first), key=lambda t: (-counts[t], t))
    if len(order) < size:
        seen = set(order)
        order += [t for t in range(vocab_size) if t not in seen][: size - len(order)]
    ids = order[:size]
    covered = sum(counts[t] for t in ids)
    by_count = sorted(counts.values(), reverse=True)
    return {"format": FORMAT, "version": VERSION, "vocab_size": vocab_size, "size": size,
            "coverage": round(covered / total, 6) if total else None, "counted_tokens": total,
            "size_for_coverage": {str(s): _size_for(by_count, total, s) for s in (0.9, 0.95, 0.99)} if total else {},
            "source": source, "token_ids": ids}


def _size_for(by_count: list[int], total: int, share: float) -> int:
    """The fewest tokens (counts `by_count`, most frequent first) that cover `share` of `total`."""
    run = 0
    for n, c in enumerate(by_count, 1):
        run += c
        if run >= share * total:
            return n
    return len(by_count)


def coverage(ids: Iterable[int], texts: Iterable[list[int]]) -> float | None:
    """The share of the tokens of `texts` that are in `ids` (None for no tokens)."""
    s, hit, n = set(ids), 0, 0
    for t in texts:
        n += len(t)
        hit += sum(1 for x in t if x in s)
    return hit / n if n else None

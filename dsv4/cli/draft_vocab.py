"""`dsv4 draft-vocab TEXT... --out FILE`: the MTP's draft vocabulary from text.

Tokenises the text files with the model's tokenizer (a piece at a time, counting as it
goes), keeps the `--size` most frequent tokens (the end-of-sequence token first) and
writes them as a draft vocabulary (`dsv4/draft_vocab.py`), which `--draft-vocab FILE`
then serves with, or which serves by default when it is the checkpoint's
`draft_vocab.json`. Reports the share of the text's
tokens the set covers, and the sizes other coverages would take; `--heldout` files
measure coverage on text the ranking did not see.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from dsv4.cli import options as O
from dsv4.cli.options import CliError

PIECE_CHARS = 1 << 20  # text is tokenised a piece at a time, cut at blank lines, and counted as it goes


def _pieces(text: str) -> Iterator[str]:
    """`text` in pieces of about PIECE_CHARS, cut after a blank line where there is one."""
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            cut = text.rfind("\n\n", start, end)
            end = cut + 2 if cut > start else end
        yield text[start:end]
        start = end


def _texts(paths: list[Path], tok, flag: str) -> Iterator[list[int]]:
    """The token ids of each file, a piece at a time (never all of them at once)."""
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"{flag} {p}: {e.strerror or e}", O.EXIT_USAGE) from None
        except UnicodeDecodeError as e:
            raise CliError(f"{flag} {p}: not UTF-8 text ({e.reason} at byte {e.start})", O.EXIT_USAGE) from None
        for piece in _pieces(text):
            yield tok.encode(piece)
        del text


def _names(paths: list[Path], most: int = 5) -> str:
    names = ", ".join(p.name for p in paths[:most])
    return names + (f" and {len(paths) - most} more" if len(paths) > most else "")


def draft_vocab(
    texts: Annotated[list[Path], typer.Argument(metavar="TEXT...", show_default=False,
                                                help="UTF-8 text files like what the model will generate.")],
    out: Annotated[Path, typer.Option("--out", metavar="FILE", show_default=False,
                                      help="Where to write the draft vocabulary (JSON); name it draft_vocab.json "
                                           "in the checkpoint directory to serve with it by default.")],
    model: O.Model = None, revision: O.Revision = None,
    size: Annotated[Optional[int], typer.Option(
        "--size", metavar="N", callback=O.int_range(1),
        help="Tokens to keep [default: a quarter of the vocabulary]")] = None,
    heldout: Annotated[Optional[list[Path]], typer.Option(
        "--heldout", metavar="FILE", help="Also report the coverage of this text (repeatable).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Rank the tokens of TEXT by frequency and write the MTP's draft vocabulary to --out."""
    from dsv4 import DEFAULT_MODEL
    from dsv4 import draft_vocab as dv
    from dsv4.config import ModelConfig
    from dsv4.engine.tokenizer import Tokenizer

    if model is not None:
        from dsv4.cli.hub import model_dir as resolve_dir

        model_dir = resolve_dir(model, revision)
    elif revision is not None:
        raise CliError("--revision applies to a hub model: give --model ORG/NAME", O.EXIT_USAGE)
    else:
        model_dir = DEFAULT_MODEL
    if out.exists() and not force:
        raise CliError(f"--out {out} exists; give --force to replace it", O.EXIT_USAGE)
    cfg = ModelConfig.from_dir(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    n = cfg.vocab_size // 4 if size is None else size
    if n > cfg.vocab_size:
        raise CliError(f"--size {n}: the model has {cfg.vocab_size} tokens", O.EXIT_USAGE)
    for p in [*texts, *(heldout or [])]:  # before the work: every file is there
        if not p.is_file():
            raise CliError(f"{'TEXT' if p in texts else '--heldout'} {p}: no such file", O.EXIT_USAGE)
    # the end-of-sequence token first (a draft may end the text); the other special tokens
    # only as often as the text has them (V4's tokenizer marks ~1200 placeholders special)
    always = [t for t in (cfg.eos_token_id, cfg.bos_token_id) if t is not None]
    data = dv.build(_texts(texts, tok, "TEXT"), cfg.vocab_size, n, source=_names(texts), always=always)
    if heldout:
        data["heldout_coverage"] = dv.coverage(data["token_ids"], _texts(heldout, tok, "--heldout"))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
        tmp.replace(out)  # whole or not at all
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CliError(f"--out {out}: {e.strerror or e}") from None
    total = data["counted_tokens"]
    sizes = ", ".join(f"{float(k):.0%} {v}" for k, v in data["size_for_coverage"].items())
    cov = f"{100 * data['coverage']:.1f}% of the {total} tokens counted" if total else "no tokens counted"
    held = (f"; {100 * data['heldout_coverage']:.1f}% of --heldout" if data.get("heldout_coverage") is not None
            else "")
    O.err(f"dsv4: wrote {out}: {n} of {cfg.vocab_size} tokens, covering {cov}{held}"
          + (f" (tokens needed to cover {sizes})" if sizes else ""))

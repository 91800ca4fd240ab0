"""Train the byte-level BPE tokenizer of the embedded default model.

    python tools/train_tokenizer.py DATA_DIR OUT_DIR [--vocab-size 4096] [--heldout DIR]

Trains on every `*.txt` under DATA_DIR (sorted, read as UTF-8) with the `tokenizers`
library: ByteLevel pre-tokenizer (GPT-2 regex, no prefix space) and ByteLevel decoder,
so decode(encode(text)) == text for any text. Special tokens sit at fixed ids:
`<｜begin▁of▁sentence｜>` 0 (BOS), `<｜end▁of▁sentence｜>` 1 (EOS), `<｜▁pad▁｜>` 2; there are
no chat tokens, so prompts for this model are raw text. Writes `tokenizer.json` and
`tokenizer_config.json` into OUT_DIR and prints the compression (chars per token) on the
held-out texts (default: DATA_DIR/../heldout when it exists).

Training is deterministic: fixed file order, one thread, no randomness in BPE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its pool
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2


def text_files(data_dir: Path) -> list[Path]:
    """All *.txt under data_dir, in a fixed order."""
    return sorted(p for p in data_dir.rglob("*.txt") if p.is_file())


def train(files: list[Path], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over the given files with the special tokens at ids 0..2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text(encoding="utf-8") for p in files]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"{t} landed at id {tok.token_to_id(t)}, expected {i}"
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """The tokenizer_config.json that goes next to tokenizer.json."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def chars_per_token(tok: Tokenizer, files: list[Path]) -> tuple[int, int]:
    """(characters, tokens) over the files; also checks that every file round-trips."""
    chars = tokens = 0
    for p in files:
        text = p.read_text(encoding="utf-8")
        ids = tok.encode(text, add_special_tokens=False).ids
        if tok.decode(ids, skip_special_tokens=False) != text:
            raise SystemExit(f"error: {p} does not round-trip through the trained tokenizer")
        chars, tokens = chars + len(text), tokens + len(ids)
    return chars, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_dir", type=Path, help="directory whose *.txt files are the training texts")
    ap.add_argument("out_dir", type=Path, help="where tokenizer.json and tokenizer_config.json go")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--model-max-length", type=int, default=2048)
    ap.add_argument("--heldout", type=Path, default=None, help="held-out *.txt dir (default DATA_DIR/../heldout)")
    args = ap.parse_args(argv)

    files = text_files(args.data_dir)
    if not files:
        print(f"error: no *.txt files under {args.data_dir}", file=sys.stderr)
        return 1
    tok = train(files, args.vocab_size)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out_dir / "tokenizer.json"), pretty=True)
    cfg = tokenizer_config(args.model_max_length)
    (args.out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"trained on {len(files)} files, vocab {tok.get_vocab_size()} -> {args.out_dir}")

    for name, d in (("train", args.data_dir), ("heldout", args.heldout or args.data_dir.parent / "heldout")):
        fs = text_files(d) if d.is_dir() else []
        if fs:
            c, n = chars_per_token(tok, fs)
            print(f"{name}: {len(fs)} files, {c} chars, {n} tokens, {c / n:.3f} chars/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

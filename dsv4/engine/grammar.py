"""Structured outputs: a request's grammar (JSON schema, JSON object, regex, choice, EBNF)
compiled by xgrammar into per-token masks, kept exact under MTP speculative decoding.

* `check_spec(spec)`: the shape of `SamplingParams.structured` (one of `json_schema`,
  `json_object`, `regex`, `choice`, `ebnf`; at most `MAX_SPEC_BYTES` of JSON), no xgrammar needed.
* `Grammars` (one per engine): `submit(spec)` compiles in the background (`grammar_compile`:
  worker processes, a time budget, a cache), over xgrammar's `TokenizerInfo` of the vocabulary
  (each id's bytes, `Tokenizer.token_bytes`; special added tokens, `<think>`, `</think>` and ids
  past the tokenizer's vocabulary are never allowed, other added tokens such as V4's `｜DSML｜`
  are their text), EOS as its stop token. `state(compiled, prompt_ids)` -> a `GrammarState`.
* `GrammarState` (one per request, on rank 0): `masks(drafts)` gives the bitmask of every
  verified row: row j's after accepting drafts 0..j-1 into the matcher, then rolled back;
  a draft the grammar refuses leaves the rows after it unconstrained (verification stops
  at it: its own row's mask forbids it). `commit(tokens)` accepts what the step emitted.
  In thinking mode (the prompt ends in `<think>`) nothing is constrained until the model
  has written `</think>`; the rows after it are.
* `draft_masks(logits, heads, drafts)`: the MTP's logits masked the same way, each draft
  after the drafts before it (better acceptance; exactness needs only the verify masks).
* `apply_masks(logits, rows, bitmask)`: logits of the constrained rows set to -inf where
  the mask forbids; any device (the bits unpack with torch, no xgrammar kernel).

The grammar's only stop token is EOS: once the answer is complete only EOS is allowed, and
the scheduler ends a constrained request at EOS even under `ignore_eos`.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any, Sequence

from .errors import RequestError

if TYPE_CHECKING:  # torch is imported where tensors are made: `check_spec` runs in params.py, without torch
    from concurrent.futures import Future

    import torch

    from .grammar_compile import CompilePool

    from .tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
MAX_SPEC_BYTES = 64 << 10  # a spec's JSON: larger schemas are refused
MAX_CHOICES = 1024
INSTALL_HINT = "scripts/venv.sh http,structured, or pip install 'dsv4[structured]'"


def check_spec(spec: Any) -> None:
    """Raise `RequestError` unless `spec` is {kind: value} with one kind of `KINDS`."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise RequestError(f"structured must be a map with one of {', '.join(KINDS)}, got {_short(spec)}")
    (kind, value), = spec.items()
    if kind not in KINDS:
        raise RequestError(f"structured: unknown kind {_short(kind)} (expected one of {', '.join(KINDS)})")
    try:
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError) as e:
        raise RequestError(f"structured {kind}: not JSON data: {e}") from None
    if size > MAX_SPEC_BYTES:
        raise RequestError(f"structured {kind} is {size} bytes, over the limit of {MAX_SPEC_BYTES}")
    if kind == "json_schema" and not isinstance(value, (dict, str, bool)):
        raise RequestError(f"structured json_schema must be a JSON schema (an object), got {_short(value)}")
    if kind == "json_object" and value is not True:
        raise RequestError(f"structured json_object must be true, got {_short(value)}")
    if kind in ("regex", "ebnf") and (not isinstance(value, str) or not value):
        raise RequestError(f"structured {kind} must be a non-empty string, got {_short(value)}")
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise RequestError(f"structured choice must be a list of 1..{MAX_CHOICES} non-empty strings, "
                               f"got {_short(value)}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class Grammars:
    """The engine's grammars over its tokenizer's vocabulary (module docstring)."""

    def __init__(self, tokenizer: "Tokenizer | None", vocab_size: int, eos_id: int | None,
                 think_start: int | None = None, think_end: int | None = None, *, budget_s: float = 10.0) -> None:
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.think_start, self.think_end = think_start, think_end
        self.budget_s = budget_s
        self._pool: "CompilePool | None" = None
        self._pool_lock = threading.Lock()  # creating the pool at the first structured request (any thread)

    def submit(self, spec: dict[str, Any]) -> "Future":
        """A Future of the compiled grammar of a checked spec (`grammar_compile.CompilePool`:
        off this thread, in a worker process, within the budget); it fails with a one-line
        `RequestError` (no xgrammar, no tokenizer, a grammar that does not compile or is over
        budget) or `RequestBusy`. Cancelling it drops the compile."""
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    from .grammar_compile import CompilePool

                    self._pool = CompilePool(self._tokenizer_info, budget_s=self.budget_s)
        return self._pool.submit(spec)

    def compile(self, spec: dict[str, Any]) -> Any:
        """`submit(spec)`, waited for: for callers without a loop to keep going (the offline LLM)."""
        return self.submit(spec).result()

    def status(self) -> dict[str, Any]:
        return self._pool.status() if self._pool is not None else {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _tokenizer_info(self) -> tuple[str, Any]:
        """xgrammar's TokenizerInfo of this vocabulary, and its JSON for the workers (built once,
        on the compile pool's thread: ~1.5 s for V4's 129k ids)."""
        try:
            import xgrammar as xgr
        except ImportError:
            raise RequestError(f"structured outputs need xgrammar, which is not installed: {INSTALL_HINT}") \
                from None
        tok = self.tokenizer
        if tok is None:
            raise RequestError("structured outputs need a tokenizer; this model has no tokenizer.json")
        special = set(tok.special_token_ids()) | {t for t in (self.think_start, self.think_end) if t is not None}
        n = min(tok.vocab_size, self.vocab_size)
        vocab = [b"" if i in special else tok.token_bytes(i) for i in range(n)]
        vocab += [b""] * (self.vocab_size - n)
        stop = [self.eos_id] if self.eos_id is not None else None
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stop)
        return info.serialize_json(), info

    def state(self, compiled: Any, prompt_ids: Sequence[int]) -> "GrammarState":
        """A fresh matcher of a compiled grammar for a request (cheap: the engine loop calls it);
        it starts unconstrained when the prompt ends in `<think>`."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        thinking = self.think_start is not None and bool(prompt_ids) and prompt_ids[-1] == self.think_start
        return GrammarState(matcher, self.vocab_size, active=not thinking, think_end=self.think_end)


class GrammarState:
    """One request's matcher and its thinking switch (module docstring)."""

    def __init__(self, matcher: Any, vocab_size: int, *, active: bool = True, think_end: int | None = None) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.active = active  # False until </think> in thinking mode
        self.think_end = think_end

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def masks(self, drafts: Sequence[int], out: torch.Tensor, first: int = 0, last_only: bool = False
              ) -> list[bool]:
        """Fill rows first.. of `out` [R, words] int32 with the bitmask of each verified row
        (row first + j: after drafts 0..j-1); returns which of the len(drafts) + 1 rows are
        constrained. The matcher ends where it began. `last_only`: fill only the last row."""
        m, active, dead, accepted = self.matcher, self.active, False, 0
        rows = []
        for j in range(len(drafts) + 1):
            live = active and not dead and not m.is_terminated()
            if live and (not last_only or j == len(drafts)):
                m.fill_next_token_bitmask(out, first + j)
            rows.append(live)
            if j < len(drafts):
                d = int(drafts[j])
                if live:
                    if m.accept_token(d):
                        accepted += 1
                    else:
                        dead = True  # row j forbids d: verification stops there
                elif not active and d == self.think_end:
                    active = True
        if accepted:
            m.rollback(accepted)
        return rows

    def last_mask(self, drafts: Sequence[int], out: torch.Tensor, row: int) -> bool:
        """Fill row `row` of `out` with the mask after `drafts` (an MTP draft's); False when
        that position is free (thinking, or a draft the grammar refused)."""
        return self.masks(drafts, out, row - len(drafts), last_only=True)[-1]

    def commit(self, tokens: Sequence[int]) -> None:
        """Accept the tokens a step emitted (after `</think>` in thinking mode)."""
        for t in tokens:
            if not self.active:
                self.active = int(t) == self.think_end
                continue
            if self.matcher.is_terminated():
                return
            self.matcher.accept_token(int(t))


def apply_masks(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [R, V] with each row of `rows` limited to the tokens its row of `bitmask`
    [R, words] allows (-inf elsewhere): a new tensor, `logits` itself when `rows` is empty.
    On CPU xgrammar's kernel does it (0.16 ms for 3 rows of 129k: unpacking the bits with
    torch took 5 ms); elsewhere torch unpacks the bytes of the constrained rows through a table."""
    if not rows:
        return logits
    import torch

    out = logits.clone()
    if out.device.type == "cpu" and out.dtype in (torch.float32, torch.bfloat16, torch.float16):
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(out, bitmask, indices=list(rows), backend="cpu")
        return out
    v, dev = logits.shape[-1], logits.device
    idx = torch.tensor(list(rows), dtype=torch.long, device=dev)
    words = bitmask[list(rows)].to(dev).contiguous()  # [n, W] int32, bit b of word w: token 32 w + b
    table = (torch.arange(256, device=dev)[:, None] >> torch.arange(8, device=dev)) & 1  # [256, 8]
    allowed = table.bool()[words.view(torch.uint8).long()].reshape(len(rows), -1)[:, :v]  # little-endian bytes
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def draft_masks(logits: torch.Tensor, heads: Sequence[Any], drafts: dict[int, list[int]]) -> torch.Tensor:
    """The MTP's logits [N, V] of `heads` (requests, one row each) with each constrained
    request's row masked by its grammar after its drafts so far this step (`drafts`: slot -> tokens)."""
    rows = []
    bm = new_bitmask(len(heads), logits.shape[-1])
    for i, req in enumerate(heads):
        if req.grammar is not None and req.grammar.last_mask(drafts.get(req.slot, []), bm, i):
            rows.append(i)
    return apply_masks(logits, rows, bm)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask of `rows` rows over `vocab_size` tokens, every token allowed."""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)

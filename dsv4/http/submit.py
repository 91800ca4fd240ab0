"""An HTTP request's prompts to the daemon: the prompts-per-request cap, the client each
counts for, and every refusal as an HTTP status.

    q, rids = await submit(bridge, parsed, client=client_of(request, body), max_prompts=64)

* `max_prompts` (`serve --max-prompts-per-request`, default DEFAULT_MAX_PROMPTS): a
  `prompt` list longer than this is a 400 naming the limit, before anything is sent. One
  request cannot fill the daemon's request table (1,024 in flight) or sidestep `n = 1`
  with a list of one prompt repeated; `n` samples a prompt count n times. OpenAI documents no number for prompt lists and
  vLLM takes any; this server's default matches OpenAI's largest `n` (128) halved, and
  the engine's fair shares (below) keep even an allowed list from crowding out others.
* `client_of`: the client a request counts for in the engine's fair admission (each
  client's requests wait behind the other clients' fewer ones): the body's `user`
  (OpenAI's end-user id) when it has one, else the peer's address; so one client's
  flood of connections or prompts does not delay another client's request.
* Refusals: over the daemon's message limit 413 (`MessageTooLarge`, named by its bytes
  and --max-model-len), daemon not answering or its send queue full 503
  (`DaemonUnavailable`, `DaemonBusy`); the prompts sent before a refusal are cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dsv4.http.bridge import Bridge, DaemonBusy, DaemonUnavailable, MessageTooLarge
from dsv4.http.requests import ApiError, Parsed

DEFAULT_MAX_PROMPTS = 64
MAX_USER_CHARS = 128


def client_of(request: Any, body: dict[str, Any]) -> str:
    """The client a request counts for: `user` from the body, else the peer's host."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user[:MAX_USER_CHARS]
    peer = getattr(request, "client", None)
    return "peer:" + (peer.host if peer is not None and peer.host else "unknown")


def check_prompt_count(parsed: Parsed, max_prompts: int) -> None:
    """400 when the request has more prompts (times `n`) than `max_prompts`."""
    count = len(parsed.prompts) * parsed.n
    if count > max_prompts:
        what = f"{len(parsed.prompts)} prompts x n = {parsed.n}" if parsed.n > 1 else f"{count} prompts"
        raise ApiError(400, f"the request has {what}, over the limit of {max_prompts} per "
                            f"request (--max-prompts-per-request); send fewer per request",
                       "n" if parsed.n > 1 else "prompt")


def sample_params(params: dict[str, Any], j: int) -> dict[str, Any]:
    """The parameters of sample j of a prompt: a seed s gives its samples s, s + 1, ... (the
    same answers for the same request, different ones for its samples)."""
    if j == 0 or params.get("seed") is None:
        return params
    return {**params, "seed": (int(params["seed"]) + j) % (1 << 64)}


async def submit(bridge: Bridge, parsed: Parsed, *, client: str, max_prompts: int, param: str = "prompt"
                 ) -> tuple[asyncio.Queue, list[str]]:
    """Send one generate per prompt; all replies arrive on the returned queue. Raises ApiError
    (400, 413, 503; `param` names the body field of the prompts) with whatever was sent cancelled."""
    check_prompt_count(parsed, max_prompts)
    q: asyncio.Queue = asyncio.Queue()
    rids: list[str] = []
    try:
        for prompt in parsed.prompts:
            for j in range(parsed.n):  # n samples, each its own request (no shared prefill yet)
                # an explicit max_tokens must fit (400 otherwise); without one, generation stops at the model's length
                rid, _ = await bridge.generate(prompt, sample_params(parsed.params, j), mode=parsed.mode,
                                               thinking=parsed.thinking, queue=q,
                                               strict_length="max_tokens" in parsed.params, client=client)
                rids.append(rid)
    except BaseException as e:
        for rid in rids:
            bridge.cancel(rid)
        if isinstance(e, (DaemonUnavailable, DaemonBusy)):
            raise ApiError(503, str(e), code="busy" if isinstance(e, DaemonBusy) else None) from None
        if isinstance(e, MessageTooLarge):
            raise ApiError(413, str(e), param) from None
        raise
    return q, rids

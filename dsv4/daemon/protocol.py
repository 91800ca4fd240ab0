"""The wire protocol between `dsv4` clients (ZeroMQ DEALER) and the daemon (ROUTER).

Every message is one ZeroMQ frame holding one msgpack map with at least `v`
(PROTOCOL_VERSION), `type` and `id` (a client-chosen string, unique among that client's
live requests). Client -> daemon: ping, status, generate {prompt, mode, params, ...},
cancel {target}, shutdown; daemon -> client: pong, status, delta (streamed), final, ok,
error {code, message}. With an API key (`serve --api-key`) a message is two frames,
KEY_PREFIX + key first, compared in constant time before anything else is read. A client
sends a message (usually `ping`) at least every HEARTBEAT_INTERVAL_S while it waits; the
daemon cancels the requests of a client silent for HEARTBEAT_TIMEOUT_S.

Exceptions never cross the socket: `decode_request` turns anything malformed into a
`ProtocolError` with an error code, answered with an `error` message. No torch is imported
here, so the CLI starts fast. Every field: docs/daemon.md, 'dsv4/daemon/protocol.py'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import PurePath
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 << 20  # one frame; larger ones get ERR_TOO_LARGE
MAX_PROMPT_CHARS = 4 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_ID_LEN = 128
MAX_CLIENT_LEN = 256
KEY_PREFIX = b"dsv4-key:"  # first frame of a message carrying an API key
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
PROMPT_MODES = ("auto", "chat", "raw")

# Error codes (strings on the wire).
ERR_BAD_MESSAGE = "bad_message"  # not msgpack, not a map, or several frames
ERR_TOO_LARGE = "too_large"  # frame or prompt over the limits
ERR_BAD_VERSION = "bad_version"
ERR_UNKNOWN_TYPE = "unknown_type"
ERR_BAD_FIELD = "bad_field"  # missing, unknown or wrongly typed field
ERR_INVALID_PARAMS = "invalid_params"  # sampling parameters rejected
ERR_BAD_REQUEST = "bad_request"  # the engine rejected the request (e.g. prompt too long)
ERR_DUPLICATE_ID = "duplicate_id"
ERR_SHUTTING_DOWN = "shutting_down"
ERR_INTERNAL = "internal"
ERR_UNAUTHORIZED = "unauthorized"  # missing or wrong API key
ERR_BUSY = "busy"  # too many clients or requests; try again later
ERR_RATE_LIMITED = "rate_limited"  # this client has its most requests in flight; wait for some to end


class ProtocolError(Exception):
    """A message the daemon cannot accept; becomes an `error` reply, never a crash."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# ---------------------------------------------------------------------- requests
@dataclass
class Request:
    """Base of client -> daemon messages."""

    TYPE: ClassVar[str] = ""
    id: str

    def to_wire(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "type": self.TYPE, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass
class Ping(Request):
    TYPE: ClassVar[str] = "ping"


@dataclass
class Status(Request):
    TYPE: ClassVar[str] = "status"


@dataclass
class Shutdown(Request):
    TYPE: ClassVar[str] = "shutdown"


@dataclass
class Cancel(Request):
    TYPE: ClassVar[str] = "cancel"
    target: str = ""


@dataclass
class Generate(Request):
    TYPE: ClassVar[str] = "generate"
    prompt: str | list[int] = ""
    mode: str = "auto"
    system: str | None = None
    thinking: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    pieces: bool = False
    strict_length: bool = False
    client: str | None = None
    tools: list[Any] | None = None  # OpenAI function tools, rendered into a chat prompt (V4's "## Tools")
    follows: str | None = None  # id of this client's earlier generate of the same prompt (a sibling sample)


REQUEST_TYPES: dict[str, type[Request]] = {c.TYPE: c for c in (Ping, Status, Shutdown, Cancel, Generate)}

# Allowed wire types per field (None = nil allowed). `id` and the header are checked apart.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "target": (str,),
    "prompt": (str, list),
    "mode": (str,),
    "system": (str, type(None)),
    "thinking": (bool,),
    "params": (dict,),
    "pieces": (bool,),
    "strict_length": (bool,),
    "client": (str, type(None)),
    "tools": (list, type(None)),
    "follows": (str, type(None)),
}


_WIRE_NAMES = {dict: "map", list: "array", str: "string", bytes: "binary", bool: "boolean", int: "integer",
               float: "float", type(None): "nil"}


def _type_name(v: Any) -> str:
    return _WIRE_NAMES.get(type(v), type(v).__name__)


def decode_request(frame: bytes) -> Request:
    """Parse and validate one frame from a client; raises `ProtocolError`."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ERR_TOO_LARGE, f"message of {len(frame)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}",
                            request_id_of(frame))
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ERR_BAD_MESSAGE, f"not a msgpack message ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise ProtocolError(ERR_BAD_MESSAGE, f"a message must be a msgpack map, got {_type_name(msg)}")
    rid = msg.get("id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN else None
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ERR_BAD_VERSION, f"protocol version {version!r} is not supported; this daemon speaks "
                                             f"version {PROTOCOL_VERSION} (upgrade or restart the daemon)", rid)
    mtype = msg.get("type")
    cls = REQUEST_TYPES.get(mtype) if isinstance(mtype, str) else None
    if cls is None:
        raise ProtocolError(ERR_UNKNOWN_TYPE, f"unknown message type {mtype!r}; expected one of "
                                              f"{', '.join(REQUEST_TYPES)}", rid)
    if rid is None:
        raise ProtocolError(ERR_BAD_FIELD, f"field 'id' must be a non-empty string of at most {MAX_ID_LEN} "
                                           f"characters, got {msg.get('id')!r:.60}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in msg if k not in names and k not in ("v", "type"))
    if unknown:
        raise ProtocolError(ERR_BAD_FIELD, f"unknown field(s) for {mtype}: {', '.join(unknown)}", rid)
    kwargs: dict[str, Any] = {"id": rid}
    for name in names - {"id"}:
        if name not in msg:
            if name in ("prompt", "target"):
                raise ProtocolError(ERR_BAD_FIELD, f"{mtype} needs field '{name}'", rid)
            continue
        value = msg[name]
        allowed = _FIELD_TYPES[name]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            want = " or ".join(_WIRE_NAMES[t] for t in allowed)
            raise ProtocolError(ERR_BAD_FIELD, f"field '{name}' must be {want}, got {_type_name(value)}", rid)
        kwargs[name] = value
    req = cls(**kwargs)
    if isinstance(req, Generate):
        _check_generate(req)
    return req


def request_id_of(frame: bytes, max_keys: int = 64, window: int = 64 << 10) -> str | None:
    """The `id` of a message that cannot be decoded whole (too large, or failing later), read
    without building its other values (skipped in place), so the error names the request.
    None when no valid id comes among the first `max_keys` keys and `window` bytes (this
    module's encoders put it third). Never raises."""
    try:
        head = frame[:window]
        u = msgpack.Unpacker(raw=False, max_buffer_size=max(len(head), 1))
        u.feed(head)
        for _ in range(min(u.read_map_header(), max_keys)):
            key = u.unpack() if head[u.tell():u.tell() + 1] == b"\xa2" else None  # "id" is a 2-character string
            if key == "id":
                rid = u.unpack()
                return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN else None
            if key is None:
                u.skip()  # the key
            u.skip()  # its value
    except Exception:  # noqa: BLE001  (not msgpack, not a map, cut short: no id)
        return None
    return None


def _check_generate(g: Generate) -> None:
    if isinstance(g.prompt, str):
        if len(g.prompt) > MAX_PROMPT_CHARS:
            raise ProtocolError(ERR_TOO_LARGE, f"prompt of {len(g.prompt)} characters exceeds the limit of "
                                               f"{MAX_PROMPT_CHARS}", g.id)
    else:
        if len(g.prompt) > MAX_PROMPT_TOKENS:
            raise ProtocolError(ERR_TOO_LARGE, f"prompt of {len(g.prompt)} tokens exceeds the limit of "
                                               f"{MAX_PROMPT_TOKENS}", g.id)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in g.prompt):
            raise ProtocolError(ERR_BAD_FIELD, "field 'prompt' must be a string or an array of token ids "
                                               "(non-negative integers)", g.id)
    if g.mode not in PROMPT_MODES:
        raise ProtocolError(ERR_BAD_FIELD, f"field 'mode' must be one of {', '.join(PROMPT_MODES)}, "
                                           f"got {g.mode!r:.40}", g.id)
    if g.client is not None and len(g.client) > MAX_CLIENT_LEN:
        raise ProtocolError(ERR_BAD_FIELD, f"field 'client' must be at most {MAX_CLIENT_LEN} characters, got "
                                           f"{len(g.client)}", g.id)
    if not all(isinstance(k, str) for k in g.params):
        raise ProtocolError(ERR_BAD_FIELD, "field 'params' must be a map with string keys", g.id)


# ---------------------------------------------------------------------- replies
def pong(rid: str, **info: Any) -> dict[str, Any]:
    return _reply("pong", rid, **info)


def status_reply(rid: str, status: dict[str, Any]) -> dict[str, Any]:
    return _reply("status", rid, status=status)


def ok(rid: str, **info: Any) -> dict[str, Any]:
    return _reply("ok", rid, **info)


def delta(rid: str, text: str, token_ids: list[int], sources: list[str],
          pieces: list[str] | None = None, logprobs: list[dict[str, Any]] | None = None,
          prompt_logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    msg = _reply("delta", rid, text=text, token_ids=list(token_ids), sources=list(sources))
    if pieces is not None:
        msg["pieces"] = pieces
    if logprobs is not None:
        msg["logprobs"] = logprobs
    if prompt_logprobs is not None:
        msg["prompt_logprobs"] = prompt_logprobs
    return msg


def final(rid: str, finish_reason: str | None, error: str | None = None,
          metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    m = metrics or {}
    return _reply("final", rid, finish_reason=finish_reason, error=error, usage=m.get("usage"),
                  timings=m.get("timings"), spec=m.get("spec"), compiled=m.get("compiled"),
                  compiled_buckets=m.get("compiled_buckets"))


def output_messages(rid: str, out: Any, detok: Any = None) -> list[dict[str, Any]]:
    """One engine `RequestOutput` as what its client gets: a delta when it carries text or
    tokens or prompt logprobs (with display pieces when a detokenizer `detok` is given), then
    a final once the request finished."""
    msgs = []
    logprobs, prompt_logprobs = getattr(out, "logprobs", None), getattr(out, "prompt_logprobs", None)
    if out.text or out.token_ids or prompt_logprobs is not None:
        pieces = [detok.push(t) for t in out.token_ids] if detok is not None else None
        msgs.append(delta(rid, out.text, out.token_ids, out.sources, pieces, logprobs, prompt_logprobs))
    if out.finished:
        msgs.append(final(rid, out.finish_reason, out.error, out.metrics))
    return msgs


def error(rid: str | None, code: str, message: str) -> dict[str, Any]:
    return _reply("error", rid, code=code, message=message)


def _reply(mtype: str, rid: str | None, **body: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": mtype, "id": rid, **body}


# ---------------------------------------------------------------------- encoding
def to_wire(obj: Any, depth: int = 0) -> Any:
    """A msgpack-safe copy: tuples -> lists, numpy/torch scalars -> numbers, NaN -> nil, others -> str."""
    if depth > 32:
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_wire(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_wire(v, depth + 1) for v in obj]
    if isinstance(obj, PurePath):
        return str(obj)
    if getattr(obj, "ndim", None) == 0 and callable(getattr(obj, "item", None)):  # numpy / torch scalars
        try:
            return to_wire(obj.item(), depth + 1)
        except Exception:  # noqa: BLE001  (anything odd becomes text)
            pass
    return str(obj)


def encode(msg: dict[str, Any]) -> bytes:
    """One frame for `msg` (made msgpack-safe first)."""
    return msgpack.packb(to_wire(msg), use_bin_type=True)


def decode_reply(frame: bytes) -> dict[str, Any]:
    """Parse one frame from the daemon (client side); raises `ProtocolError` if it is not ours."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001
        raise ProtocolError(ERR_BAD_MESSAGE, f"the daemon sent a message that is not msgpack ({e})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError(ERR_BAD_MESSAGE, "the daemon sent a message without a type")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(ERR_BAD_VERSION, f"the daemon speaks protocol version {msg.get('v')!r}, this client "
                                             f"{PROTOCOL_VERSION}; restart the daemon with this dsv4")
    return msg

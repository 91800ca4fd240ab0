"""The chat page of `serve --http`: GET / and its script and style, plain files of this package.

The page is public, as llama-server's is: it is the same static text for everyone and holds
no secret, so GET /, /static/chat.js and /static/chat.css answer without the API key. What
it does goes through the API, under the API's rules: every call carries the key the user
types in (`Authorization: Bearer`, kept in the tab's sessionStorage) and is a 401 without
it, as any client's would be. The Host and Origin checks (`dsv4.http.guard`) wrap these
routes as they wrap every other: a page asked for under a foreign Host is a 400, a
cross-origin request for it a 403. Its Content-Security-Policy keeps it to this origin:
script and style from these files only, fetches to this server only, no framing.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

FILES = {  # URL path -> (file in this package, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def routes() -> list[Route]:
    """One GET (and HEAD) route per file, its bytes read once, here."""
    out = []
    for path, (name, media) in FILES.items():
        body = resources.files(__package__).joinpath(name).read_bytes()

        async def serve(request: Request, body: bytes = body, media: str = media) -> Response:
            return Response(body, media_type=media, headers=HEADERS)

        out.append(Route(path, serve, methods=["GET"]))
    return out

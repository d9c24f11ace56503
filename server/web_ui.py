"""The built-in chat page: GET / and its few static files under /web/.

    GET /                 index.html: a conversation view over /v1/chat/completions
    GET /web/<name>       chat.js, markdown.js, chat.css (a fixed list; nothing else
                          on disk is reachable through this route)

The files live in server/web/ inside the package (pyproject's package-data ships them
in the wheel): plain HTML, CSS and JavaScript, no build step and no CDN, so the page
works offline. `web_ui: false` (`--no-web-ui`) leaves the router out (create_app).

These routes carry no API-key check, unlike every other router: they hold nothing
but the page's own code, and a browser cannot send a bearer header when it loads a
page. The page asks for the key itself when GET /v1/models answers 401 and sends it
on each API call, so the API stays exactly as guarded as before. BrowserSafety still
applies (a rebound Host is refused before any route runs).

Every response carries a Content-Security-Policy that allows only the page's own
scripts and styles and connections to this origin: even if model text ever reached
the DOM as markup, no inline script or event handler in it would run. The page
never does that (markdown.js builds nodes with createElement and textContent).
"""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from .edge.errors import OpenAIError

WEB_DIR = Path(__file__).with_name("web")

ASSET_TYPES = {
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}
"""The files under /web/ and their media types: the only names that route serves."""

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate on each load: a restarted server's new page is never shadowed by
    # an old cached script.
    "Cache-Control": "no-cache",
}

web = APIRouter(include_in_schema=False)


@functools.lru_cache(maxsize=None)
def read_web_file(name: str) -> bytes:
    """The bytes of server/web/<name>, read once per process."""
    return (WEB_DIR / name).read_bytes()


def _file_response(name: str, media_type: str) -> Response:
    return Response(read_web_file(name), media_type=media_type, headers=SECURITY_HEADERS)


@web.get("/")
async def chat_page() -> Response:
    return _file_response("index.html", "text/html; charset=utf-8")


@web.get("/web/{name}")
async def web_asset(name: str) -> Response:
    media_type = ASSET_TYPES.get(name)
    if media_type is None:
        raise OpenAIError(f"No web file {name!r}.", status_code=404, code="not_found")
    return _file_response(name, media_type)

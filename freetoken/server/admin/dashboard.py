"""`GET /`: the dashboard, one static page shipped as package data (static/dashboard.html).

Owns reading the page (once, when the router is built) and the response: HTML, never cached by
the browser (a new version shows on reload), and a Content-Security-Policy that lets it load
nothing from elsewhere (no CDN, no external fonts: its script and styles are inline). The page
itself needs no API key; the JSON it reads (`/admin/activity`, `/v1/cache/status`) stays behind
the key, which the page asks for and sends as a Bearer header. It holds no state.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi.responses import HTMLResponse

DASHBOARD_PATH = "/"
PAGE = files("freetoken.server.admin").joinpath("static/dashboard.html")
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:",
}


def dashboard_page() -> str:
    return PAGE.read_text(encoding="utf-8")


def dashboard_response(page: str) -> HTMLResponse:
    return HTMLResponse(page, headers=HEADERS)

"""The public-API service of sdk_app.py with the user's own middleware (CORS) added by its
factory, as a user whose dashboard polls the service from a browser does."""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware

from tests.children.sdk_app import create_app as _create_tint_app


def create_app(settings: dict):
    app = _create_tint_app(settings)
    app.add_middleware(CORSMiddleware, allow_origins=["*"])
    return app

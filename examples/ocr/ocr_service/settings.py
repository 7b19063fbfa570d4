"""The OCR service's settings: onecard's, plus the engine's own keys. Pydantic only (no model
import), so that ``onecard check`` validates the section before anything starts."""

from __future__ import annotations

from pydantic import Field

import onecard


class OcrSettings(onecard.Settings):
    max_side: int = Field(2000, ge=64, le=8192, description="a picture's long side is scaled to this at most")
    detect_side: int = Field(736, ge=32, le=4096, description="the text detector's working size (short side)")
    rotated_text: bool = Field(True, description="find text turned upside down (the angle classifier)")


SERVICE_SETTINGS = OcrSettings

"""Pictures and masks prepared the way the AUTOMATIC1111 webui prepares them for img2img.

The resize modes (0 stretch, 1 crop and resize, 2 resize and fill; 3, a latent upscale
there, is a stretch here), the mask (luminance, inverted, Gaussian-blurred along each
axis), the region that "only masked" inpainting (``inpaint_full_res``) generates at full
resolution, what fills the masked area before generation (``inpainting_fill``), and the
overlay that puts the original picture back wherever the mask is black, pixel for pixel.
All of it is CPU work for the decode and encode hooks.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from services.img2img.webui_infotext import png_without_chunks

FILL, ORIGINAL, LATENT_NOISE, LATENT_NOTHING = 0, 1, 2, 3


def resize_image(img: Image.Image, size: tuple[int, int], mode: int) -> Image.Image:
    """The webui's resize modes; mode 2 stretches the picture's edge rows or columns into the bars."""
    if img.size == size:
        return img
    if mode == 1:
        return ImageOps.fit(img, size, Image.LANCZOS)
    if mode != 2:
        return img.resize(size, Image.LANCZOS)
    width, height = size
    ratio = min(width / img.width, height / img.height)  # ImageOps.contain, but never 0 px on a side
    inner = img.resize((min(width, max(1, round(img.width * ratio))), min(height, max(1, round(img.height * ratio)))),
                       Image.LANCZOS)
    canvas = Image.new(img.mode, size)
    x0, y0 = (width - inner.width) // 2, (height - inner.height) // 2
    canvas.paste(inner, (x0, y0))
    if inner.width < width:
        if x0 > 0:
            canvas.paste(inner.crop((0, 0, 1, inner.height)).resize((x0, inner.height)), (0, y0))
        right = width - x0 - inner.width
        if right > 0:
            edge = inner.crop((inner.width - 1, 0, inner.width, inner.height)).resize((right, inner.height))
            canvas.paste(edge, (x0 + inner.width, y0))
    elif inner.height < height:
        if y0 > 0:
            canvas.paste(inner.crop((0, 0, inner.width, 1)).resize((inner.width, y0)), (x0, 0))
        bottom = height - y0 - inner.height
        if bottom > 0:
            edge = inner.crop((0, inner.height - 1, inner.width, inner.height)).resize((inner.width, bottom))
            canvas.paste(edge, (x0, y0 + inner.height))
    return canvas


def mask_channel(data: bytes, rgb: np.ndarray) -> Image.Image:
    """The webui's reading of a mask: an RGBA picture with any transparency is its alpha,
    rounded at 128 (masks painted in its UI); anything else its luminance. `data` was
    already decoded within the limits (as `rgb`, which drops alpha): only a PNG or WebP
    that has an alpha channel is opened a second time, a PNG without its compressed chunks
    (Pillow would inflate them: up to 64 MB of text, and more raised a ValueError, a 500)."""
    if data[:4] in (b"\x89PNG", b"RIFF"):
        pixels_only = png_without_chunks(data)
        with Image.open(io.BytesIO(pixels_only), formats=("PNG", "WEBP")) as im:
            if im.mode == "RGBA":
                alpha = ImageOps.exif_transpose(im).getchannel("A")
                if alpha.getextrema() != (255, 255):
                    return alpha.point(lambda v: 255 if v > 128 else 0)
    return Image.fromarray(rgb).convert("L")


def prepare_mask(mask: Image.Image, invert: bool, blur_x: int, blur_y: int) -> Image.Image:
    """White = repaint. Blurred as the webui blurs (sigma = the blur, each axis on its own)."""
    import cv2
    mask = np.asarray(mask.convert("L"))
    if invert:
        mask = 255 - mask
    if blur_x > 0:
        mask = cv2.GaussianBlur(mask, (2 * int(2.5 * blur_x + 0.5) + 1, 1), blur_x)
    if blur_y > 0:
        mask = cv2.GaussianBlur(mask, (1, 2 * int(2.5 * blur_y + 0.5) + 1), blur_y)
    return Image.fromarray(np.ascontiguousarray(mask))


def doubled(mask: Image.Image) -> Image.Image:
    """The overlay mask of whole-picture inpainting: a blurred edge reaches full strength halfway."""
    return mask.point(lambda v: min(255, 2 * v))


def crop_region(mask: Image.Image, padding: int, size: tuple[int, int]) -> tuple[int, int, int, int] | None:
    """Only-masked inpainting: the masked box plus padding, widened to the aspect ratio of
    `size` (the generation size) inside the picture; None for an empty mask."""
    box = mask.getbbox()
    if box is None:
        return None
    w, h = mask.size
    x1, y1, x2, y2 = max(box[0] - padding, 0), max(box[1] - padding, 0), min(box[2] + padding, w), \
        min(box[3] + padding, h)
    ratio = size[0] / size[1]
    if (x2 - x1) / (y2 - y1) > ratio:
        y1, y2 = _widen(y1, y2, int((x2 - x1) / ratio - (y2 - y1)), h)
    else:
        x1, x2 = _widen(x1, x2, int((y2 - y1) * ratio - (x2 - x1)), w)
    return x1, y1, x2, y2


def _widen(lo: int, hi: int, grow: int, limit: int) -> tuple[int, int]:
    """Grow [lo, hi) by `grow`, centred, shifted back inside [0, limit)."""
    lo, hi = lo - grow // 2, hi + grow - grow // 2
    if hi > limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, min(hi - lo, limit)
    return lo, hi


def fill_masked(img: Image.Image, mask: Image.Image, how: int, seed: int = 0) -> Image.Image:
    """What the generation starts from under the mask. `FILL`: the colours around it, spread
    in from coarse to fine; `LATENT_NOISE` and `LATENT_NOTHING` (noise and zero in the
    webui's latent space) are approximated in pixels by noise and mid-grey."""
    if how == ORIGINAL:
        return img
    if how == LATENT_NOISE:
        noise = np.random.default_rng(seed).integers(0, 256, (img.height, img.width, 3), dtype=np.uint8)
        return Image.composite(Image.fromarray(noise), img, mask)
    if how == LATENT_NOTHING:
        return Image.composite(Image.new("RGB", img.size, (128, 128, 128)), img, mask)
    from PIL import ImageFilter
    known = img.convert("RGBA")
    known.putalpha(ImageOps.invert(mask))
    known = known.convert("RGBa")  # premultiplied: blurring spreads colour only where it is known
    out = Image.new("RGBA", img.size)
    for radius, repeats in ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1)):
        layer = (known.filter(ImageFilter.GaussianBlur(radius)) if radius else known).convert("RGBA")
        for _ in range(repeats):
            out.alpha_composite(layer)
    return Image.composite(out.convert("RGB"), img, mask)


@dataclass
class Overlay:
    """The original picture at the answer's size, and where the generated one shows (white)."""
    base: Image.Image                         # RGB, the answer's size
    mask: Image.Image                         # L, same size
    box: tuple[int, int, int, int] | None = None  # only-masked: where the generated crop goes

    def apply(self, generated: Image.Image) -> Image.Image:
        if self.box is not None:
            x1, y1, x2, y2 = self.box
            canvas = self.base.copy()
            canvas.paste(ImageOps.fit(generated, (x2 - x1, y2 - y1), Image.LANCZOS), (x1, y1))
            generated = canvas
        elif generated.size != self.base.size:
            generated = generated.resize(self.base.size, Image.LANCZOS)
        return Image.composite(generated, self.base, self.mask)

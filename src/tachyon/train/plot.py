"""A PNG plot of a training run (loss and throughput over steps) with no plotting library.

matplotlib and numpy are not dependencies of tachyon, so this module rasterizes the chart itself
into an RGB byte buffer (lines with Bresenham's algorithm, text from an embedded 5x7 bitmap font)
and encodes it as a PNG with zlib and struct::

    plot_training(path, steps=[1, 2, ...], loss=[5.6, 5.1, ...], tokens_per_s=[9800.0, ...])
    width, height, rows = read_png(path)     # decode it back (only what write_png writes)

Two panels, one above the other: loss vs step (each step's loss in a light colour, an exponential
moving average over it in a dark one) and tokens/s vs step. Each panel has axes, "nice" ticks
with numeric labels (1-2-5 steps; 12.3k, 1.5M style) and a title.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Canvas", "nice_ticks", "plot_training", "read_png", "write_png"]

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
LIGHT_BLUE: Color = (160, 190, 230)
BLUE: Color = (20, 70, 170)
GREEN: Color = (20, 130, 60)

# 5x7 glyphs, one string per row, '#' = ink. Only the characters the plot writes.
_FONT: dict[str, tuple[str, ...]] = {
    "0": (" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "),
    "1": ("  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "),
    "2": (" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"),
    "3": ("#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "),
    "4": ("   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "),
    "5": ("#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "),
    "6": ("  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "),
    "7": ("#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "),
    "8": (" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "),
    "9": (" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "),
    ".": ("     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "),
    "-": ("     ", "     ", "     ", "#####", "     ", "     ", "     "),
    "+": ("     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "),
    "/": ("    #", "    #", "   # ", "  #  ", " #   ", "#    ", "#    "),
    "(": ("   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "),
    ")": (" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "),
    ":": ("     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "),
    " ": ("     ",) * 7,
    "a": ("     ", "     ", " ### ", "    #", " ####", "#   #", " ####"),
    "b": ("#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#### "),
    "c": ("     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### "),
    "d": ("    #", "    #", " ## #", "#  ##", "#   #", "#   #", " ####"),
    "e": ("     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "),
    "f": ("  ## ", " #  #", " #   ", "###  ", " #   ", " #   ", " #   "),
    "g": ("     ", " ####", "#   #", "#   #", " ####", "    #", " ### "),
    "h": ("#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#   #"),
    "i": ("  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "),
    "k": ("#    ", "#    ", "#  # ", "# #  ", "##   ", "# #  ", "#  # "),
    "l": (" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "),
    "m": ("     ", "     ", "## # ", "# # #", "# # #", "#   #", "#   #"),
    "n": ("     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"),
    "o": ("     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "),
    "p": ("     ", "     ", "#### ", "#   #", "#### ", "#    ", "#    "),
    "r": ("     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "),
    "s": ("     ", "     ", " ####", "#    ", " ### ", "    #", "#### "),
    "t": (" #   ", " #   ", "###  ", " #   ", " #   ", " #  #", "  ## "),
    "u": ("     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #"),
    "v": ("     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  "),
    "w": ("     ", "     ", "#   #", "#   #", "# # #", "# # #", " # # "),
    "x": ("     ", "     ", "#   #", " # # ", "  #  ", " # # ", "#   #"),
    "y": ("     ", "     ", "#   #", "#   #", " ####", "    #", " ### "),
    "z": ("     ", "     ", "#####", "   # ", "  #  ", " #   ", "#####"),
    "=": ("     ", "     ", "#####", "     ", "#####", "     ", "     "),
    ",": ("     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "),
    "_": ("     ", "     ", "     ", "     ", "     ", "     ", "#####"),
    "E": ("#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"),
    "M": ("#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"),
}
GLYPH_W, GLYPH_H = 5, 7


class Canvas:
    """An RGB image in memory: ``pixels`` is a bytearray of ``width * height * 3`` bytes, row-major."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"width and height must be >= 1; got {width}x{height}")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def hline(self, x0: int, x1: int, y: int, color: Color) -> None:
        for x in range(min(x0, x1), max(x0, x1) + 1):
            self.set(x, y, color)

    def vline(self, x: int, y0: int, y1: int, color: Color) -> None:
        for y in range(min(y0, y1), max(y0, y1) + 1):
            self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thick: bool = False) -> None:
        """Bresenham's line; ``thick`` also inks the pixel below each point (2 px wide)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.set(x0, y0, color)
            if thick:
                self.set(x0, y0 + 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 1) -> None:
        """Draw ``text`` with its top-left corner at (x, y); unknown characters draw as blanks."""
        for char in text:
            glyph = _FONT.get(char, _FONT[" "])
            for gy, row in enumerate(glyph):
                for gx, ink in enumerate(row):
                    if ink == "#":
                        for px in range(scale):
                            for py in range(scale):
                                self.set(x + gx * scale + px, y + gy * scale + py, color)
            x += (GLYPH_W + 1) * scale


def text_width(text: str, scale: int = 1) -> int:
    return len(text) * (GLYPH_W + 1) * scale - scale


def write_png(path: str | Path, canvas: Canvas) -> None:
    """Encode ``canvas`` as an 8-bit RGB PNG (no interlace, filter 0 on every row)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    stride = 3 * canvas.width
    raw = b"".join(b"\x00" + bytes(canvas.pixels[y * stride:(y + 1) * stride]) for y in range(canvas.height))
    header = struct.pack(">IIBBBBB", canvas.width, canvas.height, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))
    Path(path).write_bytes(data)


def read_png(path: str | Path) -> tuple[int, int, list[bytes]]:
    """Decode a PNG written by :func:`write_png`: (width, height, one ``bytes`` of RGB per row).

    Checks the signature, every chunk's CRC and the IHDR (8-bit RGB, no interlace) and raises
    ValueError naming what is wrong; only filter type 0 rows are accepted."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG (bad signature)")
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: chunk {kind!r} has a bad CRC")
        chunks.append((kind, body))
        pos += 12 + length
    if not chunks or chunks[0][0] != b"IHDR" or chunks[-1][0] != b"IEND":
        raise ValueError(f"{path}: chunks must start with IHDR and end with IEND")
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    if (depth, color_type, interlace) != (8, 2, 0):
        raise ValueError(f"{path}: expected 8-bit RGB without interlace; got depth {depth}, "
                         f"color type {color_type}, interlace {interlace}")
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 3 * width + 1
    if len(raw) != stride * height:
        raise ValueError(f"{path}: image data holds {len(raw)} bytes; expected {stride * height}")
    rows = []
    for y in range(height):
        row = raw[y * stride:(y + 1) * stride]
        if row[0] != 0:
            raise ValueError(f"{path}: row {y} uses filter {row[0]}; only filter 0 is supported")
        rows.append(row[1:])
    return width, height, rows


# --------------------------------------------------------------------------- charts


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"tick range must be finite; got [{low}, {high}]")
    if high < low:
        low, high = high, low
    if high == low:
        high = low + (abs(low) * 0.1 or 1.0)
    raw_step = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw_step)
    first = math.floor(low / step) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def format_tick(value: float) -> str:
    """Short label: 12, 2.5, 0.05, 12.5k, 1.2M."""
    magnitude = abs(value)
    if magnitude >= 1e6:
        return f"{value / 1e6:.3g}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.3g}k"
    if magnitude >= 1 or value == 0:
        return f"{value:.4g}"
    return f"{value:.2g}"


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` finite values at each position (NaN where the value is not finite)."""
    out, recent = [], []
    for value in values:
        if not math.isfinite(value):
            out.append(math.nan)
            continue
        recent.append(value)
        if len(recent) > window:
            recent.pop(0)
        out.append(sum(recent) / len(recent))
    return out


def _panel(canvas: Canvas, box: tuple[int, int, int, int], title: str, subtitle: str, xs: Sequence[float],
           series: Sequence[tuple[Sequence[float], Color, bool]]) -> None:
    """One chart in ``box`` = (left, top, right, bottom) pixels: title, axes, ticks, series."""
    left, top, right, bottom = box
    plot_left, plot_top, plot_right, plot_bottom = left + 62, top + 24, right - 14, bottom - 28
    canvas.text(plot_left, top + 4, title, BLACK, scale=2)
    canvas.text(plot_left + text_width(title, 2) + 14, top + 11, subtitle, BLACK)
    finite = [v for values, _, _ in series for v in values if math.isfinite(v)]
    x_ticks = nice_ticks(min(xs), max(xs), 8)
    y_ticks = nice_ticks(min(finite), max(finite), 5) if finite else [0.0, 1.0]
    x_lo, x_hi, y_lo, y_hi = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def px(x: float) -> int:
        return plot_left + round((x - x_lo) / (x_hi - x_lo) * (plot_right - plot_left))

    def py(y: float) -> int:
        return plot_bottom - round((y - y_lo) / (y_hi - y_lo) * (plot_bottom - plot_top))

    for tick in y_ticks:
        y = py(tick)
        canvas.hline(plot_left + 1, plot_right, y, GRID)
        canvas.hline(plot_left - 4, plot_left, y, BLACK)
        label = format_tick(tick)
        canvas.text(plot_left - 7 - text_width(label), y - GLYPH_H // 2, label)
    for tick in x_ticks:
        x = px(tick)
        canvas.vline(x, plot_top, plot_bottom - 1, GRID)
        canvas.vline(x, plot_bottom, plot_bottom + 4, BLACK)
        label = format_tick(tick)
        canvas.text(x - text_width(label) // 2, plot_bottom + 8, label)
    canvas.text(plot_right - text_width("step"), plot_bottom + 19, "step")
    canvas.vline(plot_left, plot_top, plot_bottom, BLACK)
    canvas.hline(plot_left, plot_right, plot_bottom, BLACK)
    for values, color, thick in series:
        previous = None
        for x, y in zip(xs, values):
            if not math.isfinite(y):
                previous = None
                continue
            point = (px(x), py(y))
            if previous is None:
                canvas.set(*point, color)
            else:
                canvas.line(*previous, *point, color, thick)
            previous = point


def plot_training(path: str | Path, steps: Sequence[int], loss: Sequence[float], tokens_per_s: Sequence[float],
                  *, title: str = "", width: int = 720, height: int = 560) -> None:
    """Write a two-panel PNG: loss vs step (raw and smoothed) and tokens/s vs step.

    ``steps``, ``loss`` and ``tokens_per_s`` are equally long (one entry per step); non-finite
    values are skipped (gaps in the line). ``title`` is written above the loss panel."""
    if not (len(steps) == len(loss) == len(tokens_per_s)) or not steps:
        raise ValueError(f"steps, loss and tokens_per_s must be non-empty and equally long; got "
                         f"{len(steps)}, {len(loss)}, {len(tokens_per_s)}")
    if width < 200 or height < 200:
        raise ValueError(f"width and height must be >= 200; got {width}x{height}")
    canvas = Canvas(width, height)
    half = height // 2
    window = max(1, len(loss) // 25)
    smooth = moving_average(loss, window)
    subtitle = (f"{title}  " if title else "") + (f"(line: mean of {window} steps)" if window > 1 else "")
    _panel(canvas, (0, 0, width, half), "loss", subtitle, steps, [(loss, LIGHT_BLUE, False), (smooth, BLUE, True)])
    _panel(canvas, (0, half, width, height), "tokens/s", "", steps, [(tokens_per_s, GREEN, True)])
    write_png(path, canvas)

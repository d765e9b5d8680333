"""A small line-chart PNG writer (numpy + zlib), so the demo can draw its loss curves
without pulling in a plotting library for one picture."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

# 3x5 bitmap glyphs, rows top to bottom, 3 bits per row.
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    " ": "000000000000000", "a": "000111101111101", "b": "100110101101110", "c": "000111100100111",
    "d": "001011101101011", "e": "111100111100111", "g": "111100101101111", "i": "010000010010010",
    "k": "100101110101101", "l": "010010010010010", "n": "000110101101101", "o": "000111101101111",
    "p": "111101111100100", "r": "000111100100100", "s": "111100111001111", "t": "010111010010010",
    "u": "000101101101111", "v": "000101101101010", "w": "000101101111111", "x": "000101010101101",
    "y": "101101111001111", "/": "001001010100100", "=": "000111000111000", ":": "000010000010000",
    "f": "011100110100100", "h": "100100111101101", "m": "000111111101101", "q": "111101111001001",
    "j": "001000001101010", "z": "111001010100111", "%": "101001010100101", "+": "000010111010000",
    ",": "000000000010100", "(": "010100100100010", ")": "010001001001010",
}
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


def _text(img: np.ndarray, x: int, y: int, text: str, color, scale: int = 2) -> None:
    for ch in text.lower():
        g = _GLYPHS.get(ch, _GLYPHS[" "])
        for r in range(5):
            for c in range(3):
                if g[r * 3 + c] == "1":
                    img[y + r * scale:y + (r + 1) * scale, x + c * scale:x + (c + 1) * scale] = color
        x += 4 * scale


def _line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color, width: int = 2) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for t in np.linspace(0, 1, n):
        x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
        img[max(0, y - width // 2):y + width - width // 2, max(0, x - width // 2):x + width - width // 2] = color


def line_chart(series: dict[str, list[tuple[float, float]]], path: Path, title: str = "",
               width: int = 720, height: int = 420) -> Path:
    """Draw each named series of (x, y) points; writes an RGB PNG to `path`."""
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 70, 20, 40, 50
    pts = [p for s in series.values() for p in s if np.isfinite(p[1])]
    if not pts:
        pts = [(0.0, 0.0), (1.0, 1.0)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = (max(ys) - min(ys)) * 0.05 or 0.5
    y_lo, y_hi = min(ys) - pad, max(ys) + pad

    def to_px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (width - left - right),
                top + (y_hi - y) / (y_hi - y_lo) * (height - top - bottom))

    grey = (200, 200, 200)
    for i in range(5):
        yv = y_lo + (y_hi - y_lo) * i / 4
        _, py = to_px(x_lo, yv)
        _line(img, left, py, width - right, py, grey, 1)
        _text(img, 5, int(py) - 5, f"{yv:.2f}", (80, 80, 80))
    for i in range(5):
        xv = x_lo + (x_hi - x_lo) * i / 4
        px, _ = to_px(xv, y_lo)
        _text(img, int(px) - 8, height - bottom + 10, f"{xv:.0f}" if x_hi - x_lo >= 4 else f"{xv:.1f}", (80, 80, 80))
    _line(img, left, top, left, height - bottom, (0, 0, 0), 1)
    _line(img, left, height - bottom, width - right, height - bottom, (0, 0, 0), 1)
    for k, (name, s) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        s = [p for p in s if np.isfinite(p[1])]
        for a, b in zip(s, s[1:]):
            _line(img, *to_px(*a), *to_px(*b), color)
        for p in s:
            px, py = to_px(*p)
            img[int(py) - 3:int(py) + 3, int(px) - 3:int(px) + 3] = color
        _text(img, left + 10 + 170 * k, 12, name, color)
    if title:
        _text(img, left, height - 18, title, (0, 0, 0))
    return write_png(img, path)


def write_png(img: np.ndarray, path: Path) -> Path:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    path = Path(path)
    path.write_bytes(png)
    return path

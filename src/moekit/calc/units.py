"""How the calculator writes numbers: exact integers with separators for checkable steps, and
short human forms (B params, GiB, GB/s, ms) for summaries. GiB = 2^30 bytes for memory sizes;
bandwidth in GB/s = 10^9 bytes/s, as vendors quote it."""

from __future__ import annotations

GIB = 1024**3


def n(value: float) -> str:
    """An exact count: 46,702,792,704."""
    return f"{round(value):,}"


def params(value: float) -> str:
    """A parameter count at a glance: 46.70B, 13.0M."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:,.2f}{suffix}"
    return f"{value:,.0f}"


def gib(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def nbytes(value: float) -> str:
    """Bytes in the unit that reads best: B, KiB, MiB or GiB."""
    for scale, suffix in ((GIB, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {suffix}"
    return f"{value:,.0f} B"


def pct(share: float) -> str:
    return f"{share * 100:.2f}%"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.3f} ms"


def bits(value) -> str:
    """Bits per weight: 16, 4.125."""
    return f"{float(value):g}"


def bandwidth(value: float) -> str:
    return f"{value / 1e9:,.1f} GB/s"


def rate(value: float, unit: str) -> str:
    """10^9-scaled rates: GB/s, TFLOP/s."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:,.1f} {prefix}{unit}"
    return f"{value:,.1f} {unit}"

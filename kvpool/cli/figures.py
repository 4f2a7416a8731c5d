"""Numbers as people read them in a terminal: sizes, durations, significant figures, SI prefixes."""


def size(n: int) -> str:
    """Bytes as MiB below a GiB, else GiB: 12.5 MiB, 2.00 GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def short_size(n: int) -> str:
    """Bytes in at most four characters and a binary unit letter: 0B, 512K, 64M, 1.5G."""
    value, unit = float(n), "B"
    for unit in "BKMGT":
        if value < 1000 or unit == "T":
            break
        value /= 1024
    return f"{value:.0f}{unit}" if value >= 10 or unit == "B" else f"{value:.1f}{unit}"


def short_duration(seconds: float) -> str:
    """45s, 12m, 5h, 3d (a unit once there are two of it)."""
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * length:
            return f"{seconds // length:.0f}{unit}"
    return f"{seconds:.0f}s"


def fig(x: float) -> str:
    """Three significant figures, or two decimals from 1 up: 11.47, 5.37, 0.767, 0.0123."""
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def si(x: float, unit: str) -> str:
    """Three significant figures with an SI prefix: 4.59 PFLOP, 400 TFLOPS."""
    prefixes = ("", "k", "M", "G", "T", "P", "E")
    i = 0
    while x >= 1000 and i < len(prefixes) - 1:
        x, i = x / 1000, i + 1
    return f"{x:.3g} {prefixes[i]}{unit}"

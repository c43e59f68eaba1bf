"""`--plot PNG`: bus bandwidth against size, log-log, one line per library (shmcoll, then each peer).

matplotlib is optional: without it the plot is not drawn and the caller gets a one-line message
instead (the sweep's numbers are printed and saved either way). Used by shmcoll-bench and by
bench/compare.py.
"""

from __future__ import annotations

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def human(size: int) -> str:
    """8 -> '8 B', 65536 -> '64 KiB', 1 << 20 -> '1 MiB' (exact binary units only)."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} B"


def series(rows: list[dict]) -> list[tuple[int, float]]:
    """(size, busbw) points that a log-log plot can show: sorted, positive busbw only."""
    return sorted((r["size"], r["busbw"]) for r in rows if r.get("busbw") and r["busbw"] > 0 and r["size"] > 0)


def plot(path: str, lines: dict[str, list[dict]], title: str, xlabel: str) -> tuple[bool, str]:
    """Draw busbw (GB/s) against size for each name -> rows; (written?, a one-line message)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError as e:
        return False, f"--plot {path} not written: matplotlib is not installed ({e}; pip install matplotlib)"
    drawn = {name: pts for name, pts in ((n, series(rows)) for n, rows in lines.items()) if pts}
    if not drawn:
        return False, f"--plot {path} not written: no size with a bus bandwidth to draw"
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for name, pts in drawn.items():
            ax.loglog([s for s, _ in pts], [b for _, b in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(int(round(x)))))
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.4)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return True, f"plot written to {path}"

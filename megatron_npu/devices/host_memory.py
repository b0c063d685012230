"""Process memory figures from /proc, used as the CPU's answer to torch.cuda memory queries."""

from __future__ import annotations

import os


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """Resident set size of this process."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """High-water mark of the resident set since start or the last :func:`reset_peak`."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> None:
    """Reset the kernel's resident high-water mark (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        pass


def total_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0

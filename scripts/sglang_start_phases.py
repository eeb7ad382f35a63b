"""Where an SGLang start's seconds go, read from the servers' own logs.

    python scripts/sglang_start_phases.py DIR [DIR ...]

Finds every ``engine-*.log`` under the folders (the logs ``engines.sglang.log_dir``
collects; a restarted engine appends to its file) and prints, for each start, the
seconds from its ``server_args`` line (imports done) to each milestone SGLang logs,
up to "fired up". The imports before that line are the rest of the engine's
"SGLang ready in" figure (the engine actor's log).
"""

from __future__ import annotations

import re
import sys
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
MILESTONES = [
    ("init dist", "Init torch distributed begin"),
    ("load begin", "Load weight begin"),
    ("load end", "Load weight end"),
    ("kv alloc", "KV Cache is allocated"),
    ("pool end", "Memory pool end"),
    ("graph begin", "Capture cuda graph begin"),
    ("graph end", "Capture cuda graph end"),
    ("uvicorn", "Uvicorn running"),
    ("fired up", "fired up and ready"),
]


def starts(text: str) -> list[list[tuple[datetime, str]]]:
    """The log's timestamped lines, cut into one list per start (each begins at its
    ``server_args`` line; the warnings logged before it are left out)."""
    out: list[list[tuple[datetime, str]]] = []
    for line in text.splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        if "server_args=" in line:
            out.append([])
        if out:
            out[-1].append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"), line))
    return out


def phases(lines: list[tuple[datetime, str]]) -> str:
    t0 = lines[0][0]
    seen = []
    for label, needle in MILESTONES:
        hit = next((at for at, line in lines if needle in line), None)
        if hit is not None:
            seen.append(f"{label} {(hit - t0).total_seconds():.0f}s")
    return ", ".join(seen)


def main(dirs: list[str]) -> None:
    for d in dirs:
        for log in sorted(Path(d).rglob("engine-*.log")):
            for i, lines in enumerate(starts(log.read_text(errors="replace"))):
                print(f"{log} start {i + 1}: {phases(lines)}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Looking at processes from a test: alive or not, and what a supervisor started (read from /proc)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its parent or init to reap it counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def descendants(root: int) -> set[int]:
    """Every process below ``root``: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def commands(pids: set[int]) -> str:
    """``pid: command line`` of each of ``pids`` still there, one a line (for assertion messages)."""
    out = []
    for pid in sorted(pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        out.append(f"{pid}: {cmdline[:120]}")
    return "\n".join(out)

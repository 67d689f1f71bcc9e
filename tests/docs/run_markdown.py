"""Turn a Markdown page into the shell script its code blocks describe, so that docs are tests.

In document order: a block whose info string has ``file=NAME`` is appended to that file; a ``bash`` block
is run as is; a ``python`` block without ``file=`` is run with ``python -``. Any other block (output shown
to the reader) is skipped. One script, one shell: variables and background processes carry over.
"""

from __future__ import annotations

import re
from pathlib import Path

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```\s*$", re.S | re.M)
EOF_MARK = "AGENTRL_DOC_EOF"


def blocks(markdown: str) -> list[tuple[str, dict[str, str], str]]:
    """(language, attributes, body) of every fenced block."""
    out = []
    for match in FENCE.finditer(markdown):
        info, body = match.group(1).split(), match.group(2)
        lang = info[0] if info else ""
        attrs = dict(part.split("=", 1) for part in info[1:] if "=" in part)
        out.append((lang, attrs, body))
    return out


def to_script(markdown: str) -> tuple[str, int]:
    """(bash script, number of blocks it runs or writes)."""
    lines = ["set -euo pipefail"]
    used = 0
    for lang, attrs, body in blocks(markdown):
        if EOF_MARK in body:
            raise ValueError(f"a code block contains {EOF_MARK}")
        if "file" in attrs:
            lines.append(f"cat >> {attrs['file']} <<'{EOF_MARK}'\n{body}{EOF_MARK}")
        elif lang == "bash":
            lines.append(body)
        elif lang == "python":
            lines.append(f"python - <<'{EOF_MARK}'\n{body}{EOF_MARK}")
        else:
            continue
        used += 1
    return "\n".join(lines) + "\n", used


def script_of(path: Path) -> tuple[str, int]:
    return to_script(path.read_text())

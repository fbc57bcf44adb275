"""cam_jit's documentation shipped with the package: the numerical and interface contract
(``docs/semantics.md``; ``cam_jit/_docs/semantics.md`` in an installed wheel).

``python -m cam_jit docs [SECTION]`` prints it. Imports nothing heavy (no torch).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

_PACKAGE_DIR = Path(__file__).resolve().parent
SEMANTICS = "semantics.md"


def docs_dir() -> Path:
    """``cam_jit/_docs`` in an installed wheel, else ``<repo>/docs``."""
    installed = _PACKAGE_DIR / "_docs"
    return installed if installed.is_dir() else _PACKAGE_DIR.parent / "docs"


def semantics_path() -> Path:
    """The path of ``semantics.md``, the contract every backend implements."""
    return docs_dir() / SEMANTICS


def _heading(line: str) -> Optional[re.Match]:
    return re.match(r"^(#{2,4}) (\d+(?:\.\d+)*)\.? ", line)


def sections() -> List[str]:
    """The section numbers of ``semantics.md``, in order (``"0"``, ``"0.1"``, ...)."""
    return [m.group(2) for m in map(_heading, semantics_path().read_text().splitlines()) if m]


def semantics(section: Optional[str] = None) -> str:
    """The text of ``semantics.md``, or of one numbered section (``"1.8"``, ``"§1.8"``, ``"3"``)
    with its subsections. Raises ``KeyError`` naming the known sections for an unknown one."""
    text = semantics_path().read_text()
    if section is None:
        return text
    wanted = section.strip().lstrip("§").rstrip(".")
    lines = text.splitlines()
    start = level = None
    for i, line in enumerate(lines):
        m = _heading(line)
        if m is None:
            continue
        if start is None and m.group(2) == wanted:
            start, level = i, len(m.group(1))
        elif start is not None and len(m.group(1)) <= level:
            return "\n".join(lines[start:i]).rstrip() + "\n"
    if start is None:
        raise KeyError(f"no section {section!r} in {semantics_path()}; sections: {', '.join(sections())}")
    return "\n".join(lines[start:]).rstrip() + "\n"

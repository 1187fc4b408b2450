"""Checks that an environment holds exactly the versions a constraints file pins.

    python .ci/check_floors.py constraints-floors.txt

For each ``name==version`` line: the installed distribution has that version (a local
label such as ``+cpu`` aside), and its module imports. The tests of the optional
frameworks skip themselves when an import fails, so a broken install would otherwise pass
as a run with fewer tests. Exits 1 with one line per problem.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

#: The module a distribution is imported as, where it is not the name with "_" for "-".
MODULES = {"tensorflow-cpu": "tensorflow", "lightning": "lightning.pytorch"}


def pins(path: Path) -> dict[str, str]:
    """The ``name==version`` lines of a constraints file, comments and blanks left out."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9._-]+)\s*==\s*([^\s;]+)", line)
            if match is None:
                raise SystemExit(f"{path}: not a name==version pin: {line!r}")
            found[match[1].lower()] = match[2]
    return found


def problems(pinned: dict[str, str]) -> list[str]:
    found = []
    for name, wanted in pinned.items():
        try:
            got = version(name)
        except PackageNotFoundError:
            found.append(f"{name}: not installed (pinned {wanted})")
            continue
        if got.split("+", 1)[0] != wanted:
            found.append(f"{name}: {got} installed, {wanted} pinned")
            continue
        module = MODULES.get(name, name.replace("-", "_"))
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure to import is what this check is for
            found.append(f"{name}: import {module} failed: {type(exc).__name__}: {exc}")
        else:
            print(f"{name}=={got}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    found = problems(pins(Path(argv[0])))
    for line in found:
        print(f"check_floors: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

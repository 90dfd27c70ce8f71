"""Check the sdist and the wheel in a folder against the source tree and list the configs each carries.

Both must hold every file of the package (its modules and its packaged configs, `moonep_moe/configs/*.yaml`):
the wheel is what users install, the sdist what the wheel is built from. At their top level the wheel holds
only the package and its metadata, the sdist only `SDIST_TOP`; the sdist holds no links (the repository's
root `configs` is a link to the package's configs folder and must not travel).

Usage: python .ci/dist_contents.py DIST_FOLDER
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "moonep_moe"
SDIST_TOP = {"PKG-INFO", "README.md", "MANIFEST.in", "pyproject.toml", "setup.cfg", PACKAGE,
             f"{PACKAGE}.egg-info"}
"""What the sdist holds at its top level (MANIFEST.in says why the tests are not there)."""


def package_files() -> set[str]:
    """Every file of the package in the source tree, as `moonep_moe/...` (compiled caches aside)."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def sdist_members(path: Path) -> tuple[set[str], list[str]]:
    """The sdist's file names without their top folder (`moonep_moe-VERSION/`), and its links."""
    with tarfile.open(path) as archive:
        members = archive.getmembers()
    return ({m.name.partition("/")[2] for m in members if m.isfile()},
            [m.name for m in members if m.issym() or m.islnk()])


def problems(names: set[str], want: set[str], top: set[str]) -> list[str]:
    """Files of `want` missing from `names`, and top-level entries neither in `top` nor metadata."""
    unexpected = {name.split("/")[0] for name in names} - top
    return [f"missing {name}" for name in sorted(want - names)] + [
        f"unexpected {name}" for name in sorted(unexpected) if not name.endswith(".dist-info")]


def main(folder: Path) -> int:
    want = package_files()
    (wheel,), (sdist,) = folder.glob("*.whl"), folder.glob("*.tar.gz")
    wheel_names = set(zipfile.ZipFile(wheel).namelist())
    sdist_names, links = sdist_members(sdist)
    found = [f"{wheel.name}: {p}" for p in problems(wheel_names, want, {PACKAGE})]
    found += [f"{sdist.name}: {p}" for p in problems(sdist_names, want, SDIST_TOP)]
    found += [f"{sdist.name}: link {name}" for name in links]
    configs = sorted(name for name in want if name.startswith(f"{PACKAGE}/configs/"))
    for archive, names in ((wheel, wheel_names), (sdist, sdist_names)):
        shipped = [Path(name).name for name in configs if name in names]
        print(f"{archive.name}: {len(names)} files; {len(shipped)} of the {len(configs)} configs: "
              + " ".join(shipped))
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

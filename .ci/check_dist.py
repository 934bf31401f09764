"""Check the built sdist and wheel: both carry every built-in table of configs/ and the
license; the wheel holds the tables inside the package (detgemm_cute/configs/).

    python .ci/check_dist.py DIST_DIR
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(dist: Path) -> int:
    tables = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1 or not tables:
        print(f"check_dist: expected one wheel, one sdist and tables in configs/; got "
              f"{wheels}, {sdists}, {tables}", file=sys.stderr)
        return 1
    name, version = wheels[0].name.split("-")[:2]
    with zipfile.ZipFile(wheels[0]) as z:
        in_wheel = set(z.namelist())
    with tarfile.open(sdists[0]) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    want = {wheels[0].name: ([f"detgemm_cute/configs/{t}" for t in tables]
                             + [f"{name}-{version}.dist-info/licenses/LICENSE"], in_wheel),
            sdists[0].name: ([f"configs/{t}" for t in tables] + ["LICENSE"], in_sdist)}
    missing_any = False
    for archive, (paths, names) in want.items():
        missing = [p for p in paths if p not in names]
        missing_any |= bool(missing)
        print(f"{archive}: {len(names)} files; "
              + (f"MISSING {', '.join(missing)}" if missing else f"has {', '.join(paths)}"))
    return 1 if missing_any else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

"""Air-gapped installs: aerie, its wheels, a target and data for a host without network.

    here (network)                                   offline host
    aerie bundle --out B [--preset P] ...  ── B/part-1..K ──>  python3 B/part-1/install.pyz --into D
      wheels for the host's Python/platform                      pieces checked (sha256), reassembled
      aerie's own wheel, the target, data                        wheels -> D/site, import check, D/env.sh
                                                               . D/env.sh; aerie run P --no-prefect

Each part folder holds its pieces, `contents.json` (the whole index: every file, piece and sha256) and
`install.pyz` (this package with the standard library alone, since it runs before any wheel is
installed). Parts may be unpacked one at a time and in any order (`python -m aerie.bundle unpack`);
nothing is placed that does not match its sha256, and a re-run skips what is already in place.

    cli.py      both command lines: `aerie bundle` here, `python -m aerie.bundle ...` there
    build.py    `aerie bundle`: what goes in, the installer, the parts written
    wheels.py   the wheels: aerie's requirements less what the host has, pinned, downloaded; aerie's own
    data.py     the data packages as stand-ins, and the ShareGPT export
    parts.py    the files planned into part folders of at most a given size, and written
    unpack.py   one part into the install folder: pieces checked, split files reassembled, .xz expanded
    install.py  the wheels installed into site/, the environment (env.sh), its check in a child
    layout.py   InstallDir: what the install folder holds
    files.py    atomic JSON, sha256, sizes for people

Only build.py, wheels.py and data.py import aerie's dependencies (when called).
"""

from __future__ import annotations

from aerie.bundle.files import FORMAT, MIB, sha256_file
from aerie.bundle.install import IMPORT_CHECK, environ, export_lines, install, verify_install
from aerie.bundle.layout import InstallDir
from aerie.bundle.parts import CONTENTS, BundledFile, plan_parts, write_parts
from aerie.bundle.unpack import UnpackReport, missing_files, require_unpacked, unpack

__all__ = [
    "CONTENTS",
    "FORMAT",
    "IMPORT_CHECK",
    "MIB",
    "BundledFile",
    "InstallDir",
    "UnpackReport",
    "environ",
    "export_lines",
    "install",
    "missing_files",
    "plan_parts",
    "require_unpacked",
    "sha256_file",
    "unpack",
    "verify_install",
    "write_parts",
]

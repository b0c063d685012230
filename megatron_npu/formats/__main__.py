"""``python -m megatron_npu.formats DIR``: write every format's JSON Schema into ``DIR``
(``docs/schemas`` in the repository), removing schema files of formats that no longer exist."""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_npu import console
from megatron_npu.files import make_dir, write_private
from megatron_npu.formats import schema_files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        console.error("usage: python -m megatron_npu.formats DIR")
        return 2
    folder = make_dir(argv[0])
    files = schema_files()
    for stale in folder.glob("*.schema.json"):
        if stale.name not in files:
            stale.unlink()
    for name, text in files.items():
        write_private(Path(folder, name), text)
        console.say(Path(folder, name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

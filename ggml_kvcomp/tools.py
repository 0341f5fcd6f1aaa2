"""The native tools as commands on PATH: `llama-server` and friends run paths.bin_dir()'s
binaries, so an installed wheel's tools work like the checkout's build/bin ones."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

from .paths import binary


def main() -> NoReturn:
    """Replaces this process with the tool named like the command that started it."""
    path = binary(Path(sys.argv[0]).name)
    os.execv(path, [str(path), *sys.argv[1:]])

#!/usr/bin/env python3
"""Prints the path of the prepared (fetched, verified, patched) upstream tree; see ggml_kvcomp/upstream.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ggml_kvcomp.upstream import prepare

print(prepare())

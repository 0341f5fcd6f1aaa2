"""kvcomp: compensated low-bit KV cache for llama.cpp — Python tooling.

Importing the package points llama_cpp at this build's libllama (paths.bin_dir()), since
llama_cpp binds its library at its own first import (python/README.md).
"""

import os as _os
import sys as _sys

from .paths import bin_dir as _bin_dir

__version__ = "0.1.0"

if "llama_cpp" not in _sys.modules:
    # llama-cpp-python's own overrides of the folders it loads libllama and libmtmd from
    _os.environ["LLAMA_CPP_LIB_PATH"] = _os.environ["MTMD_CPP_LIB"] = str(_bin_dir())

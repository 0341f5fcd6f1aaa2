"""Every malformed or out-of-range value of every --kv-comp-* flag, in each tool: a non-zero
exit that names the flag, and no crash (no abort, no uncaught exception, no stack trace).

Values that are malformed fail while the command line is parsed, before the model loads;
values beyond what the context holds (window, sinks, merge interval larger than -c) fail when
the context is configured, so those runs load the model."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

TOOLS = ("llama-server", "llama-cli", "llama-perplexity", "llama-bench")

WHOLE = ("1e3", "32abc", "", " 5", "0x10", "99999999999", "-1")
FRACTION = ("abc", "0.5x", "nan", "inf", "-0.5", "1.5")

BAD_VALUES: dict[str, tuple[str, ...]] = {
    "--kv-comp": ("fast", "custom", "", "Balanced"),
    "--kv-comp-window": WHOLE,
    "--kv-comp-sinks": WHOLE,
    "--kv-comp-merge": (*WHOLE, "0"),
    "--kv-comp-merge-at": (*FRACTION, "0"),
    "--kv-comp-pin-threshold": ("abc", "nan", "inf", "-1", "1e"),
    "--kv-comp-pin-budget": ("abc", "nan", "101", "-1"),
    "--kv-comp-tracker": ("maybe", "2", "", "yes"),
    "--kv-comp-ema": ("0,2", "a", "0.1,", "0.1,0.2,0.3", "0", "nan"),
    "--kv-comp-monitor": ("maybe", "2"),
    "--kv-comp-ppl-window": (*WHOLE, "0"),
    "--kv-comp-degrade-ratio": ("abc", "nan", "inf", "0.5", "1.2x"),
    "--kv-comp-degrade-windows": WHOLE,
    "--kv-comp-baseline": ("abc", "nan", "-3", "/nonexistent/profile.json"),
    "--kv-comp-fill-warn": FRACTION,
    "--kv-comp-l2-jump": ("abc", "nan", "0.5", "-2"),
}

# larger than any context these runs create (-c 256)
BEYOND_CONTEXT = ("--kv-comp-window", "--kv-comp-sinks", "--kv-comp-merge")

CRASH_SIGNS = ("terminate called", "Aborted", "Segmentation fault", "stack trace", "backtrace", "GGML_ASSERT",
               "std::bad_alloc")


def _args(bins: Path, tool: str, model: Path, text: Path, flag: str, value: str) -> list[str]:
    kv = ["--kv-comp", "balanced"] if flag != "--kv-comp" else []
    if tool == "llama-bench":
        return [str(bins / tool), "-m", str(model), "-fa", "1", "-ctk", "kvc4", "-ctv", "kvc3", "-p", "8", "-n", "0",
                "-r", "1", *kv, flag, value]
    common = [str(bins / tool), "-m", str(model), "-c", "256", "-t", "2", *kv, flag, value]
    if tool == "llama-server":
        return [*common, "--port", "0"]
    if tool == "llama-cli":
        return [*common, "-p", "hi", "-n", "1"]
    return [*common, "-f", str(text), "--chunks", "1", "-b", "256"]


def _check_refused(args: list[str], flag: str, value: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    what = f"{Path(args[0]).name} {flag} {value!r}"
    assert proc.returncode > 0, f"{what}: exit {proc.returncode}\n{out[-1500:]}"
    assert flag in out, f"{what}: the message does not name the flag\n{out[-1500:]}"
    crash = [s for s in CRASH_SIGNS if s in out]
    assert not crash, f"{what}: {crash}\n{out[-1500:]}"


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("flag", sorted(BAD_VALUES))
def test_malformed_value_is_refused(bins: Path, model: Path, text: Path, tool: str, flag: str) -> None:
    for value in BAD_VALUES[flag]:
        _check_refused(_args(bins, tool, model, text, flag, value), flag, value)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("flag", BEYOND_CONTEXT)
def test_value_beyond_context_is_refused(bins: Path, model: Path, text: Path, tool: str, flag: str) -> None:
    _check_refused(_args(bins, tool, model, text, flag, "2147483647"), flag, "2147483647")

"""Shared CLI plumbing: one-line errors, stderr console, byte formatting."""

from __future__ import annotations

import functools
import os
import sys

import typer
from rich.console import Console

from runtime.switches import setting

# Not on a terminal (logs, pipes, CI), rich would assume 80 columns: tables would cut their own numbers
# ("1310…") and messages wrap mid-sentence. A wide virtual width keeps every line whole there.
PIPE_WIDTH = 240
err = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else PIPE_WIDTH)
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else PIPE_WIDTH)


def user_errors():
    """Map the project's error types to one red line on stderr and exit code 1 (NINFER_DEBUG=1 re-raises)."""
    from format.errors import ArtifactError, BindingError, ConvertError, QuantizationError

    errors = (ArtifactError, BindingError, ConvertError, QuantizationError, FileNotFoundError, IsADirectoryError,
              PermissionError)
    try:
        from runtime.memory_plan import MemoryPlanError

        errors += (MemoryPlanError,)
    except ImportError:  # torch missing: fit and the engine are unavailable anyway
        pass
    return errors


def friendly(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped below, re-raised when unknown or debugging
            if setting("NINFER_DEBUG") == "1" or not isinstance(exc, user_errors()):
                raise
            from rich.markup import escape

            # the message may quote data (names, paths, JSON): escaped, so brackets print as themselves
            err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/red]")
            sys.exit(130)

    return wrapper


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def prepare_device(device: str) -> None:
    """Before triton is imported: on a CPU run the kernels through Triton's interpreter."""
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def printable(text: str) -> str:
    """Generated text for a terminal: control characters (other than newline and tab) as escapes, so a
    random or hostile model cannot move the cursor or ring the bell (`--raw-output` prints as is)."""
    return "".join(ch if ch in "\n\t" or (ch.isprintable() and ch != "\ufffd") else ascii(ch)[1:-1] for ch in text)

"""What gpu_check.py and its parts share: the report they write, and loading the fused attention from
the installed package or, on a GPU machine where the project is copied but not installed, from this
checkout."""
from __future__ import annotations

import importlib.machinery
import json
import importlib.util
import sys
from pathlib import Path

__all__ = ["EXIT_NO_GPU", "REPO", "Report", "load_attention_module", "out_and_device"]

EXIT_NO_GPU = 2
REPO = Path(__file__).resolve().parent.parent


def register_checkout_packages() -> None:
    """Make `import remat.attention` load this checkout's attention/ folder, for a GPU machine where
    the project is copied but not installed: a bare `remat` package (its __init__, which needs the
    solver's dependencies, is not run) whose path is this checkout's remat/ and root folders."""
    spec = importlib.machinery.ModuleSpec("remat", None, is_package=True)
    pkg = importlib.util.module_from_spec(spec)
    pkg.__path__ = [str(REPO / "remat"), str(REPO)]
    sys.modules["remat"] = pkg


def load_attention_module():
    """The fused attention's public functions (remat.attention.op and .launch), from the installed
    package, else from this checkout."""
    try:
        import remat.attention  # noqa: F401
    except ImportError:
        register_checkout_packages()
    from types import SimpleNamespace

    from remat.attention.launch import use_triton
    from remat.attention.op import flash_attention

    return SimpleNamespace(flash_attention=flash_attention, use_triton=use_triton)


class Report:
    """The lines printed and saved as NAME.txt, and the data saved as NAME.json (`save`)."""

    def __init__(self):
        self.lines: list[str] = []
        self.data: dict = {}

    def log(self, msg: str = "") -> None:
        """Print `msg` and keep it for the text report."""
        print(msg, flush=True)
        self.lines.append(msg)

    def save(self, out: Path, name: str) -> None:
        """Write out/NAME.json (the data) and out/NAME.txt (the lines)."""
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(self.data, indent=2, default=str))
        (out / f"{name}.txt").write_text("\n".join(self.lines) + "\n")


def out_and_device(doc: str, argv=None):
    """The --out directory and --device (CUDA where there is one, else the CPU) of a GPU check
    script whose description is `doc`."""
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    return Path(args.out), torch.device(args.device)

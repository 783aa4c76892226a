"""Generated modules on disk, named by the hash of what they compute.

numba's `cache=True` keeps a function's machine code next to its source file,
keyed by that file; a module written once under a name that is the hash of its
code (and of the helpers it calls, which numba does not track) is found again by
the next process, which then loads the code instead of compiling it. The file's
comments name the variables of the block it was first generated for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from fluidps.errors import ExecutionError

ENV = "FLUIDPS_CACHE_DIR"


def default_cache_dir() -> Path:
    """FLUIDPS_CACHE_DIR, else ~/.cache/fluidps/compiled (XDG_CACHE_HOME respected)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fluidps" / "compiled"


class ModuleCache:
    def __init__(self, directory: Path | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self._loaded: dict[str, ModuleType] = {}

    @staticmethod
    def _name(text: str, helper_sources: list[str]) -> str:
        # Comments (which variable each local holds) do not count: programs of one shape
        # share their code whatever their variables are called.
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        digest = hashlib.sha256("\0".join([code, *helper_sources]).encode()).hexdigest()[:24]
        return f"fluidps_segment_{digest}"

    def holds(self, text: str, helper_sources: list[str]) -> bool:
        """Whether the module of `text` is loaded or on disk already (an earlier process
        compiled it, and numba keeps its machine code next to it)."""
        name = self._name(text, helper_sources)
        return name in self._loaded or (self.directory / f"{name}.py").exists()

    def load(self, text: str, helper_sources: list[str]) -> ModuleType:
        """The module of `text`, written into the cache directory once and imported."""
        name = self._name(text, helper_sources)
        if name in self._loaded:
            return self._loaded[name]
        path = self.directory / f"{name}.py"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                # Written whole, then renamed: another process never imports half a file.
                fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
        except OSError as e:
            raise ExecutionError(
                f"cannot write compiled code into {self.directory}: {e}; set {ENV} to a writable directory"
            ) from None
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # Registered as any imported module is: numba's cached code names its module,
        # and a process loading that code imports it by that name.
        sys.modules[name] = module
        spec.loader.exec_module(module)
        self._loaded[name] = module
        return module

"""cam_jit's build engine: compile a backend's C++ on first use, cache it, load it in ~1 ms after.

``load()`` is the entry point; everything else is for tools (the CLI, tests, benchmarks) and for
registering backends. Importing this package compiles nothing and starts no subprocess.
"""
from cam_jit.jit.backends import (BACKENDS, Backend, backend_spec, cpu_spec, default_backend,
                                  kernels_dir, register_backend)
from cam_jit.jit.core import (EntryInfo, LoadedLibrary, clean, list_entries, load, load_spec,
                              status, verify_entry)
from cam_jit.jit.env import cache_dir, jit_disabled
from cam_jit.jit.errors import BuildError, CacheMissError, JitError, ToolchainError
from cam_jit.jit.spec import BuildSpec, compiler_key, content_inputs, content_key

__all__ = [
    "BACKENDS", "Backend", "BuildError", "BuildSpec", "CacheMissError", "EntryInfo", "JitError",
    "LoadedLibrary", "ToolchainError", "backend_spec", "cache_dir", "clean", "compiler_key",
    "content_inputs", "content_key", "cpu_spec", "default_backend", "jit_disabled",
    "kernels_dir", "list_entries", "load", "load_spec", "register_backend", "status",
    "verify_entry",
]

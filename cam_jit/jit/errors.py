"""Exceptions raised by the JIT engine. All derive from :class:`JitError` (a ``RuntimeError``)."""


class JitError(RuntimeError):
    """Base class: a backend library could not be provided."""


class BuildError(JitError):
    """Compiling (or loading the freshly compiled library) failed; the message shows the first
    compiler errors, the failing command and the path of the full log."""


class ToolchainError(BuildError):
    """A build is needed but a tool (C++ compiler, ninja) is missing; the message names the fix."""


class CacheMissError(JitError):
    """``CAM_JIT_DISABLE_JIT=1`` and the cache holds no usable entry for the requested backend."""

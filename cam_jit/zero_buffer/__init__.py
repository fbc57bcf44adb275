"""The zero-copy expert-parallel buffer (docs/semantics.md §5): `FusedDeepMoeBuffer`.

On CPU its symmetric heap is POSIX shared memory, one segment per rank on one host, and its
transport is the `cpu_zb` JIT backend (compiled on the first `init`, never for plain CPU
users of the other ops). `import cam_jit` imports this package on first access.
"""
from cam_jit.zero_buffer.buffer import FusedDeepMoeBuffer

__all__ = ["FusedDeepMoeBuffer"]

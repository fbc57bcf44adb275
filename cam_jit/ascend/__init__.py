"""The Ascend NPU side of cam_jit: what is installed, and the NPU backend.

- :mod:`~cam_jit.ascend.registry`: the operator registry (``kernels/operator_registry.json``).
- :mod:`~cam_jit.ascend.discover`: CANN, torch_npu, SoC, SHMEM.
- :mod:`~cam_jit.ascend.opp`: opp vendors, the aclnn library search order, the FusedDeepMoe ABI.
- :mod:`~cam_jit.ascend.report`: the per-operator verdicts printed by ``python -m cam_jit doctor``.
- :mod:`~cam_jit.ascend.build`: the NPU backend's build spec and the compile-only check.
- :mod:`~cam_jit.ascend.npu_ops`: the PrivateUse1 kernels calling the aclnn wrappers.
- :mod:`~cam_jit.ascend.opp_install`: ``python -m cam_jit opp locate|install|build``.

Importing any of them needs neither torch_npu nor CANN.
"""

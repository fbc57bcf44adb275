"""TorchAir GE converters for the cam_jit ops: one module per op, imported only with torchair.

Installed as ``cam_jit._ge_converters`` (mapped from the checkout's ``ge_converters/``). Importing
this package imports neither torchair nor a converter module; ``cam_jit.register_ge_converters()``
calls :func:`register_all`. Each op of ``cam_jit.ops._registry`` appears in exactly one of the two
tables below: ``CONVERTERS`` (op -> module whose ``register()`` registers its converter) or
``NO_CONVERTER`` (op -> why there is none). A new op adds one line here and, with a converter, one
small module.
"""
from __future__ import annotations

import importlib
from typing import Dict, List

CONVERTERS: Dict[str, str] = {
    "fused_deep_moe": "fused_deep_moe",  # GE FusedDeepMoe (docs/semantics.md §7.3, base / W4A8 / master)
    "a2e": "a2e",  # GE A2e (§7.3)
    "e2a": "e2a",  # GE E2a (§7.3)
}

NO_CONVERTER: Dict[str, str] = {
    "moe_dispatch_lowlatency": (
        "no GE op of matching semantics: MoeDispatchLowlatencyZeroBuffer (docs/semantics.md §6, §7.2) takes a "
        "SHMEM zero-buffer address and the commAlg/extInfo attributes that this op's schema does not have"),
    "moe_combine_lowlatency": (
        "no GE op of matching semantics: MoeCombineLowlatencyZeroBuffer (docs/semantics.md §6, §7.2) takes a "
        "SHMEM zero-buffer address and the commAlg/extInfo attributes that this op's schema does not have"),
    "all2_all_detour": (
        "GE All2AllDetour takes the communicator magic as a graph attribute, but every call must take a "
        "fresh magic (docs/semantics.md §3.1, §4.1): a replayed graph would reuse it"),
    "reduce_scatter_detour": (
        "GE ReduceScatterDetour takes the communicator magic as a graph attribute, but every call must "
        "take a fresh magic (docs/semantics.md §3.1, §4.1): a replayed graph would reuse it"),
    **{op: ("UMDK's prefill kernels (GE DispatchLayout, NotifyDispatch, MoeDispatchNormal, MoeCombineNormal) "
            "register no InferShape and UMDK's own binding declares them unusable in GE graphs; the op runs "
            "eagerly (and in torch.compile graphs on CPU)")
       for op in ("moe_dispatch_layout", "moe_notify_dispatch", "moe_dispatch_normal", "moe_combine_normal")},
    "cam_get_comm": "host-side communicator setup (TCP rendezvous, docs/semantics.md §4.1), not a device op",
    "cam_free_comm": "host-side communicator teardown (docs/semantics.md §4.1), not a device op",
}


def register_all() -> List[str]:
    """Imports every converter module (they import torchair) and registers its converter with
    ``torchair.register_fx_node_ge_converter``; each defined op of ``NO_CONVERTER`` gets one that
    raises NotImplementedError with the reason (torchair's own error for an op without converter
    calls it a "PyTorch built-in op", which misleads). Returns the qualified names of the ops that have a converter, e.g.
    ``["cam_jit::fused_deep_moe", ...]``."""
    from ._common import register_refusal

    registered = []
    for op, module in CONVERTERS.items():
        importlib.import_module(f"{__name__}.{module}").register()
        registered.append(f"cam_jit::{op}")
    for op, reason in NO_CONVERTER.items():
        register_refusal(op, reason)
    return registered

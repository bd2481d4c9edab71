"""mpifusion: an MPI reference implementation of PaddlePaddle's tensor fusion helper.

Params and grads live in flat, 256-byte-aligned buffers grouped by size; grads are reduced
asynchronously (all-reduce, reduce, reduce-scatter: shared memory within a node, MPI
collectives between nodes) and sharded params are all-gathered back. Backward hooks are emulated by explicit ``add_grad`` calls.

Layers (each imports only the ones above it): ``errors``/``dtypes``/``config``; ``plan``
(pure layout and grouping); ``arrays`` (numpy/cupy, DLPack); ``comm`` (every MPI call);
``runtime`` (Param, buffers, fused_parameters); ``spec``/``presets``/``oracle`` (model
descriptions and the float64 reference); ``tools`` (the command line). Public names are
imported lazily, so planning and checking never initialise MPI.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> module that defines it
_PUBLIC = {
    "Param": "runtime.param",
    "FusedCommBuffer": "runtime.buffer", "HookAction": "plan.actions",
    "HOOK_ACTION": "plan.actions",
    "ShardingGradView": "runtime.storage", "flatten_dense_tensors": "runtime.storage",
    "build_reduce_scatter_buffer": "runtime.storage",
    "fused_parameters": "runtime.fusion", "obtain_storage": "runtime.fusion",
    "filter_params": "runtime.fusion", "assign_group_by_size": "runtime.fusion",
    "CommTask": "comm.task",
    "get_group_size": "plan.layout",
    "to_torch": "arrays.backend",
    "CommOptions": "config",
    "FusionError": "errors", "LayoutError": "errors", "AgreementError": "errors",
    "GradError": "errors", "CheckInError": "errors", "CommError": "errors",
    "CommTimeoutError": "errors", "NanInfError": "errors", "OptionError": "errors",
    "StateError": "errors", "OrderError": "errors", "AbandonedError": "errors",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'mpifusion' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))

"""mpifusion: an MPI reference implementation of PaddlePaddle's tensor fusion helper.

Params and grads live in flat, 256-byte-aligned buffers grouped by size; grads are reduced
with non-blocking MPI collectives (all-reduce, reduce, reduce-scatter) and sharded params are
all-gathered back. Backward hooks are emulated by explicit ``add_grad`` calls.
"""
from .buffer import HOOK_ACTION, FusedCommBuffer, HookAction
from .storage import ShardingGradView, build_reduce_scatter_buffer, flatten_dense_tensors
from .comm import CommTask
from .errors import (AgreementError, CheckInError, CommError, CommTimeoutError, FusionError,
                     GradError, LayoutError, NanInfError)
from .fusion import assign_group_by_size, filter_params, fused_parameters, obtain_storage
from .layout import get_group_size
from .backend import to_torch
from .param import Param

__version__ = "0.1.0"

__all__ = [
    "Param", "to_torch", "FusedCommBuffer", "HookAction", "HOOK_ACTION", "ShardingGradView", "CommTask",
    "fused_parameters", "obtain_storage", "filter_params", "assign_group_by_size",
    "get_group_size", "flatten_dense_tensors", "build_reduce_scatter_buffer",
    "FusionError", "LayoutError", "AgreementError", "GradError", "CheckInError", "CommError",
    "CommTimeoutError", "NanInfError",
]

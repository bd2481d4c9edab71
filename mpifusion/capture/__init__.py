"""Capture adapters: record what a framework's data-parallel step did, in the dump format of
``mpifusion.oracle.check`` (docs/oracle.md, "Use mpifusion as the oracle in your tests").

* :class:`TorchCapture` (``mpifusion.capture.torch``): PyTorch, plain, DDP or FSDP2;
* :class:`PaddleCapture` (``mpifusion.capture.paddle``): Paddle, DataParallel or its
  ``FusedCommBuffer`` (all-reduce, reduce, reduce-scatter, ``sync_params``);
* :class:`JaxCapture` (``mpifusion.capture.jax``): a grads pytree per micro-step.

Each records every rank's local gradient per micro-step and what the rank holds after the
sync, returns the rank's record as a dict (``to_dict()``), writes ``rank{r}.npz``
(``save(dir)``) and writes the matching spec (``spec()``). Frameworks are imported only when
their adapter is used: importing mpifusion imports none of them.
"""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"Recorder": "core", "CaptureError": "core", "TorchCapture": "torch",
           "PaddleCapture": "paddle", "JaxCapture": "jax"}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'mpifusion.capture' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))

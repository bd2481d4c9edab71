"""Reading dumps (``rank{r}.npz``) safely: one-line ``DumpError`` naming the file and field."""
from __future__ import annotations

import os
import re
import zipfile
from typing import Any, Optional

import numpy as np

from .bound import as_float64


class DumpError(ValueError):
    """A dump that cannot be checked (missing file or key, wrong shape): one line naming the
    file and the field."""


def _rank_files(directory: str, nranks: int) -> list:
    if not os.path.isdir(directory):
        raise DumpError(f"{directory}: not a directory (expected rank0.npz ... "
                        f"rank{nranks - 1}.npz in it)")
    paths = [os.path.join(directory, f"rank{r}.npz") for r in range(nranks)]
    for path in paths:
        if not os.path.isfile(path):
            raise DumpError(f"{path}: missing (nranks={nranks} expects rank0.npz ... "
                            f"rank{nranks - 1}.npz)")
    extra = sorted(f for f in os.listdir(directory)
                   if re.fullmatch(r"rank\d+\.npz", f) and int(f[4:-4]) >= nranks)
    if extra:
        raise DumpError(f"{os.path.join(directory, extra[0])}: unexpected (spec field nranks="
                        f"{nranks}; is nranks wrong?)")
    return paths


def _open_npz(path: str) -> Any:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # EOFError: empty file
        raise DumpError(f"{path}: cannot read as .npz: {exc}") from None


def _array(files: Any, path: str, key: str, shape: tuple, dtype: str,
           missing_ok: bool = False) -> Optional[np.ndarray]:
    if key not in files.files:
        if missing_ok:
            return None
        raise DumpError(f"{path}: {key}: missing (expected shape {list(shape)})")
    try:
        arr = files[key]
    except ValueError as exc:
        raise DumpError(f"{path}: {key}: cannot read: {exc}") from None
    if tuple(arr.shape) != tuple(shape):
        raise DumpError(f"{path}: {key}: shape {list(arr.shape)} disagrees with the spec "
                        f"(expected {list(shape)})")
    if arr.dtype.kind not in "fV" and not (arr.dtype == np.uint16 and dtype == "bfloat16"):
        raise DumpError(f"{path}: {key}: dtype {arr.dtype} is not a floating dtype "
                        f"(bfloat16 may be stored as raw 2-byte values)")
    return as_float64(arr, dtype)



"""The float64 oracle: the exact reference of a gradient sync and how far a correct result
may be from it (``bound``), reading other implementations' dumps (``dumps``) and checking
them (``check``). Needs no MPI: it runs wherever the dumps are.
"""
from .bound import (BoundModel, ErrorStats, as_float64, bound_model, error_bound, format_ratio,
                    reduce_dtype, summed, unit_roundoff)
from .check import CheckReport, check_dump
from .dumps import DumpError

__all__ = ["BoundModel", "ErrorStats", "as_float64", "bound_model", "error_bound",
           "format_ratio", "reduce_dtype", "summed", "unit_roundoff", "CheckReport",
           "check_dump", "DumpError"]

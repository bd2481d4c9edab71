"""All of mpifusion's MPI traffic: tasks, engines, the collectives and cross-rank health.

``Communicator`` wraps private duplicates of the user's communicator (so the library never
interleaves with the user's own traffic), and one engine per private communicator issues
every call in start order. :func:`release` stops the engines and frees the duplicates of a
communicator (freeing the communicator itself does the same).
"""
from .communicator import Communicator
from .registry import live_private_comms, private_comm, release
from .task import CommTask

__all__ = ["CommTask", "Communicator", "live_private_comms", "private_comm", "release"]

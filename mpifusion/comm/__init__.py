"""All of mpifusion's MPI traffic: tasks, engines, the collectives and cross-rank health.

``Communicator`` wraps a private duplicate of the user's communicator (so the library never
interleaves with the user's own traffic), and one engine per private communicator issues
every call in start order.
"""
from .communicator import Communicator
from .engines import private_comm
from .task import CommTask

__all__ = ["CommTask", "Communicator", "private_comm"]

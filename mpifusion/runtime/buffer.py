"""Fused buffers: params and grads in flat arrays, reduced over MPI in one collective.

State machine of a ``FusedCommBuffer`` (docs/state-machine.md says the same):

* Check-in counters, per step: every ``add_grad(param)`` counts one micro-step for that
  param; at ``acc_steps`` the param is *checked in* (``checked_in`` of ``len(params)``).
  ``mark_unused(param)`` checks a param in at once with zero gradient for its remaining
  micro-steps. A further ``add_grad`` of a checked-in param is a ``GradError``.
* When all are checked in (and ``use_comm``), ``comm_grads`` starts the collective and holds
  a ``CommTask``; ``comm_grads``/``scale_grads`` with params missing raise ``CheckInError``
  naming them. ``scale_grads`` waits (within ``timeout``), scales, and resets the counters
  (step + 1). On ``CommTimeoutError`` the task stays: ``wait()`` again keeps waiting.
* ``reset()`` sets the counters back to zero and keeps the grads (``zero_grads=True`` zeroes
  them); with a collective still pending it needs ``abandon=True`` (MPI cannot cancel one).
* ``status`` tracks the *param* buffer of a reduce-scatter buffer: READY (full params
  valid), SHARDED (only this rank's shard is valid, after ``clear``/``reset_param_storage``),
  SYNCING (``sync_params`` in flight; READY again when its task completes; clear/reset of
  the param storage are refused meanwhile).
* ``clear_grad_storage`` is refused mid-step (micro-steps counted, communication not
  finished); ``add_grad``/``mark_unused`` are refused after ``close()``.

Every check that can fail runs before anything is changed, so an error leaves grads,
counters and buffers as they were: a check-in that starts communication checks first that
it can (open buffer, a comm_group, nothing abandoned), and a ``NanInfError`` found then
undoes the call (``GradIntake._snapshot``/``_restore``, runtime/grads.py). Before anything is allocated, the ranks of comm_group
check in one tiny collective that they build the same buffer (``health.check_agreement``).

Size: one class, Paddle's public ``FusedCommBuffer``, about a sixth of it the docstrings of
its arguments, methods and errors that docs/reference.md is generated from; its param side
(sharded.py) and grad intake (grads.py) are apart already.
"""
from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from mpi4py import MPI

from ..arrays import backend, cuda
from ..comm import CommTask, Communicator
from ..config import CommOptions
from ..comm import health
from ..errors import (CheckInError, CommError, CommTimeoutError, GradError, LayoutError,
                     NanInfError, OptionError, StateError, error_context)
from ..plan.layout import ALIGNMENT_BYTES, plan_flat, plan_sharded
from ..plan.actions import HOOK_ACTION, HookAction  # noqa: F401 (re-exported)
from ..plan.grouping import grad_dtype_for
from .checkin import CheckIn
from .grads import GradIntake, GradSnapshot
from .options import (BufferOptions, check_buffer_id, check_comm_group, check_switch,
                      dst_group_rank)
from .param import Param
from .sharded import ShardedParams
from .storage import (BufferMemory, buffer_dropped, build_reduce_scatter_buffer,
                      check_has_data, check_trainable, device_template,
                      flatten_dense_tensors, grad_of, plan_or_raise, set_grad, world_rank)

logger = logging.getLogger("mpifusion")


def _grad_bytes_hint(params: Sequence[Any]) -> Optional[int]:
    """The bytes of the grads of ``params`` (as main grads: fp32 where a param is narrower,
    the larger the grads can be), for ``auto``'s choice across nodes; None where a param is
    not one (that error is raised later, after the communicator every rank builds)."""
    try:
        return sum(p.numel * grad_dtype_for(p.dtype, True).itemsize for p in params)
    except Exception:  # noqa: BLE001 - reported by the checks that follow
        return None


def _prescale(grads: Any, factor: float) -> None:
    """``scale_after_comm=False``: the buffer times 1/n before it is sent."""
    backend.scale_(grads, factor)
    cuda.synchronize(grads)  # the collective's copies and calls read it next


def _locked(method: Callable) -> Callable:
    """One thread at a time in the buffer's state machine (autograd may run hooks on several
    threads): the check-in counters and the accumulation into a grad view are shared."""
    @functools.wraps(method)
    def run(self: "FusedCommBuffer", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class FusedCommBuffer(ShardedParams, GradIntake):
    """A group of same-dtype params whose grads are reduced together (Paddle's FusedCommBuffer).

    ``comm_group`` is an mpi4py communicator; the buffer talks on a private duplicate of it.
    ``timeout`` (seconds, default ``$MPIFUSION_TIMEOUT``, unset = forever) bounds every wait.
    Building one is collective: every rank of ``comm_group`` builds the same buffer (same
    params, order, shapes, dtypes and options), in the same order.

    Args:
        id: the buffer's number, unique per communicator; errors and logs name it.
        params: the :class:`Param` objects to fuse, in backward order (one dtype); their
            ``data``/``grad``/``main_grad`` become views into the buffer.
        comm_group: the ranks that reduce together; None builds a buffer that cannot
            communicate (check-ins only, ``use_comm=False``).
        acc_steps: micro-steps (``add_grad`` calls) per param before it is checked in.
        act: :class:`HookAction` (or ``"all_reduce"``, ``"reduce"``, ``"reduce_scatter"``).
        dst: ``REDUCE``'s root, a global rank (of ``COMM_WORLD``, as in Paddle); -1 otherwise.
        use_main_grad: keep the grads in fp32 main grads for half-precision params; None:
            whether ``params[0]`` has a ``main_grad`` (Paddle's default).
        fuse_param: also fuse the params into one flat buffer (not with ``release_grads``).
        scale_after_comm: scale by ``1/nranks`` after the collective; False: before it.
        release_grads: allocate the grad buffer at the first micro-step, so
            :meth:`clear_grad_storage` can free it between steps.
        use_reduce_avg: average in the collective instead of scaling the buffer.
        free_grads_in_comm: reduce-scatter into a new shard-sized buffer and drop the full
            one (needs ``REDUCE_SCATTER``, ``release_grads`` and ``acc_steps=1``).
        init_slice_param: give each param's slice in ``slice_params`` a view of this rank's
            piece of the param buffer (``REDUCE_SCATTER``).
        slice_params: ``{name: Param}``, the slices ``init_slice_param`` fills.
        timeout: seconds any wait may take; None: ``comm_options``' deadline.
        comm_options: :class:`CommOptions` for the collectives; None: from the environment.
        check_naninf: check the grad buffer for NaN/Inf before every collective; None:
            ``$MPIFUSION_CHECK_NANINF`` (or Paddle's ``FLAGS_pp_check_naninf``).
        order: ``"strict"`` or ``"negotiated"`` collective order; None: ``comm_options``'.

    Raises:
        LayoutError: params that cannot be fused (no params, mixed dtypes, duplicate names).
        AgreementError: the ranks of ``comm_group`` build different buffers.
        OptionError: an option with a value it cannot take.
    """

    def __init__(
        self,
        id: int,
        params: Sequence[Param],
        comm_group: Optional[MPI.Comm],
        acc_steps: int = 1,
        act: Any = None,
        dst: int = -1,
        use_main_grad: Optional[bool] = None,
        fuse_param: bool = False,
        scale_after_comm: bool = True,
        release_grads: bool = False,
        use_reduce_avg: bool = False,
        free_grads_in_comm: bool = False,
        init_slice_param: bool = False,
        slice_params: Optional[dict] = None,
        timeout: Optional[float] = None,
        comm_options: Optional[CommOptions] = None,
        check_naninf: Optional[bool] = None,
        order: Optional[str] = None,
    ) -> None:
        check_comm_group(comm_group, f"rank {world_rank()}: buffer {id!r}")
        self._id = check_buffer_id(id, f"rank {world_rank()}: buffer {id!r}")
        self._params = list(params)
        rank = comm_group.Get_rank() if comm_group is not None else world_rank()
        # bad options name this rank and buffer, like every other construction error
        with error_context(f"rank {rank}: buffer {id}", OptionError):
            if comm_options is None:
                comm_options = CommOptions.from_env()
            elif not isinstance(comm_options, CommOptions):
                raise OptionError(f"comm_options: expected a mpifusion.CommOptions or None, "
                                  f"got {type(comm_options).__name__}")
            if timeout is not None:
                comm_options = replace(comm_options, timeout=timeout)  # parsed again: inf -> None
            if order is not None:
                comm_options = replace(comm_options, order=order)  # parsed again
        deadline = comm_options.timeout
        # opened below, after the agreement check that also compares this buffer
        comm = None if comm_group is None else Communicator(
            comm_group, comm_options, open=False, nbytes=_grad_bytes_hint(self._params))
        self._rank = rank
        where = f"rank {rank}: buffer {id}"
        if not self._params:
            raise LayoutError(f"{where}: params: expected at least one Param, got none")
        for p in self._params:
            if not isinstance(p, Param):
                raise LayoutError(f"{where}: params: expected mpifusion.Param objects, "
                                  f"got {type(p).__name__}")
        check_has_data(self._params, rank, where)  # before anything is opened or allocated
        nranks = comm.size if comm is not None else 1
        opts = BufferOptions(
            act=act, acc_steps=acc_steps, dst=dst, use_main_grad=use_main_grad,
            fuse_param=fuse_param, scale_after_comm=scale_after_comm,
            release_grads=release_grads, use_reduce_avg=use_reduce_avg,
            free_grads_in_comm=free_grads_in_comm, init_slice_param=init_slice_param,
            check_naninf=check_naninf,
        ).checked(where, comm is not None)
        if opts.use_main_grad is None:  # Paddle's default: whether the first param has one
            opts = replace(opts, use_main_grad=self._params[0].main_grad is not None)
        #: the options this buffer was built with, checked (the one place the buffer reads them)
        self.options: BufferOptions = opts
        act = opts.act
        self._comm = comm
        # REDUCE's root as a rank of comm_group (options.dst is a global rank, as in Paddle)
        self._dst = dst_group_rank(opts.dst, comm_group, where) if act == HookAction.REDUCE else -1
        #: seconds any wait of this buffer may take, None for no deadline
        self.timeout = deadline
        #: the :class:`Status` of the param buffer, READY (full params valid), SHARDED (only
        #: this rank's shard is valid) or SYNCING (``sync_params`` in flight)
        self.status = self.Status.READY
        #: the task of the last ``sync_params(sync=False)`` (None before one)
        self.sync_param_task: Optional[CommTask] = None
        self._task: Optional[CommTask] = None
        self._logged_stop_gradient = False
        self._step = 0
        self._tracker: Optional[health.StartTracker] = None
        self._key = -1      # this buffer's index on its communicator (construction order)
        self._seq = 0       # collectives this buffer started (0 = the agreement check)
        self._task_seq = 0
        self._abandoned: list = []      # timed-out tasks given up by reset(abandon=True)
        self._pre_comm_grads = None     # free_grads_in_comm: the full grads while in flight
        self._grads_are_shard = False   # grad_storage is a reduce-scattered shard
        self._lock = threading.RLock()  # add_grad & co. from several threads: one at a time
        self._closed = False
        if comm is not None:
            # the agreement check (one tiny collective on the control communicator, with the
            # communicator's own options), then the stream this buffer's collectives run on
            comm.open(self._agreement_entries(), self._where())
            if comm.size > 1:
                self._tracker = comm.tracker
                self._key = comm.key

        #: the flat param buffer (``fuse_param`` or ``REDUCE_SCATTER``; else None)
        self.param_storage = None
        #: the flat grad buffer (main grads with ``use_main_grad``), of which every param's
        #: grad is a view; None while released (``release_grads``, ``clear_grad_storage``)
        self.grad_storage = None
        # every later allocation is made like this (device and array module), never like
        # param.data or grad_storage, which clear_*_storage and release_grads set to None
        self._like = device_template(self._params)
        self._sharding_param_grad_view: dict = {}
        check_trainable(self._params, rank)
        sharded = act == HookAction.REDUCE_SCATTER
        # planned once, then allocated from the plan
        #: the plan of the flat buffers, each param's offset and padded slot and the
        #: shards (``layout[name]``, ``layout.shard_range(rank)``)
        self.layout = (plan_or_raise(plan_sharded, self._params, nranks, rank=rank) if sharded
                       else plan_or_raise(plan_flat, self._params, rank=rank))
        self._memory = self._reserve_memory(sharded or opts.fuse_param)
        if sharded:
            (self._sharding_param_grad_view, self.buffer_size, self.param_storage,
             self.grad_storage, _) = build_reduce_scatter_buffer(
                self._params, nranks, rank, use_main_grad=self.use_main_grad,
                release_grad=opts.release_grads, init_slice_param=opts.init_slice_param,
                slice_params=slice_params, layout=self.layout, memory=self._memory)
            self._params[0].comm_buffer_ref = weakref.ref(self)
        else:
            self.buffer_size = self.layout.numel
            if opts.fuse_param:
                self.param_storage, self.grad_storage = flatten_dense_tensors(
                    self._params, use_main_grad=self.use_main_grad, fuse_param=True,
                    layout=self.layout, memory=self._memory)
            elif not opts.release_grads:
                (self.grad_storage,) = flatten_dense_tensors(
                    self._params, use_main_grad=self.use_main_grad, fuse_param=False,
                    layout=self.layout, memory=self._memory)
        #: ``{name: offset}`` of each param in the flat buffers, in elements (Paddle's)
        self.param2offset = self.layout.param2offset
        self._grad_dtype = grad_dtype_for(self.layout.dtype, self.use_main_grad)
        self._checkin = CheckIn(self._params, opts.acc_steps, where)
        # the grad (or main_grad) array each param must still have at its next add_grad: the
        # view into the grad buffer (kept as the array, so the hot path is an identity check)
        self._grad_view = {p.name: grad_of(p, self.use_main_grad) for p in self._params}

    def _reserve_memory(self, with_params: bool) -> BufferMemory:
        """The buffer's storage regions: with the ``shm`` strategy one region of the node's
        arena holding the grad storage (and the param storage of a reduce-scatter or
        fused-param buffer), made now -- collective, in construction order, after the
        agreement check -- and kept for the buffer's lifetime, even where its grads are
        allocated only at the first ``add_grad`` (``release_grads``). Fresh arrays
        otherwise."""
        if self._comm is None:
            return BufferMemory()
        numel, dtype = self.layout.numel, self.layout.dtype
        grad_dtype = grad_dtype_for(dtype, self.use_main_grad)
        sizes = [(numel, grad_dtype)] + ([(numel, dtype)] if with_params else [])
        regions = self._comm.reserve(sizes, self._like, self._where())
        if not regions:
            return BufferMemory()
        return BufferMemory(grad=regions[0], param=regions[1] if with_params else None)

    # ------------------------------------------------------------------ introspection
    @property
    def id(self) -> int:
        """The buffer's number given at construction (errors and logs name it)."""
        return self._id

    @property
    def use_main_grad(self) -> bool:
        """Whether grads live in fp32 main grads (Paddle's attribute; resolved at construction)."""
        return self.options.use_main_grad

    @property
    def params(self) -> list:
        """The fused :class:`Param` objects, in the order given."""
        return self._params

    @property
    def act(self) -> HookAction:
        """Which collective runs (ALL_REDUCE, REDUCE or REDUCE_SCATTER)."""
        return self.options.act

    @property
    def grad_dtype(self) -> Any:
        """dtype of the grad buffer (fp32 with use_main_grad, else the params' dtype)."""
        return self._grad_dtype

    @property
    def acc_steps(self) -> int:
        """Micro-steps per param before it is checked in."""
        return self.options.acc_steps

    @property
    def dst(self) -> int:
        """REDUCE's root as given, a global rank (of COMM_WORLD), as in Paddle."""
        return self.options.dst

    @property
    def dst_rank(self) -> int:
        """REDUCE's root as a rank of comm_group (where the reduced grads land)."""
        return self._dst

    @property
    def rank(self) -> int:
        """This rank in ``comm_group`` (the world rank without one)."""
        return self._rank

    @property
    def nranks(self) -> int:
        """The size of ``comm_group`` (1 without one), the divisor of the mean."""
        return self._comm.size if self._comm is not None else 1

    @property
    def comm(self) -> Optional[Communicator]:
        """The :class:`~mpifusion.comm.Communicator` the collectives run on (None without
        ``comm_group``)."""
        return self._comm

    @property
    def step(self) -> int:
        """The step serial, 0 at construction, one more at every ``scale_grads()`` and
        ``reset()``; each collective carries it and the ranks compare it (``OrderError``)."""
        return self._step

    @property
    def checked_in(self) -> int:
        """Params that finished all ``acc_steps`` micro-steps this step."""
        return self._checkin.count

    @property
    def task(self) -> Optional[CommTask]:
        """The :class:`CommTask` of this step's grad collective, from its start until
        ``scale_grads()`` or ``reset()``; None otherwise (Paddle's ``_task``)."""
        return self._task

    @property
    def param_buffer_ipc_meta(self) -> Any:
        """CUDA IPC handle of a reduce-scatter param buffer (None on the host)."""
        if self.options.act != HookAction.REDUCE_SCATTER or self.param_storage is None:
            return None
        return backend.ipc_handle(self.param_storage)

    def missing_params(self) -> list:
        """The names of the params not yet checked in this step: what ``comm_grads`` would
        wait for (a :class:`CheckInError` names them too).

        Returns:
            list of str, in the order of :attr:`params`.
        """
        return self._checkin.missing()

    def _where(self) -> str:
        return f"rank {self._rank}: buffer {self._id}"

    # ------------------------------------------------------------------ health (see health.py)
    def _agreement_entries(self) -> list:
        """What every rank of comm_group must agree on before any collective of this buffer:
        its params, id and alignment, and every option :meth:`BufferOptions.agreed` derives
        (strategy, segment size, deadline set, order and verification: the communicator adds
        them, ``Communicator._agreement_entries``)."""
        return health.describe(self._params, {"id": self._id, "alignment_bytes": ALIGNMENT_BYTES,
                                              **self.options.agreed()})

    def _announcer(self) -> Optional[health.StartTracker]:
        return self._tracker if self.timeout is not None else None

    def _start_collective(self) -> int:
        """Count (and, with a deadline, announce) a collective this rank is about to start."""
        self._seq += 1
        tracker = self._announcer()
        if tracker is not None:
            tracker.announce(self._key, self._seq)
        return self._seq

    def _late_ranks(self, seq: int) -> str:
        tracker = self._announcer()
        return tracker.late_ranks_text(self._key, seq) if tracker is not None else ""

    def _checked_in_text(self) -> str:
        return self._checkin.text()

    def _wait_task(self, task: CommTask, what: str, seq: int) -> None:
        """Wait for ``task`` within the deadline; on expiry say what, where and who is late.

        The task stays in place on a timeout: calling the same method again keeps waiting.
        """
        try:
            with error_context(f"{self._where()}: {what} (step {self._step}, action "
                               f"{self.options.act.name}) failed in MPI", MPI.Exception,
                               kind=CommError):
                task.wait(self.timeout)
        except CommTimeoutError as err:
            # the grads' check-in state says nothing about an all-gather of the params
            here = "" if what == "sync_params" else f"; {self._checked_in_text()} on this rank"
            raise CommTimeoutError(
                f"{self._where()}: {what} (step {self._step}, action {self.options.act.name}) "
                f"did not complete within {self.timeout:g} s{here}{self._late_ranks(seq)}. The "
                f"collective is still pending: call wait() to keep waiting, or let the error "
                f"abort the job (run under python -m mpi4py)") from err

    def __repr__(self) -> str:
        return (f"FusedCommBuffer(id={self._id}, act={self.options.act.name}, "
                f"params={len(self._params)}, "
                f"dtype={self.layout.dtype}, grad_dtype={self._grad_dtype.name}, "
                f"numel={self.buffer_size}, nranks={self.nranks})")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Finish and detach: waits for grad communication and ``sync_params`` still in
        flight (within the deadline; on an error the buffer stays open), then the buffer
        starts nothing more (its negotiation slot is freed). Idempotent; grads and params stay
        readable. The private duplicates and thread of comm_group are shared by its buffers:
        ``mpifusion.comm.release(comm_group)`` (or ``comm_group.Free()``) releases them.

        Raises:
            CommTimeoutError: communication still in flight did not finish in time.
        """
        with self._lock:
            if self._closed:
                return
            for task in (self._task, self.sync_param_task):
                if task is not None and not task.abandoned and not task.is_completed():
                    self._wait_task(task, "close", self._seq)
            self._closed = True
            if self._comm is not None:
                self._comm.close()

    def __del__(self) -> None:
        # with shm, the window outlives the buffer (freeing it is collective): give its
        # regions' pages back, once this buffer's own arrays of them are gone, unless a user
        # keeps some (params' data, a grad)
        memory = self.__dict__.get("_memory")
        if memory is None or not any(r is not None for r in memory.regions.values()):
            return
        self.__dict__.clear()
        try:
            buffer_dropped(memory)
        except Exception:  # interpreter shutdown: nothing to give back to
            pass

    def __enter__(self) -> "FusedCommBuffer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # leaving on an error: do not wait; a collective still in flight is abandoned
        with self._lock:
            for task in (self._task, self.sync_param_task):
                if (task is not None and not task.abandoned and self._comm is not None
                        and not task.is_completed()):
                    self._comm.abandon(task, self._key, self._seq, self._where())
            self._closed = True
            if self._comm is not None:
                self._comm.close()

    # ------------------------------------------------------------------ backward
    def add_grad(self, param: Param, use_comm: bool = True, grad: Any = None) -> None:
        """Check ``param`` in for one micro-step; at the last one of the last param, start comm.

        ``grad`` (any DLPack tensor) is accumulated into the param's grad view first, as a
        backward pass would; without it, whatever backward wrote into the view is used.
        ``use_comm`` is True or False (Paddle's second argument; anything else, such as a
        grad passed positionally, is an ``OptionError``).
        Safe from several threads (one at a time: the buffer's lock).

        Args:
            param: one of this buffer's params (the same object).
            use_comm: start the collective when this checks in the last param; False leaves
                it to an explicit :meth:`comm_grads`.
            grad: the micro-step's gradient, added to the param's grad view; None: the view
                already holds it.

        Raises:
            GradError: not a param of this buffer, already checked in this step, or a grad
                of the wrong shape or dtype.
            StateError: the buffer was closed, or communication already started this step.
            NanInfError: ``check_naninf`` found NaN/Inf when the collective was to start
                (this call is undone).
        """
        with self._lock:  # spelled out, not @_locked: this is the hot path
            self._add_grad(param, use_comm, grad)

    def _add_grad(self, param: Param, use_comm: bool, grad: Any) -> None:
        if self._closed:
            self._refuse_closed("add_grad")
        steps = self._checkin.steps_of(param)  # first: anything but a param of this buffer
        name = param.name
        if use_comm is not True and use_comm is not False:
            self._check_use_comm(use_comm, f"param '{name}': add_grad")
        if steps >= self.options.acc_steps:
            raise GradError(f"{self._where()}: param '{name}': already checked in "
                            f"{steps} time(s) this step (acc_steps={self.options.acc_steps}); "
                            f"expected scale_grads() before its next add_grad")
        if grad is not None:
            grad = self._unalias(param, self._check_grad(param, grad))
        undo = None
        if (use_comm and steps + 1 == self.options.acc_steps
                and self._checkin.count + 1 == len(self._params)):
            # this call checks the last param in and starts communication: refuse now what
            # comm_grads would refuse after the grad was added and counted
            if self._check_startable("add_grad") and self.options.check_naninf:
                undo = self._snapshot((param,))  # a NaN/Inf found then puts this call back
        if steps or not self.options.release_grads:
            view = self._grad_view[name]  # accumulated into, whatever object is set
            given = grad_of(param, self.use_main_grad)
            if given is not view:
                self._check_grad_moved(param, given)
            if view is None:
                raise GradError(f"{self._where()}: param '{name}': no grad buffer to accumulate "
                                f"into (cleared by clear_grad_storage); expected "
                                f"release_grads=True for that")
            if grad is not None:
                view += grad
        else:
            self._copy_grad_to_buffer(param, grad)  # checks the param's own grad first
        done = self._checkin.add(name)
        if self._comm is not None:
            self._comm.poll()
        if done and use_comm and self._checkin.all_in:
            self._comm_grads_or_undo(undo)

    def _comm_grads_or_undo(self, undo: Optional[GradSnapshot]) -> None:
        """Start communication after the last check-in; if it is refused before anything
        was started (NanInfError), put back what this call changed (``undo``)."""
        try:
            self.comm_grads()
        except Exception:
            if undo is not None and self._task is None:
                self._restore(undo)
            raise

    def _check_use_comm(self, value: Any, what: str) -> None:
        """use_comm is a bool (the one switch rule): add_grad(p, g) made the grad use_comm --
        a one-element grad was dropped (truthy), a zero one left comm unstarted on this rank
        only (falsy), and "False" started it."""
        with error_context(self._where(), OptionError,
                           note=" (a grad is passed by keyword: add_grad(param, grad=g)); "
                                "nothing was changed"):
            check_switch(value, f"{what}: use_comm")

    def _refuse_closed(self, what: str) -> None:
        raise StateError(f"{self._where()}: {what}: the buffer was closed (close()); expected "
                        f"an open buffer (nothing was changed)")

    def _check_startable(self, what: str) -> bool:
        """Whether this buffer can start its communication now (the one rule, used by
        ``_comm_grads`` and, before they change anything, by the check-in that would start
        it); False when there is nothing to communicate (every param has stop_gradient)."""
        if not self.need_reduce_scale_sync():
            return False
        if self._task is not None:
            raise StateError(f"{self._where()}: {what}: communication already started this "
                            f"step; expected scale_grads() first")
        if self._comm is None:
            raise StateError(f"{self._where()}: {what}: this call would start communication, "
                            f"but the buffer was built without a comm_group, so it cannot "
                            f"communicate; expected use_comm=False (nothing was changed)")
        self._comm.check_usable(f"buffer {self._id} {what}")  # closed or abandoned
        return True

    @_locked
    def mark_unused(self, *params: Param, use_comm: bool = True) -> None:
        """Check in params that get no gradient this step (Paddle PR 72688's unused params).

        Each param's remaining micro-steps of this step count as zero gradient: a param with
        no ``add_grad`` yet this step has its grad slot zeroed (it contributes exactly zero
        to the reduction); one with some keeps what it accumulated. When this checks in the
        last param, communication starts as in ``add_grad``. All params are validated first.

        Args:
            params: params of this buffer that get no gradient this step.
            use_comm: as in :meth:`add_grad`.

        Raises:
            GradError: a param already checked in, or given twice.
            StateError: the buffer was closed.
        """
        if self._closed:
            self._refuse_closed("mark_unused")
        if use_comm is not True and use_comm is not False:
            self._check_use_comm(use_comm, "mark_unused")
        names = []
        for param in params:
            name = getattr(param, "name", None)
            steps = self._checkin.steps_of(param)
            if steps >= self.options.acc_steps:
                raise GradError(f"{self._where()}: mark_unused: param '{name}' already "
                                f"checked in this step (acc_steps={self.options.acc_steps}); "
                                f"expected scale_grads() first")
            if name in names:
                raise GradError(f"{self._where()}: mark_unused: param '{name}' given twice; "
                                f"expected each param once")
            if self.options.release_grads and steps == 0:
                self._own_grad(param)
            names.append(name)
        if self.grad_storage is None and not self.options.release_grads:
            raise GradError(f"{self._where()}: mark_unused: the grad buffer was cleared "
                            f"(clear_grad_storage); expected release_grads=True for that")
        undo = None
        if use_comm and names and self._checkin.count + len(names) == len(self._params):
            if self._check_startable("mark_unused") and self.options.check_naninf:
                undo = self._snapshot(params)
        for param in params:
            if self._checkin.steps[param.name] == 0:
                if self.options.release_grads:
                    self._copy_grad_to_buffer(param, None)
                slot = self.layout[param.name]
                self.grad_storage[slot.offset:slot.end] = 0
            self._checkin.complete(param.name)
        if self._comm is not None:
            self._comm.poll()
        if use_comm and names and self._checkin.all_in:
            self._comm_grads_or_undo(undo)

    @_locked
    def reset(self, abandon: bool = False, zero_grads: bool = False) -> None:
        """End the step on this rank, unfinished: counters to zero, grads kept (or zeroed),
        and the step serial advances (:attr:`step`), as after ``scale_grads()``, so the next
        collective carries the next serial and can never pair silently with a peer's
        collective of the dropped step: a rank that resets alone makes the next collective an
        ``OrderError`` on every rank. After an ``OrderError`` naming two serials
        (``steps``), the serial moves past the higher one, so ranks that all reset after it
        are in step again.

        A collective still in flight (after ``CommTimeoutError``) is refused unless
        ``abandon=True``: MPI cannot cancel a collective, so the abandoned one stays
        pending -- its arrays are kept alive here, and if the late ranks ever join it,
        MPI finishes it into the buffer. With ``free_grads_in_comm`` the full grad buffer
        comes back (also after a collective that failed, e.g. with ``OrderError``). Later
        collectives on a communicator with an abandoned one refuse to run
        (``AbandonedError``): save what you need and abort, or use a fresh communicator.

        Args:
            abandon: give up a collective still in flight instead of refusing.
            zero_grads: zero the grad buffer too (else the grads are kept).

        Raises:
            StateError: a collective is in flight and ``abandon`` is False.
        """
        abandon = check_switch(abandon, f"{self._where()}: reset: abandon")
        zero_grads = check_switch(zero_grads, f"{self._where()}: reset: zero_grads")
        task = self._task
        pending = False
        if task is not None:
            try:
                pending = not task.is_completed()
            except MPI.Exception:
                pending = True
        if pending and not abandon:
            raise StateError(f"{self._where()}: reset: grad communication is still in flight "
                            f"({self._checked_in_text()}); expected wait() first, or "
                            f"reset(abandon=True) to give it up")
        if pending:
            self._abandoned.append(task)
            # later collectives here (and, once told, on the peers) refuse to run: they would
            # pair with the abandoned one
            self._comm.abandon(task, self._key, self._task_seq, self._where())
            logger.warning("%s: abandoned a pending collective (step %d); later collectives "
                           "on this communicator refuse to run (AbandonedError)", self._where(),
                           self._step)
        failed = task is not None and not pending and task.error is not None
        ahead = getattr(task.error, "steps", None) if failed else None
        # the step ends here: its serial is never reused (a peer must never pair with it);
        # past a peer's serial named by an OrderError, where every rank saw the same error
        self._step = max(self._step + 1, ahead[1] + 1 if ahead is not None else 0)
        if pending or failed:  # the full grads, not the shard that got no result
            if self._pre_comm_grads is not None:
                self.grad_storage = self._pre_comm_grads
                self._grads_are_shard = False
                for view in self._sharding_param_grad_view.values():
                    view.attach_grad_buffer(self.grad_storage, link_param=False)
        self._pre_comm_grads = None
        self._task = None
        self._checkin.reset()
        if zero_grads and self.grad_storage is not None:
            self.grad_storage[...] = 0

    # ------------------------------------------------------------------ communication
    def need_reduce_scale_sync(self) -> bool:
        """False when every param has stop_gradient: then comm, scaling and sync are skipped."""
        flags = [p.stop_gradient for p in self._params]
        if all(flags):
            return False
        if any(flags) and not self._logged_stop_gradient:
            logger.info("%s: some params have stop_gradient=True; their grads are still "
                        "communicated", self._where())
            self._logged_stop_gradient = True
        return True

    @_locked
    def comm_grads(self) -> None:
        """Start reducing the grad buffer; every param must have checked in.

        Called by the check-in of the last param; call it yourself after ``add_grad`` with
        ``use_comm=False``. Non-blocking: :meth:`wait` or :meth:`scale_grads` finishes it.

        Raises:
            CheckInError: some params have not checked in (the message names them).
            StateError: communication already started this step, or no ``comm_group``.
            NanInfError: ``check_naninf`` found NaN/Inf; nothing was sent.
        """
        if not self._checkin.all_in:
            raise CheckInError(
                f"{self._where()}: step {self._step}: {self._checked_in_text()} (expected "
                f"{self.options.acc_steps} add_grad per param; mark_unused(param) checks in a "
                f"param that gets no gradient this step)")
        self._comm_grads()

    def _comm_grads(self) -> None:
        if not self._check_startable("comm_grads"):
            return
        opts = self.options
        if opts.check_naninf:
            self._check_naninf()
        n = self._comm.size
        prepare: Optional[Callable[[], None]] = None
        if not opts.scale_after_comm and not opts.use_reduce_avg:
            # Paddle scales before the collective; here it runs once the order check passed:
            # an OrderError says nothing was changed, so the grads must still be unscaled
            prepare = functools.partial(_prescale, self.grad_storage, 1.0 / n)
        # 1/n for reduce-avg and scale-after-comm is applied by the collective to the result,
        # while it is still wide (fp32 for half buffers: one rounding) and in cache. Paddle's
        # scale_grads scales the whole buffer after the wait, so with scale-after-comm the
        # regions that get no result are scaled too -- also by the collective, in cache: a
        # reduce's non-root ranks what they sent, a reduce-scatter the other ranks' shards
        # once packed (free_grads_in_comm drops those regions)
        avg = 1.0 / n if (opts.use_reduce_avg or opts.scale_after_comm) else None
        own = 1.0 / n if (opts.scale_after_comm and not opts.use_reduce_avg) else None
        name = f"buffer {self._id} {opts.act.name.lower()}"
        self._task_seq = self._start_collective()
        if opts.act == HookAction.ALL_REDUCE:
            self._task = self._comm.allreduce(self.grad_storage, scale=avg, name=name,
                                              tag=(self._id, self._step), prepare=prepare)
        elif opts.act == HookAction.REDUCE:
            self._task = self._comm.reduce(self.grad_storage, self._dst, scale=avg, name=name,
                                           tag=(self._id, self._step), sent_scale=own,
                                           prepare=prepare)
        else:
            begin, end = self.layout.shard_range(self._comm.rank)
            if opts.free_grads_in_comm:
                shard = backend.empty(end - begin, self.grad_storage.dtype, self._like)
            else:
                shard = self.grad_storage[begin:end]
            self._task = self._comm.reduce_scatter(
                self.grad_storage, shard, scale=avg, name=name, tag=(self._id, self._step),
                others_scale=None if opts.free_grads_in_comm else own, prepare=prepare)
            if opts.free_grads_in_comm:
                self._pre_comm_grads = self.grad_storage  # until the shard holds the result
                self.reset_grad_storage(shard)

    def _check_naninf(self) -> None:
        bad = backend.nonfinite_count(self.grad_storage)
        if not bad:
            return
        counts = []
        for p in self._params:
            g = backend.shared_array(grad_of(p, self.use_main_grad))  # a torch view too
            if g is not None:
                c = backend.nonfinite_count(g)
                if c:
                    counts.append(f"{p.name} ({c} of {g.size})")
        raise NanInfError(f"{self._where()}: step {self._step}: grad buffer holds {bad} NaN/Inf "
                          f"value(s) before communication: {', '.join(counts) or 'in padding'}; "
                          f"nothing was sent and this call changed nothing")

    @_locked
    def scale_grads(self) -> None:
        """Finish this step's communication, scale by 1/nranks if asked, reset the counters.

        The end of a step (Paddle's ``scale_grads``): afterwards the grads hold the mean
        (or the sum, per the options) and :attr:`step` has advanced.

        Raises:
            CheckInError: params missing, or all checked in with ``use_comm=False`` and no
                :meth:`comm_grads`.
            CommTimeoutError: the collective did not finish within :attr:`timeout` (it
                stays pending: call again to keep waiting).
            OrderError: the ranks started different collectives.
        """
        if self.need_reduce_scale_sync():
            if self._task is None:
                if self.nranks == 1 and self._checkin.all_in:
                    self._reset_params_checked_in()
                    return
                if not self._checkin.all_in:
                    self.comm_grads()  # raises, naming the missing params
                raise CheckInError(f"{self._where()}: scale_grads: all params checked in but "
                                   f"communication was not started (add_grad with "
                                   f"use_comm=False needs an explicit comm_grads())")
            self.wait()  # the collective applied every 1/n (see _comm_grads)
        self._reset_params_checked_in()

    def wait(self) -> None:
        """Wait for this step's grad communication (within the buffer's timeout).

        On ``CommTimeoutError`` the collective stays pending; calling again keeps waiting.
        Unlike :meth:`scale_grads`, it neither scales nor ends the step.

        Raises:
            CommTimeoutError: not finished within :attr:`timeout`.
            CommError: the collective failed (``OrderError``, ``AbandonedError`` ...).
        """
        if self._task is not None:
            self._wait_task(self._task, "grad communication", self._task_seq)
            if self._pre_comm_grads is not None:  # the shard holds the result now
                self._pre_comm_grads = None
                self._memory.release("grad")

    def _reset_params_checked_in(self) -> None:
        self._task = None
        self._checkin.reset()
        self._step += 1

    # ------------------------------------------------------------------ grad storage lifetime
    @_locked
    def clear_grad_storage(self) -> None:
        """Release the grad buffer (after the optimizer used it, with release_grads).

        The params' grad views go too (Paddle leaves them holding the reduced values): a kept
        view would keep the whole buffer alive, and the next step would reduce it again.
        Refused mid-step: while a collective is in flight, and while params have micro-steps
        this step whose communication has not finished (their grads would be dropped).

        Raises:
            StateError: mid-step, as above; nothing was changed.
        """
        if self._task is not None and not self._task.is_completed():
            raise StateError(f"{self._where()}: clear_grad_storage: communication still in "
                            f"flight; expected scale_grads() first")
        if self._task is None and any(self._checkin.steps.values()):
            started = [n for n, k in self._checkin.steps.items() if k]
            raise StateError(
                f"{self._where()}: clear_grad_storage: step {self._step} is under way "
                f"({len(started)} param(s) have micro-steps this step: "
                f"{', '.join(started[:10])}{' ...' if len(started) > 10 else ''}; "
                f"{self._checked_in_text()}) and its communication has not finished, so their "
                f"grads would be lost; expected scale_grads() first (or reset() to drop the "
                f"step). Nothing was changed")
        self.grad_storage = None
        self._drop_grad_views()
        self._memory.release("grad")  # after the views: a live one would keep the pages

    def _drop_grad_views(self) -> None:
        for p in self._params:
            g = backend.shared_array(grad_of(p, self.use_main_grad))  # a torch view too
            view = self._grad_view[p.name]
            if g is not None and view is not None and backend.data_ptr(g) == backend.data_ptr(view):
                set_grad(p, self.use_main_grad, None)
            self._grad_view[p.name] = None
        for view in self._sharding_param_grad_view.values():
            view.clear_grad_buffer()

    def reset_grad_storage(self, shard_buffer: Any) -> None:
        """Make a shard-sized buffer this buffer's grads (``free_grads_in_comm``).

        Args:
            shard_buffer: an array of this rank's shard size, in the grad dtype; every
                param slice's grad view is re-pointed at it.
        """
        self.grad_storage = shard_buffer
        self._grads_are_shard = True
        for view in self._sharding_param_grad_view.values():
            view.reset_grad_buffer(shard_buffer)

    # Paddle's private names, for code ported from tensor_fusion_helper
    _clear_grad_storage = clear_grad_storage
    _reset_grad_storage = reset_grad_storage

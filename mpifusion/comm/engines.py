"""Engines: who issues a communicator's MPI calls, and in which order.

One engine per private communicator runs the tasks started on it in start order, on every
rank: a task issues its next call only after every earlier task issued all of its calls, and
no two threads ever call MPI on the communicator at once (``thread``: its daemon thread, or
a waiting caller that claimed the next task before the thread did; ``nonblocking``: the
caller holding the engine's lock). ``thread`` runs the calls blocking; ``nonblocking`` issues
the non-blocking forms from the caller and progresses them whenever MPI is called.

Lifetime: ``registry.py`` makes one engine per private duplicate and closes it when the
duplicate is released. After a collective was abandoned (``FusedCommBuffer.reset(abandon=
True)``) an engine refuses every later collective with :class:`AbandonedError`: MPI cannot
cancel the abandoned one, so anything started later would pair with it on the other ranks.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from typing import Any, Deque, Optional

import numpy as np
from mpi4py import MPI

from ..errors import AbandonedError, OrderError, StateError
from .poll import Backoff, never_moves, poll
from .call import nonblocking_name
from . import tuning
from .record import Collective, finish


class Engine:
    """Runs the tasks of one private communicator, in the order they were started."""

    def __init__(self, comm: MPI.Comm, label: str = "") -> None:
        self.comm = comm
        self.label = label
        self.rank = comm.Get_rank()
        self.tasks: Deque[Collective] = collections.deque()
        self.lock = threading.Lock()    # start order; the caller's MPI calls
        self.seq = 0                    # tasks started: the next one's place in the stream
        self.abandoned: Optional[str] = None  # why later collectives are refused
        #: tasks whose wait missed its deadline (see ``stuck``); an unfinished one is held by
        #: the engine's queues, so only finished ones drop out
        self.late: "weakref.WeakSet[Collective]" = weakref.WeakSet()
        self.closed = False
        self.negotiator = None          # order.Negotiator on a negotiated communicator
        self.check_scratch = np.empty(4, dtype=np.uint64)  # the order check's send + receive
        self.check_words = memoryview(self.check_scratch).cast("B").cast("Q")  # its items, fast
        #: the order check's all-reduce (order.verified_steps): its arguments never change, so
        #: it is a persistent collective (MPI-4), made here -- before any other call on this
        #: private duplicate, on every rank -- and started by the ``CHECK`` step; 0.5-0.8 us
        #: less per collective than an Iallreduce. None: this MPI has none (Iallreduce then)
        self.check_args = ([self.check_scratch[:2], MPI.UINT64_T],
                           [self.check_scratch[2:], MPI.UINT64_T])
        self.check_request: Optional[MPI.Prequest] = None
        try:
            self.check_request = comm.Allreduce_init(*self.check_args, op=MPI.MAX)
        except (NotImplementedError, AttributeError, MPI.Exception):
            pass

    @property
    def stuck(self) -> bool:
        """A wait missed its deadline and that collective has not finished since: close and
        exit do not wait for this communicator. Not for good: a collective whose late ranks
        only were slow finishes on a later wait(), and then exit drains pending collectives
        as usual (a sticky flag made a process that had recovered exit with status 1,
        without MPI_Finalize, blaming a collective that timed out)."""
        return any(not t.done.flag for t in tuple(self.late))

    def start_check(self) -> MPI.Request:
        """Start the order check's all-reduce (see ``check_request``); its request."""
        request = self.check_request
        if request is None:
            return self.comm.Iallreduce(*self.check_args, op=MPI.MAX)
        request.Start()
        return request

    def free_check(self) -> None:
        """Free the check's persistent request once nothing can start it again (close)."""
        request, self.check_request = self.check_request, None
        if request is not None and not MPI.Is_finalized():
            try:
                request.Free()
            except MPI.Exception:
                pass

    def check_open(self) -> None:
        if self.abandoned is not None:
            raise AbandonedError(self.abandoned)
        if self.closed:
            raise StateError(f"rank {self.rank}: the communicator was released "
                             f"(mpifusion.comm.release or comm_group.Free()); build a new "
                             f"buffer to communicate again")

    def _stamp(self, task: Collective) -> None:
        """Give ``task`` its place in the stream, then build its calls with that serial
        passed in (the engine's lock is held)."""
        self.check_open()
        task.seq = seq = self.seq
        self.seq += 1
        build, task.build = task.build, None
        task.steps = build(seq) if build is not None else iter(())

    def _failed(self, task: Collective, exc: BaseException) -> None:
        """``task`` failed on this rank: keep the first error for :meth:`_finish`, and
        unless every rank fails at the same call (an OrderError) or the stream was already
        refused, refuse every later collective here: the other ranks may still be inside
        this one, so the next call made here would pair with its remaining calls there (a
        wrong sum, not an error)."""
        if task.failure is None:
            task.failure = exc
        if not isinstance(exc, (OrderError, AbandonedError)):
            self.abandon(f"rank {self.rank}: refused: {task.plan.name or 'a collective'} of this "
                         f"communicator failed on this rank after the ranks had agreed to run "
                         f"it ({type(exc).__name__}: {exc}); the other ranks may still be in "
                         f"it, and a later collective would pair with its remaining calls. "
                         f"Save what you need and abort, or build new buffers on a fresh "
                         f"communicator (comm.Split/Dup)")

    def _refused(self) -> AbandonedError:
        return AbandonedError(f"{self.abandoned} (the stream stopped before this call)")

    def submit(self, task: Collective) -> None:
        """Stamp ``task`` and run it after every task started before it."""
        raise NotImplementedError

    def submit_from_stream(self, task: Collective) -> None:
        """Start ``task`` from inside a running task's steps (the negotiation's next round)."""
        raise NotImplementedError

    def progress(self) -> None:
        raise NotImplementedError

    def wait_for(self, task: Collective, timeout: Optional[float]) -> bool:
        """Run or wait for ``task`` until it finished (True), or ``timeout`` seconds passed
        first (False: it is marked late, see :meth:`missed`)."""
        raise NotImplementedError

    def missed(self, task: Collective) -> bool:
        """A wait for ``task`` missed its deadline: at close and exit, do not wait for it
        while it has not finished (``stuck``). False, for ``wait_for`` to return."""
        task.late = True
        self.late.add(task)
        return False

    def abandon(self, reason: str) -> None:
        """Refuse every later call (the message of the AbandonedError they raise)."""
        if self.abandoned is None:
            self.abandoned = reason

    def drain(self, timeout: float) -> None:
        """Finish every started task (at exit), giving up after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            # tasks started meanwhile count too: a negotiation round that ends with a buffer
            # ready on this rank starts the next round (submit_from_stream); buffers marked
            # ready wait in the negotiator's queues, in no round yet
            pending = [t for t in list(self.tasks) if not t.done.flag]
            negotiator = self.negotiator
            if negotiator is not None:
                with negotiator.lock:
                    pending += [t for q in negotiator.queues.values() for t in q]
                    if negotiator.current is not None:
                        pending.append(negotiator.current)
            pending = [t for t in pending if not t.done.flag]
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                if not self.wait_for(pending[0], left):
                    return
            except Exception:  # at exit there is nobody left to tell
                return

    def close(self, timeout: float) -> None:
        """Finish what was started (bounded), then refuse new tasks."""
        if not self.closed and not self.stuck and self.abandoned is None:
            self.drain(timeout)
        self.closed = True
        if not self.stuck and self.abandoned is None and all(t.done.flag for t in self.tasks):
            self.free_check()  # inactive: nothing will start it again


class NonBlockingEngine(Engine):
    """Non-blocking calls, up to ``window`` of one task in flight (a pipeline).

    The head task issues pipelined calls while fewer than the engine's ``window`` are in
    flight (one window per stream: the communicator's stream tag names it), lands
    them in issue order as they complete, and treats a fence as "nothing more until everything
    landed". A task starts only when every earlier task has finished, so all ranks issue the
    same calls in the same order whatever their timing. Only the thread holding the engine's
    lock calls MPI or runs a task's steps.

    Progress without the caller: at ``MPI_THREAD_MULTIPLE`` a progress thread tests the
    requests (under the lock, with back-off up to 1 ms) while tasks are in flight, so
    pipelined segments move on while the caller computes. Below that level no second thread
    may call MPI: progress then comes from ``poll()`` (every ``add_grad``), ``is_completed()``
    and ``wait()``, plus the library's own asynchronous progress where it has one (MPICH:
    ``MPIR_CVAR_ASYNC_PROGRESS=1``, which itself needs ``MPI_THREAD_MULTIPLE``).
    """

    def __init__(self, comm: MPI.Comm, label: str = "",
                 progress_thread: Optional[bool] = None, window: int = 1) -> None:
        """``progress_thread``: None = where the thread level allows it (tests pass False
        to drive progress themselves; True is refused below MPI_THREAD_MULTIPLE).
        ``window``: pipelined calls of one task in flight at most (``CommOptions.window``),
        which the call generators size their scratch rings by."""
        super().__init__(comm, label)
        self.window = window
        self.moves = 0                  # calls issued or landed (progress thread's back-off)
        self.wake = threading.Event()   # set when a task is submitted
        self.thread: Optional[threading.Thread] = None
        multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if progress_thread and not multiple:
            raise StateError(f"rank {self.rank}: a progress thread needs MPI_THREAD_MULTIPLE "
                             f"(the level is {MPI.Query_thread()})")
        if multiple if progress_thread is None else progress_thread:
            self.thread = threading.Thread(target=self._run_progress,
                                           name="mpifusion-progress", daemon=True)
            self.thread.start()
        else:
            _UNATTENDED.add(self)

    def submit(self, task: Collective) -> None:
        with self.lock:
            self._stamp(task)
            self.tasks.append(task)
        self.progress()
        self.wake.set()

    def submit_from_stream(self, task: Collective) -> None:
        self._stamp(task)  # the lock is held: steps only run inside progress
        self.tasks.append(task)

    def _stop(self, task: Collective, exc: Optional[BaseException] = None) -> None:
        """No more calls for ``task`` (``exc``: why it failed); what is in flight still
        completes before the task is finished (MPI cannot cancel a collective)."""
        if exc is not None:
            self._failed(task, exc)
        task.stopped = True

    def _advance(self, task: Collective) -> bool:
        """Land what completed, issue what the window allows; True once ``task`` finished
        (its last call landed, or it failed and nothing of it is in flight)."""
        comm = self.comm
        inflight = task.requests
        while True:
            while inflight and inflight[0][0].Test():
                land = inflight.popleft()[1]
                self.moves += 1
                if land is not None and task.failure is None:
                    try:
                        land()
                    except Exception as exc:  # raised by wait()
                        self._stop(task, exc)
            if inflight and (task.stopped or task.blocked or len(inflight) >= self.window):
                return False
            if task.stopped:
                break
            task.blocked = False
            try:
                call = next(task.steps)
            except StopIteration:
                self._stop(task)
                continue
            except Exception as exc:  # landing code or an OrderError: raised by wait()
                self._stop(task, exc)
                continue
            method = call.method
            if method is None and not call.check:
                task.blocked = True  # a fence: the pause itself is skipped
                continue
            if self.abandoned is not None:
                self._stop(task, self._refused())
                continue
            if call.ahead is not None and not call.fence and len(inflight) > call.ahead:
                try:  # the generator stated a dependency on an earlier call: land it first
                    _land_until(inflight, call.ahead)
                except Exception as exc:
                    self._stop(task, exc)
                    continue
            try:
                request = (self.start_check() if method is None
                           else getattr(comm if call.comm is None else call.comm,
                                        method if call.nonblocking else
                                        nonblocking_name(method))(*call.args, **call.kwargs))
            except Exception as exc:
                self._stop(task, exc)
                continue
            self.moves += 1
            task.blocked = call.fence
            # the call's arguments stay referenced until it landed: mpi4py keeps no
            # reference to a non-blocking call's arrays, and a scratch slot whose only other
            # owner was the finished generator would be freed (and reused) while MPI reads it
            inflight.append((request, call.land, call.args))
        finish(task, task.failure)
        return True

    def _progress(self) -> None:
        tasks = self.tasks
        while tasks and self._advance(tasks[0]):
            tasks.popleft()

    def progress(self) -> None:
        if self.lock.acquire(blocking=False):
            try:
                self._progress()
            finally:
                self.lock.release()
        if self.thread is None and len(_UNATTENDED) > 1:
            self._progress_others()

    def _progress_others(self) -> bool:
        """Progress the other engines without a progress thread; True if one has tasks.

        Without a progress thread an engine issues its next segment only when this process
        calls into one of its tasks, so a caller waiting on one communicator must also move
        the others: a peer may be waiting on another communicator's collective whose next
        segment only this rank has not issued yet (ranks waiting on two communicators in
        different orders deadlocked)."""
        busy = False
        for engine in tuple(_UNATTENDED):
            if engine is not self and engine.tasks:
                busy = True
                if engine.lock.acquire(blocking=False):
                    try:
                        engine._progress()
                    finally:
                        engine.lock.release()
        return busy

    def _run_progress(self) -> None:
        """The progress thread (MPI_THREAD_MULTIPLE only): test while tasks are in flight."""
        backoff = Backoff(1e-5, 1e-3)
        while not self.closed:
            if not self.tasks:
                self.wake.wait()
                self.wake.clear()
                backoff.reset()
                continue
            before = self.moves
            if self.lock.acquire(blocking=False):
                try:
                    if not self.closed:
                        self._progress()
                finally:
                    self.lock.release()
            if self.moves != before:
                backoff.reset()
            else:
                backoff.sleep()

    def wait_for(self, task: Collective, timeout: Optional[float]) -> bool:
        unattended = self.thread is None and len(_UNATTENDED) > 1

        def done() -> bool:
            # other engines without a progress thread move only when called (see
            # _progress_others): then never block in one request's Wait
            others = unattended and self._progress_others()
            if self.lock.acquire(blocking=False):
                try:
                    self._progress()
                    # without a deadline, block on the oldest call: nothing moves before it
                    while (timeout is None and not others and not task.done.flag
                           and self.tasks and self.tasks[0].requests):
                        self.tasks[0].requests[0][0].Wait()
                        self._progress()
                finally:
                    self.lock.release()
            return task.done.flag

        moves = ((lambda: sum(e.moves for e in tuple(_UNATTENDED))) if unattended
                 else (lambda: self.moves))
        if not poll(done, timeout, moves=moves):
            return self.missed(task)
        return True

    def close(self, timeout: float) -> None:
        super().close(timeout)
        self.stop_thread()

    def stop_thread(self) -> None:
        """Stop the progress thread (before MPI finalizes: it must not call MPI after)."""
        self.closed = True
        self.wake.set()
        _UNATTENDED.discard(self)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)


def _land_until(inflight: Deque[Any], keep: int) -> None:
    """Wait for the oldest calls in flight, landing each in issue order, until at most
    ``keep`` remain (what completed meanwhile lands too: a test of the oldest drives MPI's
    progress for all of them)."""
    while len(inflight) > keep or (inflight and inflight[0][0].Test()):
        request, land, _args = inflight[0]
        request.Wait()
        inflight.popleft()
        if land is not None:
            land()


#: nonblocking engines without a progress thread (MPI below MPI_THREAD_MULTIPLE): each
#: caller's progress and waits move all of them (NonBlockingEngine._progress_others)
_UNATTENDED: "weakref.WeakSet[NonBlockingEngine]" = weakref.WeakSet()



class ThreadEngine(Engine):
    """A daemon thread running each task's calls as blocking MPI calls, in start order.

    Small tasks (``inline``) are started without waking the thread: waking it costs 30-150 us
    here, more than a 4-64 KiB collective. A caller that waits for one, with every earlier
    task finished, runs it itself; if nobody waits within ``Tuning.handoff_s`` the thread runs
    it, so a caller that communicates between start and wait (a barrier, a send, another
    buffer) cannot deadlock. Under a deadline such a task's calls are non-blocking
    (``task.plan.polled``): the caller polls them until its deadline, and if that passes hands the
    call in flight and the rest of the task to the thread, which finishes them. ``running``
    is held by whoever runs a task's calls, so calls stay in start order on one thread at a
    time.
    """

    def __init__(self, comm: MPI.Comm, label: str = "") -> None:
        super().__init__(comm, label)
        self.todo: Deque[Collective] = collections.deque()  # started, nobody runs them yet
        self.bell: "queue.SimpleQueue[Optional[bool]]" = queue.SimpleQueue()  # None: stop
        self.running = threading.Lock()
        self.asleep = True      # the thread waits with no timeout: every start must ring
        self.last = 0.0         # when a task was last started
        self.thread = threading.Thread(target=self._run, name="mpifusion-comm", daemon=True)
        self.thread.start()

    def _execute(self, task: Collective) -> None:
        """Run ``task`` to its end, blocking: first the call its caller left in flight at its
        deadline (if any), then the rest of its calls."""
        try:
            pending = task.requests
            while pending:
                request, land, _args = pending[0]
                request.Wait()
                pending.popleft()
                if land is not None:
                    land()
        except BaseException as exc:  # reported to the caller by wait()
            self._failed(task, exc)
            return
        self._run_steps(task, None)

    def _run_steps(self, task: Collective, deadline: Optional[float]) -> bool:
        """The one loop over a task's calls: without ``deadline`` each call completes before
        the next (a non-blocking form is waited for: see call.py), except a pipelined call
        with ``ahead``, which stays in flight (``task.requests``) while the steps go on; with
        a deadline (``polled`` tasks, whose calls are all non-blocking) each is polled until
        the deadline, one at a time."""
        comm = self.comm
        inflight = task.requests
        try:
            for call in task.steps:
                method = call.method
                ahead = call.ahead if deadline is None and not call.fence else None
                if inflight:  # only pipelined calls with ``ahead`` leave any
                    _land_until(inflight, ahead or 0)
                if method is None and not call.check:
                    if call.pause > 0:
                        time.sleep(call.pause)
                    continue
                if self.abandoned is not None:
                    raise self._refused()
                if ahead is not None:
                    target = comm if call.comm is None else call.comm
                    name = method if call.nonblocking else nonblocking_name(method)
                    inflight.append((getattr(target, name)(*call.args, **call.kwargs),
                                     call.land, call.args))
                    continue
                out = (self.start_check() if method is None
                       else getattr(comm if call.comm is None else call.comm,
                                    method)(*call.args, **call.kwargs))
                land = call.land
                if deadline is None:
                    if method is None or call.nonblocking:
                        out.Wait()
                elif not poll(out.Test, max(0.0, deadline - time.monotonic()),
                              moves=never_moves):
                    task.requests.append((out, land, call.args))
                    return False
                if land is not None:
                    land()  # the call landed
            if deadline is None and inflight:
                _land_until(inflight, 0)
        except BaseException as exc:  # reported to the caller by wait()
            self._failed(task, exc)
        return True

    def _next(self) -> "tuple[Optional[Collective], Optional[float]]":
        """The task the thread runs now, else how long it may sleep (None: until rung).
        The engine's lock is held."""
        now = time.monotonic()
        todo = self.todo
        limits = tuning.ACTIVE
        if todo:
            head = todo[0]
            left = limits.handoff_s - (now - head.since)
            if not head.stealable or len(todo) > 1 or left <= 0:
                return todo.popleft(), None
            return None, left
        if now - self.last < limits.hot_s:
            return None, limits.handoff_s
        self.asleep = True
        return None, None

    def _run(self) -> None:
        timeout: Optional[float] = None
        while True:
            try:
                if self.bell.get(timeout=timeout) is None:
                    return
            except queue.Empty:
                pass
            while True:
                # choose holding ``running``: a caller running the task before this one
                # (taken from ``todo``) may hand it back at its deadline, at todo's front
                with self.running:
                    with self.lock:
                        task, timeout = self._next()
                    if task is None:
                        break
                    self._execute(task)
                finish(task, task.failure)

    def submit(self, task: Collective) -> None:
        """Start ``task``; one planned ``inline`` (a small collective) is left a moment for
        a waiting caller to run (:meth:`wait_for`) instead of waking the thread."""
        inline = task.plan.inline
        with self.lock:
            self._stamp(task)
            task.stealable = inline
            task.since = self.last = time.monotonic()
            self.tasks.append(task)
            self.todo.append(task)
            if not inline or self.asleep:
                self.asleep = False
                self.bell.put(True)

    def submit_from_stream(self, task: Collective) -> None:
        self.submit(task)  # the comm thread never holds the lock for long

    def _progress(self) -> None:
        tasks = self.tasks
        while tasks and tasks[0].done.flag:
            tasks.popleft()

    def progress(self) -> None:
        if self.tasks and self.lock.acquire(blocking=False):
            try:
                self._progress()
            finally:
                self.lock.release()

    def wait_for(self, task: Collective, timeout: Optional[float]) -> bool:
        if task.stealable:
            with self.lock:
                self._progress()
                todo = self.todo
                # nobody runs it yet, every earlier task finished, the thread runs nothing
                mine = bool((timeout is None or task.plan.polled) and todo and todo[0] is task
                            and self.tasks[0] is task and self.running.acquire(blocking=False))
                task.stealable = False  # run here, or else the thread takes it at once
                if mine:
                    todo.popleft()
                else:
                    self.bell.put(True)
            if mine:
                finished = True
                try:
                    if timeout is None:
                        self._execute(task)
                    else:
                        # a polled task's calls until the deadline; False leaves the call
                        # in flight in task.requests (with its arrays) for _execute
                        finished = self._run_steps(task, time.monotonic() + timeout)
                finally:
                    if not finished:  # the thread finishes it, before anything started later
                        with self.lock:
                            self.todo.appendleft(task)
                            self.asleep = False
                            self.bell.put(True)
                    self.running.release()
                if not finished:
                    return self.missed(task)
                finish(task, task.failure)
                return True  # finished tasks leave ``tasks`` at the next start or wait
        if not task.done.wait(timeout):
            return self.missed(task)
        self.progress()
        return True

    def close(self, timeout: float) -> None:
        super().close(timeout)
        self.bell.put(None)
        if not self.stuck and self.abandoned is None:
            self.thread.join(timeout=1.0)

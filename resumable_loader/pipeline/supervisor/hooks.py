"""What every supervisor of this process shares: the fds that fork children must close, the
SIGCHLD wake-up, and the SIGCONT mark of this process's last pause.

These are process-wide by nature -- a signal has one handler per process, and a forked worker
inherits every fd of every loader -- so they live here, apart from any one ``Supervisor``: each
supervisor registers into them when it is built and out of them when it shuts down. The two
signal hooks are installed from the main thread only and chain to whatever handler was there
before; off the main thread, sentinels, liveness polling and poll()'s own overruns do the work.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Any

# ---- the fds fork children close -----------------------------------------------------------------
# fds that the main process holds for all live supervisors; fork children close them.
_registry_lock = threading.Lock()
_MAIN_FDS: set[int] = set()


def register_fds(*fds: int) -> None:
    """Note fds of this process that a forked worker must close (its copies would keep our
    pipes and sockets open after we close them)."""
    with _registry_lock:
        _MAIN_FDS.update(fds)


def unregister_fds(*fds: int) -> None:
    """Forget fds noted by ``register_fds`` (they are about to be closed)."""
    with _registry_lock:
        _MAIN_FDS.difference_update(fds)


def fds_to_close() -> list[int]:
    """The fds a worker forked now must close, sorted."""
    with _registry_lock:
        return sorted(_MAIN_FDS)


# ---- signal hooks --------------------------------------------------------------------------------
def _uninstall(hook: Any, signum: int) -> None:
    """Put back the handler ``hook`` replaced for ``signum`` -- only from the main thread, and
    only if ours is still the one installed (a handler set after ours stays). Called with
    ``hook.lock`` held."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signum) == hook._handler:
            prev = hook.previous
            signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
        hook.installed = False
        hook.previous = None
    except (ValueError, OSError):
        pass


class ChildSignal:
    """The process-wide SIGCHLD hook shared by all supervisors.

    The handler writes to the wake fds while holding ``lock``, and a supervisor closes its
    wake fds only after ``remove()`` (which takes the lock) has returned: so the handler never
    writes to a number that was closed and handed to another file meanwhile. The lock is
    re-entrant because the handler runs in the main thread, which may be inside add/remove.
    """

    lock = threading.RLock()
    wake_fds: set[int] = set()
    previous: Any = None
    installed = False

    @classmethod
    def _handler(cls, signum: int, frame: Any) -> None:
        with cls.lock:
            for fd in tuple(cls.wake_fds):
                try:
                    os.write(fd, b"c")
                except OSError:
                    pass  # full: a wake-up is already pending
        prev = cls.previous
        if callable(prev):
            prev(signum, frame)

    @classmethod
    def add(cls, fd: int) -> None:
        with cls.lock:
            cls.wake_fds.add(fd)
            if cls.installed or threading.current_thread() is not threading.main_thread():
                return  # off the main thread, sentinels and polling do the work
            try:
                cls.previous = signal.signal(signal.SIGCHLD, cls._handler)
                cls.installed = True
            except (ValueError, OSError):
                pass

    @classmethod
    def remove(cls, fd: int) -> None:
        with cls.lock:
            cls.wake_fds.discard(fd)
            if not cls.installed or cls.wake_fds:
                return
            _uninstall(cls, signal.SIGCHLD)


class Continued:
    """The process-wide SIGCONT hook: when this process was last continued after a stop.

    A stopped process runs no code, so it cannot see its own pause while it lasts; SIGCONT at
    its end is the one sign that reaches it wherever it is -- in the user's training step as
    much as in poll(). The handler (installed from the main thread, chained to any earlier
    handler, with SA_RESTART so that no system call of the user's fails with EINTR for it)
    records the time; supervisors compare it with when they last looked.
    """

    lock = threading.RLock()
    last = -math.inf  # time.monotonic() of the last SIGCONT
    users = 0
    previous: Any = None
    installed = False

    @classmethod
    def _handler(cls, signum: int, frame: Any) -> None:
        cls.last = time.monotonic()
        prev = cls.previous
        if callable(prev):
            prev(signum, frame)

    @classmethod
    def add(cls) -> None:
        with cls.lock:
            cls.users += 1
            if cls.installed or threading.current_thread() is not threading.main_thread():
                return  # off the main thread, poll()'s own overruns are the measure
            try:
                cls.previous = signal.signal(signal.SIGCONT, cls._handler)
                signal.siginterrupt(signal.SIGCONT, False)
                cls.installed = True
            except (ValueError, OSError):
                pass

    @classmethod
    def remove(cls) -> None:
        with cls.lock:
            cls.users = max(0, cls.users - 1)
            if not cls.installed or cls.users:
                return
            _uninstall(cls, signal.SIGCONT)

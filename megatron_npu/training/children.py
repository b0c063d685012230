"""Every process a run starts dies with the process that started it, whatever kills that one.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) is armed in each child as it
starts (a forked or spawned child before it runs anything else); the kernel then kills the child
the moment its parent exits -- also on SIGKILL, where no ``finally`` and no ``atexit`` runs. A
run's processes form a chain, each link armed:

* launcher -> ranks: each rank arms it before it does any work (``training.launch.arm_rank``),
  and exits if its launcher is already gone;
* rank -> forked children (torch_dist's checkpoint writers, ``fork`` start method):
  :func:`tie_children` registers :func:`die_with_parent` as an after-fork hook;
* rank -> spawned children (Megatron-Core's checkpoint results ``Manager`` and Python's
  ``resource_tracker``, ``spawn`` start method): those start through
  ``multiprocessing.util.spawnv_passfds``, which runs no fork hook; while :func:`tie_children`
  is active it is replaced by :func:`_spawnv_passfds`, which starts the same command line with
  the signal armed. The original function is back when the context ends.

A child whose parent died before the signal was armed exits at once (its parent id is no longer
the one that started it). Elsewhere than Linux nothing is armed. (The kernel sends the signal
when the *thread* that created the child ends: a run starts its writers, Manager and tracker
from its main thread, which lives as long as the process.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

PR_SET_PDEATHSIG = 1
LINUX = sys.platform.startswith("linux")

# Resolved once, in the parent: a child of a threaded process must not dlopen after fork.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if LINUX else None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; False where that
    does not exist."""
    if _prctl is None:
        return False
    return _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with(parent_pid: int) -> None:
    """Arm the parent-death signal in this process, and exit at once if ``parent_pid`` is no
    longer its parent (it died before the signal was armed)."""
    die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(1)


def arm_preexec(parent_pid: int, *, new_group: bool = False) -> Callable[[], None]:
    """A ``preexec_fn`` (runs in the child between fork and exec): the parent-death signal,
    optionally a process group of its own, and an exit if the parent is already gone."""

    def preexec() -> None:
        if new_group:
            os.setpgid(0, 0)
        die_with(parent_pid)

    return preexec


#: The spawned children's Popen objects, kept so that their ``__del__`` never queues them for
#: subprocess's own reaping (multiprocessing waits for them itself).
_spawned: list[subprocess.Popen] = []


def _spawnv_passfds(path: str, args: list[str], passfds) -> int:
    """``multiprocessing.util.spawnv_passfds`` with the parent-death signal armed."""
    proc = subprocess.Popen(
        list(args),
        executable=path,
        pass_fds=tuple(sorted(map(int, passfds))),
        close_fds=True,
        restore_signals=False,
        preexec_fn=arm_preexec(os.getpid()),
    )
    _spawned.append(proc)
    return proc.pid


_fork_hook_installed = False
_tying = 0  # how many tie_children() contexts are open (a forked child sees the count too)


def _after_fork_in_child() -> None:
    if _tying:
        die_with_parent()


def _install_fork_hook() -> None:
    global _fork_hook_installed
    if LINUX and not _fork_hook_installed:
        # A fork hook cannot be unregistered: it stays, and acts only while a context is open.
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


@contextlib.contextmanager
def tie_children() -> Iterator[None]:
    """While active, every process this one forks or spawns dies with it (module docstring)."""
    global _tying
    from multiprocessing import util

    if not LINUX:
        yield
        return
    _install_fork_hook()
    original = util.spawnv_passfds
    util.spawnv_passfds = _spawnv_passfds
    _tying += 1
    try:
        yield
    finally:
        _tying -= 1
        util.spawnv_passfds = original

"""The supervisor: it starts, watches, replaces and stops the worker processes.

Its modules, each importing only those listed before it:

    hooks       what all supervisors of a process share: the fds fork children close, the
                SIGCHLD wake-up, the SIGCONT mark of a pause
    cpu         a worker's CPU figures from /proc (ran, waited for a CPU, runnable now)
    slots       ``WorkerSlot`` (one per worker id, its states) and ``SupervisorStatistics``
    clocks      the hang clocks: when a slot is hung under task_timeout; pauses and CPU waits
                taken off them
    events      exits in words, ``DeathReport``, and poll()'s events ``Arrived``/``Died``/``Lost``
    advice      what the user is told: the unpicklable-start and seeding warnings, the storm error
    supervisor  ``Supervisor``: the processes, their channels, and poll() that uses the above

Callers import each name from the module that defines it.
"""

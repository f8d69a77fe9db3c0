"""The machinery that moves one epoch's tasks through worker processes: messages
(``protocol``), task sources and the dispatcher (``tasks``, ``dispatch``), fetchers and the
worker process (``fetch``, ``worker``), the result channel (``transport/``), the supervisor
(``supervisor/``), recovery, pinning and the reorder buffer. Imports ``plans``, ``state``,
``core``; nothing here knows the public ``DataLoader``.
"""

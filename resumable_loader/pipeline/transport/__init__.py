"""The byte paths between the main process and a worker: the task pipe (``taskpipe``), the
result socket and its shared-memory storages (``channel``), anonymous shared memory
(``memfd``).
"""

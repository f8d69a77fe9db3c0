"""The byte paths between the main process and a worker, bottom to top:

    memfd      anonymous shared memory: a worker's segments have no name in /dev/shm
    pools      segments reused batch after batch: the worker's pool, the loader's (LoaderPool)
               lent task by task, the main side's mappings and leases
    policy     whether a batch may use shared memory (ShmPolicy), and the words for a full
               /dev/shm or an fd limit reached
    reducers   a message's payload: its storages and tensors reduced in the worker (dumps),
               rebuilt in the main process (decode)
    framing    the result socket: the frame, send(), and the Receiver that never blocks
    taskpipe   the other way: a task in one write to a worker's pipe

Each imports only those above it in this list (taskpipe none of them). What the rest of the
pipeline uses of the result channel is re-exported here.
"""

from .framing import ChannelClosed, Receiver, Undecodable, send
from .policy import ShmPolicy, shm_exhausted
from .pools import LoaderPool, collating, has_pool

__all__ = [
    "ChannelClosed",
    "LoaderPool",
    "Receiver",
    "ShmPolicy",
    "Undecodable",
    "collating",
    "has_pool",
    "send",
    "shm_exhausted",
]

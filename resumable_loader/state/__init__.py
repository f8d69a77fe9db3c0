"""The checkpoint format -- what a state says and how it is read, written and moved -- with no
processes: the schema and its validation (``schema``), the bytes (``codec``), atomic files
(``checkpoint``), the data record (``fingerprint``), the sample cursor (``cursor``), seeds
(``seeds``), ranks and global states (``ranks``), and ``skip_samples`` (``skip``).
Imports only ``core``.
"""

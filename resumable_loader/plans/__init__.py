"""Data plans: which sample each place of an epoch holds -- the index plan over torch's samplers
(``index_plan``), the samplers a loader hands out (``samplers``) and weighted mixtures
(``mixture``, whose arithmetic is ``interleave``). Pure functions of seeds and positions;
imports ``state`` and ``core``.
"""

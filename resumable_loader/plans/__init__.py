"""Data plans: which sample each place of an epoch holds -- the index plan over torch's samplers
(``index_plan``), the samplers a loader hands out (``samplers``) and weighted mixtures
(``mixture``; its arithmetic is ``interleave``, its saved plan ``mixture_state``). Pure
functions of seeds and positions; imports ``state`` and ``core``.
"""

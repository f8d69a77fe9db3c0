"""The public ``DataLoader`` (``dataloader``), one epoch's iterators (``iterators``) and
their life (``lifecycle``), and what the loader says when another library rebuilds it
(``rebuilt``, ``hf_streams``). The top of the library: imports every layer below.
"""

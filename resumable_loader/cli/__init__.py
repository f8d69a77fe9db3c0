"""``python -m resumable_loader inspect|skip``: reads and writes states through ``state`` only.

``main`` parses the arguments and maps failures to exit statuses; its docstring lists the
modules beside it and what each owns.
"""

"""The bottom layer, shared by all: the exception types (``errors``) and the private torch
APIs we rely on, checked once at import (``compat``). Imports nothing else of the package.
"""
